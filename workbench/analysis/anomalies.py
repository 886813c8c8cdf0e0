"""Anomaly detectors, calibrated: every test a run makes gets a tail probability, and the run's tests are
corrected together, so a clean run raises (almost) nothing and what is raised means something.

Each detector is a pure function of a run's frames (as ``Run.tokens()`` etc. return them) and a
``Baseline`` (the model's profile, workbench/baseline.py, or none); it returns one row per test with its
p-value. ``detect_frames`` pools all tests of the run and applies the Benjamini-Hochberg procedure
(``scipy.stats.false_discovery_control``) at level ``alpha`` (default 0.01): the expected share of false
alarms among the alarms is at most alpha, and on a run where nothing is wrong (every null true) the
chance of any false alarm at all is at most alpha, however many positions, layers, heads and experts it
has. Rows whose BH-adjusted q-value is <= alpha are warnings, <= ``critical_q`` critical.

What each test asks (upper tail unless said), against the profile cell, else (no profile, or a cell the
calibration never saw) against this run's own robust statistics (median / MAD, normal tail), which every
explanation then says:

- ``low_confidence`` (lower tail) / ``high_surprise``: a generated token's max probability / -logprob,
  by position bucket;
- ``entropy_spike``: normalised attention entropy of a layer x head at a position, by context bucket;
  ``entropy_shift``: the same against a reference run's median / MAD for that head;
- ``resid_norm_outlier``: the residual stream's norm after a block (a broken head or expert blows it up);
- ``head_norm_outlier``: an attention head's output norm (names a broken head);
- ``kv_norm_outlier``: a cached token's KV norm at the last step (cache corruption);
- ``overloaded_expert`` / ``dead_expert``: the tokens routed to an expert, against the profile's share
  (uniform without one), as binomial tests widened by the layer's calibrated overdispersion (tokens of one
  prompt route alike); ``routing_collapse``: a G-test of the layer's whole load against the profile shares,
  scaled by the same dispersion. A layer with few tokens simply cannot reach significance: the test
  accounts for the number of slots the run had.
- ``non_finite``: NaN or Inf in a recorded signal: always critical (no test needed).

Informational rows (severity ``info``, outside the correction): ``routing_near_tie`` (a margin in the
profile's lowest 0.1%) and ``diffuse_head`` (a head in its profile's top 1% where a flagged low-confidence
token was produced: evidence for that token, not an alarm of its own).

``score`` is -log10(q) (raw p for info rows), ``threshold`` -log10(alpha); the explanation gives the value,
what it was judged against and q.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
from scipy.stats import binom, chi2, false_discovery_control, norm

from workbench.analysis.baseline import bucket_of, load_profile, tail_p
from workbench.data import query
from workbench.data.schema import columns

SCHEMA = {"kind": pl.Utf8, "severity": pl.Utf8, "pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32,
          "expert": pl.Int32, "score": pl.Float64, "threshold": pl.Float64, "explanation": pl.Utf8}
TESTS = {"kind": pl.Utf8, "pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32, "expert": pl.Int32,
         "value": pl.Float64, "p": pl.Float64, "basis": pl.Utf8}

DEFAULTS: dict[str, Any] = {
    "alpha": 0.01,            # Benjamini-Hochberg level over all of a run's tests
    "critical_q": 1e-6,       # adjusted q at or below this: critical
    "min_positions": 8,       # values a within-run baseline needs
    "include_prompt": False,  # token tests also look at (teacher-forced) prompt tokens
    "info_p": 1e-3,           # raw p of an informational row (near ties, diffuse heads)
}
NO_PROFILE = "this run's own statistics (no baseline profile for this model: `workbench profile`)"
WORDS = {
    "low_confidence": "confidence {v:.3f} of the token at {pos}",
    "high_surprise": "surprise {v:.2f} nats of the token at {pos}",
    "entropy_spike": "layer {layer} head {head} at {pos}: normalised attention entropy {v:.3f}",
    "entropy_shift": "layer {layer} head {head} at {pos}: normalised attention entropy {v:.3f}",
    "resid_norm_outlier": "layer {layer} at {pos}: residual-stream norm {v:.3g} after the block",
    "kv_norm_outlier": "layer {layer}: cached KV norm {v:.3g} of the token at {pos}",
    "head_norm_outlier": "layer {layer} head {head} at {pos}: output norm {v:.3g}",
    "overloaded_expert": "layer {layer} expert {expert}: chosen by {v:.0f} tokens",
    "dead_expert": "layer {layer} expert {expert}: chosen by no token",
    "routing_collapse": "layer {layer}: expert load concentrated (G = {v:.1f})",
}


SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def select(df: pl.DataFrame, kinds: list[str] | None = None, severity: str | None = None,
           layers: list[int] | None = None) -> pl.DataFrame:
    """Anomaly rows filtered by kind, by at least a severity, and by layer (the CLI's and the UI's filters)."""
    if kinds:
        df = df.filter(pl.col("kind").is_in(kinds))
    if severity:
        if severity not in SEVERITY_ORDER:
            raise ValueError(f"severity must be one of {list(SEVERITY_ORDER)}, got {severity!r}")
        df = df.filter(pl.col("severity").replace_strict(SEVERITY_ORDER, return_dtype=pl.Int32)
                       <= SEVERITY_ORDER[severity])
    if layers:
        df = df.filter(pl.col("layer").is_in(layers))
    return df


def _rows(rows: list[dict]) -> pl.DataFrame:
    """A frame in the detectors' output schema (missing columns are null)."""
    return pl.DataFrame({c: [r.get(c) for r in rows] for c in SCHEMA}, schema=SCHEMA)


