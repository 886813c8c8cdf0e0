"""Calibrated detectors: tail probabilities, the multiple-testing bound on known nulls, each detector on a
constructed case, profiles through the store, findings, and NaN end to end."""
from __future__ import annotations

import json
import warnings

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.analysis import anomalies as an
from workbench.analysis import baseline as pr
from workbench.data import query
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


def test_cell_tails_equal_tail_p_of_each_values_own_cell():
    """A profile's cells prepared once (``CellTails``: what the detectors judge with) give, value for value, what
    ``tail_p`` gives against each value's own cell: quantiles out of order, constant cells, NaN values, values on a
    quantile and beyond both ends, both tails, a floor on the decay scale."""
    rng = np.random.default_rng(2)
    for trial in range(40):
        cells = np.sort(rng.standard_normal((12, len(pr.PROBS))) * rng.uniform(0.01, 3), axis=1)
        if trial % 3 == 0:
            cells[3] = 0.5
        if trial % 4 == 0:  # out of order: both take the running maximum
            cells[5] = rng.standard_normal(len(pr.PROBS))
        cell = rng.integers(0, 12, 300)
        x = rng.standard_normal(300) * 4
        x[:3], x[3:6], x[6:9], x[9] = cells[cell[:3], 7], cells[cell[3:6], -1], cells[cell[6:9], 0], np.nan
        tails = pr.CellTails.of(cells)
        for upper in (True, False):
            for floor in (0.0, 0.3):
                want = pr.tail_p(x, cells[cell], upper=upper, min_scale=floor)
                np.testing.assert_array_equal(tails.p(x, cell, upper=upper, min_scale=floor), want)


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
            "resid_norm", "head_norm", "log_latent_norm", "log_resid_norm", "log_head_norm"} <= set(stored["signal"])
    share = stored.filter(pl.col("signal") == "expert_share")
    assert share.group_by("layer").agg(pl.col("mean").sum())["mean"].to_list() == pytest.approx([1.0])
    acts = query.activation_profile(db, res["sha"])  # the components' activations, from the same runs
    assert acts.height == res["components"] > 0 and {"head", "attn_block", "resid", "router"} <= set(acts["kind"])
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


# -- detectors that generalise (issue 25) -----------------------------------------------------------
def entropy_profile(rng, buckets=range(4), heads=range(2)) -> an.Baseline:
    return an.Baseline(profile_frame([
        cell("norm_entropy", np.clip(0.55 + 0.05 * rng.standard_normal(2000), 0, 1), layer=0, head=h, bucket=b)
        for h in heads for b in buckets]))


def test_two_sided_entropy_catches_collapsed_attention_and_names_its_side():
    """A head at normalised entropy 0.02-0.07 where the profile has 0.55 +- 0.05: entropy_collapse rows at
    exactly the collapsed positions, said to be unusually low; the upper-tail spike still an entropy_spike."""
    rng = np.random.default_rng(5)
    base = entropy_profile(rng)
    clean = attention_frame({(0, h): list(np.clip(0.55 + 0.05 * rng.standard_normal(40), 0, 1)) for h in range(2)})
    assert an.decide(an.entropy_tests(clean, base)).height == 0
    collapsed = clean.with_columns(pl.when((pl.col("head") == 1) & (pl.col("pos") >= 30))
                                   .then(0.02 + 0.005 * (pl.col("pos") - 30)).otherwise(pl.col("norm_entropy"))
                                   .alias("norm_entropy"))
    got = an.decide(an.entropy_tests(collapsed, base))
    assert set(got["kind"]) == {"entropy_collapse"}
    assert sorted(got.select("pos", "head").rows()) == [(p, 1) for p in range(30, 40)]
    assert all("unusually low" in e for e in got["explanation"])
    f = fd.group_findings(got)
    assert f.select("component", "layer", "head").rows() == [("head", 0, 1)]
    assert "collapsed" in f["explanation"][0]
    spiked = clean.with_columns(pl.when((pl.col("pos") == 12) & (pl.col("head") == 0)).then(0.99)
                                .otherwise(pl.col("norm_entropy")).alias("norm_entropy"))
    assert an.decide(an.entropy_tests(spiked, base)).select("kind", "pos").rows() == [("entropy_spike", 12)]


