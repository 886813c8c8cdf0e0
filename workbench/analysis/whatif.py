"""What-if analyses on recorded runs: an expert cache, latency against context.

Pure functions over polars frames (a run's ``routing`` / ``steps`` tables) or an ``Adapter``; ``Run``'s
methods (``run.expert_cache``, ``run.latency_fit``, ``run.precision_probe``) are thin wrappers. This
module never imports ``workbench.run``.

**Expert cache** (``expert_cache``). Per MoE layer, a cache of K expert slots is replayed over the
recorded routing in token order (``pos``, then ``slot``): every selected expert of every token is one
lookup; a hit marks the expert most recently used, a miss loads it into the cache, evicting the least
recently used expert when all K slots are taken. Layers are independent (each has its own K slots);
positions before ``count_from`` are replayed (they warm the cache) but not counted. The predictors
(the two levels of the seed documents) prefetch before each token's lookups:

- ``"none"``: plain LRU, demand loads only.
- ``"prev3"``: the experts used by the previous 3 tokens (``PREV_WINDOW``), ranked by how many of those
  tokens used each (ties: the more recent use first, then the lower expert id); the top
  ``min(K, candidates)`` are prefetched.
- ``"lookahead"``: the experts the *recorded* routing selects for the next 5 positions (``LOOKAHEAD_WINDOW``:
  the token about to be computed and the 4 after it), ranked by how many of those positions use each
  (ties: the sooner need first, then the lower id), top ``min(K, candidates)``. It reads the future
  from the record, so it is an oracle: an upper bound for any real predictor over that window (with
  K >= the window's distinct experts it is exact, hit rate 1).

How a prefetch uses the K slots: the prefetched experts never exceed K. Each one not in the cache is
loaded, and all of them are then marked most recently used, the best ranked last, so they take the
most recent places; whatever the cache held outside the prefetch set keeps its LRU order and is
evicted from the least recent end until K remain. Prefetches are not lookups: they count neither as
hits nor as misses (their loads are the price, not measured here). Consequence worth knowing: with
K >= 3 x top-k, ``prev3`` loads nothing (LRU already holds every expert of the last 3 tokens) and only
reorders recency, the experts most used lately evicted last, so it stays close to plain LRU; with a
smaller K it keeps the most used recent experts instead of the most recent ones.

**Latency against context** (``fit_latency``): ``wall_ms = a * (L / L0)^b + c`` with ``L0 = 32768``, fitted
by ``scipy.optimize.curve_fit`` to decode steps, ``L`` = the cached length the step attends over
(``n_prompt_tokens + step - 1`` tokens before the fed one). The seed documents' fit: a = 12.4, b = 1.38,
c = 8.2 (``SEED_LATENCY``).

Precision sensitivity lives in ``workbench.analysis.precision`` (it runs the model; this module needs no torch).
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import polars as pl
from scipy.optimize import curve_fit

PREDICTORS = ("none", "prev3", "lookahead")
PREV_WINDOW = 3
LOOKAHEAD_WINDOW = 5
SEED_HIT_RATES = {"prev3": 0.824, "lookahead": 0.941}  # the seeds' level-1 / level-2 cache hit rates
L0 = 32768
SEED_LATENCY = {"a": 12.4, "b": 1.38, "c": 8.2}  # ms, the seeds' fit (A100, 32K -> 128K)
CACHE_COLUMNS = {"layer": pl.Int64, "slots": pl.Int64, "lookups": pl.Int64, "hits": pl.Int64,
                 "hit_rate": pl.Float64}


# -- expert cache ---------------------------------------------------------------------------------

def _sequences(routing: pl.DataFrame) -> dict[int, list[tuple[int, list[int]]]]:
    """Per layer, the tokens in position order, each with its experts in slot order."""
    missing = {"pos", "layer", "slot", "expert"} - set(routing.columns)
    if missing:
        raise ValueError(f"the routing frame lacks column(s) {sorted(missing)}")
    out: dict[int, list[tuple[int, list[int]]]] = {}
    r = routing.select("layer", "pos", "slot", "expert").sort("layer", "pos", "slot")
    for layer, pos, _slot, expert in r.iter_rows():
        seq = out.setdefault(int(layer), [])
        if seq and seq[-1][0] == pos:
            seq[-1][1].append(int(expert))
        else:
            seq.append((int(pos), [int(expert)]))
    return out


def _ranked(window: Sequence[list[int]], k: int) -> list[int]:
    """The ``k`` experts of ``window`` (nearest token first) used by the most of its tokens; ties: the
    nearer use, then the lower id."""
    count: Counter = Counter()
    nearest: dict[int, int] = {}
    for d, experts in enumerate(window):
        for e in set(experts):
            count[e] += 1
            nearest.setdefault(e, d)
    return sorted(count, key=lambda e: (-count[e], nearest[e], e))[:k]


def _prefetch(cache: OrderedDict, want: list[int], k: int) -> None:
    """Load ``want`` (best first, at most ``k``) and make them the most recently used, best last."""
    for e in reversed(want):
        if e in cache:
            cache.move_to_end(e)
        else:
            cache[e] = None
    while len(cache) > k:
        cache.popitem(last=False)


def replay_cache(seq: Sequence[tuple[int, list[int]]], k: int, predictor: str = "none",
                 count_from: int = 0) -> tuple[int, int]:
    """(lookups, hits) of an LRU cache of ``k`` experts over one layer's ``(pos, experts)`` tokens."""
    if predictor not in PREDICTORS:
        raise ValueError(f"unknown predictor {predictor!r}; choose from {', '.join(PREDICTORS)}")
    if k < 1:
        raise ValueError(f"a cache needs at least 1 slot, got {k}")
    cache: OrderedDict = OrderedDict()
    lookups = hits = 0
    for i, (pos, experts) in enumerate(seq):
        if predictor == "prev3":
            _prefetch(cache, _ranked([seq[j][1] for j in range(i - 1, max(i - PREV_WINDOW, 0) - 1, -1)], k), k)
        elif predictor == "lookahead":
            _prefetch(cache, _ranked([s[1] for s in seq[i:i + LOOKAHEAD_WINDOW]], k), k)
        for e in experts:
            hit = e in cache
            if hit:
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > k:
                    cache.popitem(last=False)
            if pos >= count_from:
                lookups += 1
                hits += hit
    return lookups, hits


