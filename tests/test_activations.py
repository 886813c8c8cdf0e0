"""The components' activation profile (workbench.analysis.activations): what it measures, that a broken
component stands out against it, the routing consistency check, the store round trip, and root cause
using it without a reference."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
import workbench.analysis.anomalies
from workbench.analysis import activations, faults
from workbench.capture.adapters import adapter_for


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return adapter_for(tiny_model(n_layers=4))


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(3, 250, size=length).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def prof(tiny):
    return activations.build(tiny, _prompts(24, 40, seed=1))


def test_profile_cells_are_the_calibration_moments(tiny, prof):
    prompts = _prompts(24, 40, seed=1)
    got = [activations.capture(tiny, p)[0] for p in prompts]
    key = ("attn_block", 1, None, None, "out")
    y = torch.cat([g[key][1:] for g in got])  # position 0 (the sink) is left out
    row = prof.filter((pl.col("kind") == "attn_block") & (pl.col("layer") == 1)).row(0, named=True)
    assert row["n"] == y.size(0)  # every position of every prompt but the first
    np.testing.assert_allclose(row["mean"], y.mean(0).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(row["std"], y.std(0).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(row["log_norm_mean"], float(y.norm(dim=-1).log().mean()), rtol=1e-5)
    # the residual row is what the layer added: stream after minus stream before
    g = got[0]
    s = tiny.summary
    assert ("resid", s.n_layers - 1, None, None, "out") in g
    kinds = set(prof["kind"])
    assert {"attn_norm", "kv_latent", "head", "attn_block", "mlp_norm", "resid", "router"} <= kinds
    assert prof.filter(pl.col("signal") == "pos_distance").height == s.n_layers * s.n_heads
    cells = prof.filter(~pl.col("kind").is_in(["router_check", "calibration", "unembed_rows", "embed", "first_check",
                                               "known_input"])
                        & ~pl.col("signal").is_in(["angle", "chosen"]) & ~pl.col("signal").str.starts_with("known")
                        & ~pl.col("signal").str.starts_with("first:"))
    spread = np.array(cells["run_norm_std"].to_list() + cells["run_dev_std"].to_list())
    assert spread.shape == (2 * cells.height, len(activations.RUN_BUCKETS)) and (spread >= 0.1).all()
    assert prof.filter(pl.col("kind") == "router_check")["n"].to_list() == [0]  # RouterMath agrees with the model


def _top(ev, k=3):
    return [key for key, _ in sorted(ev, key=lambda kv: -abs(kv[1]))[:k]]


@pytest.mark.parametrize("kind,layer,index,named", [
    ("layer", 2, 0, ("resid", 2)),            # a skipped layer adds nothing to the stream
    ("dead_shared", 1, 0, ("shared_expert", 1)),  # a missing contribution (two-sided: too small)
    ("norm", 3, 0, ("attn_norm", 3)),
    ("head", 2, 1, ("head", 2)),
])
def test_a_broken_component_is_the_most_unusual(tiny, prof, kind, layer, index, named):
    ids = _prompts(1, 30, seed=7)[0]
    with faults.KINDS[kind](tiny, layer, index=index):
        ev = activations.evidence(tiny, ids, prof)
    top = _top(ev, 1)[0]
    assert top[:2] == named, (kind, _top(ev, 5))
    score = dict(ev)[top]
    if kind in ("layer", "dead_shared"):
        assert score < 0  # smaller than on clean prompts
    clean = activations.evidence(tiny, ids, prof)
    assert abs(score) > 10 * max(abs(v) for _, v in clean)


def test_clean_prompts_have_no_strong_rows(tiny, prof):
    worst = [max(abs(v) for _, v in activations.evidence(tiny, p, prof)) for p in _prompts(6, 30, seed=11)]
    assert max(worst) < 12, worst  # nats, after the Bonferroni adjustment within each family


def test_each_expert_is_profiled_from_its_own_contribution(tiny, prof):
    """Per routed expert: its weighted contribution where chosen (rows of other positions NaN); the experts' rows
    plus the shared experts' add up to the MoE block's output; how often each is chosen is its own cell."""
    ids = _prompts(1, 30, seed=4)[0]
    got = activations.capture(tiny, ids)[0]
    s = tiny.summary
    for layer in s.moe_layers:
        experts = [got[k] for k in got if k[0] == "expert" and k[1] == layer]
        total = sum(torch.nan_to_num(y) for y in experts) + got[("shared_expert", layer, None, None, "out")]
        torch.testing.assert_close(total, got[("mlp_block", layer, None, None, "out")], rtol=1e-4, atol=1e-5)
        chosen = torch.cat([got[("router", layer, None, e, "chosen")] for e in range(s.n_routed_experts)], 1)
        assert (chosen.sum(1) == s.top_k).all()  # every position chose its top K
        for k in (k for k in got if k[0] == "expert" and k[1] == layer):
            assert torch.equal(~torch.isnan(got[k][:, 0]), chosen[:, k[3]].bool())
    cells = prof.filter(pl.col("kind") == "expert")
    assert cells.height > 0 and set(cells["layer"]) <= set(s.moe_layers)
    rates = prof.filter(pl.col("signal") == "chosen")
    assert rates.height == len(s.moe_layers) * s.n_routed_experts
    assert sum(r[0] for r in rates.filter(pl.col("layer") == s.moe_layers[0])["mean"]) == pytest.approx(
        s.top_k, rel=1e-5)  # the rates of one layer's experts add up to K


def test_a_scaled_expert_a_biased_router_and_a_wrong_rotation_are_named(tiny, prof):
    ids = _prompts(1, 30, seed=7)[0]
    layer = tiny.summary.moe_layers[0]
    chosen = tiny.routing_of(torch.tensor([ids]))[layer]
    busy = int(torch.bincount(chosen[1:].flatten()).argmax())
    rare = int(torch.bincount(tiny.routing_of(torch.tensor([_prompts(1, 60, seed=7)[0]]))[layer][1:].flatten(),
                              minlength=tiny.summary.n_routed_experts).argmin())
    clean = activations.evidence(tiny, ids, prof)
    assert not any(k[0] == "rotary" and abs(v) >= activations.MISMATCH_NATS for k, v in clean)  # exact rotation
    with faults.break_expert(tiny, layer, busy, scale=30.0):
        assert _top(activations.evidence(tiny, ids, prof), 1)[0] == ("expert", layer, None, busy, None)
    longer = _prompts(1, 60, seed=7)[0]  # a rate needs positions: beyond every clean prompt's, not one short one's
    with faults.bias_router(tiny, layer, rare, amount=1.0):  # chosen at (nearly) every position now
        signals = {}
        ev = dict(activations.evidence(tiny, longer, prof, signals=signals))
    key = ("router", layer, None, rare, None)
    assert signals[key] == "chosen"  # its selection rate, beyond every clean context's
    assert ev[key] >= activations.MISMATCH_NATS
    assert abs(dict(activations.evidence(tiny, longer, prof)).get(key, 0.0)) < 3  # the clean run's rate is ordinary
    with faults.scale_rotary(tiny, 1, 3.0):
        ev = dict(activations.evidence(tiny, ids, prof))
    assert _top(ev.items(), 1)[0] == ("rotary", 1, None, None, None)
    assert ev[("rotary", 1, None, None, None)] == pytest.approx(activations.MISMATCH_NATS * (len(ids) - 1))


def test_routing_that_disagrees_with_the_router_is_named(tiny):
    ids = _prompts(1, 30, seed=3)[0]
    layer = tiny.summary.moe_layers[0]
    chosen = tiny.routing_of(torch.tensor([ids]))[layer]
    expert = int(torch.bincount(chosen.flatten()).argmax())
    assert activations.evidence(tiny, ids, None) == []  # a clean model agrees with itself, profile or not
    with faults.starve_expert(tiny, layer, expert):
        ev = dict(activations.evidence(tiny, ids, None))
    assert ev[("router", layer, None, None, None)] > 0
    assert ev[("expert", layer, None, expert, None)] == pytest.approx(
        activations.MISMATCH_NATS * int((chosen == expert).any(1).sum()))  # position 0 too: the check is exact
    only0 = sorted(set(chosen[0].tolist()) - set(chosen[1].tolist()))  # chosen at position 0, not at position 1
    assert only0
    with faults.starve_expert(tiny, layer, only0[0]):  # on a 2-token context only position 0 shows it
        ev = dict(activations.evidence(tiny, ids[:2], None))
    assert ev[("router", layer, None, None, None)] == activations.MISMATCH_NATS  # one position disagrees



def test_experts_mixed_with_other_weights_than_the_routers_are_named_at_the_router(tiny, prof):
    """The experts the router chose, mixed with other weights than its logits give (a top-k cut to 1, a scaling
    factor gone wrong after the router): a ``router`` row, 10 nats per position; no expert row (no expert changed).
    A mixing weight 3% off is float noise of a half-precision family, not a fault."""
    ids = _prompts(1, 30, seed=3)[0]
    layer = tiny.summary.moe_layers[0]
    with faults.HELD_OUT["top1"](tiny, layer):
        signals: dict = {}
        ev = dict(activations.evidence(tiny, ids, None, signals=signals))
    key = ("router", layer, None, None, None)
    assert ev == {key: activations.MISMATCH_NATS * len(ids)} and signals[key] == "weights"
    with faults.HELD_OUT["top1"](tiny, layer):  # against the profile: the experts whose weight went to 0 look dead,
        ev = activations.evidence(tiny, ids, prof)  # a consequence of the routing: the router comes first
        rows = activations.anomaly_rows(tiny, ids, prof)
    assert _top(ev, 1)[0] == key
    assert any(r["layer"] == layer and "other weights than its own logits give" in r["explanation"] for r in rows)

    def off(f):
        def fn(i, r):
            if i == layer:
                w = r.weights * f
                r.force(torch.ones(w.size(0), dtype=torch.bool), r.indices, w)
        return fn
    with tiny.seams({"route": off(1.03)}):
        assert activations.evidence(tiny, ids, None) == []
    with tiny.seams({"route": off(2.5)}):  # a routed scaling factor of 2.5 applied twice
        assert dict(activations.evidence(tiny, ids, None)) == {key: activations.MISMATCH_NATS * len(ids)}

def test_a_context_is_judged_in_its_own_length_bucket_and_older_profiles_keep_theirs():
    n = len(activations.RUN_BUCKETS)
    assert [activations.run_bucket(t, n) for t in (1, 2, 3, 5, 40, 5000)] == [0, 0, 1, 2, 6, n - 1]
    old = len(activations.OLD_BUCKETS)  # a profile made before the short buckets: 4 entries from 3 tokens on
    assert [activations.run_bucket(t, old) for t in (2, 3, 31, 32, 200, 5000)] == [0, 0, 0, 1, 2, 3]


def test_store_round_trip_and_root_cause_uses_it(tiny, prof, tmp_path):
    db = workbench.Store(tmp_path / "a.duckdb")
    run = workbench.record(_prompts(1, 24, seed=5)[0], model=tiny.module, max_new_tokens=2, db=db)
    sha = run.info["checkpoint_sha256"]
    assert activations.load(db, sha) is None
    assert activations.save(db, sha, prof, "test") == prof.height
    back = activations.load(db, sha)
    assert back.columns == prof.columns and back.height == prof.height
    a = back.sort("kind", "layer", "head", "expert", "signal", nulls_last=True)
    b = prof.sort("kind", "layer", "head", "expert", "signal", nulls_last=True)
    np.testing.assert_allclose(np.concatenate(a["mean"].to_list()), np.concatenate(b["mean"].to_list()), rtol=1e-6)
    with faults.skip_layer(tiny.module, 2):
        df = run.root_cause(20, steps=4, store=False)
    prof_rows = df.filter(pl.col("method") == "profile")
    assert prof_rows["kind"][0] == "resid" and prof_rows["layer"][0] == 2
    assert df["rank"][0] == 1 and (df["kind"][0], df["layer"][0]) == ("resid", 2)


def test_detection_after_a_recording_judges_the_components(tiny, tmp_path):
    """``workbench profile`` stores both profiles; a recording's detectors (handed the model by the recorder)
    then name a dead shared expert and a skipped layer, and leave a clean run without component rows."""
    db = workbench.Store(tmp_path / "d.duckdb")
    res = workbench.profile(_prompts(24, 30, seed=21), model=tiny.module, db=db, max_new_tokens=4)
    assert res["components"] > 0
    prompt = _prompts(1, 30, seed=8)[0]
    clean = workbench.record(prompt, model=tiny.module, db=db, max_new_tokens=8)
    assert clean.anomalies().filter(pl.col("kind") == "component_outlier").height == 0
    assert "components against their activation profile" in workbench.analysis.anomalies.what_was_tested(
        db, clean.run_id)
    for kind, layer, component in (("dead_shared", 2, "shared_expert"), ("layer", 1, "layer")):
        with faults.KINDS[kind](tiny, layer, index=0):
            bad = workbench.record(prompt, model=tiny.module, db=db, max_new_tokens=8)
        rows = bad.anomalies().filter(pl.col("kind") == "component_outlier")
        assert rows.height and rows.sort("score", descending=True)["layer"][0] == layer, rows
        f = bad.findings()
        assert ((f["component"] == component) & (f["layer"] == layer)).any(), f
        # a recompute with the run's model keeps them; the stored rows survive a plain read
        assert bad.anomalies().filter(pl.col("kind") == "component_outlier").height == rows.height


def test_an_older_bundled_profile_in_a_database_is_replaced_by_the_current_one(tmp_path):
    """A database that copied an earlier release's bundled demo profile gets the current one; a profile the user
    made with ``workbench profile`` is kept."""
    bundled = pl.read_parquet(activations.BUNDLED)
    sha = bundled["checkpoint_sha256"][0]
    db = workbench.Store(tmp_path / "old.duckdb")
    old = bundled.head(5).drop("checkpoint_sha256", "created_at", "source")
    activations.save(db, sha, old, "96 prompts of data/prompts/calibration.jsonl, first 1024 tokens, teacher-forced")
    assert activations.load(db, sha).height == bundled.height
    activations.save(db, sha, old, '{"prompts": "mine.jsonl", "runs": 5}')
    assert activations.load(db, sha).height == 5


def test_a_profile_is_read_once_per_process_until_it_is_replaced(tmp_path):
    """The detectors judge every recording against the model's profiles: each is read and prepared once per
    process and database, and read again when `workbench profile` replaces it (same row count or not)."""
    rows = pl.read_parquet(activations.BUNDLED).head(7).drop("checkpoint_sha256", "created_at", "source")
    db = workbench.Store(tmp_path / "p.duckdb")
    activations.save(db, "abc", rows.head(5), '{"prompts": "mine.jsonl", "runs": 5}')
    first = activations.load(db, "abc")
    assert activations.load(db, "abc") is first and first.height == 5
    assert activations._prepared(first) is activations._prepared(first)
    activations.save(db, "abc", rows.tail(5), '{"prompts": "mine.jsonl", "runs": 5}')
    again = activations.load(db, "abc")
    assert again is not first and sorted(map(tuple, again["mean"].to_list())) == sorted(
        map(tuple, rows.tail(5)["mean"].to_list())) != sorted(map(tuple, first["mean"].to_list()))
    assert activations._prepared(again) is not activations._prepared(first)
    Baseline = workbench.analysis.anomalies.Baseline
    assert Baseline.of(first) is Baseline.of(first) and Baseline.of(again) is not Baseline.of(first)
    assert Baseline.of(None).profile is None


def _first_signals(model, ids, prof) -> dict:
    why: dict = {}
    ev = dict(activations.evidence(model, ids, prof, signals=why))
    return {k: v for k, v in ev.items() if why.get(k) == "first" and abs(v) >= activations.FIRST_NATS / 2}


def test_the_first_position_is_held_exactly_and_a_weight_edit_there_is_named(tiny, prof):
    calib = _prompts(24, 40, seed=1)
    firsts = {int(s.split(":")[-1]) for s in prof.filter(pl.col("signal").str.starts_with("first:"))["signal"]}
    assert {p[0] for p in calib} <= firsts and len(firsts) == min(activations.FIRST_TOKENS, len({t for p in calib for t in p}))
    ids = [calib[3][0]] + _prompts(1, 29, seed=11)[0]  # a profiled first token, then text never seen
    assert _first_signals(tiny, ids, prof) == {}  # the clean model computes exactly what the profile holds
    s = tiny.summary
    layer = s.moe_layers[-1]
    with faults.KINDS["router_affinity"](tiny, layer, index=2):  # one router row pushed toward another's
        got = _first_signals(tiny, ids, prof)
        rows = activations.anomaly_rows(tiny, ids, prof)
    assert ("router", layer, None, 2, None) in got
    assert not [k for k in got if k[1] is not None and k[1] < layer]  # nothing upstream of the edit moved
    named = [r for r in rows if r["layer"] == layer and r["expert"] == 2]
    assert named and "position 0" in named[0]["explanation"]
    token = ids[5]
    with faults.KINDS["unembedding"](tiny, 0, index=token):  # one output row scaled: the first position's logits
        got = _first_signals(tiny, ids, prof.filter(~((pl.col("kind") == "unembed")
                                                      & (pl.col("signal") == "known:rows"))))
    assert list(got) == [("unembed", None, None, None, None)]  # (the held output rows name it too: see below)
    # an expert chosen at position 0, half of its down projection sign-flipped: the expert, not its block
    chosen = prof.filter(pl.col("signal") == f"first:chosen:{ids[0]}")
    e = chosen.filter((pl.col("layer") == layer) & (pl.col("mean").list.first() == 1.0))["expert"][0]
    with faults.KINDS["expert_flip"](tiny, layer, index=int(e)):
        ev = activations.evidence(tiny, ids, prof)
    assert _top(ev, 1)[0] == ("expert", layer, None, e, None), _top(ev, 5)
    # a first token the profile does not hold: nothing to compare at position 0
    other = next(t for t in range(3, 250) if t not in firsts)
    with faults.KINDS["router_affinity"](tiny, layer, index=2):
        assert _first_signals(tiny, [other] + ids[1:], prof) == {}
    # a profile made in another dtype rounds otherwise: its first-position outputs are not compared
    other_dtype = prof.with_columns(pl.when(pl.col("kind") == "first_check").then(pl.lit("bfloat16"))
                                    .otherwise(pl.col("signal")).alias("signal"))
    with faults.KINDS["router_affinity"](tiny, layer, index=2):
        assert _first_signals(tiny, ids, other_dtype) == {}


def test_an_upstream_part_explains_parts_of_comparable_size_only():
    """_reach: how many times its own surprise an upstream part explains (downstream parts capped), continuous from
    2x at BLOCK_NATS to REACH at EXPLAINS: a 10-nat router logit explains no 1000-nat residual."""
    r = activations._reach
    assert r(activations.BLOCK_NATS) == 2.0 and r(activations.EXPLAINS) == activations.REACH == r(1000.0)
    mid = (activations.BLOCK_NATS + activations.EXPLAINS) / 2
    assert r(mid) == pytest.approx((2.0 + activations.REACH) / 2) and r(0.0) == 2.0
    assert 10.0 * r(10.0) < 1000.0


def test_a_rate_cell_pools_its_wide_bucket_and_other_cells_keep_their_own():
    runs = {(("router", 1, None, 3, "chosen"), b): [(float(b), 0.0)] for b in range(len(activations.RUN_BUCKETS))}
    runs |= {(("head", 1, 0, None, "out"), b): [(float(b), 0.0)] for b in range(len(activations.RUN_BUCKETS))}
    wide0 = [b for b, w in enumerate(activations.WIDE) if w == activations.WIDE[0]]  # 2 .. 31 tokens
    assert len(wide0) > 1
    got = activations._bucket_runs(runs, ("router", 1, None, 3, "chosen"), 0)
    assert sorted(got[:, 0].tolist()) == [float(b) for b in wide0]
    assert activations._bucket_runs(runs, ("head", 1, 0, None, "out"), 0)[:, 0].tolist() == [0.0]


def test_an_output_row_is_named_only_where_it_alone_is_off(tiny, prof):
    """The ``unembed`` row: one token's logit off at every position, beyond what calibration met, and no other
    token's: an output row gone wrong moves its own token only; a hidden state gone wrong moves many."""
    ids = _prompts(1, 30, seed=7)[0]
    key = ("unembed", None, None, None, None)
    sr = prof.filter(pl.col("kind") == "unembed_rows").row(0, named=True)
    cell = prof.filter(pl.col("kind") == "unembed").row(0, named=True)
    b = activations.run_bucket(len(ids), len(sr["run_norm_mean"]))

    def beyond() -> int:  # tokens whose logit is off beyond every calibration token's
        y = activations.capture(tiny, ids)[0][("unembed", None, None, None, "logit")][1:]
        zr = (activations._row_z(y, cell) - sr["run_norm_mean"][b]) / sr["run_norm_std"][b]
        return int((zr > activations.BEYOND * sr["run_dev_mean"][b]).sum())

    assert key not in dict(activations.evidence(tiny, ids, prof)) and beyond() == 0
    with faults.scale_unembedding(tiny, ids[5], scale=4.0):
        assert beyond() == 1 and dict(activations.evidence(tiny, ids, prof))[key] > 2
    with faults.shift_attention(tiny, tiny.summary.n_layers - 1, scale=30.0):  # the last hidden state moved
        assert beyond() > 1 and key not in dict(activations.evidence(tiny, ids, prof))


