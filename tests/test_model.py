"""The model on its own: gate against a line-by-line transcription, hook points, cache, sampling."""
from __future__ import annotations

import pytest
import torch

from workbench.model import Gate, ModelArgs, Transformer, generate
from workbench.model.generate import sample, stream
from workbench.probes import attach, hook_points


def tiny(**kw) -> Transformer:
    args = ModelArgs.preset("tiny")
    for k, v in kw.items():
        setattr(args, k, v)
    args.__post_init__()
    return Transformer(args).init_weights(seed=1, std=0.1).eval()


def reference_gate(x, weight, bias, score_func, n_groups, topk_groups, topk, route_scale):
    """Transcription of DeepSeek-V3 inference/model.py Gate.forward (bias always present)."""
    scores = torch.nn.functional.linear(x, weight)
    if score_func == "softmax":
        scores = scores.softmax(dim=-1, dtype=torch.float32)
    else:
        scores = scores.sigmoid()
    original_scores = scores
    scores = scores + bias
    if n_groups > 1:
        scores = scores.view(x.size(0), n_groups, -1)
        group_scores = scores.amax(dim=-1) if score_func == "softmax" else scores.topk(2, dim=-1)[0].sum(dim=-1)
        indices = group_scores.topk(topk_groups, dim=-1)[1]
        mask = scores.new_ones(x.size(0), n_groups, dtype=bool).scatter_(1, indices, False)
        scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(scores, topk, dim=-1)[1]
    weights = original_scores.gather(1, indices)
    if score_func == "sigmoid":
        weights /= weights.sum(dim=-1, keepdim=True)
    weights *= route_scale
    return weights, indices


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (4, 1)])
def test_gate_matches_reference_transcription(score_func, groups):
    args = ModelArgs.preset("tiny")
    args.score_func, (args.n_expert_groups, args.n_limited_groups) = score_func, groups
    args.norm_topk_prob = score_func == "sigmoid"  # the reference normalises only sigmoid weights
    gate = Gate(args)
    torch.manual_seed(0)
    torch.nn.init.normal_(gate.weight, std=0.5)
    gate.bias.copy_(torch.randn(args.n_routed_experts) * 0.2)
    x = torch.randn(64, args.dim)
    w, idx = gate(x)
    w_ref, idx_ref = reference_gate(x, gate.weight, gate.bias, score_func, *groups, args.n_activated_experts,
                                    args.route_scale)
    assert torch.equal(idx.sort(-1).values, idx_ref.sort(-1).values)
    torch.testing.assert_close(w.gather(1, idx.argsort(-1)), w_ref.gather(1, idx_ref.argsort(-1)))


def test_bias_changes_choice_not_weights():
    """The selection bias decides which experts are chosen, never how much they weigh."""
    args = ModelArgs.preset("tiny")
    gate = Gate(args)
    torch.nn.init.normal_(gate.weight, std=0.5)
    x = torch.randn(32, args.dim)
    w0, i0 = gate(x)
    gate.bias[3] = 10.0  # expert 3 wins every token it is allowed to see
    w1, i1 = gate(x)
    assert (i1 == 3).any(dim=-1).float().mean() > (i0 == 3).any(dim=-1).float().mean()
    scores = torch.sigmoid(x @ gate.weight.T)
    picked = scores.gather(1, i1)
    torch.testing.assert_close(w1, picked / picked.sum(-1, keepdim=True) * args.route_scale)


def test_hook_points_named_and_free():
    m = tiny()
    names = set(hook_points(m))
    for expected in ["hook_embed", "layers.0.hook_resid_pre", "layers.1.hook_resid_post", "layers.0.attn.hook_out",
                     "layers.0.attn.hook_attn_probs", "layers.1.ffn.gate.hook_logits", "layers.1.ffn.gate.hook_scores",
                     "layers.1.ffn.gate.hook_selection", "layers.1.ffn.gate.hook_weights",
                     "layers.1.ffn.gate.hook_indices", "layers.1.ffn.experts.0.hook_out",
                     "layers.1.ffn.shared_experts.hook_out", "hook_norm", "hook_logits"]:
        assert expected in names, expected
    # module names follow the reference
    params = dict(m.named_parameters())
    for p in ["embed.weight", "layers.0.attn.wq_a.weight", "layers.0.attn.wkv_a.weight", "layers.0.attn.wkv_b.weight",
              "layers.0.attn.wo.weight", "layers.0.ffn.w1.weight", "layers.1.ffn.gate.weight",
              "layers.1.ffn.experts.7.w2.weight", "layers.1.ffn.shared_experts.w3.weight", "norm.weight", "head.weight"]:
        assert p in params, p
    tokens = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        base = m(tokens)
        with attach(m, {"layers.*.attn.hook_attn_probs": lambda p, **_: None}):
            observed = m(tokens)  # explicit, chunked softmax path
        assert not any(h.active for h in hook_points(m).values())  # removed on exit
    torch.testing.assert_close(observed, base, atol=1e-5, rtol=1e-5)


