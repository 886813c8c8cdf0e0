"""Root cause: routing-frozen IG completeness, plain IG's delta, ablation vs a hand loop, faults, storage."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.analysis import faults
from workbench.analysis.rootcause import (
    CORROBORATE,
    SIGNIFICANT,
    TIE,
    WEIGHT_NATS,
    behind_block,
    component_ablation,
    corroborated,
    frozen_routing,
    integrated_gradients,
    interleave,
    real_routing,
    row_evidence,
    target_fn,
)
from workbench.capture.adapters import adapter_for
from workbench.cli import main as cli_main
from workbench.data import query
from workbench.model import ModelArgs, Transformer
from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.probes import attach


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_model()


@pytest.fixture(scope="module")
def ids():
    return torch.tensor([[17, 3, 99, 45, 200, 8, 64, 12, 150, 33, 71, 5]])


def _target(model, ids) -> int:
    """A target token with a large gap f(x) - f(baseline), so relative completeness is meaningful."""
    with torch.no_grad():
        lp = torch.log_softmax(model(ids)[0, -1], -1) - torch.log_softmax(model(torch.zeros_like(ids))[0, -1], -1)
    return int(lp.abs().argmax())


def test_routing_frozen_ig_completeness_and_plain_delta(tiny, ids, record_property):
    target = _target(tiny, ids)
    scores, delta, gap = integrated_gradients(tiny, ids, target, steps=32, mode="frozen")
    assert abs(gap) > 0.05
    assert abs(scores.sum() - gap) <= 1e-3 * abs(gap)  # completeness, 1e-3 relative
    assert abs(delta) <= 1e-3 * abs(gap)
    # at the real input the frozen model is the real model: f(x) is the real target
    f = target_fn(tiny, target)
    with torch.no_grad():
        real = f(ids)
        with frozen_routing(tiny, real_routing(tiny, ids)):
            frozen = f(ids.expand(3, -1))  # tiled for a batch of 3
    assert torch.allclose(frozen, real.expand(3), atol=1e-6)
    # plain IG: top-k routing is discontinuous along the path, so its delta is not small
    p_scores, p_delta, p_gap = integrated_gradients(tiny, ids, target, steps=32, mode="plain")
    p_delta64 = integrated_gradients(tiny, ids, target, steps=64, mode="plain")[1]
    assert abs(p_scores.sum() - p_delta - p_gap) < 1e-3 * max(1.0, abs(p_gap))  # captum's delta is what it says
    assert abs(p_delta) > abs(delta) and abs(p_delta) / abs(p_gap) > abs(delta) / abs(gap)
    record_property("frozen_rel_delta", abs(delta) / abs(gap))
    record_property("plain_rel_delta_32", abs(p_delta) / abs(p_gap))
    record_property("plain_rel_delta_64", abs(p_delta64) / abs(p_gap))
    print(f"frozen IG relative delta {abs(delta) / abs(gap):.2e}; plain IG relative delta "
          f"{abs(p_delta) / abs(p_gap):.2%} (32 steps), {abs(p_delta64) / abs(p_gap):.2%} (64 steps)")


def test_ablation_matches_a_hand_loop(tiny, ids):
    comps, eff = component_ablation(tiny, ids, 7, batch_size=5)
    col = {c: k for k, c in enumerate(comps)}
    f = target_fn(tiny, 7)

    def zero_head(z, **_):
        z = z.clone()
        z[:, :, 2] = 0
        return z

    def zero(out, **_):
        return out * 0

    def exclude(j):  # the router may not choose expert j: it picks the next best
        def fn(scores, **_):
            scores = scores.clone()
            scores[:, j] = float("-inf")
            return scores
        return fn

    with torch.no_grad():
        full = float(f(ids))
        chosen = real_routing(tiny, ids)[1]
        used = chosen[-1, 0].item()  # routed at the last position of the last layer
        unused = min(set(range(8)) - set(chosen.flatten().tolist()))
        cases = {("head", 1, 2, None): {"layers.1.attn.hook_z": zero_head},
                 ("expert", 1, None, used): {"layers.1.ffn.gate.hook_scores": exclude(used)},
                 ("expert", 1, None, unused): {"layers.1.ffn.gate.hook_scores": exclude(unused)},
                 ("shared_expert", 1, None, None): {"layers.1.ffn.shared_experts.hook_out": zero}}
        for comp, hooks in cases.items():
            with attach(tiny, hooks):
                ablated = float(f(ids))
            assert eff[col[comp]] == pytest.approx(full - ablated, abs=1e-5), comp
        assert eff[col[("expert", 1, None, used)]] != 0.0
        with attach(tiny, {"layers.1.ffn.gate.hook_scores": exclude(used)}):
            assert not (real_routing(tiny, ids)[1] == used).any()  # re-routed, not zeroed
    # the router: its selection bias removed. The tiny model has none (effect 0); give it one, by hand
    assert eff[col[("router", 1, None, None)]] == 0.0
    gate = tiny.layers[1].ffn.gate
    saved = gate.bias.clone()
    try:
        with torch.no_grad():
            gate.bias.copy_(torch.linspace(-0.3, 0.4, gate.bias.numel()))
            gate.bias[unused] += 1.0  # chosen at the last position too, the one the target depends on
            comps, eff = component_ablation(tiny, ids, 7, batch_size=7)
            full = float(f(ids))
            gate.bias.zero_()
            unbiased = float(f(ids))
    finally:
        with torch.no_grad():
            gate.bias.copy_(saved)
    assert eff[col[("router", 1, None, None)]] == pytest.approx(full - unbiased, abs=1e-5)
    assert full != unbiased


def test_root_cause_on_a_recorded_run(tiny, tmp_path):
    db = tmp_path / "w.duckdb"
    run = workbench.record(list(range(30, 50)), model=tiny, max_new_tokens=3, db=db)
    assert run.model() is tiny  # the in-memory module, not a checkpoint
    pos = 20
    df = run.root_cause(pos, steps=16)
    assert df.columns[:9] == ["target_pos", "kind", "layer", "head", "expert", "source_pos", "score", "rank",
                              "method"]
    assert df["rank"].to_list() == list(range(1, df.height + 1))
    assert set(df["kind"]) == {"token", "head", "expert", "shared_expert", "router", "embed", "unembed"}
    weights = df.filter(pl.col("method") == "profile")  # no profile for this model: only the weight rows
    assert sorted(weights["kind"].to_list()) == ["embed", "unembed"]
    rest = df.filter(pl.col("method") != "profile")
    # no reference, no profile: components (by ablation) and tokens (by IG) take turns, each in its own order
    for part in (rest.filter(pl.col("kind") == "token"), rest.filter(pl.col("kind") != "token")):
        scores = part["score"].abs().to_list()
        assert scores == sorted(scores, reverse=True)
    assert rest["kind"].head(4).to_list()[1::2] == ["token", "token"] and "token" not in rest["kind"].head(4)[::2]
    tok = df.filter(pl.col("kind") == "token")
    assert sorted(tok["source_pos"].to_list()) == list(range(pos))
    assert set(tok["method"]) == {"ig_routing_frozen"} and tok["delta"].is_not_null().all()
    assert set(rest.filter(pl.col("kind") != "token")["method"]) == {"ablation"}
    # the IG target is the recorded token's logprob (cache-free recomputation agrees with the recording)
    _, _, gap = integrated_gradients(tiny, torch.tensor([run.tokens()["token_id"].to_list()[:pos]]),
                                     run.tokens()["token_id"][pos], steps=4)
    assert abs(tok["score"].sum() - gap) <= 1e-2 * max(1.0, abs(gap))
    stored = query.attributions(run.store, run.run_id, pos)
    assert stored.height == df.height and stored["rank"].to_list() == df["rank"].to_list()
    run.root_cause(pos, steps=8, mode="plain")  # replaces, never duplicates
    again = query.attributions(run.store, run.run_id, pos)
    assert again.height == df.height and set(again.filter(pl.col("kind") == "token")["method"]) == {"ig_plain"}
    with pytest.raises(ValueError, match="pos must be in"):
        run.root_cause(0)
    with pytest.raises(ValueError, match="mode"):
        run.root_cause(pos, mode="sideways")
    # a position as NumPy hands it out (run.tokens()["pos"].to_numpy()) is a position: computed and stored
    np_pos = run.tokens()["pos"].to_numpy()[pos - 1]
    assert run.root_cause(np_pos, steps=2)["target_pos"].to_list()[0] == pos - 1
    assert query.attributions(run.store, run.run_id, pos - 1).height
    for bad in (2.0, True, "3"):  # no position: said before any work
        with pytest.raises(ValueError, match="pos must be an integer"):
            run.root_cause(bad)


def _argmax(model, ids) -> int:
    with torch.no_grad():
        return int(model(ids)[0, -1].argmax())


def test_broken_head_and_expert_rank_first(tiny, ids):
    # the target is what the broken model produces, as when a user explains a token of a faulty run
    with faults.break_head(tiny, 1, 3, scale=30.0):
        comps, eff = component_ablation(tiny, ids, _argmax(tiny, ids))
    top = max(range(len(comps)), key=lambda k: abs(eff[k]))
    assert comps[top] == ("head", 1, 3, None)
    # layer 1 is the last layer: only the experts of the last position can reach its logits
    expert = int(real_routing(tiny, ids)[1][-1, 0])
    with faults.break_expert(tiny, 1, expert, scale=30.0):
        comps, eff = component_ablation(tiny, ids, _argmax(tiny, ids))
    top = max(range(len(comps)), key=lambda k: abs(eff[k]))
    assert comps[top] == ("expert", 1, None, expert)


def test_faults_are_undone_and_router_bias_takes_over(tiny, ids):
    with torch.no_grad():
        before = tiny(ids)
        bias = tiny.layers[1].ffn.gate.bias.clone()
        with faults.bias_router(tiny, 1, 6, amount=2.0):
            chosen = real_routing(tiny, ids)[1]
            assert (chosen == 6).any(-1).all()  # every token routed to expert 6
        with faults.break_head(tiny, 0, 0), faults.break_expert(tiny, 1, 0):
            assert not torch.allclose(tiny(ids), before)
        assert torch.equal(tiny.layers[1].ffn.gate.bias, bias)
        assert torch.equal(tiny(ids), before)
    with pytest.raises(ValueError, match="dense layer"):
        with faults.break_expert(tiny, 0, 1):
            pass
    with pytest.raises(ValueError, match="head 9 out of range"):
        with faults.break_head(tiny, 1, 9):
            pass


def test_explain_cli(tiny, tmp_path, capsys):
    from workbench.model import save_checkpoint

    db = tmp_path / "w.duckdb"
    mem = workbench.record(list(range(60, 72)), model=tiny, max_new_tokens=2, db=db)
    # the CLI loads the model itself: a run recorded from an in-memory module cannot be explained there
    assert cli_main(["explain", mem.run_id, "5", "--json", "--db", str(db)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    ckpt = save_checkpoint(tiny, tmp_path / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    run = workbench.record(list(range(60, 72)), model=str(ckpt), max_new_tokens=2, db=db)
    assert cli_main(["explain", run.run_id, "6", "--json", "--steps", "8", "--db", str(db)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["pos"] == 6 and out["method"] == "ig_routing_frozen"
    assert [c["rank"] for c in out["causes"]] == list(range(1, len(out["causes"]) + 1))
    assert cli_main(["explain", run.run_id, "6", "--steps", "8", "--mode", "plain", "--db", str(db)]) == 0
    assert "ig_plain" in capsys.readouterr().out
    assert cli_main(["explain", run.run_id, "99", "--db", str(db)]) == 2
    assert cli_main(["explain", "missing", "5", "--db", str(db)]) == 2
    assert out["sampler_note"] is None  # greedy: the token is the model's own first choice


def test_a_sampled_token_the_model_did_not_prefer_is_said_to_be_the_samplers_draw(tmp_path):
    """Why a sampled token is there is the sampler first: root cause says so (with the chance of a draw that unlikely)
    beside the components that shaped the distribution; nothing is said of the model's own first choice, of a prompt
    token, or of a greedy run."""
    from workbench.analysis.rootcause import sampler_note
    from workbench.model import load_checkpoint

    db = workbench.Store(tmp_path / "w.duckdb")
    model = load_checkpoint()
    run = workbench.record("def read_lines(path):\n    ", model=model, db=db, max_new_tokens=40, temperature=1.5,
                           seed=3, detect=False)
    t = run.tokens().filter(~pl.col("is_prompt"))
    drawn = t.filter(pl.col("rank") > 1)
    assert drawn.height, "temperature 1.5 draws some token the model did not rank first"
    r = drawn.row(0, named=True)
    note = sampler_note(db, run.run_id, r["pos"])
    assert note.startswith("the sampler drew this token (temperature 1.5)") and f"its rank {r['rank']}" in note
    firsts = t.filter(pl.col("rank") == 1)
    assert sampler_note(db, run.run_id, firsts["pos"][0]) is None
    assert sampler_note(db, run.run_id, 1) is None  # a prompt token
    greedy = workbench.record("def read_lines(path):\n    ", model=model, db=db, max_new_tokens=4, detect=False)
    assert sampler_note(db, greedy.run_id, greedy.info["n_tokens"] - 1) is None


def test_root_cause_against_a_reference(tiny, tmp_path, capsys):
    import copy

    from workbench.model import save_checkpoint

    db = tmp_path / "w.duckdb"
    clean = copy.deepcopy(tiny)
    run = workbench.record(list(range(30, 46)), model=tiny, max_new_tokens=2, db=db)
    pos = 12
    ids = torch.tensor([run.tokens()["token_id"].to_list()[:pos]])
    target = run.tokens()["token_id"][pos]
    # an identical reference cancels everything
    same = run.root_cause(pos, steps=8, reference=clean, store=False, method="attribution_diff")
    assert same["score"].abs().max() < 1e-5
    assert set(same["method"]) == {"ig_routing_frozen_vs_reference", "ablation_vs_reference"}
    # a router biased toward expert 6: removing expert 6 from the biased router's choice restores the clean
    # routing exactly, so its contrast score is the fault's whole effect on the target, f(x) - f_ref(x)
    f = target_fn(tiny, target)
    with faults.bias_router(tiny, 1, 6, amount=2.0):
        df = run.root_cause(pos, steps=32, reference=clean, store=False, method="attribution_diff")
        with torch.no_grad():
            fault_effect = float(f(ids)[0] - target_fn(clean, target)(ids)[0])
        gap = integrated_gradients(tiny, ids, target, steps=2)[2]  # f(x) - f(baseline), routing frozen
    ref_gap = integrated_gradients(clean, ids, target, steps=2)[2]
    e6 = df.filter((pl.col("kind") == "expert") & (pl.col("layer") == 1) & (pl.col("expert") == 6))
    assert abs(fault_effect) > 1e-3
    assert e6["score"][0] == pytest.approx(fault_effect, abs=1e-4)
    tok = df.filter(pl.col("kind") == "token")
    assert tok["score"].sum() == pytest.approx(gap - ref_gap, abs=2e-3 * max(1.0, abs(gap), abs(ref_gap)))
    with pytest.raises(ValueError, match="own model"):
        run.root_cause(pos, reference=tiny)
    other = Transformer(dataclasses.replace(ModelArgs.preset("tiny"), vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        run.root_cause(pos, reference=other)
    # the CLI takes a reference run id or a checkpoint folder
    ckpt = save_checkpoint(tiny, tmp_path / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    a = workbench.record(list(range(30, 46)), model=str(ckpt), max_new_tokens=2, db=db)
    twin = workbench.record(list(range(30, 46)), model=str(ckpt), max_new_tokens=2, db=db)
    with pytest.raises(ValueError, match="same weights"):  # a run id resolves in the run's database
        a.root_cause(pos, reference=twin.run_id)
    with pytest.raises(ValueError, match="same weights"):  # the same weights as a folder: the same answer
        a.root_cause(pos, reference=str(ckpt))
    # the same weights in another dtype are the natural reference (bf16 against fp32)
    bf16 = workbench.record(list(range(30, 46)), model=str(ckpt), max_new_tokens=2, db=db, dtype="bfloat16")
    assert a.root_cause(pos, steps=4, reference=bf16.run_id, store=False,
                        method="attribution_diff")["method"][0].endswith("_vs_reference")
    assert set(a.root_cause(pos, reference=bf16.run_id, store=False)["method"]) == {"patching"}
    edited = workbench.record(list(range(31, 47)), model=str(ckpt), max_new_tokens=2, db=db)  # other tokens
    assert a.root_cause(pos, steps=4, reference=edited.run_id, store=False).height > 0
    with pytest.raises(ValueError, match="use method='patching'"):  # the same model on another prompt: no diff
        a.root_cause(pos, steps=4, reference=edited.run_id, store=False, method="attribution_diff")
    longer = workbench.record(list(range(30, 46)) + [7], model=str(ckpt), max_new_tokens=2, db=db)
    with pytest.raises(ValueError, match="same 12 tokens"):  # other tokens, but only after the explained prefix
        a.root_cause(pos, reference=longer.run_id, store=False)
    with pytest.raises(ValueError, match="neither a run"):
        run.root_cause(pos, reference="nope")
    with faults.bias_router(clean, 1, 6, amount=2.0):
        save_checkpoint(clean, tmp_path / "biased", tokenizer=DEFAULT_TOKENIZER)
    assert cli_main(["explain", a.run_id, str(pos), "--json", "--steps", "4", "--reference",
                     str(tmp_path / "biased"), "--db", str(db)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == "patching" and out["reference"] == str(tmp_path / "biased")
    assert {"resid", "attn_block", "unembed", "token"} <= {c["kind"] for c in out["causes"]}
    assert cli_main(["explain", a.run_id, str(pos), "--reference", str(tmp_path / "biased"), "--db", str(db)]) == 0
    assert "restored" in capsys.readouterr().out
    assert cli_main(["explain", a.run_id, str(pos), "--reference", "nope", "--db", str(db)]) == 2


def test_ig_check_flags_an_unconverged_attribution():
    from workbench.analysis.rootcause import ig_check, rank_causes

    comps = [("head", 0, 0, None)]
    ok = rank_causes(np.array([1.0, 2.0]), "ig_routing_frozen", 0.01, comps, np.array([0.5]), 2)
    assert ig_check(ok, 32) is None  # |0.01| is 0.3% of the gap 2.99
    bad = rank_causes(np.array([1.0, 2.0]), "ig_routing_frozen", -1.2, comps, np.array([0.5]), 2)
    msg = ig_check(bad, 8)
    assert "did not converge" in msg and "try --steps 16" in msg and "29%" in msg


def test_suspects_put_what_a_finding_names_first():
    from workbench.analysis.findings import SCHEMA
    from workbench.analysis.rootcause import rank_causes, suspects

    comps = [("head", 0, 0, None), ("head", 1, 2, None), ("expert", 1, None, 3), ("router", 1, None, None)]
    causes = rank_causes(np.array([0.1]), "ig_plain", 0.0, comps, np.array([2.0, 0.5, 0.2, 0.01]), 1)
    f = pl.DataFrame([{"rank": 1, "component": "expert", "layer": 1, "head": None, "expert": 3, "pos_start": 1,
                       "pos_end": 1, "positions": [1], "n_rows": 1, "kinds": ["overloaded_expert"],
                       "severity": "warning", "score": 5.0, "explanation": "layer 1 expert 3: overloaded"}],
                     schema=SCHEMA)
    s = suspects(causes, f)
    assert s.select("kind", "layer", "expert").rows()[:2] == [("expert", 1, 3), ("router", 1, None)]
    assert s["rank"].to_list() == [1, 2, 3, 4] and s["cause_rank"][2] == 1  # the rest keep their order
    assert suspects(causes, f.clear())["kind"].to_list() == ["head", "head", "expert", "router"]
    cache = f.with_columns(pl.lit("kv").alias("component"), pl.lit(None, pl.Int32).alias("expert"),
                           pl.lit(["cache_mismatch"], pl.List(pl.Utf8)).alias("kinds"))
    s = suspects(causes, cache)  # root cause has no row for it (it recomputes without the cache): one of its own
    assert s.select("kind", "layer").row(0) == ("kv_cache", 1) and s["score"][0] is None and s["finding"][0] == 1
    assert s["kind"].to_list()[1:] == ["head", "head", "expert", "router"]


# -- activation patching, the fault registry ---------------------------------------------------------------------
def _lp(a, ids, target) -> float:
    with torch.no_grad():
        return float(torch.log_softmax(a.forward(ids)[0, -1].float(), -1)[target])


def test_patching_the_residual_stream_gives_the_reference_logprob(tiny, ids):
    import copy

    from workbench.analysis.patching import patch_causes
    from workbench.capture.adapters import adapter_for

    a, clean = adapter_for(tiny), adapter_for(copy.deepcopy(tiny))
    target = _target(tiny, ids)
    with faults.break_head(tiny, 0, 1, scale=5.0):
        f_run = _lp(a, ids, target)
        sites, score, restored, gap, stats = patch_causes(a, ids, target, clean, ids, top_layers=2)
    f_ref = _lp(clean, ids, target)
    assert gap == pytest.approx(f_ref - f_run, abs=1e-5) and abs(gap) > 0.05
    row = {k: n for n, k in enumerate(sites)}
    # identity: the whole residual stream after the last layer from the reference is the reference's logprob
    # (resid rows are marginal: their sum over layers is the last layer's restoration)
    resid = sum(restored[row[("resid", i, None, None, None)]] for i in range(tiny.args.n_layers))
    assert resid == pytest.approx(1.0, abs=1e-4)
    assert restored[row[("head", 0, 1, None, None)]] == pytest.approx(1.0, abs=1e-4)
    # components the fault did not touch: nothing to restore (heads of layer 0 feed nothing the fault changed)
    for h in (0, 2, 3):
        assert abs(restored[row[("head", 0, h, None, None)]]) < 1e-4
    assert abs(restored[row[("unembed", None, None, None, None)]]) < 1e-4
    assert stats.layers[0] == 0 and stats.forwards >= 4


def test_position_faults_hit_their_position_only(tiny, ids):
    from workbench.capture.adapters import adapter_for

    a = adapter_for(tiny)
    with torch.no_grad():
        base = a.forward(ids)[0]
        with faults.inject_nan(a, 1, 4):
            nan = a.forward(ids)[0]
        with faults.corrupt_kv(a, 0, 2):
            kv = a.forward(ids)[0]
        assert torch.equal(a.forward(ids)[0], base)
    assert torch.isfinite(nan[:4]).all() and torch.isnan(nan[4]).all()  # later rows: NaN once attention mixes it
    assert torch.allclose(kv[:2], base[:2], atol=1e-6) and not torch.allclose(kv[2:], base[2:], atol=1e-3)


def test_every_fault_kind_changes_the_output_and_is_undone(tiny, ids):
    import copy

    from workbench.capture.adapters import adapter_for

    a = adapter_for(tiny)
    with torch.no_grad():
        base = a.forward(ids)
    assert len(faults.KINDS) >= 10
    trained = copy.deepcopy(a.module)  # norms away from their initial ones, as training leaves them
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "norm" in n:
                p.mul_(1.5)
    for name, kind in faults.ALL_KINDS.items():  # the held-out kinds too
        m = adapter_for(trained) if name == "norm_reset" else a  # (a reset is no change of a random model's ones)

        def out(m=m, kind=kind) -> torch.Tensor:  # a cache-only kind acts in a generation: prefill and a decode step
            if kind.cached_only:
                return torch.cat([s.logits for s in m.stream(ids[0].tolist(), 2, 0.0, 1.0, 0, None)])
            return m.forward(ids)
        with torch.no_grad():
            base, plain = out(), m.forward(ids)
        layer = kind.layers(m)[0]
        index = int(ids[0, 3]) if kind.index == "token" else 1
        made = kind(m, layer, index)  # a fault only acts inside its with block
        with torch.no_grad():
            assert torch.equal(out(), base), f"{name} acted before its with block"
        with torch.no_grad(), made:
            broken = out()
            if kind.cached_only:  # and a forward without the cache is unchanged
                assert torch.equal(m.forward(ids), plain), name
        with torch.no_grad():
            after = out()
        assert (broken - base).abs().max() > 1e-3, name
        assert torch.equal(after, base), name
    with pytest.raises(ValueError, match="dense layer"), faults.KINDS["starved"](a, 0, 1):
        pass


@pytest.mark.parametrize("kind,layer,index", [("norm", 1, 0), ("expert_flip", 1, None), ("starved", 1, None),
                                              ("rotary", 1, 0), ("kv_latent", 0, 5)])
def test_hierarchical_descent_finds_the_fault(tiny, ids, kind, layer, index):
    import copy

    from workbench.analysis.patching import patch_causes
    from workbench.analysis.rootcause import rank_patching
    from workbench.capture.adapters import adapter_for

    a, clean = adapter_for(tiny), adapter_for(copy.deepcopy(tiny))
    fk = faults.KINDS[kind]
    if index is None:  # the expert the explained (last) position is routed to first
        index = int(a.routing_of(ids)[layer][-1, 0])
    with torch.no_grad():
        lp0 = torch.log_softmax(a.forward(ids)[0, -1], -1)
        with fk(a, layer, index):
            lp1 = torch.log_softmax(a.forward(ids)[0, -1], -1)
    target = int((lp1 - lp0).abs().argmax())  # the token the fault moved most
    with fk(a, layer, index):
        sites, score, restored, gap, stats = patch_causes(a, ids, target, clean, ids, top_layers=1)
    df = rank_patching(sites, score, restored, ids.size(1), gap)
    assert stats.layers == [layer]
    top = df.head(3).to_dicts()
    assert any(fk.names(r, layer, index) and r["kind"] in fk.culprit for r in top), (kind, top)


def test_heads_off_the_same_way_make_an_attention_block_row():
    """Profile evidence: each head's surprise, and an attn_block row (their sum) only where every head of the
    layer is off in the same direction."""
    from workbench.analysis.rootcause import _heads_and_block

    z = pl.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "z": [2.0, 3.0, 2.0, -1.0]})
    got = dict(_heads_and_block(z))
    assert got[("head", 0, 1, None, None)] == pytest.approx(4.5) and got[("head", 1, 1, None, None)] == -0.5
    assert got[("attn_block", 0, None, None, None)] == pytest.approx(2.0 + 4.5)
    assert ("attn_block", 1, None, None, None) not in got


def test_an_expert_is_a_row_only_where_its_own_surprise_and_its_ablation_agree():
    """corroborated: an expert's own unusual contribution (heavy-tailed over its few positions) becomes a profile row
    only where removing it also moves the explained token by a real share of what the top component does."""
    df = pl.DataFrame({"kind": ["head", "expert", "expert", "expert", "token"], "layer": [0, 1, 1, 2, None],
                       "head": [1, None, None, None, None], "expert": [None, 3, 5, 7, None],
                       "source_pos": [None, None, None, None, 2], "score": [2.0, -0.6, 0.1, 0.9, 50.0]})
    own = {("expert", 1, None, 3, None): 9.0, ("expert", 1, None, 5, None): 12.0,
           ("expert", 2, None, 7, None): SIGNIFICANT / 2}
    # expert 3: its ablation is 30% of the head's (the token row does not count) and it is unusual: a row with its
    # own surprise; expert 5 is as unusual but removing it hardly matters; expert 7 matters but is ordinary
    assert 0.6 >= CORROBORATE * 2.0 > 0.1
    assert corroborated(df, own) == [(("expert", 1, None, 3, None), 9.0)]
    assert corroborated(df, {}) == [] and corroborated(df.filter(pl.col("kind") == "token"), own) == []


def test_a_selection_bias_far_from_its_siblings_is_a_router_row(tiny, ids):
    """row_evidence: DeepSeek-V3's balancing bias moves the experts' biases a little and together; one expert's bias
    far from the others' is named, with that expert, on the weights alone."""
    a = adapter_for(tiny)
    layer = a.summary.moe_layers[0]
    assert a.router(layer).bias is not None
    ctx = ids[0].tolist()
    assert not [k for k, _ in row_evidence(a, ctx, 5) if k[0] == "router"]  # the clean model's biases agree
    with faults.bias_router(a, layer, 3, amount=0.5):
        rows = {k: v for k, v in row_evidence(a, ctx, 5) if k[0] == "router"}
    assert list(rows) == [("router", layer, None, 3, None)] and rows[("router", layer, None, 3, None)] == WEIGHT_NATS
    assert not [k for k, _ in row_evidence(a, ctx, 5) if k[0] == "router"]  # restored
    with faults.bias_router(a, layer, 3, amount=0.5), faults.bias_router(a, layer, 4, amount=0.4):
        assert not [k for k, _ in row_evidence(a, ctx, 5) if k[0] == "router"]  # two far out: a spread, no one bias