def test_an_expert_that_outputs_nothing_is_a_row_of_its_own(tiny, prof):
    """An expert's own contribution is heavy-tailed over its few positions (no row by itself), except far past
    anything clean (OWN_ALONE_Z): a dead expert has nothing left for its ablation to remove, so it must be named
    from its activations alone."""
    ids = _prompts(1, 30, seed=7)[0]
    layer = tiny.summary.moe_layers[-1]
    idx = activations.capture(tiny, ids)[0][("route", layer, None, None, "indices")][1:]
    e = int(torch.bincount(idx.flatten()).argmax())  # an expert the context's positions choose
    assert not [k for k, _ in activations.evidence(tiny, ids, prof) if k[0] == "expert"]
    with faults.HELD_OUT["dead_expert"](tiny, layer, index=e):
        ev = activations.evidence(tiny, ids, prof)
        rows = activations.anomaly_rows(tiny, ids, prof)
    assert _top(ev, 1) == [("expert", layer, None, e, None)] and dict(ev)[("expert", layer, None, e, None)] < 0
    named = [r for r in rows if r["layer"] == layer and r["expert"] == e]
    assert named and "unusually small" in named[0]["explanation"]


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_the_experts_contributions_add_up_to_the_block_in_transformers_families(family):
    """Experts are profiled one by one only where their contributions (and the shared experts') add up to the MoE
    block's output; Qwen2-MoE gates its shared expert after the module that is read (a per-position sigmoid)."""
    pytest.importorskip("transformers")
    from workbench.capture.tiny import tiny_family  # lazy: transformers is optional

    torch.manual_seed(0)
    a = adapter_for(tiny_family(family))
    got = activations.capture(a, [5, 17, 42, 99, 123, 7, 250, 64])[0]
    fits = {k[1]: float(v) for k, v in got.items() if k[0] == "expert_fit"}
    assert fits and all(f <= activations.FIT_TOL for f in fits.values()), fits
    assert any(k[0] == "expert" for k in got)