def expert_cache(routing: pl.DataFrame, slots: Iterable[int] = (2, 4, 8), predictor: str = "none",
                 count_from: int = 0) -> pl.DataFrame:
    """Hit rates of a per-layer LRU expert cache of K ``slots`` replayed over a routing table.

    Args:
        routing: rows ``pos, layer, slot, expert`` (a run's ``routing`` table).
        slots: cache sizes K (experts held per layer) to try.
        predictor: ``"none"``, ``"prev3"`` or ``"lookahead"`` (see the module docstring).
        count_from: count lookups from this position on (earlier positions only warm the cache).

    Returns one row per (layer, slots), then per K a row with ``layer`` null for all layers together:
    ``layer, slots, lookups, hits, hit_rate`` (hit_rate null when there was no lookup).
    """
    slots = sorted({int(k) for k in slots})
    if not slots:
        raise ValueError("give at least one cache size (slots)")
    if predictor not in PREDICTORS:
        raise ValueError(f"unknown predictor {predictor!r}; choose from {', '.join(PREDICTORS)}")
    seqs = _sequences(routing)
    rows = []
    for k in slots:
        total_l = total_h = 0
        for layer in sorted(seqs):
            n, h = replay_cache(seqs[layer], k, predictor, count_from)
            rows.append((layer, k, n, h, h / n if n else None))
            total_l, total_h = total_l + n, total_h + h
        rows.append((None, k, total_l, total_h, total_h / total_l if total_l else None))
    df = pl.DataFrame(rows, schema=CACHE_COLUMNS, orient="row")
    return df.sort(pl.col("layer").is_null(), "layer", "slots")


def expert_cache_sweep(routings: pl.DataFrame | Sequence[pl.DataFrame], slots: Iterable[int] = (2, 4, 8),
                       predictors: Iterable[str] = PREDICTORS, count_from: int | Sequence[int] = 0) -> pl.DataFrame:
    """``expert_cache`` for every predictor over one or several runs' routing tables (each replayed from
    an empty cache), summed: ``predictor`` plus the columns of ``expert_cache``."""
    if isinstance(routings, pl.DataFrame):
        routings = [routings]
    starts = list(count_from) if isinstance(count_from, (list, tuple)) else [count_from] * len(routings)
    out = []
    for p in predictors:
        parts = [expert_cache(r, slots, p, c) for r, c in zip(routings, starts)]
        df = (pl.concat(parts).group_by("layer", "slots", maintain_order=True)
              .agg(pl.col("lookups").sum(), pl.col("hits").sum()))
        df = df.with_columns(pl.when(pl.col("lookups") > 0).then(pl.col("hits") / pl.col("lookups"))
                             .alias("hit_rate"))
        out.append(df.select(pl.lit(p).alias("predictor"), *CACHE_COLUMNS)
                   .cast(CACHE_COLUMNS).sort(pl.col("layer").is_null(), "layer", "slots"))
    return pl.concat(out)


# -- latency against context -----------------------------------------------------------------------

def decode_points(steps: pl.DataFrame, n_prompt_tokens: int) -> pl.DataFrame:
    """A run's decode steps as ``(step, L, wall_ms)``; ``L = n_prompt_tokens + step - 1``, the tokens cached
    before the step (the prefill is left out: it feeds many tokens at once)."""
    d = steps.filter((pl.col("kind") == "decode") & pl.col("wall_ms").is_not_null() & pl.col("wall_ms").is_finite())
    return d.select("step", (int(n_prompt_tokens) + pl.col("step") - 1).cast(pl.Int64).alias("L"),
                    pl.col("wall_ms").cast(pl.Float64))