def test_the_token_that_displaced_the_target_has_its_output_row_judged(tiny, ids):
    a = adapter_for(tiny)
    ctx, target, rival = ids[0].tolist(), 5, 7
    with faults.scale_unembedding(a, rival, scale=20.0):  # the rival's logit is off everywhere; the target's row is not
        alone = dict(row_evidence(a, ctx, target))[("unembed", None, None, None, None)]
        both = dict(row_evidence(a, ctx, target, rival))[("unembed", None, None, None, None)]
    assert both > 2 * SIGNIFICANT and both > abs(alone)
    assert dict(row_evidence(a, ctx, target, target)) == dict(row_evidence(a, ctx, target))  # no rival: unchanged


def test_explain_names_the_expert_of_a_router_row():
    from workbench.commands.explain import _where  # lazy: the CLI's row label, tested without a run
    assert _where({"kind": "router", "layer": 3, "expert": 7}, {}) == "layer 3 router, expert 7"
    assert _where({"kind": "router", "layer": 3, "expert": None}, {}) == "layer 3 router"


def test_a_layer_row_shares_its_turn_with_its_part_and_near_ties_put_the_earlier_layer_first():
    """The profile list's turns (_profile_turns): a layer row and the most unusual of its own parts in the list go
    together, the part first; rows within TIE of each other rank the earlier layer first; ablation and token rows
    keep their turns after them."""
    df = pl.DataFrame({"target_pos": [9] * 3, "kind": ["head", "head", "token"], "layer": [2, 3, None],
                       "head": [2, 0, None], "expert": [None, None, None], "source_pos": [None, None, 4],
                       "score": [0.8, 0.5, 2.0], "method": ["ablation"] * 2 + ["ig"], "delta": [None] * 3,
                       "restored": [None] * 3}, schema_overrides={"layer": pl.Int32, "head": pl.Int32,
                                                                  "expert": pl.Int32, "source_pos": pl.Int32})
    resid, expert = ("resid", 1, None, None, None), ("expert", 1, None, 10, None)
    other = ("attn_norm", 4, None, None, None)

    def order(ev):
        out = interleave(df, ev)
        return [(r["kind"], r["layer"], r["head"], r["expert"], r["source_pos"]) for r in out.iter_rows(named=True)]

    # what layer 1 added to the stream is unusual, and inside it one expert: the expert, then the layer, then the
    # component whose removal matters most, then the token
    got = order([(resid, 4.4), (other, 3.0), (expert, 2.8)])
    assert got[:5] == [expert, resid, ("head", 2, 2, None, None), ("token", None, None, None, 4), other]
    assert order([(resid, 4.4), (other, 3.0)])[:2] == [resid, ("head", 2, 2, None, None)]  # no part: its own turn
    # an expert of another layer is no part of the layer row
    assert order([(resid, 4.4), (("expert", 2, None, 1, None), 2.8)])[:2] == [resid, ("head", 2, 2, None, None)]
    # near ties: the earlier layer first; beyond TIE the larger first
    late, early = ("expert", 5, None, 0, None), ("expert", 3, None, 9, None)
    assert order([(late, -3.46), (early, 3.40)])[0] == early
    assert order([(late, -3.4 / (1 - TIE) - 0.1), (early, 3.4)])[0] == late


