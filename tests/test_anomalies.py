"""Calibrated detectors: tail probabilities, the multiple-testing bound on known nulls, each detector on a
constructed case, profiles through the store, findings, and NaN end to end."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.analysis import anomalies as an
from workbench.analysis import baseline as pr
from workbench.analysis import findings as fd
from workbench.cli import main as cli_main
from workbench.probes import attach


def tokens_frame(conf: list[float], logprob: list[float] | None = None, n_prompt: int = 2) -> pl.DataFrame:
    n = len(conf)
    return pl.DataFrame({
        "pos": list(range(n)), "text": [f"t{i}" for i in range(n)], "is_prompt": [i < n_prompt for i in range(n)],
        "confidence": conf, "rank": [1] * n, "logprob": logprob or [-0.1] * n, "prob": [0.9] * n, "entropy": [0.5] * n,
    }, schema_overrides={"pos": pl.Int32})


def attention_frame(values: dict[tuple[int, int], list[float]]) -> pl.DataFrame:
    rows = [{"pos": p, "layer": l, "head": h, "entropy": v, "norm_entropy": v, "max_weight": 0.5, "sink_weight": 0.1}
            for (l, h), vals in values.items() for p, v in enumerate(vals)]
    return pl.DataFrame(rows, schema_overrides={"pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32})


def routing_frame(choices: list[list[int]], layer: int = 1, margin: float = 0.1) -> pl.DataFrame:
    rows = [{"pos": p, "layer": layer, "slot": s, "expert": e, "weight": 0.5, "score": 0.5, "margin": margin}
            for p, es in enumerate(choices) for s, e in enumerate(es)]
    return pl.DataFrame(rows, schema_overrides={"pos": pl.Int32, "layer": pl.Int32, "slot": pl.Int32,
                                                "expert": pl.Int32})


def cell(signal: str, values: np.ndarray, **keys) -> dict:
    return {"signal": signal, "layer": keys.get("layer"), "head": keys.get("head"), "expert": keys.get("expert"),
            "bucket": keys.get("bucket"), "n": len(values), "mean": float(values.mean()), "std": float(values.std()),
            "quantiles": np.quantile(values, pr.PROBS).tolist()}


def profile_frame(cells: list[dict]) -> pl.DataFrame:
    return pl.DataFrame(cells, schema={k: pr.SCHEMA[k] for k in ("signal", "layer", "head", "expert", "bucket", "n",
                                                                 "mean", "std", "quantiles")})


def test_tail_p_is_uniform_under_the_null_and_small_far_out():
    rng = np.random.default_rng(0)
    q = np.quantile(rng.standard_normal(20_000), pr.PROBS)
    p = pr.tail_p(rng.standard_normal(20_000), q)
    for level in (0.01, 0.05, 0.2, 0.5):
        assert abs((p <= level).mean() - level) < 0.25 * level + 0.003, level
    assert np.all(np.diff(pr.tail_p(np.linspace(-5, 8, 200), q)) <= 1e-12)  # monotone
    assert pr.tail_p(np.array([8.0]), q)[0] < 1e-8 and pr.tail_p(np.array([-8.0]), q, upper=False)[0] < 1e-8
    flat = np.full(len(pr.PROBS), 0.5)  # a constant cell: float noise is not an alarm
    assert pr.tail_p(np.array([0.5 + 1e-12]), flat)[0] > 5e-4


def test_tail_p_per_row_cells_equal_one_call_per_cell():
    """Each value against its own cell's quantiles in one call equals one call per cell (np.interp), ties,
    constant cells, values on a quantile and beyond both ends included."""
    rng = np.random.default_rng(1)
    for trial in range(60):
        q = np.sort(rng.standard_normal((40, len(pr.PROBS))) * rng.uniform(0.01, 3), axis=1)
        if trial % 3 == 0:
            q[:, 10:30] = q[:, 10:11]
        if trial % 7 == 0:
            q[:] = 0.5
        x = rng.standard_normal(40) * 3
        x[:4], x[4:6], x[6:8] = q[:4, 10], q[4:6, -1], q[6:8, 0]
        for upper in (True, False):
            one = np.array([pr.tail_p(x[i:i + 1], q[i], upper=upper)[0] for i in range(40)])
            np.testing.assert_allclose(pr.tail_p(x, q, upper=upper), one, rtol=1e-9, atol=1e-15)


def test_benjamini_hochberg_bounds_false_alarms_on_known_nulls():
    """200 synthetic runs of 500 null tests each: the share of runs with any alarm stays within alpha; with
    10 planted signals the planted ones are found and the false discovery share stays within alpha."""
    rng = np.random.default_rng(1)
    q = np.quantile(rng.standard_normal(50_000), pr.PROBS)
    alpha, runs, any_alarm, false, found, raised = 0.05, 200, 0, 0, 0, 0
    for _ in range(runs):
        x = rng.standard_normal(500)
        planted = np.zeros(500, bool)
        tests = an._tests(kind="resid_norm_outlier", pos=np.arange(500), layer=np.zeros(500, int),
                          value=x, p=pr.tail_p(x, q), basis="the baseline profile")
        any_alarm += an.decide(tests, alpha).height > 0
        x2 = x.copy()
        planted[:10] = True
        x2[:10] += 6.0
        t2 = tests.with_columns(pl.Series("p", pr.tail_p(x2, q)), pl.Series("value", x2))
        hit = an.decide(t2, alpha)["pos"].to_numpy()
        found += planted[hit].sum()
        false += (~planted[hit]).sum()
        raised += len(hit)
    se = np.sqrt(alpha * (1 - alpha) / runs)
    assert any_alarm / runs <= alpha + 3 * se
    assert found / (10 * runs) > 0.95 and false / raised <= alpha + 0.01


def test_each_detector_fires_on_its_case_and_stays_quiet_when_clean():
    rng = np.random.default_rng(2)
    base = an.Baseline(profile_frame([
        cell("norm_entropy", 0.5 + 0.02 * rng.standard_normal(2000), layer=0, head=h, bucket=b)
        for h in range(2) for b in range(4)] + [
        cell("confidence", rng.beta(8, 2, 5000), bucket=b) for b in range(4)] + [
        cell("surprise", rng.exponential(0.5, 5000), bucket=b) for b in range(4)]))
    clean = attention_frame({(0, h): list(0.5 + 0.02 * rng.standard_normal(30)) for h in range(2)})
    assert an.decide(an.entropy_tests(clean, base)).height == 0
    spiked = clean.with_columns(pl.when((pl.col("pos") == 17) & (pl.col("head") == 1)).then(0.95)
                                .otherwise(pl.col("norm_entropy")).alias("norm_entropy"))
    got = an.decide(an.entropy_tests(spiked, base))
    assert got.select("kind", "pos", "layer", "head").rows() == [("entropy_spike", 17, 0, 1)]
    assert "baseline profile" in got["explanation"][0]
    toks = tokens_frame(list(np.clip(rng.beta(8, 2, 30), 0.05, 1)))
    assert an.decide(an.token_tests(toks, base)).height == 0
    low = toks.with_columns(pl.when(pl.col("pos") == 20).then(0.0001).otherwise(pl.col("confidence")).alias("confidence"))
    assert an.decide(an.token_tests(low, base)).select("kind", "pos").rows() == [("low_confidence", 20)]
    # without a profile: judged against the run itself, and every explanation says so
    alone = an.decide(an.entropy_tests(spiked, an.Baseline(None)))
    assert alone.select("pos", "head").rows() == [(17, 1)] and "no baseline profile" in alone["explanation"][0]


def test_expert_count_tests_account_for_the_slots_a_run_had():
    none = an.Baseline(None)
    # 16 experts, top-2, 40 tokens: one empty expert is expected by chance, not an alarm
    rng = np.random.default_rng(3)
    few = routing_frame([list(rng.choice(15, 2, replace=False)) for _ in range(40)])
    assert an.decide(an.expert_tests(few, 16, none)).height == 0
    # a router sending every token to expert 3: overloaded and collapsed
    hot = routing_frame([[3, int(e)] for e in rng.choice([0, 1, 2, 4, 5, 6, 7], 200)])
    got = an.decide(an.expert_tests(hot, 8, none))
    assert ("overloaded_expert", 1, 3) in got.select("kind", "layer", "expert").rows()
    assert "routing_collapse" in got["kind"].to_list() and "uniform load" in got["explanation"][0]
    # 400 tokens that never pick experts 6 and 7: dead
    dead = routing_frame([list(rng.choice(6, 2, replace=False)) for _ in range(400)])
    d = an.decide(an.expert_tests(dead, 8, none)).filter(pl.col("kind") == "dead_expert")
    assert sorted(d["expert"].to_list()) == [6, 7]


def test_non_finite_is_critical_and_quiet_when_clean():
    att = attention_frame({(0, 0): [0.2] * 5, (1, 0): [0.2] * 5})
    assert an.non_finite({"attention": att, "tokens": tokens_frame([0.9] * 5)}).height == 0
    bad = att.with_columns(pl.when((pl.col("layer") == 1) & (pl.col("pos") >= 3)).then(float("nan"))
                           .otherwise(pl.col("entropy")).alias("entropy"))
    got = an.non_finite({"attention": bad})
    assert got.select("severity", "layer", "pos", "score").rows() == [("critical", 1, 3, 2.0)]


def test_unknown_threshold_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown anomaly thresholds"):
        an.detect_frames(tokens_frame([0.9]), attention_frame({}), routing_frame([]), 8, low_conf=0.3)


def test_findings_group_rows_by_component_and_name_the_expert_behind_residual_outliers():
    def row(kind, pos=None, layer=None, head=None, expert=None, score=5.0, sev="warning"):
        return {"kind": kind, "severity": sev, "pos": pos, "layer": layer, "head": head, "expert": expert,
                "score": score, "threshold": 2.0, "explanation": kind}

    rows = [row("head_norm_outlier", p, 2, 1, score=9.0) for p in range(5)]
    rows += [row("resid_norm_outlier", p, layer) for p in range(5) for layer in (2, 3)]  # starts at the head's layer
    rows += [row("resid_norm_outlier", p, 4, score=7.0) for p in (10, 12, 14)]  # all routed to expert 5 at layer 4
    rows += [row("low_confidence", p) for p in (20, 21, 22, 30)]
    rows += [row("overloaded_expert", None, 3, expert=2, score=4.0)]
    a = an._rows(rows)
    routing = routing_frame([[5, 1 + p % 4] if p in (10, 12, 14) else [1 + p % 4, 6] for p in range(40)], layer=4)
    f = fd.group_findings(a, routing, shared_experts=True)
    got = {(r["component"], r["layer"], r["head"], r["expert"]): r for r in f.iter_rows(named=True)}
    assert got[("head", 2, 1, None)]["positions"] == [0, 1, 2, 3, 4] and got[("head", 2, 1, None)]["n_rows"] == 10
    assert got[("expert", 4, None, 5)]["positions"] == [10, 12, 14]
    assert ("expert", 3, None, 2) in got
    spans = sorted(r["positions"] for r in f.iter_rows(named=True) if r["component"] == "tokens")
    assert spans == [[20, 21, 22], [30]]
    assert f["rank"].to_list() == list(range(1, f.height + 1)) and f["score"][0] == 9.0
    assert fd.group_findings(an.empty()).height == 0


def test_profile_round_trip_through_the_store_and_detection_against_it(tmp_path):
    model = tiny_model()
    db = workbench.Store(tmp_path / "w.duckdb")
    res = workbench.profile([[5 + i, 17, 101 + i, 3] for i in range(6)], model=model, db=db, max_new_tokens=6)
    from workbench.data import query
    stored = query.profile(db, res["sha"])
    assert stored.height == res["cells"] > 0
    assert {"norm_entropy", "confidence", "surprise", "margin", "expert_share", "load_dispersion", "latent_norm",
            "resid_norm", "head_norm"} <= set(stored["signal"])
    share = stored.filter(pl.col("signal") == "expert_share")
    assert share.group_by("layer").agg(pl.col("mean").sum())["mean"].to_list() == pytest.approx([1.0])
    out = pr.export_profile(db, res["sha"], tmp_path / "p.parquet")
    back = pl.read_parquet(out)
    assert back.height == stored.height and set(back["checkpoint_sha256"]) == {res["sha"]}
    run = workbench.record([5, 17, 101, 3], model=model, db=db, max_new_tokens=6)
    assert json.loads(run.refresh().info["detection"])["profile"] == "profile"


def test_detect_stores_and_reuses(tmp_path):
    model = tiny_model()
    run = workbench.record(list(range(5, 25)), model=model, max_new_tokens=4, db=tmp_path / "w.duckdb")
    first = run.anomalies()
    assert set(first["severity"]) <= {"info", "warning", "critical"}
    assert sorted(first["anomaly_id"].to_list()) == list(range(first.height))
    assert run.anomalies().equals(first)  # read back, not recomputed
    assert json.loads(run.refresh().info["detection"])["profile"] == "within-run"
    loose = run.anomalies(alpha=0.5)
    assert loose.filter(pl.col("severity") != "info").height >= first.filter(pl.col("severity") != "info").height
    assert cli_main(["anomalies", run.run_id, "--json", "--db", str(tmp_path / "w.duckdb")]) == 0
    assert cli_main(["findings", run.run_id, "--json", "--db", str(tmp_path / "w.duckdb")]) == 0


def test_nan_in_a_layer_is_detected_and_the_run_is_kept(tmp_path, capsys):
    def poison(x, **_):
        return torch.full_like(x, float("nan"))

    model = tiny_model()
    db = tmp_path / "w.duckdb"
    with attach(model, {"layers.0.hook_resid_post": poison}):
        run = workbench.record(list(range(5, 25)), model=model, max_new_tokens=5, db=db)
    assert run.status in ("complete", "failed")
    assert run.tokens().height == run.refresh().info["n_tokens"]
    a = run.anomalies()
    crit = a.filter((pl.col("kind") == "non_finite") & (pl.col("severity") == "critical"))
    assert crit.height >= 1 and "tokens" in " ".join(crit["explanation"].to_list())
    f = run.findings()
    assert f["component"][0] == "non_finite" and f["layer"][0] == 0
    assert cli_main(["anomalies", run.run_id, "--json", "--kind", "non_finite", "--db", str(db)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["anomalies"] and all(r["kind"] == "non_finite" for r in out["anomalies"])
    assert cli_main(["anomalies", "nope", "--db", str(db)]) == 2