def test_head_norm_two_sided_catches_a_head_whose_output_is_gone():
    rng = np.random.default_rng(6)
    base = an.Baseline(profile_frame([cell("log_head_norm", np.log(np.abs(1 + 0.1 * rng.standard_normal(3000))),
                                           layer=2, head=h) for h in range(2)]))
    rows = [{"pos": p, "layer": 2, "head": h, "norm": 0.0 if (h == 0 and p >= 5) else float(1 + 0.1 * rng.standard_normal())}
            for p in range(30) for h in range(2)]
    hn = pl.DataFrame(rows, schema_overrides={"pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32})
    got = an.decide(an.head_norm_tests(hn, base))
    assert sorted(got.select("pos", "head").rows()) == [(p, 0) for p in range(5, 30)]
    assert fd.group_findings(got)["explanation"][0].startswith("layer 2 head 0: its output is unusually small")
    # position 0: one key, the first token's value (what a sink leaves it): no test of the head, never judged
    first = hn.with_columns(pl.when(pl.col("pos") == 0).then(1e-4).otherwise(pl.col("norm")).alias("norm"))
    tests = an.head_norm_tests(first, base)
    assert tests.filter(pl.col("pos") == 0).height == 0 and tests.filter(pl.col("pos") == 1).height == 2


def test_long_contexts_are_judged_against_the_nearest_bucket_never_the_run_itself():
    """A profile calibrated below 128 tokens judges a 700-token run's heads against its nearest bucket: values
    typical of the cell raise nothing (no p = 1e-300 against the run's own statistics), a collapse still
    shows, and every test's basis is the profile."""
    rng = np.random.default_rng(7)
    base = entropy_profile(rng, buckets=range(3))  # contexts 1..127 only
    vals = np.clip(0.55 + 0.05 * rng.standard_normal(700), 0, 1)
    vals[:600] += 0.3 * (np.arange(600) % 7 == 0)  # a run whose own statistics would call its typical values odd
    att = attention_frame({(0, 0): list(np.clip(vals, 0, 1))})
    tests = an.entropy_tests(att, base)
    assert set(tests["basis"]) == {"the baseline profile", "the baseline profile (its nearest context-length bucket)"}
    far = tests.filter(pl.col("pos") >= 200)
    assert set(far["basis"]) == {"the baseline profile (its nearest context-length bucket)"}
    assert an.decide(tests.filter(pl.col("pos") >= 600)).height == 0
    collapsed = att.with_columns(pl.when(pl.col("pos") >= 690).then(0.01).otherwise(pl.col("norm_entropy"))
                                 .alias("norm_entropy"))
    hit = an.decide(an.entropy_tests(collapsed, base).filter(pl.col("pos") >= 600))
    assert sorted(hit["pos"].to_list()) == list(range(690, 700))
    # every bucket up to the last one exists for the cell, copied from the nearest calibrated bucket
    cells = base.cells("norm_entropy").filter(pl.col("head") == 0)
    assert sorted(cells["bucket"].to_list()) == list(range(len(pr.BUCKETS) - 1))
    b2 = cells.filter(pl.col("bucket") == 2)["quantiles"][0].to_list()
    assert all(q.to_list() == b2 for q in cells.filter(pl.col("bucket") > 2)["quantiles"])


def test_without_a_profile_every_statistical_row_is_info_with_one_line_to_profile():
    rng = np.random.default_rng(8)
    att = attention_frame({(0, h): list(0.5 + 0.02 * rng.standard_normal(30)) for h in range(2)})
    att = att.with_columns(pl.when(pl.col("pos") == 17).then(0.99).otherwise(pl.col("norm_entropy")).alias("norm_entropy"))
    hot = routing_frame([[3, int(e)] for e in rng.choice([0, 1, 2, 4, 5, 6, 7], 200)])
    toks = tokens_frame([0.9] * 60, n_prompt=4).with_columns(
        pl.Series("token_id", [7] * 4 + [11, 12, 13] * 18 + [1, 2]))
    meta = {}
    got = an.detect_frames(toks, att, hot, 8, meta=meta)
    assert got.height > 0 and set(got["severity"]) == {"info"}
    assert {"entropy_spike", "overloaded_expert", "routing_collapse", "repetition", "no_profile"} <= set(got["kind"])
    note = got.filter(pl.col("kind") == "no_profile")
    assert note.height == 1 and "workbench profile" in note["explanation"][0]
    assert meta["profile"] is False and meta["tests"] > 0 and meta["profile_tests"] == 0
    assert fd.group_findings(got).height == 0  # findings ignore info rows: nothing to chase on a clean run
    # NaN stays critical: it is no statistical judgement
    bad = att.with_columns(pl.when(pl.col("pos") == 3).then(float("nan")).otherwise(pl.col("entropy")).alias("entropy"))
    assert "critical" in an.detect_frames(toks, bad, hot, 8)["severity"].to_list()


def test_repetition_finds_a_loop_repeated_spans_and_a_copy_and_nothing_in_varied_text():
    def frame(ids: list[int], n_prompt: int) -> pl.DataFrame:
        return tokens_frame([0.9] * len(ids), n_prompt=n_prompt).with_columns(
            pl.Series("token_id", ids), pl.Series("text", [f"<{i}>" for i in ids]))

    rng = np.random.default_rng(9)
    varied = [int(x) for x in rng.permutation(2000)[:90]]
    assert an.repetition(frame(varied, 30)).height == 0
    # the is_prime loop: a 4-token unit over and over from generated position 40
    loop = varied[:40] + [101, 102, 103, 104] * 8 + varied[40:50]
    got = an.repetition(frame(loop, 30))
    assert got.height == 1 and got["severity"][0] == "warning" and got["pos"][0] == 40 and got["score"][0] == 32
    assert "4-token unit '<101><102><103><104>' repeated 8.0 times" in got["explanation"][0]
    # an 8-token span three times, with other text between the copies
    span = [201 + i for i in range(8)]
    rep = varied[:30] + span + varied[30:35] + span + varied[35:41] + span + varied[41:50]
    got = an.repetition(frame(rep, 30))
    assert got.height == 1 and "generated 3 times (positions 30, 43, 57)" in got["explanation"][0]
    # a 40-token copy of the prompt
    copy = varied[:60] + varied[10:50] + varied[60:64]
    got = an.repetition(frame(copy, 60))
    assert got.height == 1 and "copies 40 tokens of the prompt verbatim (positions 60-99 repeat 10-49)" \
        in got["explanation"][0]
    # in findings: one generation finding over the loop's positions
    f = fd.group_findings(an.repetition(frame(loop, 30)))
    assert f.select("component", "pos_start", "pos_end").rows() == [("generation", 40, 71)]


def test_a_prompt_that_loops_is_degenerate_input_not_judged_and_said_once(tmp_path):
    """A prompt holding a loop ("a a a a ...", a line pasted many times): one info row says so, and the detectors
    judge neither its positions (nor the generation going on with it) nor the heads after it (its keys stay in
    context); before, "a " * 40 on the clean demo model raised 241 warning/critical rows. A generated loop after
    it is still a repetition warning."""
    from workbench.analysis.repetition import input_loops
    from workbench.model import load_checkpoint
    ids = [int(x) for x in np.random.default_rng(2).permutation(2000)[:30]]
    toks = tokens_frame([0.9] * 70, n_prompt=45).with_columns(
        pl.Series("token_id", ids[:5] + [7, 8] * 20 + [7, 8] * 3 + ids[5:24]))
    got = input_loops(toks)
    assert [(s.pos, s.tokens) for s in got] == [(5, 46)]  # in the prompt from 5, and 6 generated tokens go on
    assert "degenerate input" in got[0].explanation and "generation going on with it" in got[0].explanation
    # a 20-token unit twice and a half in the prompt: under two periods, no loop
    assert input_loops(toks.with_columns(pl.Series("token_id", ids[:20] * 3 + ids[:10]))) == []
    model = load_checkpoint()
    db = workbench.Store(tmp_path / "w.duckdb")
    for prompt in ("a " * 40, "ha" * 60):
        a = workbench.record(prompt, model=model, db=db, max_new_tokens=32).anomalies()
        assert a.filter((pl.col("severity") != "info") & (pl.col("kind") != "repetition")).height == 0, a
        note = a.filter((pl.col("kind") == "repetition") & (pl.col("severity") == "info"))
        assert note.height == 1 and note["pos"][0] == 1 and "the prompt repeats" in note["explanation"][0]


def test_routing_is_judged_against_the_calibrated_spread_of_clean_prompts():
    """A load as concentrated as clean calibration prompts of several kinds is no collapse; far beyond it is,
    and an expert the profile expects that no token picks over a long run is dead, one picked rarely starved."""
    rng = np.random.default_rng(10)
    share = np.full(8, 1 / 8)
    stats = np.abs(0.05 + 0.015 * rng.standard_normal(200))  # clean prompts of several kinds: G per slot ~0.05
    base = an.Baseline(profile_frame(
        [{"signal": "expert_share", "layer": 1, "head": None, "expert": e, "bucket": None, "n": 10_000,
          "mean": float(share[e]), "std": 0.0, "quantiles": None} for e in range(8)]
        + [cell("load_dispersion", stats, layer=1)]))
    # another kind of text: routing skewed (G per slot ~0.03), within what clean prompts show
    skew = np.array([0.15, 0.15, 0.125, 0.125, 0.125, 0.1, 0.1, 0.125])
    mild = routing_frame([list(rng.choice(8, 2, replace=False, p=skew)) for _ in range(300)])
    stat = pr.load_statistic(np.bincount(mild["expert"].to_numpy(), minlength=8).astype(float), share)
    assert stat < np.quantile(stats, 0.99)
    assert an.decide(an.expert_tests(mild, 8, base)).height == 0
    hot = routing_frame([[3, int(e)] for e in rng.choice([0, 1, 2, 4, 5, 6, 7], 300)])
    got = an.decide(an.expert_tests(hot, 8, base))
    assert {("routing_collapse", None), ("overloaded_expert", 3)} <= set(got.select("kind", "expert").rows())
    assert all("baseline profile" in e for e in got["explanation"])
    starved = routing_frame([list(rng.choice([0, 1, 2, 3, 4, 5, 6], 2, replace=False)) if i % 60 else [7, 0]
                             for i in range(1200)])
    got = an.decide(an.expert_tests(starved, 8, base))
    assert ("starved_expert", 7) in got.select("kind", "expert").rows()
    dead = routing_frame([list(rng.choice(7, 2, replace=False)) for _ in range(1200)])
    assert ("dead_expert", 7) in an.decide(an.expert_tests(dead, 8, base)).select("kind", "expert").rows()


def test_an_expert_every_token_chooses_is_no_overload_where_the_profile_expects_it():
    """A layer whose favourite expert takes every token (a top-2 share of 0.5, as a tiny random PhiMoE's layer 0 routes)
    is what the profile expects: no overloaded_expert row however long the run and however widened the counts are
    (before, rounding the widened count up past the widened number of tokens gave p = 0: 69 of 64 clean PhiMoE runs'
    alarms); the same expert chosen by every token where the profile expects a quarter of them still is one."""
    rng = np.random.default_rng(4)
    share = np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005])
    stats = np.abs(0.08 + 0.03 * rng.standard_normal(60))
    base = an.Baseline(profile_frame(
        [{"signal": "expert_share", "layer": 1, "head": None, "expert": e, "bucket": None, "n": 10_000,
          "mean": float(share[e]), "std": 0.0, "quantiles": None} for e in range(8)]
        + [cell("load_dispersion", stats, layer=1)]))
    for n in (20, 95, 400):
        every = routing_frame([[0, int(rng.choice([1, 2, 3], p=[0.6, 0.3, 0.1]))] for _ in range(n)])
        got = an.decide(an.expert_tests(every, 8, base))
        assert ("overloaded_expert", 0) not in got.select("kind", "expert").rows(), (n, got)
    low = share.copy()
    low[0], low[1] = 0.125, 0.675
    base_low = an.Baseline(profile_frame(
        [{"signal": "expert_share", "layer": 1, "head": None, "expert": e, "bucket": None, "n": 10_000,
          "mean": float(low[e]), "std": 0.0, "quantiles": None} for e in range(8)]
        + [cell("load_dispersion", stats, layer=1)]))
    every = routing_frame([[0, int(rng.choice([1, 2, 3], p=[0.6, 0.3, 0.1]))] for _ in range(400)])
    assert ("overloaded_expert", 0) in an.decide(an.expert_tests(every, 8, base_low)).select("kind", "expert").rows()


