"""Anomaly detectors: each fires on a constructed case and stays quiet on a clean one; NaN end to end."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

import workbench
from workbench.probes import attach
from workbench import anomalies as an
from workbench.cli import main as cli_main
from helpers import tiny_model


def tokens_frame(conf: list[float], rank: list[int] | None = None, logprob: list[float] | None = None,
                 n_prompt: int = 2) -> pl.DataFrame:
    n = len(conf)
    return pl.DataFrame({
        "pos": list(range(n)), "text": [f"t{i}" for i in range(n)], "is_prompt": [i < n_prompt for i in range(n)],
        "confidence": conf, "rank": rank or [1] * n, "logprob": logprob or [-0.1] * n,
        "prob": [0.9] * n, "entropy": [0.5] * n,
    })


def attention_frame(values: dict[tuple[int, int], list[float]]) -> pl.DataFrame:
    rows = [{"pos": p, "layer": l, "head": h, "entropy": v, "norm_entropy": v, "max_weight": 0.5, "sink_weight": 0.1}
            for (l, h), vals in values.items() for p, v in enumerate(vals)]
    return pl.DataFrame(rows)


def routing_frame(choices: list[list[int]], layer: int = 1, margin: float = 0.1) -> pl.DataFrame:
    rows = [{"pos": p, "layer": layer, "slot": s, "expert": e, "weight": 0.5, "score": 0.5, "margin": margin}
            for p, es in enumerate(choices) for s, e in enumerate(es)]
    return pl.DataFrame(rows)


def balanced(n_tokens: int = 32, n_experts: int = 8) -> list[list[int]]:
    return [[(2 * p) % n_experts, (2 * p + 1) % n_experts] for p in range(n_tokens)]


def test_low_confidence_fires_and_stays_quiet():
    t = tokens_frame([0.9, 0.8, 0.9, 0.1, 0.95, 0.15])
    got = an.low_confidence(t, 0.2)
    assert got["pos"].to_list() == [3, 5]
    assert set(got["severity"]) == {"warning"} and got["threshold"].to_list() == [0.2, 0.2]
    assert an.low_confidence(tokens_frame([0.9, 0.1, 0.9, 0.5]), 0.2).height == 0  # prompt token ignored
    assert an.low_confidence(tokens_frame([0.9, 0.1, 0.9, 0.5]), 0.2, include_prompt=True)["pos"].to_list() == [1]
    assert an.low_confidence(t, 0.12)["pos"].to_list() == [3]  # configurable


def test_high_surprise_fires_and_stays_quiet():
    t = tokens_frame([0.5] * 5, rank=[1, 1, 1, 40, 2], logprob=[-0.1, -0.1, -0.5, -3.0, -7.5])
    assert an.high_surprise(t, 10, -6.0)["pos"].to_list() == [3, 4]
    assert an.high_surprise(tokens_frame([0.5] * 5), 10, -6.0).height == 0


def test_entropy_spike_fires_on_one_position_and_stays_quiet():
    rng = np.random.default_rng(0)
    clean = {(0, h): list(0.5 + 0.01 * rng.standard_normal(30)) for h in range(2)}
    assert an.entropy_spikes(attention_frame(clean), z=5.0).height == 0
    spiked = {k: list(v) for k, v in clean.items()}
    spiked[(0, 1)][17] = 0.95
    got = an.entropy_spikes(attention_frame(spiked), z=5.0)
    assert got.select("pos", "layer", "head").rows() == [(17, 0, 1)]
    assert got["kind"][0] == "entropy_spike" and got["score"][0] > 5


def test_entropy_shift_against_reference():
    rng = np.random.default_rng(1)
    ref = attention_frame({(1, 0): list(0.3 + 0.01 * rng.standard_normal(30))})
    same = attention_frame({(1, 0): list(0.3 + 0.01 * rng.standard_normal(30))})
    shifted = attention_frame({(1, 0): list(0.8 + 0.01 * rng.standard_normal(30))})
    assert an.entropy_spikes(same, reference=ref).height == 0
    got = an.entropy_spikes(shifted, reference=ref)
    assert got.height == 30 and set(got["kind"]) == {"entropy_shift"}
    assert an.entropy_spikes(shifted).height == 0  # against itself the whole head is its normal


def test_diffuse_head_with_low_confidence_token():
    att = attention_frame({(0, 0): [0.2] * 6, (0, 1): [0.2, 0.3, 0.3, 0.95, 0.3, 0.3]})
    low = tokens_frame([0.9, 0.9, 0.9, 0.9, 0.1, 0.9])  # token at 4 comes from query row 3
    got = an.diffuse_heads(att, low, 0.2, 0.85)
    assert got.select("pos", "layer", "head").rows() == [(4, 0, 1)]
    assert an.diffuse_heads(att, tokens_frame([0.9] * 6), 0.2, 0.85).height == 0
    low_but_focused = tokens_frame([0.9, 0.9, 0.1, 0.9, 0.9, 0.9])
    assert an.diffuse_heads(att, low_but_focused, 0.2, 0.85).height == 0


def test_near_ties():
    r = routing_frame(balanced(8)).with_columns(
        pl.when(pl.col("pos") == 5).then(0.001).when(pl.col("pos") == 6).then(-0.3).otherwise(0.1).alias("margin"))
    got = an.near_ties(r, 0.005)
    assert got.select("pos", "layer").rows() == [(5, 1)]  # -0.3 is a group override, not a tie
    assert an.near_ties(routing_frame(balanced(8)), 0.005).height == 0
    # a small negative margin is a group override by a hair; the message says what happened, not "by -0.002"
    neg = an.near_ties(routing_frame(balanced(8), margin=-0.002), 0.005)
    assert neg.height == 8 and all("passed over an expert that scored 0.0020 higher" in e for e in neg["explanation"])
    assert "beat the best unchosen one by only 0.0010" in got["explanation"][0]


def test_dead_and_overloaded_experts_and_collapse():
    clean = routing_frame(balanced(32))
    for fn in (an.dead_experts, an.overloaded_experts, an.routing_collapse):
        assert fn(clean, 8).height == 0, fn.__name__
    dead = routing_frame([[(2 * p) % 6, (2 * p + 1) % 6] for p in range(32)])  # experts 6, 7 unused
    assert an.dead_experts(dead, 8).select("layer", "expert").rows() == [(1, 6), (1, 7)]
    hot = routing_frame([[3, (p % 7) + (p % 7 >= 3)] for p in range(32)])  # expert 3 in every token
    got = an.overloaded_experts(hot, 8, factor=3.0)
    assert got.select("layer", "expert").rows() == [(1, 3)] and got["score"][0] == pytest.approx(32 / 8)
    assert an.overloaded_experts(hot, 8, factor=4.0).height == 0  # load is exactly 4x the mean
    collapsed = routing_frame([[0, 1]] * 32)
    got = an.routing_collapse(collapsed, 8)
    assert got.height == 1 and got["layer"][0] == 1 and got["score"][0] == pytest.approx(np.log(2) / np.log(8))


def test_non_finite_is_critical_and_quiet_when_clean():
    att = attention_frame({(0, 0): [0.2] * 5, (1, 0): [0.2] * 5})
    assert an.non_finite({"attention": att, "tokens": tokens_frame([0.9] * 5)}).height == 0
    bad = att.with_columns(pl.when((pl.col("layer") == 1) & (pl.col("pos") >= 3)).then(float("nan"))
                           .otherwise(pl.col("entropy")).alias("entropy"))
    got = an.non_finite({"attention": bad})
    assert got.select("severity", "layer", "pos", "score").rows() == [("critical", 1, 3, 2.0)]
    inf = tokens_frame([0.9, 0.9, float("inf"), 0.9])
    assert an.non_finite({"tokens": inf}).select("pos", "layer").rows() == [(2, None)]


def test_unknown_threshold_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown anomaly thresholds"):
        an.detect_frames(tokens_frame([0.9]), attention_frame({}), routing_frame([]), 8, low_conf=0.3)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def test_detect_stores_and_reuses(tiny, tmp_path):
    run = workbench.record(list(range(5, 25)), model=tiny, max_new_tokens=4, db=tmp_path / "w.duckdb",
                           probes=("tokens", "attention", "routing"))
    first = run.anomalies()
    assert first.height > 0 and set(first["severity"]) <= {"info", "warning", "critical"}
    assert sorted(first["anomaly_id"].to_list()) == list(range(first.height))
    assert run.anomalies().equals(first)  # read back, not recomputed
    stored = run.store.sql("SELECT count(*) AS n FROM anomalies WHERE run_id = ?", [run.run_id])["n"][0]
    assert stored == first.height
    strict = run.anomalies(low_confidence=1.0)  # every generated token is below 100%
    n_gen = run.tokens().filter(~pl.col("is_prompt")).height
    assert strict.filter(pl.col("kind") == "low_confidence").height == n_gen
    rc = cli_main(["anomalies", run.run_id, "--json", "--db", str(tmp_path / "w.duckdb")])
    assert rc == 0


def test_nan_in_a_layer_is_detected_and_the_run_is_kept(tiny, tmp_path, capsys):
    def poison(x, **_):
        return torch.full_like(x, float("nan"))

    db = tmp_path / "w.duckdb"
    with attach(tiny, {"layers.0.hook_resid_post": poison}):
        run = workbench.record(list(range(5, 25)), model=tiny, max_new_tokens=5, db=db)
    assert run.status in ("complete", "failed")
    assert run.tokens().height == run.refresh().info["n_tokens"]
    a = run.anomalies()
    crit = a.filter((pl.col("kind") == "non_finite") & (pl.col("severity") == "critical"))
    assert crit.height >= 1
    assert "tokens" in " ".join(crit["explanation"].to_list())
    assert cli_main(["anomalies", run.run_id, "--json", "--db", str(db)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert any(r["kind"] == "non_finite" for r in out["anomalies"])
    assert cli_main(["anomalies", "nope", "--db", str(db)]) == 2
