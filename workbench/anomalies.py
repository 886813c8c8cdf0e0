"""Anomaly detectors: pure functions over a run's signal frames, results in the ``anomalies`` table.

Each detector takes polars frames (as ``Run.tokens()`` / ``attention()`` / ``routing()`` return them)
and thresholds, and returns a frame of anomaly rows (``kind, severity, pos, layer, head, expert,
score, threshold, explanation``); ``detect`` runs them all on a run, numbers the rows and stores them.

Detectors (kind: what fires it):
- ``low_confidence``: a generated token whose distribution's max prob is below 0.2 (seed default).
- ``high_surprise``: a generated token far down its distribution (rank > 10 or logprob < -6).
- ``entropy_spike``: attention entropy (normalised by log of visible keys) of a layer x head at a
  position, robust z-score over that head's positions in the run > 5 (median / MAD);
  ``entropy_shift``: the same against a reference run's median / MAD for that head.
- ``diffuse_head``: a head whose attention was diffuse (normalised entropy > 0.85) at the query
  position that produced a low-confidence token (the seeds' link between the two).
- ``routing_near_tie``: a token whose last chosen expert beat the best unchosen one by < 0.005.
- ``dead_expert`` / ``overloaded_expert``: an expert with no slots (when enough were expected), or
  with more than 4 x the mean load.
- ``routing_collapse``: a layer whose load is concentrated: normalised entropy of the load < 0.5
  or coefficient of variation of per-expert counts > 2.5.
- ``non_finite``: NaN or Inf in any recorded signal: critical, one row per signal and layer.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from . import query

SCHEMA = {"kind": pl.Utf8, "severity": pl.Utf8, "pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32,
          "expert": pl.Int32, "score": pl.Float64, "threshold": pl.Float64, "explanation": pl.Utf8}

DEFAULTS: dict[str, Any] = {
    "low_confidence": 0.2,         # max prob below this
    "surprise_rank": 10,           # produced token ranked worse than this
    "surprise_logprob": -6.0,      # or logprob below this (nats)
    "entropy_z": 5.0,              # robust z-score of normalised attention entropy
    "min_positions": 8,            # positions a head needs before its own run is a baseline
    "diffuse_entropy": 0.85,       # normalised entropy of a diffuse head
    "near_tie_margin": 0.005,      # selection-score margin of a near tie
    "overload_factor": 4.0,        # load over this x mean
    "min_expected_slots": 4.0,     # expected slots per expert needed to call one dead
    "collapse_entropy": 0.5,       # normalised entropy of the load below this
    "collapse_cv": 2.5,            # or coefficient of variation above this
    "include_prompt": False,       # token detectors also look at (teacher-forced) prompt tokens
}


def _rows(rows: list[dict]) -> pl.DataFrame:
    """A frame in the detectors' output schema (missing columns are null)."""
    cols = {c: [r.get(c) for r in rows] for c in SCHEMA}
    return pl.DataFrame(cols, schema=SCHEMA)


def empty() -> pl.DataFrame:
    return _rows([])


def _generated(tokens: pl.DataFrame, include_prompt: bool) -> pl.DataFrame:
    t = tokens.filter(pl.col("pos") > 0)
    return t if include_prompt else t.filter(~pl.col("is_prompt"))


def _finite(col: str) -> pl.Expr:
    return pl.col(col).is_not_null() & pl.col(col).is_finite()


# -- tokens ----------------------------------------------------------------------------------------
def low_confidence(tokens: pl.DataFrame, threshold: float = 0.2, include_prompt: bool = False) -> pl.DataFrame:
    """Tokens whose producing distribution had max prob (``confidence``) below ``threshold``."""
    t = _generated(tokens, include_prompt).filter(_finite("confidence") & (pl.col("confidence") < threshold))
    return _rows([{"kind": "low_confidence", "severity": "warning", "pos": r["pos"], "score": r["confidence"],
                   "threshold": threshold,
                   "explanation": f"token {r['text']!r} at {r['pos']}: the model's top choice had only "
                                  f"{r['confidence']:.1%} probability (threshold {threshold:.0%})"}
                  for r in t.iter_rows(named=True)])


def high_surprise(tokens: pl.DataFrame, max_rank: int = 10, min_logprob: float = -6.0,
                  include_prompt: bool = False) -> pl.DataFrame:
    """Tokens far down their distribution: rank worse than ``max_rank`` or logprob below ``min_logprob``."""
    t = _generated(tokens, include_prompt).filter(
        _finite("logprob") & ((pl.col("rank") > max_rank) | (pl.col("logprob") < min_logprob)))
    return _rows([{"kind": "high_surprise", "severity": "warning", "pos": r["pos"], "score": -r["logprob"],
                   "threshold": -min_logprob,
                   "explanation": f"token {r['text']!r} at {r['pos']} was rank {r['rank']} with logprob "
                                  f"{r['logprob']:.2f} (surprise {-r['logprob']:.2f} nats)"}
                  for r in t.iter_rows(named=True)])


