"""Recorded signals proven right: each table equals the same quantity computed independently.

One recording of the tiny preset (prompt + greedy decode, attention computed in blocks of 3 query rows
so chunking is exercised) is checked against references from a single full forward of the final
sequence: attention from a non-absorbed MLA (keys and values materialised per head from ``wkv_b``, as
``transformers`` does), routing from calling the gate on the captured normed hidden state, token
signals from a softmax of the full logits.
"""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.model import MoE, Transformer
from workbench.model.model import apply_rotary_emb
from workbench.probes import attach
from workbench.probes.signals import attention_stats, routing_records, token_confidence

PROMPT = [5, 17, 101, 3, 3, 250, 42, 9, 77, 18, 200, 64]
NEW = 6
CHUNK = 3


def biased_tiny_model() -> Transformer:
    m = tiny_model()
    with torch.no_grad():
        for layer in m.layers:
            if isinstance(layer.ffn, MoE):  # a non-zero selection bias, so score and selection differ
                layer.ffn.gate.bias.copy_(torch.rand(layer.ffn.gate.bias.shape,
                                                     generator=torch.Generator().manual_seed(3)) * 0.05)
    return m


def reference_probs(attn, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Attention probabilities [H, T, T] of one MLA from its own weights, keys materialised per head."""
    T = x.size(0)
    q = attn.wq(x) if attn.q_lora_rank == 0 else attn.wq_b(attn.q_norm(attn.wq_a(x)))
    q = q.view(T, attn.n_heads, -1)
    q_nope, q_pe = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], -1)
    q_pe = apply_rotary_emb(q_pe[None], freqs_cis)[0]
    c, k_pe = attn.wkv_a(x).split([attn.kv_lora_rank, attn.qk_rope_head_dim], -1)
    k_pe = apply_rotary_emb(k_pe[None], freqs_cis)[0]  # [T, R]
    kv = attn.wkv_b(attn.kv_norm(c)).view(T, attn.n_heads, -1)  # [T, H, nope+v]
    k_nope = kv[..., : attn.qk_nope_head_dim]
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, attn.n_heads, -1)], -1)  # [T, H, nope+R]
    qf = torch.cat([q_nope, q_pe], -1)
    scores = torch.einsum("thd,shd->hts", qf, k) * attn.softmax_scale
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    model = biased_tiny_model()
    for layer in model.layers:
        layer.attn.attn_chunk = CHUNK
    run = workbench.record(PROMPT, model=model, max_new_tokens=NEW, db=tmp_path_factory.mktemp("db") / "w.duckdb")
    tokens = run.tokens()
    seq = tokens["token_id"].to_list()
    # one full forward of the final sequence, capturing each block's inputs
    captured: dict[str, torch.Tensor] = {}

    def keep(t, name, **_):
        captured[name] = t[0].detach()

    with torch.no_grad(), attach(model, {"layers.*.hook_resid_pre": keep, "layers.*.hook_resid_mid": keep,
                                         "layers.*.hook_resid_post": keep}):
        logits = model(torch.tensor([seq]))[0]
    return model, run, seq, logits, captured


def test_resid_norm_equals_the_residual_streams_norm(recorded):
    """The registry's resid_norm signal: per fed position x layer, ||h|| after the block."""
    model, run, seq, _, captured = recorded
    got = run.resid_norm().sort("layer", "pos")
    n = len(seq) - 1  # the last token is never fed
    assert got.height == n * len(model.layers)
    for i in range(len(model.layers)):
        ref = captured[f"layers.{i}.hook_resid_post"][:n].norm(dim=-1)
        np.testing.assert_allclose(got.filter(pl.col("layer") == i)["norm"].to_numpy(), ref.numpy(), rtol=1e-4)


def test_sequence_shape(recorded):
    model, run, seq, _, _ = recorded
    assert len(seq) == len(PROMPT) + NEW
    assert seq[: len(PROMPT)] == PROMPT
    assert run.status == "complete"


def test_attention_equals_full_softmax(recorded):
    """Every stored row (prefill in blocks of 3 and every decode step) equals the full-matrix statistics."""
    model, run, seq, _, cap = recorded
    att = run.attention()
    n_rows = len(seq) - 1  # the last generated token is never fed
    assert att.height == n_rows * model.args.n_layers * model.args.n_heads
    freqs = model.freqs_cis[: len(seq)]
    for i, layer in enumerate(model.layers):
        with torch.no_grad():
            x = layer.attn_norm(cap[f"layers.{i}.hook_resid_pre"])
            probs = reference_probs(layer.attn, x, freqs)[:, :n_rows, :n_rows]  # [H, T, T]
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]))
        ref = attention_stats(probs.transpose(0, 1), 0)
        got = att.filter(pl.col("layer") == i).sort("pos", "head")
        for col in ("entropy", "max_weight", "sink_weight"):
            np.testing.assert_allclose(got[col].to_numpy(), ref[col].ravel(), atol=2e-5, err_msg=col)
        # and straight from p*log(p), not through the probe function
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1).T.ravel().numpy()
        np.testing.assert_allclose(got["entropy"].to_numpy(), ent, atol=2e-5)
        np.testing.assert_allclose(got["max_weight"].to_numpy(), probs.amax(-1).T.ravel().numpy(), atol=2e-5)
        np.testing.assert_allclose(got["sink_weight"].to_numpy(), probs[..., 0].T.ravel().numpy(), atol=2e-5)
        later = got.filter(pl.col("pos") > 0)
        norm = later["entropy"].to_numpy() / np.log(later["pos"].to_numpy() + 1)
        np.testing.assert_allclose(later["norm_entropy"].to_numpy(), norm, atol=1e-9)
        assert got.filter(pl.col("pos") == 0)["norm_entropy"].null_count() == model.args.n_heads