def test_what_was_tested_says_what_a_nothing_found_means(tmp_path, capsys):
    model = tiny_model()
    db = workbench.Store(tmp_path / "w.duckdb")
    run = workbench.record([5, 17, 101, 3, 9, 44], model=model, db=db, max_new_tokens=6)
    line = an.what_was_tested(db, run.run_id)
    n = json.loads(run.refresh().info["detection"])["tests"]
    assert line.startswith(f"{n} tests against this run's own statistics (no baseline profile for this model")
    assert "workbench profile" in line
    res = workbench.profile([[5 + i, 17, 101 + i, 3] for i in range(6)], model=model, db=db, max_new_tokens=6)
    run2 = workbench.record([5, 17, 101, 3, 9, 44], model=model, db=db, max_new_tokens=6)
    meta = json.loads(run2.refresh().info["detection"])
    line = an.what_was_tested(db, run2.run_id)
    assert meta["tests"] > 0 and meta["calibration_runs"] == len(res["runs"]) == 6
    loud = run2.anomalies().filter(pl.col("severity") != "info").height
    expect = f"{meta['tests']} tests against the baseline profile (6 calibration prompts)"
    assert line.startswith(expect), line
    # a greedy run's generated tokens: their surprise against its sampler, said so (no reference was given)
    assert meta["sampler_tests"] == 6, meta
    assert f"{expect}, 6 of them (the generated tokens' surprise) against the run's own sampler" in line, line
    assert "reference" not in line, line
    assert line.endswith("none significant at FDR 0.01") if loud == 0 else "at FDR 0.01" in line
    assert cli_main(["findings", run2.run_id, "--db", str(tmp_path / "w.duckdb")]) == 0
    assert expect in " ".join(capsys.readouterr().out.split())  # rich wraps lines


def test_residual_tests_name_the_block_that_changed_the_stream_not_the_ones_after():
    """Blocks each growing the stream by ~1.2x on tokens of very different scales: clean, nothing; layer 2
    scaled x3 (or removed, x1/3 of its usual growth) at every position: rows at layer 2 only, both ways."""
    rng = np.random.default_rng(11)
    growth = lambda n: np.log(1.2) + 0.03 * rng.standard_normal(n)  # noqa: E731
    base = an.Baseline(profile_frame([cell("log_resid_growth", rng.normal(3, 0.5, 4000) if layer == 0
                                           else growth(4000), layer=layer, bucket=b)
                                      for layer in range(4) for b in range(4)]))

    def frame(factor: float) -> pl.DataFrame:
        rows = []
        for p in range(40):
            norm = float(np.exp(rng.normal(3, 0.5)))  # the token's own scale: 7-55 (2 sd)
            for layer in range(4):
                norm *= 1.0 if layer == 0 else float(np.exp(growth(1)[0])) * (factor if layer == 2 else 1.0)
                rows.append({"pos": p, "layer": layer, "norm": norm})
        return pl.DataFrame(rows, schema_overrides={"pos": pl.Int32, "layer": pl.Int32})

    assert an.decide(an.resid_tests(frame(1.0), base)).height == 0
    for factor, side in ((3.0, "high"), (1 / 3, "low")):
        got = an.decide(an.resid_tests(frame(factor), base))
        assert set(got["layer"]) == {2} and got.height == 40, factor
        assert all(f"unusually {side}" in e for e in got["explanation"])
        f = fd.group_findings(got)
        assert f.select("component", "layer").rows() == [("mlp", 2)]
        assert ("drops" if side == "low" else "jumps") in f["explanation"][0]