# -- attention -------------------------------------------------------------------------------------
def _robust(values: pl.Expr, median: pl.Expr, mad: pl.Expr) -> pl.Expr:
    # 0.6745 makes the MAD a consistent estimate of sigma; the floor keeps a constant head from
    # turning float noise into infinite z-scores
    return 0.6745 * (values - median) / pl.max_horizontal(mad, pl.lit(0.01))


def head_baseline(attention: pl.DataFrame) -> pl.DataFrame:
    """Median and MAD of normalised entropy per layer x head (positions with > 1 visible key)."""
    a = attention.filter(_finite("norm_entropy"))
    med = a.group_by("layer", "head").agg(pl.col("norm_entropy").median().alias("median"),
                                          pl.len().alias("n"))
    a = a.join(med, on=["layer", "head"])
    mad = a.group_by("layer", "head").agg((pl.col("norm_entropy") - pl.col("median")).abs().median().alias("mad"))
    return med.join(mad, on=["layer", "head"])


def entropy_spikes(attention: pl.DataFrame, z: float = 5.0, min_positions: int = 8,
                   reference: pl.DataFrame | None = None) -> pl.DataFrame:
    """Positions where a head's normalised attention entropy jumps above its usual level.

    The usual level is the head's median / MAD over this run's positions, or over ``reference`` (an
    attention frame of another run, e.g. a known-good one) when given; kinds ``entropy_spike`` and
    ``entropy_shift`` respectively. Heads with fewer than ``min_positions`` baseline positions are skipped.
    """
    base = head_baseline(attention if reference is None else reference).filter(pl.col("n") >= min_positions)
    kind = "entropy_spike" if reference is None else "entropy_shift"
    a = attention.filter(_finite("norm_entropy")).join(base, on=["layer", "head"])
    a = a.with_columns(_robust(pl.col("norm_entropy"), pl.col("median"), pl.col("mad")).alias("z")) \
        .filter(pl.col("z") > z).sort("pos", "layer", "head")
    against = "this run" if reference is None else "the reference run"
    return _rows([{"kind": kind, "severity": "warning" if r["z"] > 2 * z else "info", "pos": r["pos"],
                   "layer": r["layer"], "head": r["head"], "score": r["z"], "threshold": z,
                   "explanation": f"layer {r['layer']} head {r['head']} at {r['pos']}: normalised attention "
                                  f"entropy {r['norm_entropy']:.2f} vs median {r['median']:.2f} in {against} "
                                  f"(robust z {r['z']:.1f})"}
                  for r in a.iter_rows(named=True)])


def diffuse_heads(attention: pl.DataFrame, tokens: pl.DataFrame, confidence: float = 0.2,
                  diffuse: float = 0.85, include_prompt: bool = False) -> pl.DataFrame:
    """Heads that were diffuse where a low-confidence token was produced.

    The token at ``pos`` comes from the distribution computed at query position ``pos - 1``, so the
    heads looked at are those of that query row; the anomaly is reported at ``pos`` (the token).
    """
    low = _generated(tokens, include_prompt).filter(_finite("confidence") & (pl.col("confidence") < confidence))
    if low.height == 0:
        return empty()
    q = low.select((pl.col("pos") - 1).alias("qpos"), pl.col("pos").alias("tok_pos"), "text", "confidence")
    a = attention.filter(_finite("norm_entropy") & (pl.col("norm_entropy") > diffuse)) \
        .join(q, left_on="pos", right_on="qpos").sort("tok_pos", "layer", "head")
    return _rows([{"kind": "diffuse_head", "severity": "warning", "pos": r["tok_pos"], "layer": r["layer"],
                   "head": r["head"], "score": r["norm_entropy"], "threshold": diffuse,
                   "explanation": f"layer {r['layer']} head {r['head']} spread its attention (normalised entropy "
                                  f"{r['norm_entropy']:.2f}) when the low-confidence token {r['text']!r} "
                                  f"({r['confidence']:.1%}) at {r['tok_pos']} was produced"}
                  for r in a.iter_rows(named=True)])