def test_attention_bounds(recorded):
    _, run, _, _, _ = recorded
    att = run.attention()
    logk = np.log(att["pos"].to_numpy() + 1)
    ent = att["entropy"].to_numpy()
    assert (ent >= -1e-6).all() and (ent <= logk + 1e-5).all()
    ne = att["norm_entropy"].drop_nulls().to_numpy()
    assert (ne >= -1e-6).all() and (ne <= 1 + 1e-6).all()
    mw = att["max_weight"].to_numpy()
    assert (mw <= 1 + 1e-6).all() and (mw >= 1 / (att["pos"].to_numpy() + 1) - 1e-6).all()


def test_routing_equals_gate(recorded):
    """Routing rows equal the gate's output on the normed hidden state of a full forward."""
    model, run, seq, _, cap = recorded
    rt = run.routing()
    n_rows = len(seq) - 1
    moe = [i for i, l in enumerate(model.layers) if isinstance(l.ffn, MoE)]
    k = model.args.n_activated_experts
    assert rt.height == n_rows * len(moe) * k
    for i in moe:
        ffn = model.layers[i].ffn
        with torch.no_grad():
            h = model.layers[i].ffn_norm(cap[f"layers.{i}.hook_resid_mid"])[:n_rows]
            weights, indices = ffn.gate(h)
            scores = torch.sigmoid(h.float() @ ffn.gate.weight.float().T)
        got = rt.filter(pl.col("layer") == i).sort("pos", "slot")
        g_exp = got["expert"].to_numpy().reshape(n_rows, k)
        g_w = got["weight"].to_numpy().reshape(n_rows, k)
        assert [set(r) for r in g_exp.tolist()] == [set(r) for r in indices.tolist()]
        order = weights.argsort(-1, descending=True)
        np.testing.assert_array_equal(g_exp, indices.gather(1, order).numpy())
        np.testing.assert_allclose(g_w, weights.gather(1, order).numpy(), atol=1e-5)
        assert (np.diff(g_w, axis=1) <= 1e-9).all(), "slots by decreasing weight"
        np.testing.assert_allclose(got["score"].to_numpy().reshape(n_rows, k),
                                   scores.gather(1, indices.gather(1, order)).numpy(), atol=1e-5)
        # margin: lowest chosen selection score minus best unchosen, over all experts
        sel = scores + ffn.gate.bias
        chosen = torch.zeros_like(sel, dtype=torch.bool).scatter_(1, indices, True)
        margin = sel.masked_fill(~chosen, math.inf).amin(-1) - sel.masked_fill(chosen, -math.inf).amax(-1)
        np.testing.assert_allclose(got["margin"].to_numpy()[::k], margin.numpy(), atol=1e-5)
        np.testing.assert_allclose(g_w.sum(1), model.args.route_scale, atol=1e-5)  # normalised, then scaled