def _points(source) -> pl.DataFrame:
    if isinstance(source, pl.DataFrame):
        if {"L", "wall_ms"} <= set(source.columns):
            return source.select(pl.col("L").cast(pl.Float64), pl.col("wall_ms").cast(pl.Float64))
        raise ValueError("a frame to fit needs columns L and wall_ms (see decode_points for a steps table)")
    if hasattr(source, "steps") and hasattr(source, "info"):  # a workbench Run
        steps = source.steps()
        if steps.height == 0:
            raise ValueError(f"run {source.info['run_id']} has no steps rows (recorded without the steps probe): "
                             "no decode timings to fit")
        d = decode_points(steps, int(source.info["n_prompt_tokens"] or 0))
        return d.select(pl.col("L").cast(pl.Float64), "wall_ms")
    raise TypeError(f"cannot fit latency to a {type(source).__name__}: pass frames with L and wall_ms, or runs")


@dataclass
class LatencyFit:
    """``wall_ms = a * (L / L0)^b + c``: parameters, their standard errors, and each point's residual."""

    a: float
    b: float
    c: float
    a_se: float
    b_se: float
    c_se: float
    L0: int
    residuals: pl.DataFrame = field(repr=False)  # L, wall_ms, fitted, residual

    @property
    def n(self) -> int:
        return self.residuals.height

    @property
    def rmse(self) -> float:
        return float(np.sqrt(np.mean(self.residuals["residual"].to_numpy() ** 2)))

    def predict(self, L) -> np.ndarray:
        return latency_model(np.asarray(L, dtype=float), self.a, self.b, self.c, self.L0)

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "c": self.c, "a_se": self.a_se, "b_se": self.b_se, "c_se": self.c_se,
                "L0": self.L0, "n": self.n, "rmse": self.rmse}


def latency_model(L, a: float, b: float, c: float, L0: float = L0):
    return a * (np.asarray(L, dtype=float) / L0) ** b + c


def fit_latency(*sources, L0: int = L0, p0: tuple[float, float, float] | None = None) -> LatencyFit:
    """Fit ``wall_ms = a * (L / L0)^b + c`` to decode-step timings (``scipy.optimize.curve_fit``).

    Args:
        sources: frames with columns ``L`` and ``wall_ms`` (e.g. ``decode_points(...)``), or runs (their
            decode steps; ``L = n_prompt_tokens + step - 1``); several are pooled.
        p0: starting (a, b, c); default from the data (b = 1).

    The fit runs on ``x = L / max(L)`` (well scaled whatever L0 is) with a >= 0 and 0 <= b <= 8, and is
    mapped back: ``a = A * (L0 / max L)^b``, its standard error by the delta method.
    """

    if not sources:
        raise ValueError("give at least one run or frame to fit")
    pts = pl.concat([_points(s) for s in sources]).filter(pl.col("wall_ms").is_finite() & (pl.col("L") > 0))
    if pts.height < 4 or pts["L"].n_unique() < 3:
        raise ValueError(f"a latency fit needs >= 4 points at >= 3 context lengths, got {pts.height} points at "
                         f"{pts['L'].n_unique()} lengths")
    L = pts["L"].to_numpy().astype(float)
    y = pts["wall_ms"].to_numpy().astype(float)
    lmax = float(L.max())
    x = L / lmax

    def g(x, A, b, c):
        return A * x ** b + c

    if p0 is None:
        start = (max(float(np.ptp(y)), 1e-6), 1.0, float(y.min()))
    else:
        a0, b0, c0 = p0
        start = (a0 * (lmax / L0) ** b0, b0, c0)
    popt, pcov = curve_fit(g, x, y, p0=start, bounds=([0.0, 0.0, -np.inf], [np.inf, 8.0, np.inf]), maxfev=20000)
    A, b, c = (float(v) for v in popt)
    r = L0 / lmax
    a = A * r ** b
    jac = np.array([r ** b, A * r ** b * math.log(r)])  # d a / d (A, b)
    cov_ab = pcov[:2, :2]
    var_a = float(jac @ cov_ab @ jac) if np.all(np.isfinite(cov_ab)) else float("inf")
    se = lambda v: float(math.sqrt(v)) if np.isfinite(v) and v >= 0 else float("inf")  # noqa: E731
    fitted = g(x, A, b, c)
    res = pl.DataFrame({"L": L, "wall_ms": y, "fitted": fitted, "residual": y - fitted}).sort("L")
    return LatencyFit(a=a, b=b, c=c, a_se=se(var_a), b_se=se(pcov[1, 1]), c_se=se(pcov[2, 2]), L0=int(L0),
                      residuals=res)