# -- routing ---------------------------------------------------------------------------------------
def near_ties(routing: pl.DataFrame, margin: float = 0.005) -> pl.DataFrame:
    """Tokens whose expert choice was a near tie: |last chosen - best unchosen selection score| < margin.

    A negative margin larger than that means group-limited routing overrode a better expert: not a tie.
    """
    r = routing.filter(pl.col("slot") == 0).filter(_finite("margin") & (pl.col("margin").abs() < margin)) \
        .sort("pos", "layer")
    def say(x: dict) -> str:
        where = f"layer {x['layer']} at {x['pos']}"
        if x["margin"] >= 0:
            return f"{where}: the router's last chosen expert beat the best unchosen one by only {x['margin']:.4f}"
        return (f"{where}: the router passed over an expert that scored {-x['margin']:.4f} higher than its last "
                "chosen one (group-limited routing)")
    return _rows([{"kind": "routing_near_tie", "severity": "info", "pos": x["pos"], "layer": x["layer"],
                   "score": x["margin"], "threshold": margin, "explanation": say(x)}
                  for x in r.iter_rows(named=True)])


def expert_counts(routing: pl.DataFrame, n_experts: int) -> pl.DataFrame:
    """Slots per expert per MoE layer, zeros included (layer, expert, slots)."""
    if routing.height == 0:
        return pl.DataFrame(schema={"layer": pl.Int32, "expert": pl.Int32, "slots": pl.UInt32})
    got = routing.group_by("layer", "expert").agg(pl.len().alias("slots"))
    grid = pl.DataFrame({"layer": routing["layer"].unique().sort()}).join(
        pl.DataFrame({"expert": np.arange(n_experts, dtype=np.int32)}), how="cross")
    return grid.join(got.with_columns(pl.col("layer").cast(pl.Int32), pl.col("expert").cast(pl.Int32)),
                     on=["layer", "expert"], how="left") \
        .with_columns(pl.col("slots").fill_null(0).cast(pl.UInt32)).sort("layer", "expert")


def dead_experts(routing: pl.DataFrame, n_experts: int, min_expected: float = 4.0) -> pl.DataFrame:
    """Experts never chosen in a layer, where at least ``min_expected`` slots each were expected."""
    c = expert_counts(routing, n_experts)
    out = []
    for (layer,), g in c.group_by("layer", maintain_order=True):
        expected = g["slots"].sum() / n_experts
        if expected < min_expected:
            continue
        for e in g.filter(pl.col("slots") == 0)["expert"]:
            out.append({"kind": "dead_expert", "severity": "warning", "layer": layer, "expert": e, "score": 0.0,
                        "threshold": expected,
                        "explanation": f"layer {layer} expert {e} got no tokens (about {expected:.1f} slots "
                                       f"each expected)"})
    return _rows(out)


def overloaded_experts(routing: pl.DataFrame, n_experts: int, factor: float = 4.0,
                       min_expected: float = 1.0) -> pl.DataFrame:
    """Experts whose slot count is over ``factor`` x the layer's mean (score: load / mean).

    Layers with fewer than ``min_expected`` slots per expert on average are skipped.
    """
    c = expert_counts(routing, n_experts)
    out = []
    for (layer,), g in c.group_by("layer", maintain_order=True):
        mean = g["slots"].sum() / n_experts
        if mean < min_expected:  # too few slots per expert for "over k x mean" to mean anything
            continue
        for r in g.filter(pl.col("slots") > factor * mean).iter_rows(named=True):
            out.append({"kind": "overloaded_expert", "severity": "warning", "layer": layer, "expert": r["expert"],
                        "score": r["slots"] / mean, "threshold": factor,
                        "explanation": f"layer {layer} expert {r['expert']} took {r['slots']} slots, "
                                       f"{r['slots'] / mean:.1f}x the mean of {mean:.1f}"})
    return _rows(out)


def routing_collapse(routing: pl.DataFrame, n_experts: int, min_entropy: float = 0.5,
                     max_cv: float = 2.5, min_expected: float = 1.0) -> pl.DataFrame:
    """Layers whose routing concentrates on few experts: low normalised load entropy or high load CV."""
    c = expert_counts(routing, n_experts)
    out = []
    for (layer,), g in c.group_by("layer", maintain_order=True):
        counts = g["slots"].to_numpy().astype(np.float64)
        total = counts.sum()
        if total / n_experts < min_expected or n_experts < 2:
            continue
        p = counts / total
        ent = float(-(p[p > 0] * np.log(p[p > 0])).sum() / math.log(n_experts))
        cv = float(counts.std() / counts.mean())
        if ent < min_entropy or cv > max_cv:
            out.append({"kind": "routing_collapse", "severity": "critical" if ent < min_entropy / 2 else "warning",
                        "layer": layer, "score": ent, "threshold": min_entropy,
                        "explanation": f"layer {layer}: routing concentrated on few experts (load entropy "
                                       f"{ent:.2f} of max 1, coefficient of variation {cv:.2f})"})
    return _rows(out)