def test_a_component_named_by_two_lists_takes_one_turn():
    """An expert both unusual (profile) and the component whose removal matters most takes one turn: the top 3 are
    three suspects (the components' next one moves up), and its ablation row follows the turns."""
    df = pl.DataFrame({"target_pos": [9] * 4, "kind": ["expert", "head", "head", "token"], "layer": [2, 3, 1, None],
                       "head": [None, 0, 1, None], "expert": [5, None, None, None], "source_pos": [None, None, None, 4],
                       "score": [-2.0, 0.9, 0.5, 2.0], "method": ["ablation"] * 3 + ["ig"], "delta": [None] * 4,
                       "restored": [None] * 4}, schema_overrides={"layer": pl.Int32, "head": pl.Int32,
                                                                  "expert": pl.Int32, "source_pos": pl.Int32})
    out = interleave(df, [(("expert", 2, None, 5, None), 40.0), (("attn_norm", 0, None, None, None), 3.0)])
    rows = [(r["kind"], r["layer"], r["head"], r["expert"], r["source_pos"], r["method"]) for r in out.iter_rows(named=True)]
    assert rows[:3] == [("expert", 2, None, 5, None, "profile"), ("head", 3, 0, None, None, "ablation"),
                        ("token", None, None, None, 4, "ig")]
    assert rows[3:5] == [("attn_norm", 0, None, None, None, "profile"), ("head", 1, 1, None, None, "ablation")]
    assert rows[5] == ("expert", 2, None, 5, None, "ablation") and len(rows) == 6
    assert out["rank"].to_list() == list(range(1, 7))