def test_token_signals_equal_softmax(recorded):
    model, run, seq, logits, _ = recorded
    tok = run.tokens()
    assert tok["pos"].to_list() == list(range(len(seq)))
    assert tok["is_prompt"].to_list() == [True] * len(PROMPT) + [False] * NEW
    first = tok.row(0, named=True)
    assert all(first[c] is None for c in ("prob", "logprob", "confidence", "entropy", "rank", "topk_ids"))
    p = logits[:-1].softmax(-1)  # row t predicts the token at t+1
    nxt = torch.tensor(seq[1:])
    rest = tok[1:]
    np.testing.assert_allclose(rest["prob"].to_numpy(), p.gather(1, nxt[:, None])[:, 0].numpy(), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(rest["logprob"].to_numpy(), np.log(rest["prob"].to_numpy()), atol=1e-5)
    np.testing.assert_allclose(rest["confidence"].to_numpy(), p.amax(-1).numpy(), rtol=1e-4)
    ent = -(p * p.log()).sum(-1).numpy()
    np.testing.assert_allclose(rest["entropy"].to_numpy(), ent, atol=1e-4)
    assert (rest["entropy"].to_numpy() >= 0).all()
    assert (rest["entropy"].to_numpy() <= math.log(model.args.vocab_size) + 1e-6).all()
    rank = (p > p.gather(1, nxt[:, None])).sum(-1) + 1
    assert rest["rank"].to_list() == rank.tolist()
    # greedy decoding: every generated token is the argmax of its distribution
    assert rest.filter(~pl.col("is_prompt"))["rank"].to_list() == [1] * NEW
    top_p, top_i = p.topk(5, -1)
    for r, (ids, probs) in enumerate(zip(rest["topk_ids"].to_list(), rest["topk_probs"].to_list())):
        assert probs == sorted(probs, reverse=True)
        assert ids == top_i[r].tolist()
        np.testing.assert_allclose(probs, top_p[r].numpy(), rtol=1e-4)


def test_kv_rows(recorded):
    model, run, seq, _, cap = recorded
    kv = run.kv()
    a = model.args
    assert kv["step"].unique().sort().to_list() == list(range(NEW))
    for row in kv.iter_rows(named=True):
        cached = len(PROMPT) + row["step"]
        assert row["cached_tokens"] == cached
        assert row["bytes"] == cached * (a.kv_lora_rank + a.qk_rope_head_dim) * 4


def test_kv_tokens_attention_received(recorded):
    """Each attention row sums to 1, so received attention sums to (queries x heads); per key it matches."""
    model, run, seq, _, cap = recorded
    kt = run.kv_tokens()
    final = NEW - 1
    assert set(kt["step"].unique().to_list()) == {0, final}
    n_rows = len(seq) - 1
    freqs = model.freqs_cis[: len(seq)]
    for step, n_q in ((0, len(PROMPT)), (final, n_rows)):
        for i, layer in enumerate(model.layers):
            got = kt.filter((pl.col("step") == step) & (pl.col("layer") == i)).sort("pos")
            assert got["pos"].to_list() == list(range(n_q))
            assert got["attn_received"].sum() == pytest.approx(n_q * a_heads(model), rel=1e-5)
            with torch.no_grad():
                x = layer.attn_norm(cap[f"layers.{i}.hook_resid_pre"])
                probs = reference_probs(layer.attn, x, freqs)[:, :n_q, :n_q]
                c, k_pe = layer.attn.wkv_a(x).split([layer.attn.kv_lora_rank, layer.attn.qk_rope_head_dim], -1)
                latent = layer.attn.kv_norm(c)[:n_q]
                rope = apply_rotary_emb(k_pe[None], freqs)[0][:n_q]
            np.testing.assert_allclose(got["attn_received"].to_numpy(), probs.sum((0, 1)).numpy(), atol=1e-4)
            np.testing.assert_allclose(got["latent_norm"].to_numpy(), latent.norm(dim=-1).numpy(), rtol=1e-4)
            np.testing.assert_allclose(got["rope_norm"].to_numpy(), rope.norm(dim=-1).numpy(), rtol=1e-4)


def a_heads(model: Transformer) -> int:
    return model.args.n_heads


def test_steps(recorded):
    _, run, _, _, _ = recorded
    st = run.steps()
    assert st["step"].to_list() == list(range(NEW))
    assert st["kind"].to_list() == ["prefill"] + ["decode"] * (NEW - 1)
    assert st["n_tokens"].to_list() == [len(PROMPT)] + [1] * (NEW - 1)
    assert (st["wall_ms"] > 0).all()


def test_chunked_probe_equals_one_block():
    """attention_stats over blocks of query rows equals one pass over the whole matrix."""
    g = torch.Generator().manual_seed(0)
    T, H = 11, 3
    scores = torch.randn(H, T, T, generator=g).masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1),
                                                           float("-inf"))
    probs = scores.softmax(-1).transpose(0, 1)  # [T, H, S]
    whole = attention_stats(probs, 0)
    parts = [attention_stats(probs[t0:t0 + 4], t0) for t0 in range(0, T, 4)]
    for key in whole:
        np.testing.assert_allclose(np.concatenate([p[key] for p in parts]), whole[key])