# -- non-finite ------------------------------------------------------------------------------------
def non_finite(frames: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """NaN / Inf in any float column of any signal frame: one critical row per table x layer.

    ``pos`` is the first affected position, ``score`` the number of non-finite values.
    """
    out = []
    for table, df in frames.items():
        if df is None or df.height == 0:
            continue
        cols = [c for c, t in df.schema.items() if t in (pl.Float32, pl.Float64) and c != "threshold"]
        if not cols:
            continue
        bad = pl.sum_horizontal([(pl.col(c).is_nan() | pl.col(c).is_infinite()).fill_null(False).cast(pl.Int64)
                                 for c in cols]).alias("_bad")
        d = df.with_columns(bad).filter(pl.col("_bad") > 0)
        if d.height == 0:
            continue
        keys = ["layer"] if "layer" in d.columns else []
        order = "pos" if "pos" in d.columns else ("step" if "step" in d.columns else None)
        groups = d.group_by(keys, maintain_order=True) if keys else [((None,), d)]
        for key, g in groups:
            layer = key[0] if keys else None
            which = [c for c in cols if g.select((pl.col(c).is_nan() | pl.col(c).is_infinite()).any()).item()]
            first = int(g[order].min()) if order else None
            where = f"{table}" + (f" layer {layer}" if layer is not None else "")
            unit = "position" if order == "pos" else "step"
            out.append({"kind": "non_finite", "severity": "critical", "pos": first if order == "pos" else None,
                        "layer": layer, "score": float(g["_bad"].sum()), "threshold": 0.0,
                        "explanation": f"{int(g['_bad'].sum())} NaN/Inf values in {where} ({', '.join(which)}), "
                                       f"first at {unit} {first}"})
    return _rows(out)


# -- all together ----------------------------------------------------------------------------------
def detect_frames(tokens: pl.DataFrame, attention: pl.DataFrame, routing: pl.DataFrame, n_experts: int,
                  kv: pl.DataFrame | None = None, reference_attention: pl.DataFrame | None = None,
                  **thresholds) -> pl.DataFrame:
    """Run every detector on a run's frames; returns rows sorted by severity then position (no ids)."""
    unknown = set(thresholds) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown anomaly thresholds {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    th = {**DEFAULTS, **thresholds}
    if not 0 < th["low_confidence"] <= 1:
        raise ValueError(f"low_confidence threshold must be in (0, 1], got {th['low_confidence']}")
    ip = bool(th["include_prompt"])
    parts = [
        non_finite({"tokens": tokens, "attention": attention, "routing": routing, "kv": kv}),
        low_confidence(tokens, th["low_confidence"], ip),
        high_surprise(tokens, th["surprise_rank"], th["surprise_logprob"], ip),
        entropy_spikes(attention, th["entropy_z"], th["min_positions"]),
        diffuse_heads(attention, tokens, th["low_confidence"], th["diffuse_entropy"], ip),
    ]
    if reference_attention is not None:
        parts.append(entropy_spikes(attention, th["entropy_z"], th["min_positions"], reference=reference_attention))
    if routing.height and n_experts:
        parts += [near_ties(routing, th["near_tie_margin"]),
                  dead_experts(routing, n_experts, th["min_expected_slots"]),
                  overloaded_experts(routing, n_experts, th["overload_factor"]),
                  routing_collapse(routing, n_experts, th["collapse_entropy"], th["collapse_cv"])]
    out = pl.concat(parts)
    sev = pl.col("severity").replace_strict({"critical": 0, "warning": 1, "info": 2}, return_dtype=pl.Int32)
    return out.sort(sev, pl.col("pos"), pl.col("layer"), pl.col("head"), pl.col("expert"), nulls_last=False)


def detect(store, run_id: str, recompute: bool = False, reference: str | None = None, **thresholds) -> pl.DataFrame:
    """Anomalies of run ``run_id``: the stored ones, or computed from its signals, stored, and returned.

    Computed (and stored, replacing the old rows) when ``recompute`` is set, when thresholds or a
    ``reference`` run id (in the same database) are given, or when none are stored. Expert counts come
    from the run's neutral model summary, never from family-specific config keys.

    Returns: the ``anomalies`` rows of the run (without ``run_id``), most severe first.
    """
    if not (recompute or thresholds or reference is not None):
        have = query.anomalies(store, run_id)
        if have.height:
            return have
    summary = query.run_summary(store, run_id)
    ref_att = query.attention(store, query.run_row(store, str(reference))["run_id"]) if reference is not None else None
    n_experts = summary.n_routed_experts if summary.moe_layers else 0
    df = detect_frames(query.tokens(store, run_id), query.attention(store, run_id), query.routing(store, run_id),
                       n_experts, kv=query.kv(store, run_id), reference_attention=ref_att, **thresholds)
    df = df.with_columns(pl.lit(run_id).alias("run_id"),
                         pl.arange(0, df.height, dtype=pl.Int32).alias("anomaly_id"))
    store.replace("anomalies", run_id, df)
    return query.anomalies(store, run_id)