def _known(model, ids, prof) -> dict:
    why: dict = {}
    ev = dict(activations.evidence(model, ids, prof, signals=why))
    return {k: v for k, v in ev.items() if why.get(k) == "known"}


def test_known_answers_name_an_expert_whose_weights_changed(tiny, prof):
    """Each routed expert's and the shared experts' outputs on a few fixed inputs of their layer (the MLP input norm's
    output on calibration prompts) are held in the profile, projected: an expert that computes another function at
    its usual size (half its down projection sign-flipped, swapped with another's, noisy) differs there, wherever
    the context starts, and is named, by itself and not capped by what it changed downstream."""
    s = tiny.summary
    held = prof.filter(pl.col("signal") == "known")
    assert set(held.filter(pl.col("kind") == "expert")["layer"]) == set(s.moe_layers)
    assert held.filter(pl.col("kind") == "expert").height == len(s.moe_layers) * s.n_routed_experts
    assert held.filter(pl.col("kind") == "shared_expert").height == len(s.moe_layers)
    assert held.filter(pl.col("kind") == "router").height == len(s.moe_layers)
    assert held.filter(pl.col("kind") != "router")["mean"].list.len().unique().to_list() == [
        activations.KNOWN_INPUTS * activations.KNOWN_DIMS]
    attn = prof.filter(pl.col("signal").str.starts_with("known:"))  # the attention's linear maps, head by head
    assert set(attn.filter(pl.col("kind") == "head")["head"]) == set(range(s.n_heads))
    # wo's columns, wq's and wkv_b's rows, head by head
    assert attn.filter(pl.col("kind") == "head").height == s.n_layers * s.n_heads * 3
    assert attn.filter(pl.col("kind") == "kv_latent").height == 2 * s.n_layers  # wkv_a and the latent's norm
    ids = _prompts(1, 30, seed=5)[0]  # a first token nobody profiled at position 0 is as good as any
    assert _known(tiny, ids, prof) == {}  # the clean model gives exactly the held answers
    layer = s.moe_layers[0]
    idx = activations.capture(tiny, ids)[0][("route", layer, None, None, "indices")]
    used = set(idx.unique().tolist())
    e = min(used)
    for kind in ("expert_flip", "expert_noise"):
        with faults.ALL_KINDS[kind](tiny, layer, index=e):
            got = _known(tiny, ids, prof)
            rows = activations.anomaly_rows(tiny, ids, prof)
        assert got == {("expert", layer, None, e, None): activations.KNOWN_NATS}, (kind, got)
        named = [r for r in rows if r["layer"] == layer and r["expert"] == e]
        assert named and named[0]["severity"] == "critical" and "no longer computes" in named[0]["explanation"]
    with faults.HELD_OUT["expert_swap"](tiny, layer, index=e):  # both experts of the pair compute another function
        got = _known(tiny, ids, prof)
    pair = {e, faults.partner(e, s.n_routed_experts)}
    assert {k[3] for k in got} == pair & used
    unused = [x for x in range(s.n_routed_experts) if x not in used]
    if unused:  # an expert no position chose took no part in this context
        with faults.ALL_KINDS["expert_flip"](tiny, layer, index=unused[0]):
            assert _known(tiny, ids, prof) == {}
    w = tiny.parts(layer)["shared"]
    lin = next(m for m in w.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad():
        lin.weight.mul_(-1)
        try:
            got = _known(tiny, ids, prof)
        finally:
            lin.weight.mul_(-1)
    assert got == {("shared_expert", layer, None, None, None): activations.KNOWN_NATS}
    with faults.KINDS["router_affinity"](tiny, layer, index=e):  # one router row pushed toward another's
        assert _known(tiny, ids, prof) == {("router", layer, None, None, None): activations.KNOWN_NATS}
    wo = tiny.parts(layer)["attn"].wo.weight  # one head's columns of the output projection zeroed: that head
    d = wo.size(1) // s.n_heads
    with faults._edited(wo, lambda w: w[:, 2 * d:3 * d].zero_()):
        assert _known(tiny, ids, prof) == {("head", layer, 2, None, None): activations.KNOWN_NATS}
    wkv_b = tiny.parts(layer)["attn"].wkv_b.weight  # every head's part of a per-head map: the map's block
    with faults._edited(wkv_b, lambda w: w.mul_(1.5)):
        assert _known(tiny, ids, prof) == {("attn_block", layer, None, None, None): activations.KNOWN_NATS}
    wkv = tiny.parts(layer)["attn"].wkv_a.weight
    with faults._edited(wkv, lambda w: w.mul_(1.5)):
        assert list(_known(tiny, ids, prof)) == [("kv_latent", layer, None, None, None)]
    with faults.KINDS["expert"](tiny, layer, index=e):  # its output scaled in its weights: another function
        assert _known(tiny, ids, prof) == {("expert", layer, None, e, None): activations.KNOWN_NATS}

    def mix(i, r):  # a mixing weight scaled after the router: the expert's function is the same
        if i == layer:
            r.scale_expert(e, 30.0)
    with tiny.seams({"route": mix}):
        assert _known(tiny, ids, prof) == {}
    other_dtype = prof.with_columns(pl.when(pl.col("kind") == "first_check").then(pl.lit("bfloat16"))
                                    .otherwise(pl.col("signal")).alias("signal"))
    with faults.ALL_KINDS["expert_flip"](tiny, layer, index=e):  # a profile of another dtype is not compared
        assert _known(tiny, ids, other_dtype) == {}


def test_while_the_weights_are_fixed_each_layers_known_answers_run_once(tiny, prof, monkeypatch):
    """A prompt set's detectors judge run after run with the same weights (``fixed_weights``): each layer's known
    answers run once, every routed expert's, and each context takes its chosen experts' from them; the rows are
    those of a judgment outside it (an expert the context did not choose is still not named)."""
    s = tiny.summary
    layer = s.moe_layers[0]
    ctx = _prompts(3, 30, seed=5)
    used = [set(activations.capture(tiny, ids)[0][("route", layer, None, None, "indices")].unique().tolist())
            for ids in ctx]
    unused = [x for x in range(s.n_routed_experts) if x not in used[0]]
    e = unused[0] if unused else min(used[0])
    calls = []
    real = activations._known_outputs
    monkeypatch.setattr(activations, "_known_outputs", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    with faults.ALL_KINDS["expert_flip"](tiny, layer, index=e):
        alone = [_known(tiny, ids, prof) for ids in ctx]
        n_alone = len(calls)
        calls.clear()
        with activations.fixed_weights():
            fixed = [_known(tiny, ids, prof) for ids in ctx]
    assert fixed == alone
    assert sorted(calls) == sorted(set(calls)) and set(s.moe_layers) <= set(calls)  # once per layer (dense too)
    assert n_alone == 3 * len(calls)
    for got, chose in zip(fixed, used):
        assert got == ({("expert", layer, None, e, None): activations.KNOWN_NATS} if e in chose else {})


def test_fixed_weights_holds_in_its_own_thread_only():
    """A prompt set's scope of fixed weights (one thread of a UI) never reaches a judgment in another thread (which
    may edit its model meanwhile: a what-if, a fault)."""
    import threading
    seen = []
    with activations.fixed_weights():
        t = threading.Thread(target=lambda: seen.append(activations._FIXED.get()))
        t.start()
        t.join()
        assert activations._FIXED.get() == {}
    assert seen == [None] and activations._FIXED.get() is None


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_known_answers_in_transformers_families(family):
    """The known answers hold in transformers families too (fused or per-module experts, MLA or GQA attention): the
    clean model answers exactly, a sign-flipped expert and a head whose output weights are zeroed are named."""
    pytest.importorskip("transformers")
    from workbench.capture.tiny import tiny_family  # lazy: transformers is optional

    torch.manual_seed(0)
    a = adapter_for(tiny_family(family))
    prof = activations.build(a, _prompts(6, 20, seed=3))
    held = prof.filter(pl.col("signal").str.starts_with("known"))
    assert {"expert", "router", "head"} <= set(held["kind"]), set(held["kind"])
    ids = _prompts(1, 16, seed=9)[0]
    assert _known(a, ids, prof) == {}
    layer = a.summary.moe_layers[0]
    e = int(activations.capture(a, ids)[0][("route", layer, None, None, "indices")][1:].flatten()[0])
    with faults.KINDS["expert_flip"](a, layer, index=e):
        assert _known(a, ids, prof) == {("expert", layer, None, e, None): activations.KNOWN_NATS}
    with faults.HELD_OUT["head_weights_dead"](a, layer, index=1):
        assert _known(a, ids, prof) == {("head", layer, 1, None, None): activations.KNOWN_NATS}


def test_what_a_known_fault_changes_after_it_is_no_finding_of_its_own():
    """On the demo model, a head whose output weights are zeroed changes its layer's attention block and MLP input at
    position 0 (the first-position check sees them, 30 nats each, warnings by themselves): under the head's known
    answer they are its consequences, suspects for root cause but no warning rows."""
    from pathlib import Path

    from workbench.capture.adapters import load_adapter
    from workbench.model import load_tokenizer

    demo = Path(activations.BUNDLED).parent
    a = load_adapter(demo)
    prof = pl.read_parquet(activations.BUNDLED)
    ids = load_tokenizer(demo / "tokenizer.json").encode("def fibonacci(n):\n    if n < 2:\n").ids
    assert activations.anomaly_rows(a, ids, prof) == []
    with faults.HELD_OUT["head_weights_dead"](a, 3, index=2):
        why: dict = {}
        ev = dict(activations.evidence(a, ids, prof, signals=why))
        rows = activations.anomaly_rows(a, ids, prof)
    assert [(r["layer"], r["head"], r["severity"]) for r in rows] == [(3, 2, "critical")], rows
    assert why[("attn_block", 3, None, None, None)] == "first"  # seen, and kept as a suspect under the cap
    assert 0 < abs(ev[("attn_block", 3, None, None, None)]) <= activations.KNOWN_AFTER


@pytest.mark.parametrize("fault", [None, "expert", "expert_flip", "starved", "nan"])
def test_expert_rows_from_the_forwards_own_calls_equal_the_experts_run_again(tiny, fault, monkeypatch):
    """``capture`` reads each routed expert's contribution from the expert calls the forward made (the expert_out
    seam) instead of running the experts again: every captured tensor is the same either way, clean and with a
    fault on an expert or a NaN injected; a forward whose calls do not match its choice falls back to running."""
    ids = _prompts(1, 30, seed=4)[0]
    calls: list = []
    real = activations._own_slots
    monkeypatch.setattr(activations, "_own_slots", lambda *a: calls.append(1) or real(*a))

    def both():
        with contextlib.ExitStack() as stack:
            if fault == "nan":
                stack.enter_context(faults.inject_nan(tiny, 1, pos=5))
            elif fault is not None:
                stack.enter_context(faults.KINDS[fault](tiny, 1, index=0))
            return activations.capture(tiny, ids)[0]
    own = both()
    assert calls  # read from the forward's calls
    monkeypatch.setattr(type(tiny), "expert_out_seam", False)
    again = both()
    experts = [k for k in own if k[0] == "expert"]
    assert experts and own.keys() == again.keys()
    for k in own:
        assert torch.equal(own[k].nan_to_num(nan=7.5), again[k].nan_to_num(nan=7.5)), k
    idx = torch.tensor([[0, 1], [1, 2]])
    assert activations._own_slots(idx, torch.ones(2, 2), [(0, torch.ones(1, 4)), (1, torch.ones(1, 4))], 4) is None


def test_the_profile_knows_its_longest_context_and_the_check_stops_there(tiny, prof, tmp_path):
    """A profile says the longest context its calibration ran (a ``calibration`` row); the component check judges a
    run up to there and says so: past it, what a clean model computes is unknown to the profile (the demo's clean
    prompts of 1,500-3,800 tokens raised 3-6 critical component rows each, a head 3,600 nats out)."""
    assert activations.calibrated_context(prof) == 40 and activations.calibrated_context(None) is None
    assert prof.filter(pl.col("kind") == "calibration")["signal"].to_list() == ["max_context", "bucket_prompts"]
    from workbench.analysis import anomalies
    from workbench.capture.prompts import load_prompts
    from workbench.model import load_checkpoint, load_tokenizer
    model, tok = load_checkpoint(), load_tokenizer()
    # the bundled demo profile's: its longest calibration runs reach the 1,024 tokens a run is profiled over
    assert activations.calibrated_context(pl.read_parquet(activations.BUNDLED)) == 1024
    clean = Path(__file__).resolve().parents[1] / "data" / "prompts" / "clean_kinds.jsonl"
    text = "\n\n".join(it["prompt"] for it in load_prompts(clean)[:40])
    ids = tok.encode(text).ids[:1500]
    db = workbench.Store(tmp_path / "w.duckdb")
    run = workbench.record(ids, model=model, db=db, max_new_tokens=16)
    assert run.anomalies().filter(pl.col("kind") == "component_outlier").height == 0
    assert "judged over the first 1024 tokens" in anomalies.what_was_tested(db, run.run_id)
    # root cause's evidence past it: the exact checks only (the statistics named a merely long-context head)
    aprof = activations.load(db, run.info["checkpoint_sha256"])
    loud = [k for k, v in activations.evidence(run._adapter, ids[:1500], aprof) if abs(v) >= activations.WARNING_NATS]
    assert loud  # what the statistics say of a clean context past their reach
    assert not [k for k, v in activations.evidence(run._adapter, ids[:1500], aprof, max_stats=1024)
                if abs(v) >= activations.WARNING_NATS]


def test_an_embedding_row_swapped_or_rescaled_is_named_at_the_positions_that_hold_it(tiny, prof):
    """The profile holds every input-embedding row (projected on 4 fixed directions): a row of usual size that is
    another token's (a vocabulary off by a pair), invisible to the statistics, is named at the first position holding
    either token of the pair, by itself (60 nats, critical), and not elsewhere; the clean model matches the held
    rows."""
    cell = prof.filter((pl.col("kind") == "embed") & (pl.col("signal") == "known:rows"))
    vocab = tiny.embedding().weight.size(0)
    assert cell.height == 1 and cell["n"][0] == vocab
    assert cell["mean"].list.len()[0] == vocab * activations.KNOWN_EMBED_DIMS
    ids = _prompts(1, 30, seed=5)[0]
    assert activations._end_evidence(tiny, ids, prof) == {}
    t = ids[7]
    if t ^ 1 in ids[:7]:
        pytest.skip("the partner token comes first")
    with faults.HELD_OUT["embed_swap"](tiny, index=t):
        got = activations._end_evidence(tiny, ids, prof)
        rows = activations.anomaly_rows(tiny, ids, prof)
    where = {ids.index(x) for x in (t, t ^ 1) if x in ids}
    assert got == {("embed", None, None, None, p): activations.KNOWN_NATS for p in where}
    named = [r for r in rows if r["component"] == "embed" and r["pos"] == 7]
    assert named and named[0]["severity"] == "critical" and "not the row the profile holds" in named[0]["explanation"]
    with faults.KINDS["embedding"](tiny, index=t, strength=1.5):  # a modest rescale: within the statistics' range
        assert set(activations._end_evidence(tiny, ids, prof)) == {("embed", None, None, None, 7)}
    assert activations._end_evidence(tiny, ids, prof) == {}  # undone


def test_a_changed_embedding_row_does_not_hide_a_fault_elsewhere(tiny, prof):
    """An embedding row named at its position is no anchor that caps the rest: a scaled norm at layer 1 (visible at
    every position) stays a critical row of its own beside a swapped row held at position 25."""
    ids = _prompts(1, 30, seed=5)[0]
    loud = lambda rows: {(r["component"], r["layer"]) for r in rows if r["severity"] != "info"}  # noqa: E731
    with faults.KINDS["norm"](tiny, 1):
        alone = loud(activations.anomaly_rows(tiny, ids, prof))
        with faults.HELD_OUT["embed_swap"](tiny, index=ids[25]):
            both = loud(activations.anomaly_rows(tiny, ids, prof))
    assert ("attn_norm", 1) in alone and both >= alone | {("embed", None)}


def test_the_norms_and_the_output_head_are_held_and_a_change_is_named_where_it_is(tiny, prof):
    """Every norm (each block's two input norms, MLA's latent norm, the final norm) is held by its answer on fixed
    inputs and every output-projection row like the embedding's: a final norm scaled as a whole (a temperature:
    every logit alike, the same symptom as a scaled output projection) is named as the final norm, a scaled output
    projection as the output projection, a layer's norm at its own layer; the clean model matches all of it."""
    s = tiny.summary
    norms = prof.filter(pl.col("signal").str.starts_with("known:norm"))
    assert set(norms.filter(pl.col("kind") == "attn_norm")["layer"]) == set(range(s.n_layers))
    assert set(norms.filter(pl.col("kind") == "mlp_norm")["layer"]) == set(range(s.n_layers))
    assert norms.filter(pl.col("kind") == "final_norm").height == 1
    rows = prof.filter((pl.col("kind") == "unembed") & (pl.col("signal") == "known:rows"))
    assert rows.height == 1 and rows["n"][0] == tiny.unembedding().weight.size(0)
    ids = _prompts(1, 30, seed=5)[0]
    ends = lambda: activations._end_evidence(tiny, ids, prof)  # noqa: E731
    assert ends() == {} and _known(tiny, ids, prof) == {}
    w = tiny.final_norm().weight
    with faults._edited(w, lambda x: x.mul_(0.3)):
        assert ends() == {("final_norm", None, None, None, None): activations.KNOWN_NATS}
        ev = activations.evidence(tiny, ids, prof)
        assert _top(ev, 1) == [("final_norm", None, None, None, None)]
        rows = activations.anomaly_rows(tiny, ids, prof)
    named = [r for r in rows if r["component"] == "final_norm"]
    assert named and named[0]["severity"] == "critical" and "the final norm" in named[0]["explanation"]
    with faults._edited(w[3:4], lambda x: x.mul_(30.0)):  # one outlier channel
        assert set(ends()) == {("final_norm", None, None, None, None)}
    with faults._edited(tiny.unembedding().weight, lambda x: x.mul_(0.5)):
        assert set(ends()) == {("unembed", None, None, None, None)}
        assert _top(activations.evidence(tiny, ids, prof), 1) == [("unembed", None, None, None, None)]
    token = 7 if 7 not in ids else 9  # a row no context token holds: judged when it is the explained token
    with faults.KINDS["unembedding"](tiny, 0, index=token):
        assert activations._end_evidence(tiny, ids, prof, [token]) == {
            ("unembed", None, None, None, None): activations.KNOWN_NATS}
    layer = 2
    norm = tiny.parts(layer)["mlp_norm"].weight
    with faults._edited(norm, lambda x: x.mul_(0.5)):  # (a random model's norms are at ones: no reset to show)
        got = activations._known_evidence(tiny, activations.capture(tiny, ids)[0], prof)
        assert _top(activations.evidence(tiny, ids, prof), 1) == [("mlp_norm", layer, None, None, None)]
    assert got == {("mlp_norm", layer, None, None, None): activations.KNOWN_NATS}
    assert ends() == {} and _known(tiny, ids, prof) == {}  # undone


def test_a_selection_rate_is_judged_by_its_beta_binomial_tail_not_a_normal_z():
    """How often an expert is chosen varies between texts as a beta-binomial (positions of one text choose alike): a
    rarely chosen expert's burst (10 of 95 positions, at 0.2% of calibration positions, intraclass 0.056) is a tail
    of a few nats, where its normal z claimed 40; an expert every position chooses at a clean rate of 1 in 8 stays
    far out; and with no intraclass correlation the tail is the binomial's (two-sided, on the side the rate is)."""
    from scipy.stats import binom

    rare = {"mean": [0.002], "n": 3800, "std": [0.056]}
    burst = torch.zeros(95, 1)
    burst[:10] = 1
    assert activations._rate_tail(burst, rare) < 8 < 30 < activations.log_tail(activations._rate_z(burst, rare))
    common = {"mean": [0.125], "n": 6000, "std": [0.05]}
    assert activations._rate_tail(torch.ones(95, 1), common) > activations.CRITICAL_NATS / 2
    flat = {"mean": [0.125], "n": 10**7, "std": [0.0]}
    p = (0.125 * 10**7 + 0.5) / (10**7 + 1)
    for k in (5, 12, 30):
        y = torch.zeros(95, 1)
        y[:k] = 1
        one_sided = -binom.logsf(k - 1, 95, p) if k >= 95 * p else -binom.logcdf(k, 95, p)  # 95p = 11.9
        assert activations._rate_tail(y, flat) == pytest.approx(one_sided - np.log(2), rel=1e-3)


def test_a_norm_channel_gone_wrong_is_named_at_any_width():
    """A norm's known answer is its whole output on one fixed row, judged by its largest coordinate: one channel x4 in
    a norm 4,096 wide is 3 times the answer's RMS off (a projection's RMS difference was 0.025, under the 5%
    tolerance); the same norm unchanged gives its answer back exactly."""
    from workbench.model.model import RMSNorm

    norm = RMSNorm(4096)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    clean = activations._norm_answer(norm)
    assert clean.shape == (1, 4096) and activations._norm_dev(activations._norm_answer(norm), clean) == 0.0
    with faults._edited(norm.weight[100:101], lambda w: w.mul_(4.0)):
        assert activations._norm_dev(activations._norm_answer(norm), clean) > 1.0 > activations.KNOWN_TOL
        assert activations._known_dev(activations._held(activations._norm_answer(norm)), activations._held(clean)) \
            < 5 * activations.KNOWN_TOL  # what a projection would have seen


def test_the_reach_ends_where_a_length_bucket_has_too_few_calibration_prompts(prof):
    """A spread from a handful of prompts judges no context: the profile's reach ends at the last length bucket that
    REACH_RUNS calibration prompts reach (a 102M model profiled on 60 prompts, 5 of them past 512 tokens, judged its
    clean 500-960-token prompts with 15 component rows); a profile of fewer prompts than that, or one made before the
    counts were kept, reaches its longest prompt as before."""
    R = activations.RUN_BUCKETS
    assert activations._bucket_reach([60, 60, 60, 60, 60, 55, 37, 14, 5], 977) == R[8] - 1 == 511
    assert activations._bucket_reach([272, 272, 272, 271, 271, 263, 226, 128, 25], 1139) == 1139
    assert activations._bucket_reach([60, 60, 60, 60, 60, 55, 9, 0, 0], 120) == R[6] - 1 == 31
    assert activations._bucket_reach([8] * 9, 300) == 300  # a small profile: no length singled out
    counts = prof.filter(pl.col("signal") == "bucket_prompts")
    n = int(counts["n"][0])
    assert counts["mean"][0].to_list() == [float(n)] * 5 + counts["mean"][0].to_list()[5:]  # every prompt >= 6 tokens
    few = prof.with_columns(pl.when(pl.col("signal") == "bucket_prompts")
                            .then(pl.lit([60.0, 60, 60, 60, 60, 55, 9, 0, 0], pl.List(pl.Float32)))
                            .otherwise(pl.col("mean")).alias("mean"))
    assert activations.calibrated_context(few) == min(31, activations.calibrated_context(prof))
    old = prof.filter(pl.col("signal") != "bucket_prompts")  # made before the counts: its longest prompt
    assert activations.calibrated_context(old) == 40


def test_known_answers_in_half_precision_against_an_fp32_profile():
    """bf16 rounds a component's answer on its fixed inputs by about 2% of its RMS (the demo, every component), far
    under ``KNOWN_TOL_HALF``: a clean bf16 model against the fp32 bundled profile has no known-answer evidence, an
    expert whose weights were noised has (in fp32 only the profile's own dtype was compared before)."""
    from workbench.analysis import faults
    from workbench.capture.adapters import load_adapter
    from workbench.model import load_tokenizer

    prof = pl.read_parquet(activations.BUNDLED)
    assert activations._known_tol(prof, torch.float32) == activations.KNOWN_TOL
    assert activations._known_tol(prof, torch.bfloat16) == activations._known_tol(prof, torch.float16) \
        == activations.KNOWN_TOL_HALF
    assert activations._known_tol(prof, torch.float64) is None
    a = load_adapter(None, dtype=torch.bfloat16)
    ids = load_tokenizer().encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):").ids
    got = activations.capture(a, ids)[0]
    assert activations._known_evidence(a, got, prof) == {}
    idx = got[("route", 3, None, None, "indices")]
    expert = int(idx.flatten()[0])  # one the context chose
    with faults.ALL_KINDS["expert_noise"](a.module, 3, index=expert):
        off = activations._known_evidence(a, activations.capture(a, ids)[0], prof)
    assert ("expert", 3, None, expert, None) in off