def test_an_unusual_block_names_the_one_expert_whose_removal_matters():
    """behind_block: an MoE block unusual against the profile, and of its layer's experts one whose removal moves the
    explained token by a real share of the top component's and twice any other expert's of the layer: that expert
    takes the block's surprise (a swapped expert's outputs keep their size: its own activations do not single it
    out)."""
    df = pl.DataFrame({"kind": ["head", "expert", "expert", "expert", "token"], "layer": [4, 4, 4, 2, None],
                       "head": [2, None, None, None, None], "expert": [None, 7, 13, 1, None],
                       "source_pos": [None, None, None, None, 3], "score": [-5.4, -2.4, 0.1, 3.0, 40.0]})
    block = ("mlp_block", 4, None, None, None)
    assert behind_block(df, [(block, 3.05)]) == [(("expert", 4, None, 7, None), 3.05)]
    assert behind_block(df, [(block, SIGNIFICANT / 2)]) == []  # an ordinary block names nobody
    assert behind_block(df, [(("mlp_block", 3, None, None, None), 3.05)]) == []  # no expert of layer 3 matters
    two = df.with_columns(pl.when(pl.col("expert") == 13).then(-1.5).otherwise(pl.col("score")).alias("score"))
    assert behind_block(two, [(block, 3.05)]) == []  # two experts of the layer matter alike: neither alone
    small = df.with_columns(pl.when(pl.col("expert") == 7).then(-1.0).otherwise(pl.col("score")).alias("score"))
    assert 1.0 < CORROBORATE * 5.4 and behind_block(small, [(block, 3.05)]) == []  # too small beside the head


def test_a_run_without_token_rows_says_why_it_cannot_be_explained(tiny, tmp_path):
    db = tmp_path / "w.duckdb"
    probes = tuple(p for p in workbench.PROBES if p != "tokens")
    run = workbench.record(list(range(30, 38)), model=tiny, max_new_tokens=4, db=db, probes=probes, detect=False)
    assert run.info["n_tokens"] == 12
    listed = query.runs(run.store).filter(pl.col("run_id") == run.run_id)
    assert listed["n_tokens"].to_list() == [12]  # from the runs row: there are no tokens rows to count
    with pytest.raises(ValueError, match="recorded without the tokens probe"):
        run.root_cause(9, steps=2)
    with pytest.raises(ValueError, match="no tokens rows"):
        run.compile_check()