def test_attention_chunking_is_exact():
    m = tiny()
    tokens = torch.randint(0, 256, (1, 37))
    seen = []
    with torch.no_grad(), attach(m, {"layers.0.attn.hook_attn_probs": lambda p, q_start, **_: seen.append((q_start, p))}):
        full = m(tokens)
        for layer in m.layers:
            layer.attn.attn_chunk = 5
        chunked = m(tokens)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    whole = seen[0][1][0]
    parts = torch.cat([p[0] for _, p in seen[1:]], 0)
    assert [q for q, _ in seen[1:]] == list(range(0, 37, 5))
    torch.testing.assert_close(parts, whole)
    torch.testing.assert_close(whole.sum(-1), torch.ones(37, 4))
    future = torch.ones(37, 37).triu(1).bool()  # [query, key] pairs a causal row must not see
    assert whole.permute(1, 0, 2)[:, future].abs().max() == 0


def test_kv_cache_holds_latent_only():
    m = tiny()
    m.setup_cache(1, 64)
    a = m.args
    assert m.layers[0].attn.cache.bytes_per_token() == (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    assert m.kv_bytes_per_token() == a.n_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    with torch.no_grad():
        m(torch.randint(0, 256, (1, 10)))
    assert m.layers[1].attn.cache.length == 10
    with pytest.raises(ValueError, match="overflow"):
        with torch.no_grad():
            m(torch.randint(0, 256, (1, 60)), start_pos=10)
    m.clear_cache()


def test_forward_is_differentiable():
    m = tiny()
    emb = m.embed(torch.randint(0, 256, (1, 12))).detach().requires_grad_(True)
    m(inputs_embeds=emb)[0, -1].logsumexp(-1).backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_sampling_seeded_and_top_p():
    m = tiny()
    prompt = [5, 6, 7]
    a = generate(m, prompt, 16, temperature=1.0, top_p=0.9, seed=7)
    b = generate(m, prompt, 16, temperature=1.0, top_p=0.9, seed=7)
    c = generate(m, prompt, 16, temperature=1.0, top_p=0.9, seed=8)
    assert a == b and a != c
    logits = torch.tensor([5.0, 4.0, -10.0, -10.0])
    g = torch.Generator().manual_seed(0)
    picks = {sample(logits, 1.0, 0.5, g) for _ in range(50)}
    assert picks == {0}  # token 0 alone carries > 50% of the mass
    assert sample(torch.tensor([float("nan"), 1.0, 0.5]), 0.0, 1.0, g) == 1  # NaN never chosen


def test_prompt_errors():
    m = tiny()
    with pytest.raises(ValueError, match="empty"):
        list(stream(m, [], 4))
    with pytest.raises(ValueError, match="max_seq_len"):
        list(stream(m, [1] * 250, 10))


def test_file_sha256_is_remembered_until_a_file_changes(tmp_path):
    """The checkpoint hash is cached per process, but a rewritten file is hashed anew (its size or
    modification time moved), and the cached value is the real SHA-256 of the bytes."""
    import hashlib
    import os

    from workbench.model import file_sha256

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"a" * 1000)
    first = file_sha256(tmp_path)
    assert first == hashlib.sha256(b"a" * 1000).hexdigest() == file_sha256(tmp_path)
    st = f.stat()
    f.write_bytes(b"b" * 1000)  # same size; the clock may not have ticked: move the mtime explicitly
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert file_sha256(tmp_path) == hashlib.sha256(b"b" * 1000).hexdigest()