def test_probe_functions_on_random_tensors():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g)
    ids = torch.randint(0, 50, (7,), generator=g)
    s = token_confidence(logits, ids, k=5)
    p = logits.softmax(-1)
    np.testing.assert_allclose(s["prob"], p.gather(1, ids[:, None])[:, 0].numpy(), rtol=1e-5)
    assert (np.diff(s["topk_probs"], axis=1) <= 0).all()
    bad = logits.clone()
    bad[2, 3] = float("nan")
    s_bad = token_confidence(bad, ids)
    assert s_bad["rank"][2] == -1 and np.isnan(s_bad["entropy"][2])  # never an exception
    scores = torch.rand(4, 8, generator=g)
    bias = torch.zeros(8)
    idx = scores.topk(2, -1).indices
    w = scores.gather(1, idx)
    r = routing_records(idx, w, scores, scores + bias)
    srt = scores.sort(-1, descending=True).values
    np.testing.assert_allclose(r["margin"], (srt[:, 1] - srt[:, 2]).numpy(), rtol=1e-6)


def test_token_confidence_against_float64():
    """Entropy, confidence, probability and rank against a float64 softmax, masked (-inf) logits included: a
    masked token adds nothing to the entropy (0 log 0 = 0) and the probabilities stay those of the rest (its rank is
    -1, as for any non-finite logit); an inf logit makes the row's entropy NaN."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g) * 4
    logits[1, :150] = float("-inf")  # a masked half of the vocabulary
    logits[2, 7] = -300.0  # a probability that underflows to 0 in float32
    logits[4, 9] = float("inf")
    ids = torch.randint(150, 300, (6,), generator=g)
    got = token_confidence(logits, ids, k=3)
    for t in (0, 1, 2, 3, 5):
        p = torch.softmax(logits[t].double(), -1)
        ent = -torch.special.xlogy(p, p).sum().item()
        assert abs(got["entropy"][t] - ent) < 1e-4 * max(1.0, ent)
        assert abs(got["confidence"][t] - p.max().item()) < 1e-6
        assert abs(got["prob"][t] - p[ids[t]].item()) < 1e-6
        np.testing.assert_allclose(got["topk_probs"][t], p.topk(3).values.numpy(), atol=1e-6)
    assert got["rank"][1] == -1 and got["rank"][0] >= 1
    none = token_confidence(logits, ids, k=0)  # no alternatives kept: the confidence all the same
    np.testing.assert_allclose(none["confidence"], got["confidence"])
    assert none["topk_ids"].shape == (6, 0)
    assert np.isnan(got["entropy"][4]) and got["rank"][4] == -1


def test_chunked_prefill_equals_whole():
    """A prefill longer than attn_chunk (query rows in blocks, with or without probes) gives the same logits."""
    model = biased_tiny_model()
    x = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x)
        for layer in model.layers:
            layer.attn.attn_chunk = 7
        got = model(x)
        with attach(model, {"layers.*.attn.hook_attn_probs": lambda p, **_: None}):
            observed = model(x)
        with attach(model, {"layers.*.attn.hook_attn_stats": lambda s, **_: None}):
            reduced = model(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(observed, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reduced, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sharp,n_prefill", [(1.0, 9), (40.0, 9), (1.0, 40), (40.0, 40)])
def test_reduced_attention_stats_equal_the_probabilities(sharp, n_prefill):
    """``hook_attn_stats`` from the path without probabilities (max s + log l - scale q.(p@K), 1/l, e_0/l,
    received as a matrix-vector product) equals the same statistics taken from the explicit softmax's
    probabilities, for prefill blocks with a query offset and for decode rows; a model whose rows are
    nearly one-hot (``sharp``) keeps entropy within [0, log n]. A 9-row prefill attends in latent space, a
    40-row one over expanded keys and values (``MLA.naive``); the explicit softmax is always latent."""
    model = biased_tiny_model()
    assert model.layers[0].attn.naive(n_prefill) == (n_prefill == 40) and not model.layers[0].attn.naive(1)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.attn_chunk = 4
            layer.attn.wkv_a.weight.mul_(sharp ** 0.5)
            (layer.attn.wq if layer.attn.q_lora_rank == 0 else layer.attn.wq_b).weight.mul_(sharp ** 0.5)
    x = torch.randint(0, 256, (2, n_prefill + 2), generator=torch.Generator().manual_seed(1))

    def run(hooks):
        seen = []

        def keep(st, q_start, received, **_):
            seen.append((q_start, st.clone(), received.clone()))
        model.setup_cache(2, 64)
        try:
            with torch.no_grad(), attach(model, {"layers.*.attn.hook_attn_stats": keep, **hooks}):
                logits = [model(x[:, :n_prefill], start_pos=0)]
                logits += [model(x[:, t:t + 1], start_pos=t) for t in (n_prefill, n_prefill + 1)]
        finally:
            model.clear_cache()
        return torch.cat(logits, 1), seen

    reduced, got = run({})
    observed, ref = run({"layers.*.attn.hook_attn_probs": lambda p, **_: None})  # stats from the probabilities
    torch.testing.assert_close(reduced, observed, atol=1e-4, rtol=1e-4)  # naive vs latent: summation order
    n_blocks = -(-n_prefill // 4) + 2
    assert [q for q, _, _ in got] == [q for q, _, _ in ref] and len(got) == n_blocks * len(model.layers)
    for (q0, st, rec), (_, st_ref, rec_ref) in zip(got, ref):
        torch.testing.assert_close(st, st_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(rec, rec_ref, atol=1e-4, rtol=1e-4)
        n_keys = torch.arange(q0, q0 + st.size(1)) + 1.0
        assert (st[..., 0] >= 0).all() and (st[..., 0] <= n_keys.log()[None, :, None] + 1e-5).all()
        assert rec.sum(-1).allclose(torch.full((2,), float(st.size(1) * st.size(2))), rtol=1e-5)


def test_token_confidence_in_blocks_equals_one_pass():
    """A prefill's logits go through token_confidence in blocks of ROWS rows: the same columns as one pass."""
    import workbench.probes.signals as sig

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(sig.ROWS * 2 + 7, 40, generator=g)
    logits[3, 5] = float("nan")
    ids = torch.randint(0, 40, (logits.size(0),), generator=g)
    got = token_confidence(logits, ids)
    rows, sig.ROWS = sig.ROWS, logits.size(0)
    try:
        ref = token_confidence(logits, ids)
    finally:
        sig.ROWS = rows
    for key in ref:
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)