def empty() -> pl.DataFrame:
    return _rows([])


def _tests(**cols) -> pl.DataFrame:
    n = max((len(v) for v in cols.values() if isinstance(v, (list, np.ndarray, pl.Series))), default=0)
    data = {c: (cols[c] if isinstance(cols.get(c), (list, np.ndarray, pl.Series)) else [cols.get(c)] * n)
            for c in TESTS}
    return pl.DataFrame(data, schema=TESTS)


def _finite(col: str) -> pl.Expr:
    return pl.col(col).is_not_null() & pl.col(col).is_finite()


def _generated(tokens: pl.DataFrame, include_prompt: bool) -> pl.DataFrame:
    t = tokens.filter(pl.col("pos") > 0)
    return t if include_prompt else t.filter(~pl.col("is_prompt"))


# -- the baseline ----------------------------------------------------------------------------------
@dataclass
class Baseline:
    """A model's profile (or None) and the helpers the detectors use to judge values against it."""

    profile: pl.DataFrame | None = None

    @property
    def has_profile(self) -> bool:
        return self.profile is not None and self.profile.height > 0

    def cells(self, signal: str) -> pl.DataFrame:
        if not self.has_profile:
            return pl.DataFrame()
        return self.profile.filter((pl.col("signal") == signal) & (pl.col("n") >= 20))

    def judge(self, df: pl.DataFrame, signal: str, value: str, keys: list[str], upper: bool,
              min_positions: int) -> tuple[np.ndarray, list[str]]:
        """p-values of ``df[value]`` per row against the profile cell of ``keys`` (``bucket`` computed by the
        caller), else against the run's own robust statistics grouped by the non-bucket keys."""
        p = np.ones(df.height)
        basis = np.full(df.height, "none", dtype=object)
        if df.height == 0:
            return p, list(basis)
        df = df.with_row_index("_i")
        cells = self.cells(signal)
        covered = pl.DataFrame()
        if cells.height:
            j = df.join(cells.select(*keys, "quantiles"), on=keys, how="inner")
            if j.height:  # every row against its own cell's quantiles, in one vectorised call
                q = j["quantiles"].explode().to_numpy().astype(np.float64).reshape(j.height, -1)
                p[j["_i"].to_numpy()] = tail_p(j[value].to_numpy(), q, upper=upper)
            basis[j["_i"].to_numpy()] = "the baseline profile"
            covered = j.select("_i")
        rest = df if covered.height == 0 else df.join(covered, on="_i", how="anti")
        if rest.height:
            group = [k for k in keys if k != "bucket"]
            stats = (rest.group_by(group) if group else rest.with_columns(pl.lit(0).alias("_g")).group_by("_g"))
            for _, grp in stats:
                if grp.height < min_positions:
                    continue
                v = grp[value].to_numpy()
                med = np.median(v)
                mad = max(np.median(np.abs(v - med)) / 0.6745, 0.01 * (abs(med) + 1e-3), 1e-6)
                z = (v - med) / mad if upper else (med - v) / mad
                idx = grp["_i"].to_numpy()
                p[idx] = _norm_sf(z)
                basis[idx] = NO_PROFILE if not self.has_profile else "this run's own statistics (a cell the profile lacks)"
        return p, list(basis)

    def shares(self, layer: int, n_experts: int) -> tuple[np.ndarray, float, bool]:
        """(expected share per expert, overdispersion, from a profile?) for one MoE layer."""
        s = self.cells("expert_share").filter(pl.col("layer") == layer) if self.has_profile else pl.DataFrame()
        if s.height == 0:
            return np.full(n_experts, 1.0 / n_experts), 1.0, False
        share = np.full(n_experts, 0.5 / max(int(s["n"][0]), 1))  # never seen in calibration: half a slot
        share[s["expert"].to_numpy()] = s["mean"].to_numpy()
        share /= share.sum()
        d = self.profile.filter((pl.col("signal") == "load_dispersion") & (pl.col("layer") == layer))
        return share, max(float(d["mean"][0]), 1.0) if d.height else 1.0, True