def test_run_level_tests_catch_a_shift_no_single_position_shows():
    """A block that stops growing the stream (a skipped block: x1.0 where clean runs grow x1.2 +- 15% per
    position) and a head whose attention is sharper all run long (0.35 where clean runs average 0.55, positions
    spread +- 0.15): no position is out of range, the run-level means are, and findings name the layer and head."""
    rng = np.random.default_rng(12)
    sd_pos, n_pos = 0.15, 60
    run_growth = np.log(1.2) + sd_pos / np.sqrt(n_pos) * rng.standard_normal(300)  # per-run means of clean runs
    run_entropy = 0.55 + 0.02 * rng.standard_normal(300)
    base = an.Baseline(profile_frame(
        [cell("log_resid_growth", np.log(1.2) + sd_pos * rng.standard_normal(5000), layer=layer, bucket=b)
         for layer in range(1, 4) for b in range(4)]
        + [cell("run_log_resid_growth", run_growth, layer=layer, bucket=b) for layer in range(1, 4) for b in range(4)]
        + [cell("norm_entropy", np.clip(0.55 + 0.15 * rng.standard_normal(5000), 0, 1), layer=0, head=h, bucket=b)
           for h in range(2) for b in range(4)]
        + [cell("run_norm_entropy", run_entropy, layer=0, head=h, bucket=b) for h in range(2) for b in range(4)]))

    def resid(skip: bool) -> pl.DataFrame:
        rows = []
        for p in range(8, 8 + n_pos):
            norm = 10.0
            for layer in range(4):
                if layer:
                    g = 0.0 if (skip and layer == 2) else np.log(1.2)
                    norm *= float(np.exp(g + sd_pos * rng.standard_normal()))
                rows.append({"pos": p, "layer": layer, "norm": norm})
        return pl.DataFrame(rows, schema_overrides={"pos": pl.Int32, "layer": pl.Int32})

    def attention(level: float) -> pl.DataFrame:
        return attention_frame({(0, h): [0.0] * 8 + list(np.clip((level if h == 1 else 0.55)
                                                                  + 0.15 * rng.standard_normal(n_pos), 0, 1))
                                for h in range(2)}).filter(pl.col("pos") >= 8)

    empty_heads = pl.DataFrame(schema={"pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32, "norm": pl.Float64})
    clean = an.run_level_tests(attention(0.55), empty_heads, resid(False), base)
    assert an.decide(clean).height == 0
    broken_resid, broken_att = resid(True), attention(0.35)
    assert an.decide(an.resid_tests(broken_resid, base)).height == 0  # no position alone is out of range
    assert an.decide(an.entropy_tests(broken_att, base)).height == 0
    got = an.decide(an.run_level_tests(broken_att, empty_heads, broken_resid, base))
    assert set(got.select("kind", "layer", "head").rows()) == {("block_shift", 2, None), ("head_entropy_shift", 0, 1)}
    assert all("unusually low" in e for e in got["explanation"])
    f = {(r["component"], r["layer"], r["head"]): r["explanation"] for r in fd.group_findings(got).iter_rows(named=True)}
    assert "weaker than on clean runs" in f[("layer", 2, None)]
    assert "sharper than on clean runs" in f[("head", 0, 1)]


def test_a_stored_copy_of_an_older_bundled_profile_is_refreshed_and_a_users_own_is_kept(tmp_path):
    """A database that copied the demo's bundled profile before a release changed it (the older release's stamp, or a
    bundle's missing created_at) reads the bundled one now; a profile the user made with `workbench profile`, even
    from the same prompt file, and a bundle-stamped profile of another model are kept as they are."""
    from datetime import datetime

    from workbench.data.store import Store

    bundled = pl.read_parquet(pr.BUNDLED)
    sha = bundled["checkpoint_sha256"][0]
    (old_source, old_stamp), = pr.OLD_BUNDLES
    assert old_source != bundled["source"][0] and bundled["created_at"].null_count() == bundled.height
    store = Store(tmp_path / "w.duckdb")
    for stale in (bundled.with_columns(pl.lit(old_source).alias("source"), pl.col("n") * 0 + 1,
                                       pl.lit(datetime.fromisoformat(old_stamp)).alias("created_at")),
                  bundled.with_columns(pl.lit('{"prompts": "data/prompts/calibration.jsonl", "runs": 9}')
                                       .alias("source"), pl.col("n") * 0 + 1)):  # a bundle: no created_at
        store.replace_rows("profiles", {"checkpoint_sha256": sha}, stale)
        got = pr.load_profile(store, sha)
        assert got["source"][0] == bundled["source"][0] and got["n"].to_list() == bundled["n"].to_list()
    mine = pl.read_parquet(pr.BUNDLED).with_columns(  # the user's own, from the very prompt file bundles name
        pl.lit('{"prompts": "data/prompts/calibration.jsonl", "runs": 136, "max_new_tokens": 32}').alias("source"),
        pl.col("n") * 0 + 1, pl.lit(datetime(2026, 12, 3, 9, 0)).alias("created_at"))
    store.replace_rows("profiles", {"checkpoint_sha256": sha}, mine)
    assert set(pr.load_profile(store, sha)["n"].to_list()) == {1}
    other = bundled.with_columns(pl.lit("e" * 64).alias("checkpoint_sha256"), pl.lit(old_source).alias("source"))
    store.replace_rows("profiles", {"checkpoint_sha256": "e" * 64}, other)
    assert pr.load_profile(store, "e" * 64)["source"][0] == old_source


def test_a_profile_made_by_an_older_workbench_is_upgraded_or_not_used(tmp_path):
    """An old profile lacks the cells today's detectors read: the bundled demo's replaces it for the demo model;
    another model's is not used (its runs are judged as without a profile, with a warning), never half-read."""
    from workbench.data.store import Store

    bundled = pl.read_parquet(pr.BUNDLED)
    sha = bundled["checkpoint_sha256"][0]
    old = bundled.filter(~pl.col("signal").is_in(list(pr.CURRENT_SIGNALS)))
    store = Store(tmp_path / "w.duckdb")
    store.replace_rows("profiles", {"checkpoint_sha256": sha}, old)
    got = pr.load_profile(store, sha)
    assert got is not None and set(pr.CURRENT_SIGNALS) <= set(got["signal"].to_list())
    other = old.with_columns(pl.lit("f" * 64).alias("checkpoint_sha256"))
    store.replace_rows("profiles", {"checkpoint_sha256": "f" * 64}, other)
    with pytest.warns(UserWarning, match="older workbench"):
        assert pr.load_profile(store, "f" * 64) is None
    # a model that records no head outputs (JetMoE's attention experts have no per-head projection) has no head-norm
    # cells of either kind: its current profile is used (it was judged as without one: 10% of faults named)
    headless = bundled.filter(~pl.col("signal").str.contains("head_norm")).with_columns(
        pl.lit("d" * 64).alias("checkpoint_sha256"))
    store.replace_rows("profiles", {"checkpoint_sha256": "d" * 64}, headless)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pr.load_profile(store, "d" * 64)
    assert got is not None and "log_resid_growth" in set(got["signal"].to_list())


def test_component_outlier_rows_carry_their_component_and_old_databases_get_the_column(tmp_path):
    rows = an._rows([{"kind": "component_outlier", "severity": "warning", "layer": 2, "expert": 5, "score": 9.0,
                      "threshold": 8.7, "explanation": "layer 2 expert 5 differs (no kind in this text)",
                      "component": "expert"},
                     {"kind": "component_outlier", "severity": "warning", "layer": 3, "score": 9.0,
                      "threshold": 8.7, "explanation": "layer 3 the router ... (30 nats, router)"}])
    assert rows["component"].to_list() == ["expert", None]
    f = fd.group_findings(rows)
    by_layer = dict(zip(f["layer"].to_list(), f["component"].to_list()))
    assert by_layer == {2: "expert", 3: "router"}  # the column where set, else the explanation's last word
    db = tmp_path / "old.duckdb"
    store = workbench.Store(db)
    store.execute("ALTER TABLE anomalies DROP COLUMN component")  # a database made before the column existed
    store.close()
    old = tmp_path / "copy.duckdb"  # opened afresh (a store's connections are shared within a process, per path)
    old.write_bytes(db.read_bytes())
    store = workbench.Store(old)
    assert "component" in store.sql("SELECT * FROM anomalies LIMIT 0").columns
    store.close()


def test_a_run_without_token_rows_says_the_component_check_did_not_run(tmp_path, recwarn):
    """The component check runs the model on the run's token ids (its tokens rows): a run recorded without the
    tokens probe has none, and its detection says the check did not run instead of failing on an empty input."""
    from workbench.model import load_checkpoint
    model = load_checkpoint()  # the demo: it ships an activation profile
    db = workbench.Store(tmp_path / "w.duckdb")
    probes = tuple(p for p in workbench.PROBES if p != "tokens")
    bare = workbench.record("def f(x):\n", model=model, db=db, max_new_tokens=3, probes=probes)
    assert not [w for w in recwarn if "component check" in str(w.message)]
    meta = json.loads(bare.refresh().info["detection"])
    assert meta["component_check"].startswith("not run") and not meta.get("component_tests")
    line = an.what_was_tested(db, bare.run_id)
    assert "component check not run" in line and "no check for repetition loops" in line
    full = workbench.record("def f(x):\n", model=model, db=db, max_new_tokens=3)  # with tokens: judged
    meta = json.loads(full.refresh().info["detection"])
    assert meta["component_tests"] > 0 and "component_check" not in meta
    line = an.what_was_tested(db, full.run_id)
    assert "components against their activation profile" in line and "and a check for repetition loops" in line


def test_entropy_shift_judges_each_head_against_the_references_distribution():
    """``entropy_shift``: a run against a reference run's own distribution per head. Values the reference itself
    showed are never significant (the same run as its own reference gives no p below 1/the reference's length); a
    head that moved past everything the reference showed is."""
    rng = np.random.default_rng(3)
    heavy = {(0, 0): list(rng.standard_t(2, 200) * 0.05 + 0.5), (1, 1): list(rng.uniform(0.2, 0.9, 200))}
    ref = attention_frame(heavy)
    same = an.entropy_shift_tests(ref, ref)
    assert same.height == 400 and float(same["p"].min()) >= 1e-3  # the median/MAD z gave 1e-60 on such heads
    moved = attention_frame({(0, 0): [0.5] * 20, (1, 1): [0.99] * 20})
    got = an.entropy_shift_tests(moved, ref)
    p = {k: float(g["p"].max()) for (k,), g in got.group_by("head")}
    assert p[1] < 1e-8 and p[0] > 0.05
    assert an.entropy_shift_tests(moved, attention_frame({(0, 0): [0.5] * 3})).height == 0  # too few to judge


def test_a_reference_must_be_another_run_of_the_same_model_with_attention(tmp_path):
    db = workbench.Store(tmp_path / "w.duckdb")
    model = tiny_model()
    run = workbench.record([5, 17, 101, 3, 9, 44], model=model, db=db, max_new_tokens=6)
    other = workbench.record([7, 8, 9, 10], model=model, db=db, max_new_tokens=6)
    assert run.anomalies(recompute=True, reference=other).height >= 0  # accepted
    with pytest.raises(ValueError, match="no reference for itself"):
        run.anomalies(recompute=True, reference=run)
    bigger = workbench.record([5, 17, 101], model=tiny_model(n_layers=4), db=db, max_new_tokens=3)
    with pytest.raises(ValueError, match="of another model"):
        run.anomalies(recompute=True, reference=bigger)
    bare = workbench.record([7, 8, 9, 10], model=model, db=db, max_new_tokens=3, probes=("tokens", "routing"))
    with pytest.raises(ValueError, match="no attention rows"):
        run.anomalies(recompute=True, reference=bare.run_id)


def test_very_short_clean_runs_raise_no_run_level_or_load_alarms(tmp_path):
    """A run of 1-4 tokens: a mean over a handful of positions (the first ones attend to little) or an expert's load
    over a few tokens is no whole prompt's, so the run-level and load tests do not judge it, nor the component
    statistics a 2-token run (before: 1+1 and 2+2 token runs of clean prompts raised 1-5 critical head_norm_shift /
    overloaded_expert rows each, and a component_outlier warning at layer 1's input norm)."""
    from workbench.model import load_checkpoint, load_tokenizer
    model, tok = load_checkpoint(), load_tokenizer()
    db = workbench.Store(tmp_path / "w.duckdb")
    for name in ("01_fibonacci", "02_read_lines", "04_is_prime", "06_argparse"):
        ids = tok.encode((pr.BUNDLED.parents[1] / "prompts" / f"{name}.txt").read_text()).ids
        for k in (1, 2, 4):
            loud = workbench.record(ids[:k], model=model, db=db, max_new_tokens=k).anomalies().filter(
                (pl.col("severity") != "info") & pl.col("kind").is_in(
                    ["head_norm_shift", "head_entropy_shift", "block_shift", "overloaded_expert", "starved_expert",
                     "routing_collapse", "component_outlier"]))
            assert loud.height == 0, (name, k, loud["explanation"].to_list())


def test_a_load_unusual_at_many_layers_at_once_is_the_texts_kind_not_a_fault(tmp_path):
    """Text unlike the calibration's (numbers, another language) moves the expert load at most MoE layers at once; a
    broken router moves its own layer's. The distribution-level rows of such a run are info, with one routing_shift
    row saying why; a load unusual at one layer stays an alarm."""
    def rows(layers: list[int]) -> pl.DataFrame:
        return an._rows([{"kind": k, "severity": "critical", "layer": layer, "score": 9.0, "explanation": k}
                         for layer in layers for k in ("routing_collapse", "head_norm_shift")]
                        + [{"kind": "entropy_spike", "severity": "warning", "layer": 1, "pos": 4, "explanation": "e"}])
    one, shift = an.content_shift(rows([2]), 5)
    assert shift == [] and one.equals(rows([2]))
    many, shift = an.content_shift(rows([1, 2, 4, 5]), 5)
    assert shift == [1, 2, 4, 5]
    assert set(many.filter(pl.col("kind") != "entropy_spike")["severity"]) == {"info"}
    assert many.filter(pl.col("kind") == "entropy_spike")["severity"].to_list() == ["warning"]  # per position: kept
    assert an.content_shift(rows([1, 2]), 2)[1] == []  # fewer than three layers: never
    # a load moved a little at most layers (p <= SHIFT_P, uncorrected) counts with the flagged ones: the demo's
    # number sequences moved all 5 MoE layers' load (p 1e-3 - 2e-2) and were flagged at one
    def tested(ps: dict[int, float]) -> pl.DataFrame:
        return pl.DataFrame([{"kind": "routing_collapse", "layer": layer, "p": p} for layer, p in ps.items()])
    moved, shift = an.content_shift(rows([2]), 5, tested({1: 0.01, 2: 1e-7, 3: 0.015, 4: 0.3, 5: 0.002}))
    assert shift == [1, 2, 3, 5] and set(moved.filter(pl.col("kind") != "entropy_spike")["severity"]) == {"info"}
    assert an.content_shift(rows([2]), 5, tested({1: 0.01, 2: 1e-7, 3: 0.3, 4: 0.3, 5: 0.4}))[1] == []
    from workbench.model import load_checkpoint
    text = "3.14159 2.71828 1.41421 1.73205 0.57721 1.61803 2.50290 4.66920"
    run = workbench.record(text, model=load_checkpoint(), db=workbench.Store(tmp_path / "w.duckdb"), max_new_tokens=48)
    a = run.anomalies()
    loud = a.filter((pl.col("severity") != "info") & (pl.col("kind") != "repetition"))
    assert loud.height == 0, loud["explanation"].to_list()  # before: 21 warning/critical rows on the clean model
    note = a.filter(pl.col("kind") == "routing_shift")
    assert note.height == 1 and "text unlike the calibration's" in note["explanation"][0]
    assert json.loads(run.refresh().info["detection"])["routing_shift"]


def test_a_recompute_without_the_model_keeps_the_component_checks_rows(tmp_path):
    """The component check runs the model; a recompute from a stored run (a notebook, the app, `workbench anomalies
    --recompute`) has none loaded: the check's rows and count from the detection after the recording are kept (and
    said kept), instead of silently dropped with the findings they made."""
    from workbench.analysis import faults
    from workbench.model import load_checkpoint
    model = load_checkpoint()
    db = workbench.Store(tmp_path / "w.duckdb")
    with faults.KINDS["dead_shared"](model, 3, index=0):
        run = workbench.record("def fibonacci(n):\n    if n < 2:\n", model=model, db=db, max_new_tokens=16)
    comp = run.anomalies().filter(pl.col("kind") == "component_outlier")
    assert comp.height and (comp["layer"] == 3).any()
    again = workbench.open(db.path).run(run.run_id)
    assert again._adapter is None
    kept = again.anomalies(recompute=True).filter(pl.col("kind") == "component_outlier")
    assert kept.drop("anomaly_id").sort("explanation").equals(comp.drop("anomaly_id").sort("explanation"))
    assert ((again.findings()["component"] == "shared_expert") & (again.findings()["layer"] == 3)).any()
    line = an.what_was_tested(db, run.run_id)
    assert "components against their activation profile" in line and "kept from the detection" in line


def test_an_entropy_cell_whose_low_quantiles_tie_does_not_make_a_nearby_value_certain():
    """Prompts that begin alike tie a first-bucket cell's low quantiles (0.1%-5% all 0.625): its own tail is then
    a hundredth of a unit, and a clean 0.42 scored p = 1e-20. Past the profile's extremes an entropy's p falls by e per
    ``ENTROPY_TAIL`` at the least: 0.42 is unremarkable at a run's FDR, a collapse onto one key (0.0) still stands
    out, and inside the quantiles nothing changes."""
    q = np.concatenate([np.full(7, 0.625), np.linspace(0.63, 0.95, len(pr.PROBS) - 7)])
    base = an.Baseline(profile_frame([{"signal": "norm_entropy", "layer": 1, "head": 2, "bucket": 0, "n": 240,
                                       "mean": 0.7, "std": 0.1, "quantiles": list(q)}]))
    got = an.entropy_tests(attention_frame({(1, 2): [0.9, 0.8, 0.42, 0.0]}).with_columns(
        pl.Series("pos", [1, 2, 3, 4], pl.Int32)), base)
    p = dict(zip(got["pos"].to_list(), got["p"].to_list()))
    assert p[3] > 1e-5 and p[4] < 1e-7  # a run holds thousands of tests: BH at 1% needs p of about 1e-6
    assert p[1] > 0.05 and p[2] > 0.05


def test_loop_scan_periods_equal_trying_every_period_at_every_position():
    """``repetition._Periods`` (run lengths per period from numpy, once) gives at every position and end what trying
    the 32 periods one token at a time gives, and names as candidates every position where that finds a loop."""
    from workbench.analysis.repetition import _Periods

    def brute(ids, i, end, min_loop):
        best = None
        for p in range(1, 33):
            j = i
            while j < end and j - p >= 0 and ids[j] == ids[j - p]:
                j += 1
            if j - i >= max(2 * p, min_loop) and (best is None or j - i > best[1] + p):
                best = (p, j - i)
        return best

    rng = np.random.default_rng(4)
    for _ in range(30):
        ids = []
        while len(ids) < 150:
            ids += list(rng.integers(0, 30, rng.integers(1, 6))) * int(rng.integers(1, 9)) if rng.random() < 0.3 \
                else [int(rng.integers(0, 500))]
        per = _Periods(ids, 12)
        for end in (len(ids), len(ids) // 2):
            found = [i for i in range(1, end) if brute(ids, i, end, 12) is not None]
            assert all(per.loop_at(i, end, 12) == brute(ids, i, end, 12) for i in range(1, end))
            assert set(found) <= set(per.cand.tolist())


def _exact_sampler_p(probs: np.ndarray, chosen: int, temperature: float, top_p: float) -> float:
    """The sampler's p-value of ``chosen`` from the whole distribution (``model.generate.sample``'s arithmetic)."""
    q = probs ** (1 / temperature)
    q /= q.sum()
    order = np.argsort(-q)
    if top_p < 1:
        keep = np.cumsum(q[order]) - q[order] < top_p
        nucleus = np.zeros_like(q)
        nucleus[order[keep]] = q[order[keep]]
        if nucleus[chosen] == 0:
            return 0.0
        q = nucleus / nucleus.sum()
    return float(q[probs <= probs[chosen]].sum())


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 1.0), (1.0, 0.9), (0.8, 0.95)])
def test_sampler_p_is_never_below_the_exact_value_and_exact_at_temperature_one(temperature, top_p):
    """From the stored top-5 probabilities alone, a sampled token's p-value against its sampler is at least the exact
    one (computed from the whole distribution), equal to it at temperature 1 for a token in the top 5, and 0 for a
    token past the top-p nucleus."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        v = 50
        probs = rng.dirichlet(np.full(v, 0.3))
        chosen = int(rng.integers(v))
        top = np.sort(probs)[::-1][:5]
        got = an.sampler_p(np.array([probs[chosen]]), np.array([probs.max()]), [list(top)], temperature, top_p, v)[0]
        exact = _exact_sampler_p(probs, chosen, temperature, top_p)
        assert got >= exact - 1e-9
        if exact == 0.0:
            continue
        if temperature == 1.0 and top_p == 1.0 and probs[chosen] >= top[-1]:
            assert got == pytest.approx(exact, abs=1e-9)
    # a token the nucleus leaves out could not have been drawn
    probs = np.array([0.6, 0.3, 0.05, 0.03, 0.02])
    assert an.sampler_p(probs[[3]], probs[[0]], [list(probs)], 1.0, 0.8, 5)[0] == 0.0
    # greedy: the most probable token is what it must pick; any other cannot be
    assert list(an.sampler_p(np.array([0.6, 0.3]), np.array([0.6, 0.6]), [None, None], 0.0, 1.0, 5)) == [1.0, 0.0]


def test_sampled_tokens_are_judged_against_their_sampler_so_a_clean_sampled_run_raises_nothing():
    """At temperature 1 a token of probability 0.01 is drawn one time in a hundred: judged against the calibration's
    greedy tokens, the demo's clean prompts sampled at temperature 1 raised 300 high_surprise rows per 1,000 tokens.
    Against the sampler the p-values of sampled tokens are at least uniform: none at FDR 0.01 on 2,000 draws; a
    greedy run whose token is not the most probable one is critical; without the sampler's settings, the profile
    still judges."""
    rng = np.random.default_rng(3)
    v, n = 40, 2000
    probs = rng.dirichlet(np.full(v, 0.2), size=n)
    chosen = np.array([rng.choice(v, p=p) for p in probs])
    top = [list(np.sort(p)[::-1][:5]) for p in probs]
    pc = probs[np.arange(n), chosen]
    toks = pl.DataFrame({"pos": list(range(1, n + 1)), "is_prompt": [False] * n, "prob": pc,
                         "logprob": np.log(pc), "confidence": probs.max(1), "topk_probs": top},
                        schema_overrides={"pos": pl.Int32})
    base = an.Baseline(profile_frame([cell("confidence", rng.beta(8, 2, 5000), bucket=b) for b in range(5)]
                                     + [cell("surprise", rng.exponential(0.2, 5000), bucket=b) for b in range(5)]))
    sampler = an.Sampler(1.0, 1.0, v)
    judged = an.token_tests(toks, base, sampler=sampler).filter(pl.col("kind") == "high_surprise")
    assert an.decide(judged).height == 0
    assert set(judged["basis"]) == {"the sampler's own distribution (temperature 1)"}
    p = judged["p"].to_numpy()
    for a in (0.01, 0.05, 0.1, 0.5):  # never below uniform under the null (a discrete test: often above)
        assert float((p <= a).mean()) <= a + 0.02
    # the same tokens against the greedy calibration: hundreds of alarms
    assert an.decide(an.token_tests(toks, base).filter(pl.col("kind") == "high_surprise")).height > 100
    greedy = toks.with_columns(pl.col("confidence").alias("prob"))  # every token the argmax
    bad = greedy.with_columns(pl.when(pl.col("pos") == 9).then(pl.col("prob") / 2).otherwise(pl.col("prob"))
                              .alias("prob"))
    g = an.Sampler(0.0, 1.0, v)
    assert an.decide(an.token_tests(greedy, base, sampler=g)).filter(pl.col("kind") == "high_surprise").height == 0
    got = an.decide(an.token_tests(bad, base, sampler=g)).filter(pl.col("kind") == "high_surprise")
    assert got.select("pos", "severity").rows() == [(9, "critical")]
    assert "greedy decoding" in got["explanation"][0]


def test_a_sampled_run_knows_its_sampler_and_raises_no_surprise_rows(tmp_path):
    """The recorded settings reach the detectors: a demo run sampled at temperature 1.3 raises no high_surprise row,
    and a run whose params do not say how it sampled (an imported trace) is judged against the profile."""
    from workbench.model import load_checkpoint
    model = load_checkpoint()
    db = workbench.Store(tmp_path / "w.duckdb")
    run = workbench.record("def fibonacci(n):\n    ", model=model, db=db, max_new_tokens=48, temperature=1.3, seed=4)
    assert an.Sampler.of_run(query.run_row(db, run.run_id), 10) == an.Sampler(1.3, 1.0, 10)
    assert run.anomalies().filter(pl.col("kind") == "high_surprise").height == 0
    assert an.Sampler.of_run({"params": "{}"}, 10) is None and an.Sampler.of_run({"params": "[1]"}, 10) is None


def test_a_generation_loop_is_left_out_of_the_run_level_means():
    """Over a loop the heads attend across copies of the same keys (entropy up) however clean the model: the run-level
    means leave the loop's positions out (the loop is its own row), and judge the positions before it."""
    rng = np.random.default_rng(5)
    base = an.Baseline(profile_frame(
        [cell("norm_entropy", np.clip(0.5 + 0.1 * rng.standard_normal(5000), 0, 1), layer=0, head=0, bucket=b)
         for b in range(6)]
        + [cell("run_norm_entropy", 0.5 + 0.01 * rng.standard_normal(300), layer=0, head=0, bucket=b)
           for b in range(6)]))
    n = 96
    ids = list(rng.integers(100, 1000, 40)) + [7, 8, 9] * 20
    toks = pl.DataFrame({"pos": list(range(n)), "token_id": ids[:n], "text": [str(i) for i in ids[:n]],
                         "is_prompt": [i < 30 for i in range(n)]}, schema_overrides={"pos": pl.Int32})
    loop = sorted(an.covered_positions(toks))
    assert loop and loop[0] >= 38
    ent = [0.95 if p in set(loop) else 0.5 for p in range(n)]
    att = attention_frame({(0, 0): ent})
    empty_heads = pl.DataFrame(schema={"pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32, "norm": pl.Float64})
    empty_resid = pl.DataFrame(schema={"pos": pl.Int32, "layer": pl.Int32, "norm": pl.Float64})
    judged_all = an.decide(an.run_level_tests(att, empty_heads, empty_resid, base))
    assert "head_entropy_shift" in judged_all["kind"].to_list()  # the loop alone makes the means unusual
    assert an.decide(an.run_level_tests(att, empty_heads, empty_resid, base, exclude=set(loop))).height == 0
    sharp = att.with_columns(pl.when(pl.col("pos") < 38).then(0.2).otherwise(pl.col("norm_entropy"))
                             .alias("norm_entropy"))
    got = an.decide(an.run_level_tests(sharp, empty_heads, empty_resid, base, exclude=set(loop)))
    assert got.select("kind").to_series().to_list() and set(got["kind"]) == {"head_entropy_shift"}


def test_rows_the_runs_own_interventions_account_for_are_info_and_say_so(tmp_path):
    """Ablating a head or boosting an expert is what the user did, not a fault of the model: the demo with head 1 of
    layer 3 scaled to 0 raised 2,700 critical rows over 12 runs (its output norm at every position) before; now that
    head's rows are info and name the intervention. Without the intervention the same head is judged."""
    from workbench import interventions as iv
    from workbench.model import load_checkpoint
    model = load_checkpoint()
    db = workbench.Store(tmp_path / "w.duckdb")
    prompt = "def read_lines(path):\n    with open(path) as f:\n        "
    run = workbench.record(prompt, model=model, db=db, max_new_tokens=24, interventions=[iv.scale_head(3, 1, 0.0)])
    a = run.anomalies()
    mine = a.filter((pl.col("layer") == 3) & (pl.col("head") == 1))
    assert mine.height > 10 and set(mine["severity"]) == {"info"}
    assert all("the run's own intervention scale_head:L3H1=0 does this" in e for e in mine["explanation"])
    # the same rows without the declared intervention (the head's output norm 0 throughout): critical
    rows = an.declared(mine.with_columns(pl.lit("critical").alias("severity")), pl.DataFrame(
        {"kind": ["ban"], "layer": [3], "expert": [9], "head": [None], "path": [None], "spec": ["ban:L3E9"]},
        schema_overrides={"head": pl.Int64, "path": pl.Utf8}))
    assert set(rows["severity"]) == {"critical"}  # another intervention does not account for them
    scaled = an.declared(mine.with_columns(pl.lit("warning").alias("severity")), pl.DataFrame(
        {"kind": ["scale"], "layer": [None], "expert": [None], "head": [None], "path": ["layers.3.attn"],
         "spec": ["scale:layers.3.attn=0"]}, schema_overrides={"layer": pl.Int64, "expert": pl.Int64,
                                                                "head": pl.Int64}))
    assert set(scaled["severity"]) == {"info"}  # a module path inside layer 3
    # the component check runs the model without the interventions: its rows are the model's, never explained away
    comp = an.declared(an._rows([{"kind": "component_outlier", "severity": "critical", "layer": 3, "head": 1,
                                  "score": 90.0, "threshold": 20.0, "explanation": "layer 3 head 1 ...",
                                  "component": "head"},
                                 {"kind": "non_finite", "severity": "critical", "layer": 3, "head": 1, "score": 1.0,
                                  "threshold": 0.0, "explanation": "NaN"}]),
                       run.interventions().select("kind", "layer", "expert", "head", "path", "spec"))
    assert set(comp["severity"]) == {"critical"}


def test_a_cell_of_few_calibration_values_claims_no_tail_it_cannot_resolve():
    """From 40 calibration values the stored 0.1% / 99.9% quantiles are the sample's extremes: read as such, 1.2% of
    fresh draws from the very same distribution scored p <= 1e-6 (a user profiling a model on 40 prompts got
    run-level alarms on clean text). With the cell's n a value within the range has p >= 1 / (n + 1) and the tail
    beyond falls at the pace the top tenth shows: p-values near uniform. A cell of thousands of values is
    unchanged."""
    rng = np.random.default_rng(0)
    old, new = [], []
    for _ in range(200):
        q = np.quantile(rng.standard_normal(40), pr.PROBS)
        x = rng.standard_normal(500)
        cell = np.zeros(x.size, dtype=int)
        old.append(pr.CellTails.of(q[None]).p(x, cell))
        new.append(pr.CellTails.of(q[None], np.array([40])).p(x, cell))
    old, new = np.concatenate(old), np.concatenate(new)
    assert (old <= 1e-6).mean() > 0.005  # what the extremes claimed
    for a in (1e-2, 1e-3, 1e-4):
        assert (new <= a).mean() <= 2 * a
    assert (new <= 1e-6).mean() == 0.0
    q = np.quantile(rng.standard_normal(5000), pr.PROBS)
    x = np.linspace(-6, 6, 101)
    assert np.array_equal(pr.CellTails.of(q[None], np.array([5000])).p(x, np.zeros(101, dtype=int)), pr.tail_p(x, q))
    assert np.array_equal(pr.CellTails.of(q[None], np.array([5000])).p(x, np.zeros(101, dtype=int), upper=False),
                          pr.tail_p(x, q, upper=False))


def test_calibration_token_cells_count_tokens_and_each_runs_share_of_tokens_no_other_run_holds():
    """``token_count``: each token's count over the calibration runs; ``novel_share``: per run, the share of its tokens
    that no other run holds (leave one run out), by hand on three runs."""
    tok = pl.DataFrame({"run_id": ["a"] * 4 + ["b"] * 3 + ["c"] * 5,
                        "token_id": [1, 2, 2, 9, 1, 2, 3, 1, 4, 4, 5, 2]})
    counts, shares = pr.token_cells(tok)
    assert dict(zip(counts["bucket"], counts["n"])) == {1: 3, 2: 4, 3: 1, 4: 2, 5: 1, 9: 1}
    assert set(counts["signal"]) == {"token_count"} and counts["layer"].null_count() == counts.height
    by_run = dict(pr.novel_shares(tok).iter_rows())
    assert by_run == pytest.approx({"a": 1 / 4, "b": 1 / 3, "c": 3 / 5})  # a: 9; b: 3; c: 4, 4, 5
    assert shares["signal"][0] == "novel_share" and shares["n"][0] == 3
    assert shares["quantiles"][0][-1] == pytest.approx(np.quantile([1 / 4, 1 / 3, 3 / 5], pr.PROBS[-1]))
    # the prompt is judged, never the generation (a broken model's made-up tokens are a symptom): c's prompt is 1, 4
    gen = tok.with_columns(pl.Series("is_prompt", [True] * 7 + [True, True, False, False, False]))
    assert dict(pr.novel_shares(gen).iter_rows()) == pytest.approx({"a": 1 / 4, "b": 1 / 3, "c": 1 / 2})
    assert pr.token_cells(tok.filter(pl.col("run_id") == "a"))[0].height == 3  # one run: counts, no shares
    assert len(pr.token_cells(tok.filter(pl.col("run_id") == "a"))) == 1


def test_text_the_calibration_never_saw_has_its_distribution_level_tests_as_info():
    """A run whose tokens are mostly ones no calibration run held (another script, say) is text unlike the
    calibration's: its run-level and load rows are info, with one novel_input row saying why; per-position tests and
    NaNs are still judged; a run of seen tokens is judged as before; a profile without the cells judges as before."""
    seen = profile_frame([{"signal": "token_count", "bucket": t, "n": 5} for t in range(100)]
                         + [cell("novel_share", np.linspace(0.0, 0.1, 50))])
    base = an.Baseline(seen)
    nov = base.novelty(np.array(list(range(40)) + list(range(500, 510))))
    assert (nov["unseen"], nov["tokens"], nov["novel"]) == (10, 50, True)
    assert nov["limit"] == pytest.approx(0.1, rel=1e-2)
    assert not base.novelty(np.array(list(range(95)) + [500] * 5))["novel"]  # 5% unseen: within the calibration's
    assert not base.novelty(np.array([500] * 7 + [1]))["novel"]  # 7 unseen tokens: too few to say
    assert an.Baseline(profile_frame([cell("confidence", np.linspace(0, 1, 50), bucket=0)])).novelty(
        np.array([500] * 50)) is None
    rows = an._rows([{"kind": k, "severity": "critical", "layer": 1, "pos": p, "score": 9.0, "explanation": k}
                     for k, p in (("block_shift", None), ("overloaded_expert", None), ("entropy_spike", 4))])
    quiet = an.as_info(rows, pl.col("kind").is_in(list(an.SHIFTED)), an.NOVEL_NOTE)
    assert quiet["severity"].to_list() == ["info", "info", "critical"]
    assert quiet["explanation"][0] == f"block_shift ({an.NOVEL_NOTE})" and quiet["explanation"][2] == "entropy_spike"
    row = an.novel_input(nov)
    assert row["kind"][0] == "novel_input" and row["severity"][0] == "info"
    assert "10 of the prompt's 50 tokens (20%)" in row["explanation"][0]


def test_a_stored_bundle_copy_without_the_token_cells_is_refreshed_and_a_users_profile_without_them_kept(tmp_path):
    """The bundle gained ``token_count`` / ``novel_share`` cells under the same source: a database holding a copy made
    before (no created_at) reads the bundle now; a profile the user made without them is kept, and judges as before
    (no novelty: ``Baseline.novelty`` is None)."""
    from datetime import datetime

    from workbench.data.store import Store

    bundled = pl.read_parquet(pr.BUNDLED)
    sha = bundled["checkpoint_sha256"][0]
    assert {"token_count", "novel_share"} <= set(bundled["signal"])
    old = bundled.filter(~pl.col("signal").is_in(["token_count", "novel_share"]))
    store = Store(tmp_path / "w.duckdb")
    store.replace_rows("profiles", {"checkpoint_sha256": sha}, old)
    got = pr.load_profile(store, sha)
    assert got.height == bundled.height and an.Baseline(got).novelty(np.arange(100)) is not None
    fewer = bundled.filter(~((pl.col("signal") == "expert_share") & (pl.col("expert") == 0)))  # same signals
    store.replace_rows("profiles", {"checkpoint_sha256": sha}, fewer)
    assert pr.load_profile(store, sha).height == bundled.height
    mine = old.with_columns(pl.lit(datetime(2026, 12, 3, 9, 0)).alias("created_at"))
    store.replace_rows("profiles", {"checkpoint_sha256": sha}, mine)
    kept = pr.load_profile(store, sha)
    assert kept.height == old.height and an.Baseline(kept).novelty(np.arange(100)) is None


def test_another_scripts_text_on_the_demo_is_novel_input_not_a_fault(tmp_path):
    """Georgian and Thai prose (kinds of data/prompts/unusual_held_out.jsonl, written after the novel-input rule) raised
    5-7 warning/critical load and component rows per run on the clean demo model: most of their tokens occur in no
    calibration run. Now: info rows with one novel_input row saying why, the detection's JSON and what_was_tested say
    so; a code prompt of seen tokens is not novel. A NaN in such a run is still critical."""
    from workbench.analysis import faults
    from workbench.capture.prompts import load_prompts
    from workbench.model import load_checkpoint
    model = load_checkpoint()
    db = workbench.Store(tmp_path / "w.duckdb")
    held_out = pr.BUNDLED.parents[1] / "prompts" / "unusual_held_out.jsonl"
    items = {it["id"]: it["prompt"] for it in load_prompts(held_out)}
    for key in ("georgian:0", "thai:1"):
        run = workbench.record(items[key], model=model, db=db, max_new_tokens=24)
        a = run.anomalies()
        loud = a.filter((pl.col("severity") != "info") & (pl.col("kind") != "repetition"))
        assert loud.height == 0, (key, loud["explanation"].to_list())
        note = a.filter(pl.col("kind") == "novel_input")
        assert note.height == 1 and "never occur in the calibration runs" in note["explanation"][0]
        meta = json.loads(run.refresh().info["detection"])["novelty"]
        assert meta["novel"] and meta["share"] > meta["limit"] and meta["unseen"] >= 8
        assert "text unlike the calibration's" in an.what_was_tested(db, run.run_id)
    code = workbench.record("def fibonacci(n):\n    if n < 2:\n        return n\n", model=model, db=db,
                            max_new_tokens=24)
    assert not json.loads(code.refresh().info["detection"])["novelty"]["novel"]
    assert code.anomalies().filter(pl.col("kind") == "novel_input").height == 0
    with faults.inject_nan(model, 2, 30):
        bad = workbench.record(items["georgian:0"], model=model, db=db, max_new_tokens=4)
    assert bad.anomalies().filter((pl.col("kind") == "non_finite") & (pl.col("severity") == "critical")).height


def test_a_novel_share_cell_from_few_runs_is_not_used_and_its_limit_has_a_floor():
    """From fewer than 20 calibration runs one odd prompt would set the limit: no novelty then; near-duplicate
    calibration prompts give a limit of 0, floored at 5% (else any prompt with 8 new tokens would be novel)."""
    counts = [{"signal": "token_count", "bucket": t, "n": 5} for t in range(100)]
    few = an.Baseline(profile_frame(counts + [cell("novel_share", np.linspace(0.0, 0.1, 12))]))
    assert few.novelty(np.arange(200, 260)) is None
    dup = an.Baseline(profile_frame(counts + [cell("novel_share", np.zeros(40))]))
    assert dup.novelty(np.arange(200, 260))["limit"] == an.NOVEL_FLOOR
    assert not dup.novelty(np.array(list(range(96)) + [500] * 4))["novel"]  # 4% new tokens
    assert dup.novelty(np.array(list(range(90)) + [500] * 10))["novel"]


def _judge_by_groups(df: pl.DataFrame, value: str, keys: list[str], tail: str, min_positions: int):
    """The within-run judgment as a loop over groups (the earlier implementation): the reference for ``judge``."""
    p = np.ones(df.height)
    side = np.full(df.height, "low" if tail == "lower" else "high", dtype=object)
    df = df.with_row_index("_i")
    group = [k for k in keys if k != "bucket"]
    stats = df.group_by(group) if group else df.with_columns(pl.lit(0).alias("_g")).group_by("_g")
    for _, grp in stats:
        if grp.height < min_positions:
            continue
        v = grp[value].cast(pl.Float64).fill_null(float("nan")).to_numpy()
        med = np.median(v)
        mad = max(np.median(np.abs(v - med)) / 0.6745, 0.01 * (abs(med) + 1e-3), 1e-6)
        z = (v - med) / mad
        idx = grp["_i"].to_numpy()
        p[idx], side[idx] = an._pick(an._norm_sf(z), an._norm_sf(-z), tail)
    return p, side


@pytest.mark.parametrize("tail", ["upper", "lower", "two"])
def test_within_run_judge_equals_a_loop_over_groups(tail):
    """Without a profile each row is judged against its group's median and MAD, all groups in one pass: equal to
    a loop over the groups, with groups too small to judge, a NaN and a null in a group (NaN p-values there), an even
    group's median, and no group keys at all."""
    rng = np.random.default_rng(0)
    n = 600
    df = pl.DataFrame({"layer": rng.integers(0, 5, n).astype(np.int32), "head": rng.integers(0, 7, n).astype(np.int32),
                       "bucket": rng.integers(0, 3, n).astype(np.int32), "entropy": rng.gamma(2.0, 1.0, n)})
    df = pl.concat([df, pl.DataFrame({"layer": [9] * 5, "head": [0] * 5, "bucket": [0] * 5,
                                      "entropy": [1.0, 2.0, 3.0, 4.0, 5.0]}, schema=df.schema)])  # under min_positions
    vals = df["entropy"].to_list()
    vals[3], vals[10] = float("nan"), None
    df = df.with_columns(pl.Series("entropy", vals, pl.Float64))
    base = an.Baseline.of(None)
    for keys in (["layer", "head", "bucket"], ["layer"], ["bucket"]):
        got_p, got_side, basis = base.judge(df, "entropy", "entropy", keys, tail, min_positions=8)
        ref_p, ref_side = _judge_by_groups(df, "entropy", keys, tail, 8)
        np.testing.assert_allclose(got_p, ref_p, rtol=1e-12, equal_nan=True)
        assert list(got_side) == list(ref_side)
        assert np.isnan(got_p).any() and (keys == ["bucket"] or (got_p == 1.0).any())  # [bucket]: one group
        assert {b for b, q in zip(basis, got_p) if q != 1.0} <= {an.NO_PROFILE}
