"""Anomaly detectors, calibrated: every test a run makes gets a tail probability, and the run's tests are
corrected together, so a clean run raises (almost) nothing and what is raised means something.

Each detector is a pure function of a run's frames (as ``Run.tokens()`` etc. return them) and a
``Baseline`` (the model's profile, workbench/baseline.py, or none); it returns one row per test with its
p-value. ``detect_frames`` pools all tests of the run and applies the Benjamini-Hochberg procedure
(``scipy.stats.false_discovery_control``) at level ``alpha`` (default 0.01): the expected share of false
alarms among the alarms is at most alpha, and on a run where nothing is wrong (every null true) the
chance of any false alarm at all is at most alpha, however many positions, layers, heads and experts it
has. Rows whose BH-adjusted q-value is <= alpha are warnings, <= ``critical_q`` critical.

What each test asks, against the profile cell (a context-length bucket the calibration never reached is judged
against the nearest calibrated bucket of the same cell; a value with no cell is not tested, never judged
against the run itself). Two-sided tests (twice the smaller tail) say in their explanation which way the
value broke, since a component can fail both ways: blown up, or collapsed, gone, starved.

- ``low_confidence`` (lower tail) / ``high_surprise`` (upper): a generated token's max probability /
  -logprob, by position bucket; where the run's sampler is recorded (``Sampler``), a generated token's surprise is
  judged against that sampler instead (``sampler_p``: the chance it draws a token no more probable; greedy: the
  token must be the most probable), so sampling at temperature 1 is not a fault;
- ``entropy_spike`` / ``entropy_collapse`` (two-sided): normalised attention entropy of a layer x head at a
  position, by context bucket: the head spread its attention, or collapsed onto a few keys;
  ``entropy_shift``: the same against a reference run's distribution for that head (its quantiles);
- ``resid_norm_outlier`` (two-sided): the residual stream's norm after a block (a broken head or expert blows
  it up, a missing contribution shrinks it);
- ``head_norm_outlier`` (two-sided): an attention head's output norm (names a broken or dead head);
- ``kv_norm_outlier`` (two-sided): a cached token's KV norm at the last step (cache corruption);
- ``overloaded_expert`` / ``dead_expert`` / ``starved_expert``: the tokens routed to an expert, against the
  profile's share, as binomial tests widened by the overdispersion clean runs of a similar length show (the
  95th percentile of the profile's ``load_dispersion``: tokens of one prompt route alike);
  ``routing_collapse``: the layer's load concentration (``load_statistic``: (G - df) per routed slot against
  the profile shares) against its distribution over the calibration runs, prompts of several kinds and
  lengths, so another kind of text is not a collapse. A layer with few tokens simply cannot reach significance.
- ``head_entropy_shift`` / ``head_norm_shift`` / ``block_shift`` (two-sided, run-level, ``pos`` null): a head's
  mean normalised entropy per context bucket, its mean log output norm, a block's mean log change of the
  residual norm, against the same means over the calibration runs: a shift that lasts the whole run (a head
  whose attention sharpened, a skipped or weakened block) is clear there though no single position is odd (the
  positions of a loop or a repeated span are left out: they are reported as such);
- ``repetition`` (no test: read off the generated ids, severity warning): a loop, a repeated n-gram, a verbatim
  copy of a span of the prompt (``repetition``);
- ``non_finite``: NaN or Inf in a recorded signal: always critical (no test needed).
- ``cache_mismatch`` (with the model the run was recorded with, no profile needed; not for a run with interventions):
  the recorded token logprobs against one forward of the run's tokens without the KV cache (``cache_rows``), critical
  past ``CACHE_NATS``, at the first layer whose recorded residual norm differs: a fault only the cached step-by-step
  path has (a corrupted cache entry, a decode kernel) that root cause, which recomputes without the cache, cannot see.

Without a profile the same tests run against the run's own robust statistics (median / MAD, normal tail) and
a uniform expert load, but every row they raise is ``info`` (so are repetition rows), with one ``no_profile``
row saying to run ``workbench profile``: nothing is a warning on a model nobody calibrated.
``what_was_tested(store, run_id)`` words what a run's detection tested, for a "nothing found".

Rows the run's own declared interventions account for (a head it scaled, an expert it banned, boosted or forced, a
router it biased: ``declared``) are ``info`` and name the intervention: what the user did is no fault of the model.

Informational rows (severity ``info``, outside the correction): ``routing_near_tie`` (a margin in the
profile's lowest 0.1%) and ``diffuse_head`` (a head in its profile's top 1% where a flagged low-confidence
token was produced: evidence for that token, not an alarm of its own).

``score`` is -log10(q) (raw p for info rows), ``threshold`` -log10(alpha); the explanation gives the value,
what it was judged against and q.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import polars as pl
from scipy.stats import binom, chi2, false_discovery_control, norm

from workbench.analysis.baseline import (BUCKETS, PROBS, CellTails, bucket_of, load_profile, load_statistic,
                                         resid_growth, run_means)
from workbench.analysis.memo import by_object
from workbench.analysis.repetition import covered_positions, scan, spans
from workbench.capture.interventions import stored as stored_interventions
from workbench.data import query
from workbench.data.schema import columns

SCHEMA = {"kind": pl.Utf8, "severity": pl.Utf8, "pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32,
          "expert": pl.Int32, "score": pl.Float64, "threshold": pl.Float64, "explanation": pl.Utf8,
          "component": pl.Utf8}  # component: a component_outlier row's component kind (else null)
TESTS = {"kind": pl.Utf8, "pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32, "expert": pl.Int32,
         "value": pl.Float64, "p": pl.Float64, "side": pl.Utf8, "basis": pl.Utf8}

DEFAULTS: dict[str, Any] = {
    "alpha": 0.01,            # Benjamini-Hochberg level over all of a run's tests
    "critical_q": 1e-6,       # adjusted q at or below this: critical
    "min_positions": 8,       # values a within-run baseline needs
    "run_min_positions": 16,  # positions a run-level mean or an expert-load test needs (fewer: not tested)
    "include_prompt": False,  # token tests also look at (teacher-forced) prompt tokens
    "info_p": 1e-3,           # raw p of an informational row (near ties, diffuse heads)
}
NO_PROFILE = "this run's own statistics (no baseline profile for this model: `workbench profile`)"
WORDS = {
    "low_confidence": "confidence {v:.3f} of the token at {pos}",
    "high_surprise": "surprise {v:.2f} nats of the token at {pos}",
    "entropy_spike": "layer {layer} head {head} at {pos}: normalised attention entropy {v:.3f}",
    "entropy_collapse": "layer {layer} head {head} at {pos}: normalised attention entropy {v:.3f}",
    "entropy_shift": "layer {layer} head {head} at {pos}: normalised attention entropy {v:.3f}",
    "head_entropy_shift": "layer {layer} head {head}: mean normalised attention entropy {v:.3f} over the run",
    "head_norm_shift": "layer {layer} head {head}: output norm {v:.3g} on average over the run",
    "block_shift": "layer {layer}: the block changed the residual stream's norm x{v:.3g} on average over the run",
    "resid_norm_outlier": "layer {layer} at {pos}: the residual stream's norm changed x{v:.3g} over the block",
    "kv_norm_outlier": "layer {layer}: cached KV norm {v:.3g} of the token at {pos}",
    "head_norm_outlier": "layer {layer} head {head} at {pos}: output norm {v:.3g}",
    "overloaded_expert": "layer {layer} expert {expert}: chosen by {v:.0f} tokens",
    "dead_expert": "layer {layer} expert {expert}: chosen by no token",
    "starved_expert": "layer {layer} expert {expert}: chosen by only {v:.0f} tokens",
    "routing_collapse": "layer {layer}: expert load concentrated ((G - df) per routed slot {v:.3f})",
}


SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
LOG_TAIL = 0.1  # beyond the profile's 99.9% quantile a log norm's p falls by e per 0.1 (a 10% larger norm)
RUN_TAIL = {"log": 0.025, "entropy": 0.03}  # the same for run-level means (from one value per calibration run)
# a position's normalised attention entropy (0..1): past the profile's extreme quantiles p falls by e per 0.05 at the
# least. A cell's values come from few prompts (its n counts positions; prompts that begin alike tie its early
# quantiles), so its own tail can be a hundredth of that: 0.42 against a first-bucket cell tied at 0.625 scored
# p = 1e-20 on a clean tiny qwen3_moe profiled on 40 prompts, whose calibration itself went down to 0.27
ENTROPY_TAIL = 0.05


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
TAILS = ("upper", "lower", "two")


@dataclass
class Baseline:
    """A model's profile (or None) and the helpers the detectors use to judge values against it.

    With a profile, a value whose context-length bucket the calibration never reached is judged against the
    nearest bucket of the same cell (the profile covers every length up to the model's maximum that way), and a
    value with no cell at all is not tested: never against the run's own statistics. Without a profile, values
    are judged against the run's own median / MAD, and every row that produces is informational.
    """

    profile: pl.DataFrame | None = None

    def __post_init__(self):
        self._cells: dict[tuple, pl.DataFrame | CellTails] = {}  # cells(), and tails() under ("tails", ...)

    @classmethod
    def of(cls, profile: pl.DataFrame | None) -> "Baseline":
        """The Baseline of ``profile``, one per profile object: ``load_profile`` hands out the same object while the
        stored profile is unchanged, so the cells the detectors read after every recording are selected once."""
        return cls(None) if profile is None else by_object(_BASELINES, profile, cls)

    @property
    def has_profile(self) -> bool:
        return self.profile is not None and self.profile.height > 0

    @property
    def calibration_runs(self) -> int | None:
        """How many calibration runs the profile was made from (its ``source``), if it says."""
        if not self.has_profile or "source" not in self.profile.columns:
            return None
        try:
            return int(json.loads(self.profile["source"][0] or "{}").get("runs"))
        except (ValueError, TypeError):
            return None

    def cells(self, signal: str, min_n: int = 20) -> pl.DataFrame:
        """The profile's cells of ``signal`` with n >= ``min_n``; bucketed signals get every bucket up to the last
        one, a missing bucket copying the nearest calibrated bucket of the same cell (``filled`` says which)."""
        if not self.has_profile:
            return pl.DataFrame()
        if (signal, min_n) in self._cells:
            return self._cells[(signal, min_n)]
        c = self.profile.filter((pl.col("signal") == signal) & (pl.col("n") >= min_n)).with_columns(
            pl.lit(False).alias("filled"))
        if c.height and c["bucket"].null_count() < c.height:
            extra = []
            keys = ("layer", "head", "expert")
            for _, g in c.group_by([pl.col(k).fill_null(-1).alias(f"_{k}") for k in keys], maintain_order=True):
                have = g["bucket"].to_list()
                for b in range(len(BUCKETS) - 1):
                    if b not in have:
                        near = min(have, key=lambda h: (abs(h - b), h))
                        extra.append(g.filter(pl.col("bucket") == near).with_columns(
                            pl.lit(b, pl.Int32).alias("bucket"), pl.lit(True).alias("filled")))
            c = pl.concat([c, *[e.drop([x for x in e.columns if x.startswith("_")]) for e in extra]],
                          how="vertical_relaxed")
        c = c.drop([x for x in c.columns if x.startswith("_")])
        self._cells[(signal, min_n)] = c
        return c

    def judge(self, df: pl.DataFrame, signal: str, value: str, keys: list[str], tail: str,
              min_positions: int, min_scale: float = 0.0) -> tuple[np.ndarray, list[str], list[str]]:
        """(p-values, side "high" / "low", basis) of ``df[value]`` per row against the profile cell of ``keys``
        (``bucket`` computed by the caller). ``tail``: "upper", "lower" or "two" (twice the smaller tail)."""
        if tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
        p = np.ones(df.height)
        side = np.full(df.height, "low" if tail == "lower" else "high", dtype=object)
        basis = np.full(df.height, "nothing (no profile cell)", dtype=object)
        if df.height == 0:
            return p, list(side), list(basis)
        df = df.with_row_index("_i")
        if self.has_profile:
            cells = self.cells(signal)
            if cells.height:
                j = df.join(cells.select(*keys, "filled").with_row_index("_cell"), on=keys, how="inner")
                if j.height:  # every row against its own cell's quantiles, in one vectorised call
                    i = j["_i"].to_numpy()
                    p[i], side[i] = _sided_cells(j[value].to_numpy(), self.tails(signal), j["_cell"].to_numpy(),
                                                 tail, min_scale)
                    basis[i] = np.where(j["filled"].to_numpy(), "the baseline profile (its nearest context-length "
                                        "bucket)", "the baseline profile")
            return p, list(side), list(basis)
        # without a profile: each row against its own group's (``keys`` but the bucket) median and MAD, every group
        # in one pass (a loop over groups cost 1 ms apiece: a model of 60 layers x 64 heads has 3,840 of them); a
        # group holding a NaN judges its rows NaN, as np.median would
        group = [k for k in keys if k != "bucket"]
        over = (lambda e: e.over(group)) if group else (lambda e: e)
        x = pl.col(value).cast(pl.Float64).fill_null(float("nan"))
        st = df.select(*group, x.alias("_v"), over(pl.len()).alias("_n"), over(x.is_nan().any()).alias("_nan"),
                       over(x.median()).alias("_med"))
        st = st.with_columns(pl.when(pl.col("_nan")).then(float("nan")).otherwise(pl.col("_med")).alias("_med"))
        st = st.with_columns(over((pl.col("_v") - pl.col("_med")).abs().median()).alias("_mad"))
        keep = st["_n"].to_numpy() >= min_positions
        if keep.any():
            v, med, mad = (st[c].to_numpy()[keep] for c in ("_v", "_med", "_mad"))  # a NaN median: NaN z
            scale = np.maximum(np.maximum(mad / 0.6745, 0.01 * (np.abs(med) + 1e-3)), 1e-6)
            z = (v - med) / scale
            p[keep], side[keep] = _pick(_norm_sf(z), _norm_sf(-z), tail)
            basis[keep] = NO_PROFILE
        return p, list(side), list(basis)

    def tails(self, signal: str, min_n: int = 20) -> CellTails:
        """The quantiles of ``cells(signal, min_n)``, row for row, prepared for ``tail_p`` once per profile."""
        key = ("tails", signal, min_n)
        if key not in self._cells:
            c = self.cells(signal, min_n)
            q = c["quantiles"].explode().to_numpy().astype(np.float64).reshape(c.height, -1)
            self._cells[key] = CellTails.of(q, c["n"].to_numpy())
        return self._cells[key]

    def _dispersion_cell(self, layer: int) -> dict | None:
        """The profile's ``load_dispersion`` cell of ``layer`` (one value per calibration run), or None."""
        d = self.cells("load_dispersion", min_n=8)
        if d.height == 0 or "quantiles" not in d.columns:
            return None
        d = d.filter((pl.col("layer") == layer) & pl.col("quantiles").is_not_null())
        return d.row(0, named=True) if d.height else None

    def dispersion(self, layer: int) -> np.ndarray | None:
        """The calibration's quantiles of a run's load concentration (``load_statistic``) at ``layer``, or None."""
        c = self._dispersion_cell(layer)
        return None if c is None else np.asarray(c["quantiles"], dtype=np.float64)

    def dispersion_p(self, layer: int, stat: float) -> float | None:
        """P(a clean run's load concentration at ``layer`` >= ``stat``) against the calibration's runs (their number
        bounds the tail it can claim: ``CellTails``), or None without that cell."""
        c = self._dispersion_cell(layer)
        if c is None:
            return None
        tails = CellTails.of(np.asarray(c["quantiles"], dtype=np.float64)[None], np.array([c["n"]]))
        return float(tails.p(np.array([stat]), np.zeros(1, dtype=int))[0])

    def novelty(self, token_ids: np.ndarray, min_tokens: int = 8) -> dict | None:
        """How unlike the calibration's a prompt's tokens are: {unseen, tokens, share, limit, novel} (``unseen``: its
        tokens that no calibration run holds; ``limit``: the largest share of such tokens a calibration prompt had
        against the other runs, the ``novel_share`` cell's top quantile, at least ``NOVEL_FLOOR``; ``novel``: at least
        ``min_tokens`` of them and a larger share than ``limit``), or None without those cells (a profile made before
        them, or from fewer than ``NOVEL_MIN_RUNS`` runs: one odd prompt would set the limit)."""
        if not self.has_profile:
            return None
        if ("novelty",) not in self._cells:
            seen = self.profile.filter(pl.col("signal") == "token_count")["bucket"].to_numpy()
            lim = self.profile.filter((pl.col("signal") == "novel_share") & pl.col("quantiles").is_not_null()
                                      & (pl.col("n") >= NOVEL_MIN_RUNS))
            self._cells[("novelty",)] = (seen, max(float(lim["quantiles"][0][-1]), NOVEL_FLOOR)
                                         if lim.height and seen.size else None)
        seen, limit = self._cells[("novelty",)]
        ids = np.asarray(token_ids)
        if limit is None or ids.size == 0:
            return None
        unseen = int((~np.isin(ids, seen)).sum())
        share = unseen / ids.size
        return {"unseen": unseen, "tokens": int(ids.size), "share": share, "limit": limit,
                "novel": unseen >= min_tokens and share > limit}

    def shares(self, layer: int, n_experts: int) -> tuple[np.ndarray, bool]:
        """(expected share per expert, from a profile?) for one MoE layer."""
        s = self.cells("expert_share").filter(pl.col("layer") == layer) if self.has_profile else pl.DataFrame()
        if s.height == 0:
            return np.full(n_experts, 1.0 / n_experts), False
        share = np.full(n_experts, 0.5 / max(int(s["n"][0]), 1))  # never seen in calibration: half a slot
        share[s["expert"].to_numpy()] = s["mean"].to_numpy()
        return share / share.sum(), True


_BASELINES: dict[int, tuple] = {}  # id(profile) -> (profile, its Baseline): memo.by_object


def _pick(hi: np.ndarray, lo: np.ndarray, tail: str) -> tuple[np.ndarray, np.ndarray]:
    if tail == "upper":
        return hi, np.full(hi.shape, "high", dtype=object)
    if tail == "lower":
        return lo, np.full(hi.shape, "low", dtype=object)
    return np.clip(2 * np.minimum(hi, lo), 1e-300, 1.0), np.where(hi <= lo, "high", "low").astype(object)


def _sided_cells(x: np.ndarray, tails: CellTails, cell: np.ndarray, tail: str,
                 min_scale: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(p, side) of values that each name their row of ``tails`` (a profile's cells prepared once): the upper, the
    lower or twice the smaller tail (``_pick``)."""
    hi = tails.p(x, cell, upper=True, min_scale=min_scale) if tail != "lower" else np.ones(x.size)
    lo = tails.p(x, cell, upper=False, min_scale=min_scale) if tail != "upper" else np.ones(x.size)
    return _pick(hi, lo, tail)


def _log(col: str, alias: str) -> pl.Expr:
    """log of a norm (floored at 1e-30; the profile's norm cells are of log norms)."""
    return pl.col(col).clip(lower_bound=1e-30).log().alias(alias)


def _norm_sf(z: np.ndarray) -> np.ndarray:
    return np.clip(norm.sf(z), 1e-300, 1.0)


# -- detectors: one row per test -------------------------------------------------------------------
def token_tests(tokens: pl.DataFrame, base: Baseline, include_prompt: bool = False,
                min_positions: int = 8, sampler: Sampler | None = None) -> pl.DataFrame:
    """``low_confidence`` and ``high_surprise`` tests of every generated token.

    ``sampler``: how the run chose its tokens. With it, a generated token's surprise is judged against that
    sampler's own distribution (``sampler_p``: exact, no profile needed), not against the calibration's greedy
    tokens: a sampled token of probability 0.05 is what temperature 1 does one time in twenty, not a fault. Without
    it (settings unknown, e.g. imported traces), and for teacher-forced prompt tokens, against the profile."""
    t = _generated(tokens, include_prompt).filter(_finite("confidence") & _finite("logprob")) \
        .with_columns(bucket_of(pl.col("pos")).alias("bucket"), (-pl.col("logprob")).alias("surprise"))
    p, side, basis = base.judge(t, "confidence", "confidence", ["bucket"], "lower", min_positions)
    out = [_tests(kind="low_confidence", pos=t["pos"], value=t["confidence"], p=p, side=side, basis=basis)]
    profiled = t.filter(pl.col("is_prompt")) if sampler is not None else t  # the sampler judges the generated ones
    p, side, basis = base.judge(profiled, "surprise", "surprise", ["bucket"], "upper", min_positions)
    out.append(_tests(kind="high_surprise", pos=profiled["pos"], value=profiled["surprise"], p=p, side=side,
                      basis=basis))
    if sampler is not None:
        drawn = t.filter(~pl.col("is_prompt"))
        out.append(_tests(kind="high_surprise", pos=drawn["pos"], value=drawn["surprise"], p=sampler.p(drawn),
                          side="high", basis=sampler.basis))
    return pl.concat(out)


@dataclass(frozen=True)
class Sampler:
    """How a run chose its generated tokens: ``temperature`` (<= 0: greedy), ``top_p`` and the vocabulary size."""

    temperature: float
    top_p: float
    vocab: int

    @classmethod
    def of_run(cls, info: dict, vocab: int) -> Sampler | None:
        """The run's sampler from its ``params`` (None where they do not say: an imported trace)."""
        try:
            params = json.loads(info.get("params") or "{}")
        except (TypeError, ValueError):
            return None
        if not isinstance(params, dict) or "temperature" not in params:
            return None
        try:
            # a vocabulary the run does not record: a size no tokenizer reaches keeps the bound conservative
            return cls(float(params["temperature"]), float(params.get("top_p", 1.0)), int(vocab) if vocab else 1 << 20)
        except (TypeError, ValueError):
            return None

    @property
    def basis(self) -> str:
        if self.temperature <= 0:
            return "greedy decoding (the token must be the most probable)"
        return (f"the sampler's own distribution (temperature {self.temperature:g}"
                + (f", top-p {self.top_p:g}" if self.top_p < 1 else "") + ")")

    def p(self, t: pl.DataFrame) -> np.ndarray:
        """Per generated token of ``t`` (columns prob, confidence, topk_probs), the chance that this sampler draws a
        token at most as probable (``sampler_p``)."""
        return sampler_p(t["prob"].to_numpy(), t["confidence"].to_numpy(),
                         t["topk_probs"].to_list() if "topk_probs" in t.columns else [None] * t.height,
                         self.temperature, self.top_p, self.vocab)


def sampler_p(prob: np.ndarray, confidence: np.ndarray, topk: list, temperature: float, top_p: float,
              vocab: int) -> np.ndarray:
    """The sampler's own p-value of each chosen token: the chance it draws a token no more probable than the one
    it drew, ``1 - sum of q_i over tokens with p_i > p_chosen`` (q: the tempered distribution, whose order is
    p's). Only the stored top-k probabilities are known, so the sum runs over those (a lower bound) and the
    tempered normaliser is bounded above (the rest of the mass: each below the k-th probability; at temperature > 1
    spread evenly over the rest of the vocabulary): the value is never below the exact one. A token past the
    top-p nucleus (the tempered mass above it already >= top_p) could not have been drawn: p = 0. Greedy: 1 for the
    most probable token (within float rounding), 0 for any other."""
    prob = np.asarray(prob, dtype=float)
    n = prob.size
    if temperature <= 0:
        conf = np.asarray(confidence, dtype=float)
        return np.where(prob >= conf * (1 - 1e-5) - 1e-12, 1.0, 0.0)
    a = 1.0 / temperature
    out = np.ones(n)
    for i in range(n):
        k = np.asarray(topk[i] if topk[i] is not None else [], dtype=float)
        k = k[np.isfinite(k) & (k >= 0)]
        pc = prob[i]
        if k.size == 0 or not np.isfinite(pc):
            continue
        rest = max(0.0, 1.0 - float(k.sum()))
        kmin = float(k.min())
        n_rest = max(1, vocab - k.size)
        if a >= 1:
            tail = rest * kmin ** (a - 1) if kmin > 0 else 0.0
        else:
            tail = n_rest ** (1 - a) * rest ** a
        z = float((k ** a).sum()) + tail
        if z <= 0:
            continue
        above = float((k[k > pc * (1 + 1e-6)] ** a).sum()) / z
        out[i] = 0.0 if top_p < 1 and above >= top_p else max(0.0, 1.0 - above)
    return out


def entropy_tests(attention: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """Every (position, layer, head) with a visible-keys-normalised entropy, two-sided: ``entropy_spike`` (the
    head spread its attention) or ``entropy_collapse`` (it collapsed onto a few keys)."""
    a = attention.filter(_finite("norm_entropy")).with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
    p, side, basis = base.judge(a, "norm_entropy", "norm_entropy", ["layer", "head", "bucket"], "two", min_positions,
                                ENTROPY_TAIL)
    kind = np.where(np.asarray(side, dtype=object) == "low", "entropy_collapse", "entropy_spike")
    return _tests(kind=list(kind), pos=a["pos"], layer=a["layer"], head=a["head"], value=a["norm_entropy"],
                  p=p, side=side, basis=basis)


def run_level_tests(attention: pl.DataFrame, head_norm: pl.DataFrame, resid: pl.DataFrame, base: Baseline,
                    min_positions: int = 8, run_min_positions: int = 16,
                    exclude: set[int] | None = None) -> pl.DataFrame:
    """Run-level, two-sided, against the spread of the same means over the calibration runs:
    ``head_entropy_shift`` (a head's mean normalised entropy per context bucket: collapsed or flattened over the
    run), ``head_norm_shift`` (its mean log output norm) and ``block_shift`` (a block's mean log change of the
    residual norm per context bucket: a skipped or weakened block, a missing contribution). ``pos`` is null.

    A mean over fewer than ``run_min_positions`` positions (or, per context bucket, fewer than the bucket holds
    when that is less) is not tested: the calibration's spread is that of means over whole prompts, and a few
    positions (the first ones above all, which attend to little) scatter far wider (a 1- or 2-token run raised
    several critical rows on clean text); its positions' own tests stand.

    ``exclude``: positions left out of the means (``covered_positions``: a loop's or a repeated span's). Over a loop
    the heads attend across the copies of the same keys (entropy up, outputs their values' mean) however clean the
    model; the loop is reported as such, and a 256-token greedy generation on prose that loops raised 3 run-level
    shifts per 100 generated tokens before they were left out."""
    if exclude:
        drop = pl.col("pos").is_in(sorted(exclude))
        attention = attention.filter(~drop)
        head_norm = head_norm.filter(~drop) if head_norm.height else head_norm
        resid = resid.filter(~drop) if resid.height else resid
    out = []
    width = pl.Series([b - a for a, b in zip(BUCKETS[:-1], BUCKETS[1:])], dtype=pl.Int64)

    def means(df: pl.DataFrame, value: str, keys: list[str]) -> pl.DataFrame:
        need = pl.lit(run_min_positions)
        if "bucket" in keys:  # a bucket of fewer positions: all of them
            need = pl.min_horizontal(need, pl.col("bucket").replace_strict(list(range(len(width))), width.to_list(),
                                                                           default=run_min_positions))
        return run_means(df, value, keys).filter(pl.col("positions") >= need)
    a = attention.filter(_finite("norm_entropy")).with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
    if a.height:
        m = means(a, "norm_entropy", ["layer", "head", "bucket"])
        p, side, basis = base.judge(m, "run_norm_entropy", "norm_entropy", ["layer", "head", "bucket"], "two",
                                    min_positions, RUN_TAIL["entropy"])
        out.append(_tests(kind="head_entropy_shift", layer=m["layer"], head=m["head"], value=m["norm_entropy"], p=p,
                          side=side, basis=basis))
    h = head_norm.filter(_finite("norm")) if head_norm.height else head_norm
    if h.height:
        m = means(h.with_columns(_log("norm", "norm")), "norm", ["layer", "head"])
        p, side, basis = base.judge(m, "run_log_head_norm", "norm", ["layer", "head"], "two", min_positions,
                                    RUN_TAIL["log"])
        out.append(_tests(kind="head_norm_shift", layer=m["layer"], head=m["head"], value=m["norm"].exp(), p=p,
                          side=side, basis=basis))
    r = resid.filter(_finite("norm")) if resid.height else resid
    if r.height:
        m = means(resid_growth(r).with_columns(bucket_of(pl.col("pos") + 1).alias("bucket")), "growth",
                  ["layer", "bucket"])
        p, side, basis = base.judge(m, "run_log_resid_growth", "growth", ["layer", "bucket"], "two", min_positions,
                                    RUN_TAIL["log"])
        out.append(_tests(kind="block_shift", layer=m["layer"], value=m["growth"].exp(), p=p, side=side, basis=basis))
    return pl.concat(out) if out else _tests()


def entropy_shift_tests(attention: pl.DataFrame, reference: pl.DataFrame, min_positions: int = 8) -> pl.DataFrame:
    """``entropy_shift``: each position's normalised entropy against the reference run's distribution for the same
    head (two-sided): the reference's quantiles, with the profile's exponential tail past its extremes (``tail_p``),
    so a value inside what the reference itself showed is never significant (a run against itself: nothing); a head
    the reference saw at fewer than ``min_positions`` positions is not tested."""
    ref = reference.filter(_finite("norm_entropy")).group_by("layer", "head").agg(
        pl.col("norm_entropy").alias("vals")).filter(pl.col("vals").list.len() >= min_positions)
    if ref.height == 0:
        return _tests()
    q = np.stack([np.quantile(np.asarray(v, dtype=np.float64), PROBS) for v in ref["vals"]])
    a = attention.filter(_finite("norm_entropy")).join(ref.select("layer", "head").with_row_index("_cell"),
                                                       on=["layer", "head"])
    p, side = _sided_cells(a["norm_entropy"].to_numpy(), CellTails.of(q), a["_cell"].to_numpy(), "two")
    return _tests(kind="entropy_shift", pos=a["pos"], layer=a["layer"], head=a["head"], value=a["norm_entropy"],
                  p=p, side=side, basis="the reference run")


def resid_tests(resid: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """``resid_norm_outlier``: what every block did to the residual norm at every position, the log ratio of
    the norm after it to the norm before it (two-sided: a block that blows the stream up, or one whose
    contribution went missing; the token's own scale cancels, so the first block out of range is the one)."""
    r = resid_growth(resid.filter(_finite("norm"))).with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
    p, side, basis = base.judge(r, "log_resid_growth", "growth", ["layer", "bucket"], "two", min_positions, LOG_TAIL)
    return _tests(kind="resid_norm_outlier", pos=r["pos"], layer=r["layer"], value=r["growth"].exp(), p=p, side=side,
                  basis=basis)


def head_norm_tests(head_norm: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """``head_norm_outlier``: each head's output norm at every position after the first (two-sided: blown up, or gone).
    At position 0 a head reads one key: its output is the first token's value, scaled by what an attention sink leaves
    it, a function of that token alone (the first-position checks judge it exactly where the profile holds the token;
    against every position's norms a first token unlike the calibration's scored p = 1e-11 on a clean gpt-oss)."""
    h = head_norm.filter(_finite("norm") & (pl.col("pos") > 0)).with_columns(_log("norm", "_log"))
    p, side, basis = base.judge(h, "log_head_norm", "_log", ["layer", "head"], "two", min_positions, LOG_TAIL)
    return _tests(kind="head_norm_outlier", pos=h["pos"], layer=h["layer"], head=h["head"], value=h["norm"], p=p,
                  side=side, basis=basis)


def kv_tests(kv_tokens: pl.DataFrame, base: Baseline, min_positions: int = 8) -> pl.DataFrame:
    """``kv_norm_outlier``: each cached token's KV norm at the run's last recorded step (upper tail: a corrupted
    entry blows up; a cached norm varies too much with its token for a low one to mean much)."""
    if kv_tokens.height == 0:
        return _tests()
    k = kv_tokens.filter((pl.col("step") == pl.col("step").max()) & _finite("latent_norm")) \
        .with_columns(_log("latent_norm", "_log"))
    p, side, basis = base.judge(k, "log_latent_norm", "_log", ["layer"], "upper", min_positions, LOG_TAIL)
    return _tests(kind="kv_norm_outlier", pos=k["pos"], layer=k["layer"], value=k["latent_norm"], p=p, side=side,
                  basis=basis)


def expert_tests(routing: pl.DataFrame, n_experts: int, base: Baseline, exclude: set[int] | None = None,
                 min_tokens: int = 16) -> pl.DataFrame:
    """Per (layer, expert): ``overloaded_expert`` (chosen by far more tokens than the profile's share) and
    ``dead_expert`` / ``starved_expert`` (chosen by none / far fewer); per layer ``routing_collapse``: the load's
    concentration (``load_statistic``) against its distribution over the clean calibration runs (prompts of
    several kinds and lengths: another kind of text is not a collapse).

    Tokens of one prompt route alike, so the expert counts are widened by the overdispersion a run of this
    length would show at the calibration's 95th-percentile concentration; a layer with few tokens simply
    cannot reach significance. Without a profile: a uniform load, plain binomial and chi-squared tests (info only).
    ``exclude``: positions left out (inside repetition loops: their routing repeats with their tokens).
    ``min_tokens``: a layer routing fewer tokens is not tested (neighbouring tokens route alike beyond what the
    calibration's overdispersion says of a whole run: 3 of 4 tokens on one expert is no overload).
    """

    if exclude:
        routing = routing.filter(~pl.col("pos").is_in(sorted(exclude)))
    if routing.height == 0 or n_experts < 2:
        return _tests()
    rows: list[dict] = []
    for (layer,), g in routing.group_by("layer", maintain_order=True):
        n_tok = g["pos"].n_unique()
        if n_tok < min_tokens:
            continue
        k_slots = g.height // max(n_tok, 1)
        chosen = np.bincount(g.unique(["pos", "expert"])["expert"].to_numpy(), minlength=n_experts)[:n_experts]
        slots = np.bincount(g["expert"].to_numpy(), minlength=n_experts)[:n_experts]
        share, profiled = base.shares(int(layer), n_experts)
        disp = base.dispersion(int(layer)) if profiled else None
        # G / df of a run of this length at the calibration's 95th-percentile concentration: the overdispersion
        phi = 1.0 + max(float(np.interp(0.95, PROBS, disp)), 0.0) * g.height / max(n_experts - 1, 1) \
            if disp is not None else 1.0
        basis = ("the baseline profile" if disp is not None else "the baseline profile's shares (no load statistics)") \
            if profiled else "a uniform load (no baseline profile for this model)"
        pi = np.clip(share * k_slots, 1e-9, 1 - 1e-9)  # chance a token picks the expert
        n_eff = max(int(round(n_tok / phi)), 1)  # overdispersion: tokens of one prompt route alike
        # the counts scaled as the tokens are (an expert every token chose is chosen by all n_eff, never by more:
        # rounding ``chosen / phi`` up past ``n_eff`` made p = 0 for a layer whose favourite takes every token), each
        # rounded the way that claims less
        k = chosen * (n_eff / n_tok)
        over = binom.sf(np.clip(np.floor(k + 1e-9), 0, n_eff) - 1, n_eff, pi)
        under = binom.cdf(np.clip(np.ceil(k - 1e-9), 0, n_eff), n_eff, pi)
        for e in range(n_experts):
            rows.append({"kind": "overloaded_expert", "layer": layer, "expert": e, "value": float(chosen[e]),
                         "p": float(over[e]), "side": "high", "basis": basis})
            rows.append({"kind": "dead_expert" if chosen[e] == 0 else "starved_expert", "layer": layer, "expert": e,
                         "value": float(chosen[e]), "p": float(under[e]), "side": "low", "basis": basis})
        stat = load_statistic(slots.astype(np.float64), share)
        p = base.dispersion_p(int(layer), stat) if disp is not None else \
            float(chi2.sf(stat * g.height + n_experts - 1, n_experts - 1))
        rows.append({"kind": "routing_collapse", "layer": layer, "value": stat, "p": p, "side": "high",
                     "basis": basis})
    return pl.DataFrame(rows, schema=TESTS)


def near_ties(routing: pl.DataFrame, base: Baseline, info_p: float = 1e-3, min_positions: int = 8) -> pl.DataFrame:
    """Informational: a token whose router margin (slot 0 rows) is in the layer's lowest ``info_p`` tail."""
    r = routing.filter((pl.col("slot") == 0) & _finite("margin"))
    p, _, basis = base.judge(r, "margin", "margin", ["layer"], "lower", min_positions)
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


# -- degenerate generation -------------------------------------------------------------------------
def repetition(tokens: pl.DataFrame, found: list | None = None, **kw) -> pl.DataFrame:
    """``repetition`` rows (severity warning), one per loop, repeated n-gram or copy of the prompt
    (``workbench.analysis.repetition.spans``; ``found``: those spans, already scanned). ``pos`` is where it starts,
    ``score`` how many tokens it covers, ``threshold`` the minimum that counts."""
    return _rows([{"kind": "repetition", "severity": "warning", "pos": s.pos, "score": float(s.tokens),
                   "threshold": float(s.threshold), "explanation": s.explanation}
                  for s in (spans(tokens, **kw) if found is None else found)])


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
        tail = r["side"] or ("low" if r["kind"] == "low_confidence" else "high")
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
    e = entropy.filter((pl.col("p") <= info_p) & (pl.col("side") == "high")).select("pos", "layer", "head", "value", "p")
    hits = e.join(low.select((pl.col("pos") - 1).alias("pos"), pl.col("pos").alias("tok")), on="pos") \
        .sort("tok", "layer", "head")
    return _rows([{"kind": "diffuse_head", "severity": "info", "pos": r["tok"], "layer": r["layer"], "head": r["head"],
                   "score": -math.log10(max(r["p"], 1e-300)), "threshold": -math.log10(info_p),
                   "explanation": f"layer {r['layer']} head {r['head']} spread its attention (normalised entropy "
                                  f"{r['value']:.2f}, p = {r['p']:.1e}) when the low-confidence token at "
                                  f"{r['tok']} was produced"}
                  for r in hits.iter_rows(named=True)])


def _empty_signal(*cols: str) -> pl.DataFrame:
    return pl.DataFrame(schema={c: (pl.Float64 if c == "norm" else pl.Int32) for c in cols})


def detect_frames(tokens: pl.DataFrame, attention: pl.DataFrame, routing: pl.DataFrame, n_experts: int,
                  kv: pl.DataFrame | None = None, reference_attention: pl.DataFrame | None = None,
                  profile: pl.DataFrame | None = None, resid: pl.DataFrame | None = None,
                  kv_tokens: pl.DataFrame | None = None, head_norm: pl.DataFrame | None = None,
                  meta: dict | None = None, sampler: Sampler | None = None, **thresholds) -> pl.DataFrame:
    """Run every detector on a run's frames; returns rows sorted by severity then position (no ids).

    ``sampler``: how the run chose its tokens (``Sampler.of_run``); a generated token's surprise is judged against
    it (``token_tests``).

    Without a profile every row but ``non_finite`` is informational, and one ``no_profile`` info row says how
    to make one. ``meta``, if given, receives what was tested: ``tests``, ``profile_tests`` (judged against
    the profile), ``calibration_runs``, ``alpha``, ``profile`` (bool).
    """
    unknown = set(thresholds) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown anomaly thresholds {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    th = {**DEFAULTS, **thresholds}
    if not 0 < th["alpha"] < 1:
        raise ValueError(f"alpha must be in (0, 1), got {th['alpha']}")
    base = Baseline.of(profile)
    mp, run_mp = int(th["min_positions"]), int(th["run_min_positions"])
    raw = {"tokens": tokens, "attention": attention, "routing": routing, "kv": kv, "resid_norm": resid,
           "head_norm": head_norm}
    degenerate, found = scan(tokens)  # the prompt's own loops (positions no test judges; one info row each), and
    # the generation's loops, repeated spans and copies: the token sequence scanned once for all three uses
    skip = sorted({p for s in degenerate for p in s.positions})
    if skip:
        def judged(df: pl.DataFrame | None) -> pl.DataFrame | None:
            return df.filter(~pl.col("pos").is_in(skip)) if df is not None and "pos" in df.columns else df
        tokens, routing, resid, kv_tokens = (judged(x) for x in (tokens, routing, resid, kv_tokens))
        # the repeated keys stay in every later position's context: its attention spreads over them (entropy at its
        # maximum, each head's output their values' mean) however clean the model, so the heads are judged only
        # before the loop
        attention = attention.filter(pl.col("pos") < skip[0])
        head_norm = head_norm.filter(pl.col("pos") < skip[0]) if head_norm is not None else None
    ent = entropy_tests(attention, base, mp)
    covered = {p for sp in degenerate + found for p in sp.positions}  # ``covered_positions``
    parts = [token_tests(tokens, base, bool(th["include_prompt"]), mp, sampler), ent,
             resid_tests(resid if resid is not None else _empty_signal("pos", "layer", "norm"), base, mp),
             kv_tests(kv_tokens if kv_tokens is not None else pl.DataFrame(), base, mp),
             head_norm_tests(head_norm if head_norm is not None else _empty_signal("pos", "layer", "head", "norm"),
                             base, mp),
             expert_tests(routing, n_experts, base, covered, run_mp),
             run_level_tests(attention, head_norm if head_norm is not None else _empty_signal("pos", "layer", "head", "norm"),
                             resid if resid is not None else _empty_signal("pos", "layer", "norm"), base, mp, run_mp,
                             covered)]
    if reference_attention is not None:
        parts.append(entropy_shift_tests(attention, reference_attention, mp))
    tests = pl.concat([p for p in parts if p.height], how="vertical_relaxed") if any(p.height for p in parts) \
        else _tests()
    tested = tests.filter(pl.col("basis") != "nothing (no profile cell)")
    flagged = decide(tested, th["alpha"], th["critical_q"])
    flagged, shift = content_shift(flagged, routing["layer"].n_unique() if routing.height else 0, tested)
    # the input's tokens (a broken model's made-up ones are a symptom, not text unlike the calibration's); a frame
    # that does not say which are the prompt's: all of them
    cols = raw["tokens"].columns
    prompt = raw["tokens"].filter(pl.col("is_prompt")) if "is_prompt" in cols else raw["tokens"]
    nov = base.novelty(prompt["token_id"].drop_nulls().to_numpy(), mp) if "token_id" in cols else None
    novel = nov is not None and nov["novel"]
    if novel:  # text unlike the calibration's: its distribution-level tests are moot
        flagged = as_info(flagged, pl.col("kind").is_in(list(SHIFTED)), NOVEL_NOTE)
    rep = repetition(raw["tokens"], found)
    extra = [repetition(raw["tokens"], degenerate).with_columns(pl.lit("info").alias("severity"))]
    if not base.has_profile:
        flagged = flagged.with_columns(pl.lit("info").alias("severity"))
        rep = rep.with_columns(pl.lit("info").alias("severity"))
        extra += [_rows([{"kind": "no_profile", "severity": "info", "score": 0.0, "threshold": 0.0,
                         "explanation": f"no baseline profile for this model: its {tested.height} tests were judged "
                                        "against the run's own statistics and are shown as info only; run "
                                        "`workbench profile --prompts data/prompts/calibration.jsonl --model MODEL` "
                                        "to calibrate"}])]
    if novel:
        extra.append(novel_input(nov))
    if shift:
        extra.append(_rows([{"kind": "routing_shift", "severity": "info", "score": float(len(shift)), "threshold": 3.0,
                             "explanation": f"the run's expert load differs from the calibration's at {len(shift)} MoE "
                                            f"layers at once ({', '.join(map(str, shift))}): text unlike the "
                                            "calibration's (a broken router shows at its own layer); its load and "
                                            "run-level tests are shown as info. To judge text like this, profile the "
                                            "model on some (`workbench profile`)"}]))
    if meta is not None:
        if shift:
            meta["routing_shift"] = shift
        if nov is not None:
            meta["novelty"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in nov.items()}
        meta.update({"tests": tested.height, "alpha": th["alpha"], "profile": base.has_profile,
                     "profile_tests": int(tested["basis"].str.starts_with("the baseline profile").sum()),
                     "sampler_tests": int(tested["basis"].is_in([sampler.basis]).sum()) if sampler is not None else 0,
                     "calibration_runs": base.calibration_runs})
    out = pl.concat([
        non_finite(raw),  # a NaN is a fault whatever the input
        flagged, rep, diffuse_heads(attention, flagged, ent, 0.01),
        near_ties(routing, base, th["info_p"], mp) if routing.height else empty(), *extra,
    ])
    sev = pl.col("severity").replace_strict({"critical": 0, "warning": 1, "info": 2}, return_dtype=pl.Int32)
    return out.sort(sev, pl.col("pos"), pl.col("layer"), pl.col("head"), pl.col("expert"), nulls_last=False)


# a run whose expert load is unusual at this many MoE layers at once (and at least half of them) routes text unlike the
# calibration's: a router fault shows at its own layer (on the demo's injected faults: 1 layer, or every later one
# behind a NaN or a corrupted cache entry, which their own rows name); prose-like numbers or other languages: 3-4 of 5
SHIFT_LAYERS = 3
SHIFTED = ("routing_collapse", "overloaded_expert", "starved_expert", "head_norm_shift", "head_entropy_shift",
           "block_shift")  # distribution-level tests the text's kind moves (per-position tests and exact checks stay)


SHIFT_P = 0.02  # a layer whose load concentration is this unusual (uncorrected) moved with the text too


def content_shift(flagged: pl.DataFrame, n_moe: int, tested: pl.DataFrame | None = None) -> tuple[pl.DataFrame,
                                                                                                  list[int]]:
    """(``flagged`` with its ``SHIFTED`` rows as info, the MoE layers whose load was unusual) when the load is unusual
    at ``SHIFT_LAYERS`` or more MoE layers and at least half of them: the text, not the model; else unchanged, [].
    A layer counts where a load test was flagged, or where ``tested``'s load concentration (``routing_collapse``) has
    p <= ``SHIFT_P``: text unlike the calibration's moves every layer's load a little (the demo's number sequences:
    p <= 0.02 at all 5 MoE layers, flagged at 1), a broken router moves its own layer's a lot."""
    load = flagged.filter(pl.col("kind").is_in(["routing_collapse", "overloaded_expert"])
                          & (pl.col("severity") != "info"))
    layers = {int(x) for x in load["layer"].drop_nulls()}
    if tested is not None and tested.height:
        moved = tested.filter((pl.col("kind") == "routing_collapse") & (pl.col("p") <= SHIFT_P))
        layers |= {int(x) for x in moved["layer"].drop_nulls()}
    layers = sorted(layers)
    if len(layers) < max(SHIFT_LAYERS, (n_moe + 1) // 2):
        return flagged, []
    why = "the whole run's routing differs: see routing_shift"
    return as_info(flagged, pl.col("kind").is_in(list(SHIFTED)), why), layers


def as_info(rows: pl.DataFrame, which: pl.Expr, why: str) -> pl.DataFrame:
    """``rows`` with those ``which`` selects (and not info already) turned to info, ``why`` in parentheses after their
    explanation."""
    hit = which & (pl.col("severity") != "info")
    return rows.with_columns(
        pl.when(hit).then(pl.lit("info")).otherwise(pl.col("severity")).alias("severity"),
        pl.when(hit).then(pl.col("explanation") + f" ({why})").otherwise(pl.col("explanation")).alias("explanation"))


NOVEL_NOTE = "the run's text is unlike the calibration's: see novel_input"
NOVEL_FLOOR = 0.05  # a prompt needs more than this share of tokens no calibration run held to be novel (a calibration
# set of near-duplicate prompts has a limit of 0: any prompt with 8 new tokens would be)
NOVEL_MIN_RUNS = 20  # calibration runs a novel_share cell needs (from fewer, one odd prompt sets the limit)


def novel_input(nov: dict) -> pl.DataFrame:
    """The ``novel_input`` info row of a run whose tokens the calibration mostly never saw (``Baseline.novelty``)."""
    return _rows([{"kind": "novel_input", "severity": "info", "score": nov["share"], "threshold": nov["limit"],
                   "explanation": f"{nov['unseen']} of the prompt's {nov['tokens']} tokens ({nov['share']:.0%}) never "
                                  "occur in the calibration runs (a calibration prompt held at most "
                                  f"{nov['limit']:.0%} tokens the other runs lacked): text unlike the calibration's, "
                                  "whose statistics say nothing of it; its load and run-level tests and the component "
                                  "check's statistics are shown as info (per-position tests, exact checks and NaNs "
                                  "are judged). To judge text like this, profile the model on some (`workbench "
                                  "profile`)"}])


def component_rows(store, info: dict, tokens: pl.DataFrame, model, meta: dict,
                   seen: dict | None = None) -> pl.DataFrame:
    """``component_outlier`` rows: the run's components (its ``tokens`` rows) against the model's activation
    profile (workbench.analysis.activations), from one teacher-forced forward of the model the run was recorded
    with; empty without a model or a profile. ``meta`` gets ``component_tests`` (components judged); ``seen`` the
    forward's token logprobs and residual norms (``activations.capture``), for ``cache_rows``."""
    if model is None:
        return empty()
    from workbench.analysis import activations  # lazy: imports torch; reading a stored run needs none

    prof = activations.load(store, info.get("checkpoint_sha256"))
    if prof is None:
        return empty()
    ids = tokens.sort("pos")["token_id"].to_list()
    if not ids:  # recorded without the tokens probe: no token ids to run the model on
        meta["component_check"] = "not run: the run has no tokens rows (recorded without the tokens probe)"
        return empty()
    first = pl.col("signal").str.starts_with("first:")  # exact first-position outputs: those of this first token
    tests = ~pl.col("kind").is_in(["router_check", "first_check", "known_input", "calibration"])  # no checks' rows
    meta["component_tests"] = int(prof.filter(tests & (
        ~first | pl.col("signal").str.ends_with(f":{ids[0] if ids else -1}"))).height)
    # a loop is a repetition row of its own, and what the model computes once it loops (and as it falls into it)
    # is outside any clean range: the components are judged on the run before its first repeated span
    loops = covered_positions(tokens)
    start = min(loops) if loops else len(ids)
    # past the longest context the calibration ran, what a clean model computes is unknown to the profile (a model
    # run beyond the lengths it was trained or calibrated at is no faulty model): judged up to there
    reach = activations.calibrated_context(prof)
    if reach is not None and start > reach:
        meta["component_check"] = (f"judged over the first {reach} tokens, the longest context its calibration ran; "
                                   "profile on longer prompts to judge the rest")
        start = reach
    return _rows(activations.anomaly_rows(model, ids[:start], prof, routing_shift=bool(meta.get("routing_shift")),
                                          novel=bool(meta.get("novelty", {}).get("novel")), seen=seen))


# how far a recorded token's logprob may be from a forward of the run's tokens without the KV cache, in nats, and a
# layer's residual or head output norm, relatively: summation order differs between the two paths (fp32: 1e-6 on the
# demo and the tiny transformers families); a half-precision model's rounding differs more (the demo in bf16 / fp16,
# 725 sampled tokens: up to 0.6-0.7 nats at single positions)
CACHE_NATS = {"float32": 0.05, None: 1.0}
CACHE_REL = {"float32": 1e-3, None: 0.05}
# and how many of the compared positions must be that far apart: a real fault of the cached path moves many (30-62 of
# 44-75 on the demo); rounding, or a near tie of a router flipped by it, moves single positions
CACHE_SHARE, CACHE_MIN = 0.05, 2
# In half precision the cached and the whole forward round differently, and on a model whose routers are near ties
# (random weights, flat distributions) that moves some generated tokens by 1-1.6 nats (bf16, a 102M random DeepSeek-V3:
# up to 10% of them; 2 of 16 clean runs were flagged by the rule above), while a cache gone wrong moves most of them.
# There the generated tokens are judged as a whole: their median gap (clean bf16 and fp16 runs: 0.000-0.063 nats on the
# demo, tiny transformers models and that 102M one; the cache-only faults 0.03-3.7, most over 0.25) or the share over
# ``CACHE_NATS[None]`` (clean at most 10%; faults 15-97%). A fault that moves few tokens little (the demo's corrupted
# cache in bf16: a median 0.03-0.24 nats) is below it; in fp32 it is found.
CACHE_MEDIAN_HALF, CACHE_SHARE_HALF = 0.2, 0.25
CACHE_TOKENS = 2048  # a run's first tokens held against the cache-free forward


def cache_rows(tokens: pl.DataFrame, resid: pl.DataFrame | None, model, dtype: str | None,
               seen: dict | None = None, head_norm: pl.DataFrame | None = None,
               meta: dict | None = None) -> pl.DataFrame:
    """``cache_mismatch``: one critical row when the run's recorded token logprobs differ from one forward of its
    tokens as a whole, without the KV cache (``activations.cache_free``), by more than ``CACHE_NATS`` at
    ``CACHE_MIN`` positions and ``CACHE_SHARE`` of those compared (in half precision: the generated tokens a median
    ``CACHE_MEDIAN_HALF`` apart, or ``CACHE_SHARE_HALF`` of them over ``CACHE_NATS``): what only the recorded
    step-by-step path computes (the KV cache's entries, a decode kernel, a hook active while recording) is not what
    the model computes.
    ``layer``: the first layer whose recorded residual or head output norm differs from the cache-free one
    (``CACHE_REL``) at the first position where any does (a head's output norm changes at once with what it reads
    from the cache; the residual's norm only to second order); root cause, which recomputes without the cache,
    cannot see such a fault. ``dtype``: the run's; the looser threshold of it and the model's is used.

    Not compared (empty; ``meta["cache_check"]`` says why): no token logprobs, an adapter that is not
    ``cache_exact`` (attention that selects its keys: the cached decode is another computation), a run past the
    length up to which the adapter's rotary embedding is the same for every length (``cache_exact_len``: longrope,
    dynamic NTK). ``seen``: the component check's forward of the same tokens (``activations.capture``), used instead
    of a forward of its own where it covered them all, or at least one generated token (the run before its first
    loop); ``meta["cache_check"]`` says how many positions were compared."""
    meta = meta if meta is not None else {}
    if model is None or tokens is None or not tokens.height or "logprob" not in tokens.columns:
        return empty()
    from workbench.analysis import activations  # lazy: imports torch; reading a stored run needs none
    from workbench.capture.adapters import adapter_for  # lazy: imports torch, as above

    model = adapter_for(model)
    if not model.cache_exact:
        meta["cache_check"] = ("not run: this model's attention selects its keys, so its cached decode is another "
                               "computation")
        return empty()
    limit = model.cache_exact_len
    if limit is not None and tokens.height > limit:
        meta["cache_check"] = (f"not run: the run is longer than {limit} tokens, past which this model's rotary "
                               "embedding depends on the length (its cached decode then differs from a whole forward)")
        return empty()
    t = tokens.sort("pos").head(CACHE_TOKENS)
    n_seen = len(seen.get("logprobs", ())) + 1 if seen else 0
    prompt = int(t["is_prompt"].sum()) if "is_prompt" in t.columns else 0
    if n_seen >= 2 and (n_seen >= t.height or n_seen > prompt):
        # the component check's forward covered them all, or the run up to its first loop past the prompt (a run
        # that loops is held against the clean model up to there only: a forward of its own costs as much again)
        t = t.head(n_seen)
        lp, norms = np.asarray(seen["logprobs"])[: t.height - 1], seen["norms"]  # a longer forward: its first tokens
    elif t.height >= 2:
        lp, norms = activations.cache_free(model, t["token_id"].to_list())
    else:
        return empty()
    ids, pos = t["token_id"].to_list(), t["pos"].to_list()
    rec = t["logprob"].to_numpy()[1:].astype(np.float64)
    ok = np.isfinite(rec) & np.isfinite(lp)
    gap = np.where(ok, np.abs(rec - np.where(ok, lp, 0.0)), 0.0)
    half = dtype not in ("float32", None) or str(getattr(model, "dtype", "float32")).split(".")[-1] != "float32"
    key = None if half else "float32"
    nats, rel = CACHE_NATS[key], CACHE_REL[key]
    judged, whom, how = ok, "token logprobs", ""
    what = f"positions 1-{pos[-1]} of {tokens.height} compared"
    if half:  # as a whole (CACHE_MEDIAN_HALF): rounding moves a few tokens, a fault most
        prompt_at = t["is_prompt"].to_numpy()[1:].astype(bool) if "is_prompt" in t.columns else np.zeros(ok.size, bool)
        if int((ok & ~prompt_at).sum()) >= CACHE_MIN:  # the generated tokens (a decode-only fault moves no other)
            judged, whom = ok & ~prompt_at, "generated tokens"
        g = gap[judged]
        med = float(np.median(g)) if g.size else 0.0
        n_over = int(np.sum(g > nats))
        by_median = med > CACHE_MEDIAN_HALF and int(np.sum(g > CACHE_MEDIAN_HALF)) >= CACHE_MIN
        if not (by_median or n_over >= max(CACHE_MIN, CACHE_SHARE_HALF * g.size)):
            meta["cache_check"] = (f"agrees ({what}; the {g.size} {whom} judged a median {med:.3f} nats apart, "
                                   f"{n_over} more than {nats:g}: half precision's rounding)")
            return empty()
        if by_median:
            nats = CACHE_MEDIAN_HALF
            how = (f" (a median of {med:.2f} nats, where half precision's rounding leaves the median under "
                   f"{CACHE_MEDIAN_HALF:g})")
        else:
            how = f" ({n_over / g.size:.0%} of them, where half precision's rounding moves a few)"
    off = np.nonzero(judged & (gap > nats))[0]
    compared = int(judged.sum())
    if not half and off.size < max(CACHE_MIN, CACHE_SHARE * compared):
        meta["cache_check"] = f"agrees ({what}; {off.size} more than {nats:g} nats apart)"
        return empty()
    meta["cache_check"] = f"differs ({what})"
    first_pos = pos[int(off[0]) + 1]
    layer, where = None, ""
    firsts = [_first_differing(frame, norms.get(kind, {}), len(ids), rel)
              for kind, frame in (("resid", resid), ("head", head_norm))]
    firsts = [f for f in firsts if f is not None]
    if firsts:
        p0, layer = min(firsts)
        where = f"; the layers' outputs first differ at layer {layer} (position {p0})"
    top = np.where(judged, gap, -1.0)
    worst, score = pos[int(np.argmax(top)) + 1], float(top.max())
    n = f"{off.size} of {compared} {whom} compared"
    return _rows([{"kind": "cache_mismatch", "severity": "critical", "pos": first_pos, "layer": layer,
                   "score": score, "threshold": nats,
                   "explanation": "the recorded run is not what the model computes for its tokens without the KV "
                                  f"cache: {n} more than {nats:g} nats apart{how}, first at position {first_pos}, most "
                                  f"at {worst} ({score:.2f} nats){where}: what only the recorded step-by-step path "
                                  "computes is at fault (the KV cache's entries, a decode kernel, a hook active while "
                                  "recording), or the model given is not the one recorded; root cause recomputes "
                                  "without the cache and cannot see it"}])


def _first_differing(frame: pl.DataFrame | None, mine: dict[int, np.ndarray], n: int,
                     rel: float) -> tuple[int, int] | None:
    """(position, layer) of the first recorded norm (a ``resid_norm`` frame: pos, layer, norm; ``head_norm``: and
    head) that differs from the cache-free forward's (``mine``: per layer [T] or [T, H]) by more than ``rel`` of it,
    the lowest layer at the first such position; None when all agree (or nothing to compare)."""
    if frame is None or not frame.height or not mine:
        return None
    layers = sorted(mine)
    shapes = {mine[la].shape for la in layers}
    if len(shapes) != 1 or next(iter(shapes))[0] < n:
        return None
    f = frame.filter((pl.col("pos") < n) & pl.col("layer").is_in(layers))
    if not f.height:
        return None
    arr = np.stack([mine[la] for la in layers])  # [L, T] or [L, T, H]
    where = np.searchsorted(layers, f["layer"].to_numpy())
    pos = f["pos"].to_numpy()
    if arr.ndim == 3:
        heads = f["head"].to_numpy()
        if heads.max(initial=0) >= arr.shape[2]:
            return None
        want = arr[where, pos, heads]
    else:
        want = arr[where, pos]
    got = f["norm"].to_numpy().astype(np.float64)
    bad = np.abs(got - want) > rel * np.maximum(np.abs(want), 1e-6)
    if not bad.any():
        return None
    p0 = int(pos[bad].min())
    return p0, int(f["layer"].to_numpy()[bad & (pos == p0)].min())


def _reference_attention(store, info: dict, summary, reference: str) -> pl.DataFrame:
    """The attention rows of ``reference`` for judging run ``info``'s heads against, or a ValueError: a reference of
    another model (its heads are not this run's), the run itself, or one recorded without the attention probe."""
    ref = query.run_row(store, reference)
    if ref["run_id"] == info["run_id"]:
        raise ValueError(f"run {reference} is no reference for itself: pick a known-good run of the same model")
    theirs = query.model_summary(ref)
    if (theirs.n_layers, theirs.n_heads, theirs.family) != (summary.n_layers, summary.n_heads, summary.family):
        raise ValueError(f"reference run {reference} is of another model ({theirs.family}, {theirs.n_layers} layers x "
                         f"{theirs.n_heads} heads; this run's: {summary.family}, {summary.n_layers} x {summary.n_heads}):"
                         " its heads are not this run's")
    att = query.attention(store, ref["run_id"])
    if att.height == 0:
        raise ValueError(f"reference run {reference} has no attention rows (recorded without the attention probe)")
    return att


def _compute(store, run_id: str, reference: str | None = None, model=None,
             **thresholds) -> tuple[pl.DataFrame, dict]:
    """(rows with run_id and anomaly_id, what was tested) of one run, computed from its signals (and, with the
    ``model`` it was recorded with, its components against their activation profile)."""
    info = query.run_row(store, run_id)
    prof = load_profile(store, info.get("checkpoint_sha256"))
    summary = query.model_summary(info)
    ref_att = _reference_attention(store, info, summary, str(reference)) if reference is not None else None
    n_experts = summary.n_routed_experts if summary.moe_layers else 0
    tokens = query.tokens(store, run_id)
    meta: dict = {"token_rows": tokens.height}  # none: recorded without the tokens probe (no loop check either)
    resid, heads = query.signal(store, "resid_norm", run_id), query.signal(store, "head_norm", run_id)
    df = detect_frames(tokens, query.attention(store, run_id), query.routing(store, run_id),
                       n_experts, kv=query.kv(store, run_id), reference_attention=ref_att,
                       profile=prof,
                       resid=resid, kv_tokens=query.kv_tokens(store, run_id),
                       head_norm=heads, meta=meta,
                       sampler=Sampler.of_run(info, summary.vocab_size), **thresholds)
    ivs = _interventions_of(store, run_id)
    seen: dict = {}  # the component check's forward, for the cache check
    parts = []
    if model is None:  # a recompute without the model keeps what the recording's detection ran the model for
        if prof is not None:
            parts.append(_kept_components(store, run_id, meta))
        parts.append(_kept_rows(store, run_id, "cache_mismatch", "cache_check", meta))
    else:
        if prof is not None:
            parts.append(_checked("component check", run_id, meta,
                                  lambda: component_rows(store, info, tokens, model, meta, seen)))
        if ivs is None:  # the run's own interventions are no fault: it is not compared then
            parts.append(_checked("cache check", run_id, meta, lambda: cache_rows(
                tokens, resid, model, info.get("dtype"), seen, head_norm=heads, meta=meta)))
    for part in parts:
        if part.height:
            df = pl.concat([df, part], how="vertical_relaxed")
    if ivs is not None:
        df = declared(df, ivs)
        meta["interventions"] = ivs["spec"].to_list()
    df = df.with_columns(pl.lit(run_id).alias("run_id"),
                         pl.arange(0, df.height, dtype=pl.Int32).alias("anomaly_id"))
    return df, meta


ROUTING_KINDS = ("overloaded_expert", "dead_expert", "starved_expert", "routing_collapse", "routing_near_tie")


def declared(df: pl.DataFrame, ivs: pl.DataFrame) -> pl.DataFrame:
    """``df`` with the rows the run's own interventions (``interventions`` rows: kind, layer, expert, head, path, spec)
    account for turned to ``info``, saying which: what the user did to the model is no fault of it. A head scaled:
    that head's rows; an expert banned, boosted or forced: that expert's rows at its layer and the layer's load
    rows; a router bias: the layer's load and expert rows; a module scaled: the rows of the layer its path names
    (``layers.3.``). Never a ``component_outlier`` row (the component check runs the model without the
    interventions: what it finds is the model's) nor a ``non_finite`` one; other layers' rows are still judged."""
    if not df.height or ivs is None or not ivs.height:
        return df
    rules = []
    routing = pl.col("kind").is_in(ROUTING_KINDS)
    for iv in ivs.iter_rows(named=True):
        k, layer = iv["kind"], iv["layer"]
        at = pl.col("layer") == layer if layer is not None else None
        if k == "scale_head":
            cond = at & (pl.col("head") == iv["head"])
        elif k in ("ban", "boost", "force"):
            cond = at & ((pl.col("expert") == iv["expert"]) | routing)
        elif k == "router_bias":
            cond = at & (routing | pl.col("expert").is_not_null())
        else:  # scale: a module path
            m = re.search(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)", iv["path"] or "")
            cond = pl.col("layer") == int(m.group(1)) if m else None
        if cond is not None:  # the component check runs the clean model: its rows are never the intervention's;
            # a NaN is a fault whatever was done
            cond = cond & ~pl.col("kind").is_in(["component_outlier", "non_finite"])
            rules.append((cond.fill_null(False), str(iv["spec"])))
    if not rules:
        return df
    spec = pl.lit(None, dtype=pl.Utf8)
    for cond, sp in reversed(rules):
        spec = pl.when(cond).then(pl.lit(sp)).otherwise(spec)
    hit = (pl.col("severity") != "info") & spec.is_not_null()
    return df.with_columns(
        pl.when(hit).then(pl.lit("info")).otherwise(pl.col("severity")).alias("severity"),
        pl.when(hit).then(pl.col("explanation") + pl.lit(" (the run's own intervention ") + spec
                          + pl.lit(" does this: info)")).otherwise(pl.col("explanation")).alias("explanation"))


def _interventions_of(store, run_id: str) -> pl.DataFrame | None:
    """The run's ``interventions`` rows (``workbench.capture.interventions.stored``), or None (none, or a store
    without the table)."""
    try:
        got = stored_interventions(store, run_id)
    except Exception:  # noqa: BLE001 - an older database or a shard folder without the table: nothing declared
        return None
    return got if got.height else None


def _checked(what: str, run_id: str, meta: dict, check: Callable[[], pl.DataFrame]) -> pl.DataFrame:
    """``check()``'s rows, or none with a warning and ``meta`` saying it failed (``what``: "component check" sets
    ``component_check``): the recorded signals' rows stand without it."""
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - the recorded signals' rows stand without it
        warnings.warn(f"the {what} of run {run_id} failed: {e}")
        meta[what.replace(" ", "_")] = f"failed: {type(e).__name__}: {e}"
        return empty()


def _last_detection(store, run_id: str) -> dict:
    """What the run's last detection tested (its ``detection`` JSON; {} for none or an unreadable one)."""
    stored = query.run_row(store, run_id).get("detection")
    try:
        return json.loads(stored) if stored else {}
    except ValueError:
        return {}


def _stored(store, run_id: str, kind: str) -> pl.DataFrame:
    """The run's stored ``kind`` anomaly rows, without run_id (as computed ones are before it is added)."""
    return query.anomalies(store, run_id).filter(pl.col("kind") == kind).select([c for c in SCHEMA if c != "run_id"])


def _kept_components(store, run_id: str, meta: dict) -> pl.DataFrame:
    """The component check's rows of the run's last detection, kept by a recompute without the model (the check
    runs the model: a notebook or the app reading a stored run has none loaded), with what it tested; ``meta`` says
    where they come from. None kept: the check is said not run."""
    last = _last_detection(store, run_id)
    if last.get("component_tests"):
        meta["component_tests"] = last["component_tests"]
        meta["component_check"] = "kept from the detection after the recording: no model loaded to run it again"
        return _stored(store, run_id, "component_outlier")
    meta.setdefault("component_check", last.get("component_check") or "not run: no model loaded")
    return empty()


def _kept_rows(store, run_id: str, kind: str, key: str, meta: dict) -> pl.DataFrame:
    """The ``kind`` rows of the run's last detection and its ``meta[key]``, kept by a recompute without the model (the
    cache check runs the model); empty where that detection had no such check."""
    last = _last_detection(store, run_id)
    if not last.get(key):
        return empty()
    was = str(last[key]).split(" (kept from")[0]
    meta[key] = f"{was} (kept from the detection after the recording: no model loaded to run it again)"
    return _stored(store, run_id, kind)


def _sorted(df: pl.DataFrame) -> pl.DataFrame:
    sev = pl.col("severity").replace_strict({"critical": 0, "warning": 1}, default=2, return_dtype=pl.Int32)
    return df.select([c for c in columns("anomalies") if c in df.columns and c != "run_id"]).sort(
        [sev, pl.col("score"), pl.col("anomaly_id")], descending=[False, True, False], nulls_last=True)


def detect(store, run_id: str, recompute: bool = False, reference: str | None = None, model=None,
           **thresholds) -> pl.DataFrame:
    """Anomalies of run ``run_id``: the stored ones, or computed from its signals, stored, and returned.

    Computed (and stored, replacing the old rows) when ``recompute`` is set, when thresholds or a
    ``reference`` run id (in the same database) are given, or when none are stored. Expert counts come
    from the run's neutral model summary, never from family-specific config keys; the baseline is the
    model's profile (``runs.checkpoint_sha256``), if the database (or the bundled demo) has one. The run's
    ``detection`` (JSON) records the settings and what was tested (``what_was_tested``).

    ``model``: the adapter the run was recorded with (the recorder hands it to ``after_run``): with it, and an
    activation profile for the model, the run's components are judged too (``component_rows``).

    Returns: the ``anomalies`` rows of the run (without ``run_id``), most severe first.
    """

    if not (recompute or thresholds or reference is not None):
        have = query.anomalies(store, run_id)
        if have.height or query.detected(store, run_id):
            return have
    df, meta = _compute(store, run_id, reference, model, **thresholds)
    if getattr(store, "read_only", False):  # a folder of Parquet shards (TraceStore): computed, not stored
        return _sorted(df)
    store.replace("anomalies", run_id, df)
    store.update_run(run_id, detection=json.dumps({**DEFAULTS, **thresholds, **meta,
                                                   "profile": "profile" if meta["profile"] else "within-run"}))
    return query.anomalies(store, run_id)


def what_was_tested(store, run_id: str) -> str:
    """One line saying what the detectors tested on a run and what came of it, e.g. "412 tests against the
    baseline profile (144 calibration prompts), none significant at FDR 0.01" (what a "nothing found" means)."""
    info = query.run_row(store, run_id)
    try:
        meta = json.loads(info.get("detection") or "{}")
    except ValueError:
        meta = {}
    if "tests" not in meta:  # never detected, detected before this was recorded, or a read-only store
        rows, meta = _compute(store, run_id)
        meta = {**DEFAULTS, **meta, "profile": "profile" if meta["profile"] else "within-run"}
    else:
        rows = query.anomalies(store, run_id)
    alpha = meta.get("alpha", DEFAULTS["alpha"])
    n = int(meta.get("tests", 0))
    sev = rows["severity"].to_list() if rows.height else []
    crit, warn = sev.count("critical"), sev.count("warning")
    loops = rows.filter(pl.col("kind") == "repetition").height if rows.height else 0
    if meta.get("profile") != "profile":
        line = (f"{n} tests against this run's own statistics (no baseline profile for this model: shown as info "
                f"only; run `workbench profile` to calibrate)")
        return line + (f"; {loops} repetition row{'s' if loops != 1 else ''} (info)" if loops else "")
    cal = meta.get("calibration_runs")
    base = f"{n} tests against the baseline profile" + (f" ({cal} calibration prompts)" if cal else "")
    n_prof, n_samp = int(meta.get("profile_tests", n)), int(meta.get("sampler_tests", 0))
    if n_samp:
        base += f", {n_samp} of them (the generated tokens' surprise) against the run's own sampler"
    if n_prof + n_samp < n:
        base += f", {n - n_prof - n_samp} of them against the run's reference"
    if meta.get("component_tests"):
        base += f", {meta['component_tests']} components against their activation profile"
    if meta.get("component_check"):  # a model and a profile, but no component judged: say why
        base += f" (component check {meta['component_check']})"
    nov = meta.get("novelty") or {}
    if nov.get("novel"):
        base += (f" (text unlike the calibration's: {nov['share']:.0%} of the prompt's tokens never occur there; its "
                 "distribution-level tests and component statistics are shown as info)")
    base += " and a check for repetition loops" if meta.get("token_rows", 1) else " (no tokens rows: no check for " \
        "repetition loops)"
    if crit + warn == 0:
        return f"{base}, none significant at FDR {alpha:g}"
    parts = [f"{crit} critical" if crit else "", f"{warn} warning" if warn else ""]
    return f"{base}: {' and '.join(x for x in parts if x)} row{'s' if crit + warn != 1 else ''} at FDR {alpha:g}"