@pytest.mark.parametrize("n_prefill", [9, 40])
def test_reduced_stats_paths_keep_a_bf16_models_output_and_autograd(n_prefill):
    """With a stats listener a bf16 model's first attention output stays the plain path's within bf16 rounding
    (the logits further on may differ more: a near-tie in routing can flip), and a forward under autograd (root
    cause's gradients) works on both the latent and the naive path."""
    model = biased_tiny_model()
    x = torch.randint(0, 256, (1, n_prefill), generator=torch.Generator().manual_seed(4))
    half = biased_tiny_model().to(torch.bfloat16)

    def z0(hooks):
        got = {}
        with torch.no_grad(), attach(half, {"layers.0.attn.hook_z": lambda z, **_: got.setdefault("z", z), **hooks}):
            half(x)
        return got["z"]
    plain, reduced = z0({}), z0({"layers.*.attn.hook_attn_stats": lambda s, **_: None})
    assert reduced.dtype == torch.bfloat16
    torch.testing.assert_close(reduced.float(), plain.float(), atol=0.02 * plain.abs().max().item(), rtol=0.02)
    emb = model.embed(x).detach().requires_grad_(True)
    seen = []
    with attach(model, {"layers.*.attn.hook_attn_stats": lambda s, **_: seen.append(s)}):
        model(inputs_embeds=emb).sum().backward()
    assert seen and emb.grad is not None and torch.isfinite(emb.grad).all()