def _norm_sf(z: np.ndarray) -> np.ndarray:
    return np.clip(norm.sf(z), 1e-300, 1.0)


# -- detectors: one row per test -------------------------------------------------------------------
def token_tests(tokens: pl.DataFrame, base: Baseline, include_prompt: bool = False,
                min_positions: int = 8) -> pl.DataFrame:
    """``low_confidence`` and ``high_surprise`` tests of every generated token."""
    t = _generated(tokens, include_prompt).filter(_finite("confidence") & _finite("logprob")) \
        .with_columns(bucket_of(pl.col("pos")).alias("bucket"), (-pl.col("logprob")).alias("surprise"))
    out = []
    for kind, signal, col, upper in (("low_confidence", "confidence", "confidence", False),
                                     ("high_surprise", "surprise", "surprise", True)):
        p, basis = base.judge(t, signal, col, ["bucket"], upper, min_positions)
        out.append(_tests(kind=kind, pos=t["pos"], value=t[col], p=p, basis=basis))
    return pl.concat(out)


def entropy_tests(attention: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """``entropy_spike``: every (position, layer, head) with a visible-keys-normalised entropy."""
    a = attention.filter(_finite("norm_entropy")).with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
    p, basis = base.judge(a, "norm_entropy", "norm_entropy", ["layer", "head", "bucket"], True, min_positions)
    return _tests(kind="entropy_spike", pos=a["pos"], layer=a["layer"], head=a["head"], value=a["norm_entropy"],
                  p=p, basis=basis)


def entropy_shift_tests(attention: pl.DataFrame, reference: pl.DataFrame, min_positions: int = 8) -> pl.DataFrame:
    """``entropy_shift``: normalised entropy against a reference run's median / MAD of the same head."""
    ref = reference.filter(_finite("norm_entropy")).group_by("layer", "head").agg(
        pl.col("norm_entropy").median().alias("med"), pl.len().alias("n"),
        pl.col("norm_entropy").alias("vals")).filter(pl.col("n") >= min_positions)
    ref = ref.with_columns(pl.struct("vals", "med").map_elements(
        lambda s: float(np.median(np.abs(np.asarray(s["vals"]) - s["med"]))), return_dtype=pl.Float64).alias("mad"))
    a = attention.filter(_finite("norm_entropy")).join(ref.select("layer", "head", "med", "mad"), on=["layer", "head"])
    z = (a["norm_entropy"].to_numpy() - a["med"].to_numpy()) / np.maximum(a["mad"].to_numpy() / 0.6745, 0.01)
    return _tests(kind="entropy_shift", pos=a["pos"], layer=a["layer"], head=a["head"], value=a["norm_entropy"],
                  p=_norm_sf(z), basis="the reference run")


def resid_tests(resid: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """``resid_norm_outlier``: the residual norm after every block at every position."""
    r = resid.filter(_finite("norm")).with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
    p, basis = base.judge(r, "resid_norm", "norm", ["layer", "bucket"], True, min_positions)
    return _tests(kind="resid_norm_outlier", pos=r["pos"], layer=r["layer"], value=r["norm"], p=p, basis=basis)


def head_norm_tests(head_norm: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """``head_norm_outlier``: each head's output norm at every position (a broken head's output blows up)."""
    h = head_norm.filter(_finite("norm"))
    p, basis = base.judge(h, "head_norm", "norm", ["layer", "head"], True, min_positions)
    return _tests(kind="head_norm_outlier", pos=h["pos"], layer=h["layer"], head=h["head"], value=h["norm"], p=p,
                  basis=basis)


def kv_tests(kv_tokens: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """``kv_norm_outlier``: each cached token's KV norm at the run's last recorded step."""
    if kv_tokens.height == 0:
        return _tests()
    k = kv_tokens.filter((pl.col("step") == pl.col("step").max()) & _finite("latent_norm"))
    p, basis = base.judge(k, "latent_norm", "latent_norm", ["layer"], True, min_positions)
    return _tests(kind="kv_norm_outlier", pos=k["pos"], layer=k["layer"], value=k["latent_norm"], p=p, basis=basis)


def expert_tests(routing: pl.DataFrame, n_experts: int, base: Baseline) -> pl.DataFrame:
    """``overloaded_expert`` / ``dead_expert`` per (layer, expert) and ``routing_collapse`` per layer."""

    if routing.height == 0 or n_experts < 2:
        return _tests()
    rows: list[dict] = []
    for (layer,), g in routing.group_by("layer", maintain_order=True):
        n_tok = g["pos"].n_unique()
        k_slots = g.height // max(n_tok, 1)
        chosen = np.bincount(g.unique(["pos", "expert"])["expert"].to_numpy(), minlength=n_experts)[:n_experts]
        slots = np.bincount(g["expert"].to_numpy(), minlength=n_experts)[:n_experts]
        share, phi, profiled = base.shares(int(layer), n_experts)
        basis = "the baseline profile" if profiled else "a uniform load (no baseline profile for this model)"
        pi = np.clip(share * k_slots, 1e-9, 1 - 1e-9)  # chance a token picks the expert
        n_eff = n_tok / phi  # overdispersion: tokens of one prompt route alike
        over = binom.sf(np.ceil(chosen / phi) - 1, max(int(round(n_eff)), 1), pi)
        dead = np.where(chosen == 0, (1 - pi) ** n_eff, 1.0)
        for e in range(n_experts):
            rows.append({"kind": "overloaded_expert", "layer": layer, "expert": e, "value": float(chosen[e]),
                         "p": float(over[e]), "basis": basis})
            rows.append({"kind": "dead_expert", "layer": layer, "expert": e, "value": float(chosen[e]),
                         "p": float(dead[e]), "basis": basis})
        expected = slots.sum() * share
        nz = slots > 0
        g_stat = float(2 * (slots[nz] * np.log(slots[nz] / expected[nz])).sum())
        rows.append({"kind": "routing_collapse", "layer": layer, "value": g_stat,
                     "p": float(chi2.sf(g_stat / phi, n_experts - 1)), "basis": basis})
    return pl.DataFrame(rows, schema=TESTS)


def near_ties(routing: pl.DataFrame, base: Baseline, info_p: float = 1e-3, min_positions: int = 8) -> pl.DataFrame:
    """Informational: a token whose router margin (slot 0 rows) is in the layer's lowest ``info_p`` tail."""
    r = routing.filter((pl.col("slot") == 0) & _finite("margin"))
    p, basis = base.judge(r, "margin", "margin", ["layer"], False, min_positions)
    r = r.with_columns(pl.Series("p", p), pl.Series("basis", basis, pl.Utf8)).filter(pl.col("p") <= info_p)

    def say(x: dict) -> str:
        where = f"layer {x['layer']} at {x['pos']}"
        if x["margin"] >= 0:
            return (f"{where}: the router's last chosen expert beat the best unchosen one by only {x['margin']:.4f} "
                    f"(p = {x['p']:.1e} against {x['basis']})")
        return (f"{where}: the router passed over an expert that scored {-x['margin']:.4f} higher than its last "
                f"chosen one (group-limited routing; p = {x['p']:.1e} against {x['basis']})")
    return _rows([{"kind": "routing_near_tie", "severity": "info", "pos": x["pos"], "layer": x["layer"],
                   "score": -math.log10(max(x["p"], 1e-300)), "threshold": -math.log10(info_p), "explanation": say(x)}
                  for x in r.iter_rows(named=True)])


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


# -- the decision: one correction over every test of the run ---------------------------------------
def decide(tests: pl.DataFrame, alpha: float = 0.01, critical_q: float = 1e-6) -> pl.DataFrame:
    """Benjamini-Hochberg over all ``tests`` of a run; rows with q <= alpha, in the output schema."""

    if tests.height == 0:
        return empty()
    q = false_discovery_control(np.clip(tests["p"].fill_null(1.0).to_numpy(), 0.0, 1.0), method="bh")
    hit = tests.with_columns(pl.Series("q", q)).filter(pl.col("q") <= alpha)
    rows = []
    for r in hit.iter_rows(named=True):
        what = WORDS[r["kind"]].format(v=r["value"], **{k: r[k] for k in ("pos", "layer", "head", "expert")})
        tail = "low" if r["kind"] == "low_confidence" else "high"
        rows.append({"kind": r["kind"], "severity": "critical" if r["q"] <= critical_q else "warning",
                     "pos": r["pos"], "layer": r["layer"], "head": r["head"], "expert": r["expert"],
                     "score": -math.log10(max(r["q"], 1e-300)), "threshold": -math.log10(alpha),
                     "explanation": f"{what}: unusually {tail} against {r['basis']} (p = {r['p']:.1e}, "
                                    f"q = {r['q']:.1e} over the run's {tests.height} tests)"})
    return _rows(rows)


def diffuse_heads(attention: pl.DataFrame, flagged_tokens: pl.DataFrame, entropy: pl.DataFrame,
                  info_p: float = 0.01) -> pl.DataFrame:
    """Informational: heads far up their entropy range (p <= ``info_p``) at the query row that produced a
    flagged low-confidence token (the token at ``pos`` comes from query row ``pos - 1``)."""
    low = flagged_tokens.filter(pl.col("kind") == "low_confidence")
    if low.height == 0:
        return empty()
    e = entropy.filter(pl.col("p") <= info_p).select("pos", "layer", "head", "value", "p")
    hits = e.join(low.select((pl.col("pos") - 1).alias("pos"), pl.col("pos").alias("tok")), on="pos") \
        .sort("tok", "layer", "head")
    return _rows([{"kind": "diffuse_head", "severity": "info", "pos": r["tok"], "layer": r["layer"], "head": r["head"],
                   "score": -math.log10(max(r["p"], 1e-300)), "threshold": -math.log10(info_p),
                   "explanation": f"layer {r['layer']} head {r['head']} spread its attention (normalised entropy "
                                  f"{r['value']:.2f}, p = {r['p']:.1e}) when the low-confidence token at "
                                  f"{r['tok']} was produced"}
                  for r in hits.iter_rows(named=True)])


def detect_frames(tokens: pl.DataFrame, attention: pl.DataFrame, routing: pl.DataFrame, n_experts: int,
                  kv: pl.DataFrame | None = None, reference_attention: pl.DataFrame | None = None,
                  profile: pl.DataFrame | None = None, resid: pl.DataFrame | None = None,
                  kv_tokens: pl.DataFrame | None = None, head_norm: pl.DataFrame | None = None,
                  **thresholds) -> pl.DataFrame:
    """Run every detector on a run's frames; returns rows sorted by severity then position (no ids)."""
    unknown = set(thresholds) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown anomaly thresholds {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    th = {**DEFAULTS, **thresholds}
    if not 0 < th["alpha"] < 1:
        raise ValueError(f"alpha must be in (0, 1), got {th['alpha']}")
    base = Baseline(profile)
    mp = int(th["min_positions"])
    ent = entropy_tests(attention, base, mp)
    parts = [token_tests(tokens, base, bool(th["include_prompt"]), mp), ent,
             resid_tests(resid if resid is not None else pl.DataFrame(schema={"pos": pl.Int32, "layer": pl.Int32,
                                                                            "norm": pl.Float64}), base, mp),
             kv_tests(kv_tokens if kv_tokens is not None else pl.DataFrame(), base, mp),
             head_norm_tests(head_norm if head_norm is not None else pl.DataFrame(
                 schema={"pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32, "norm": pl.Float64}), base, mp),
             expert_tests(routing, n_experts, base)]
    if reference_attention is not None:
        parts.append(entropy_shift_tests(attention, reference_attention, mp))
    tests = pl.concat([p for p in parts if p.height], how="vertical_relaxed") if any(p.height for p in parts) \
        else _tests()
    flagged = decide(tests, th["alpha"], th["critical_q"])
    out = pl.concat([
        non_finite({"tokens": tokens, "attention": attention, "routing": routing, "kv": kv, "resid_norm": resid,
                    "head_norm": head_norm}),
        flagged, diffuse_heads(attention, flagged, ent, 0.01),
        near_ties(routing, base, th["info_p"], mp) if routing.height else empty(),
    ])
    sev = pl.col("severity").replace_strict({"critical": 0, "warning": 1, "info": 2}, return_dtype=pl.Int32)
    return out.sort(sev, pl.col("pos"), pl.col("layer"), pl.col("head"), pl.col("expert"), nulls_last=False)


def detect(store, run_id: str, recompute: bool = False, reference: str | None = None, **thresholds) -> pl.DataFrame:
    """Anomalies of run ``run_id``: the stored ones, or computed from its signals, stored, and returned.

    Computed (and stored, replacing the old rows) when ``recompute`` is set, when thresholds or a
    ``reference`` run id (in the same database) are given, or when none are stored. Expert counts come
    from the run's neutral model summary, never from family-specific config keys; the baseline is the
    model's profile (``runs.checkpoint_sha256``), if the database (or the bundled demo) has one.

    Returns: the ``anomalies`` rows of the run (without ``run_id``), most severe first.
    """

    if not (recompute or thresholds or reference is not None):
        have = query.anomalies(store, run_id)
        if have.height or query.detected(store, run_id):
            return have
    info = query.run_row(store, run_id)
    prof = load_profile(store, info.get("checkpoint_sha256"))
    summary = query.model_summary(info)
    ref_att = query.attention(store, query.run_row(store, str(reference))["run_id"]) if reference is not None else None
    n_experts = summary.n_routed_experts if summary.moe_layers else 0
    df = detect_frames(query.tokens(store, run_id), query.attention(store, run_id), query.routing(store, run_id),
                       n_experts, kv=query.kv(store, run_id), reference_attention=ref_att,
                       profile=prof,
                       resid=query.signal(store, "resid_norm", run_id), kv_tokens=query.kv_tokens(store, run_id),
                       head_norm=query.signal(store, "head_norm", run_id),
                       **thresholds)
    df = df.with_columns(pl.lit(run_id).alias("run_id"),
                         pl.arange(0, df.height, dtype=pl.Int32).alias("anomaly_id"))
    if getattr(store, "read_only", False):  # a folder of Parquet shards (TraceStore): computed, not stored
        sev = pl.col("severity").replace_strict({"critical": 0, "warning": 1}, default=2, return_dtype=pl.Int32)
        return df.select([c for c in columns("anomalies") if c in df.columns and c != "run_id"]).sort(
            [sev, pl.col("score"), pl.col("anomaly_id")], descending=[False, True, False], nulls_last=True)
    store.replace("anomalies", run_id, df)
    store.update_run(run_id, detection=json.dumps({**DEFAULTS, **thresholds,
                                                   "profile": "profile" if prof is not None else "within-run"}))
    return query.anomalies(store, run_id)
