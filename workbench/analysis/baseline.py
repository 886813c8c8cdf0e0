"""Baseline profiles: the normal range of each signal for one model, from a calibration set of runs.

A profile is a set of rows in the ``profiles`` table, keyed by the model's ``checkpoint_sha256``, one per
(signal, layer, head, expert, bucket) cell, each with its sample size, mean, standard deviation and the
empirical quantiles at ``PROBS``. The detectors (workbench/anomalies.py) turn a run's values into tail
probabilities against it (``tail_p``). Signals:

- ``norm_entropy``: attention entropy / log(visible keys), per layer x head x context-length bucket;
- ``confidence`` and ``surprise`` (-logprob) of generated tokens, per position bucket;
- ``margin``: the router's margin (slot 0 rows), per MoE layer;
- ``expert_share``: each expert's share of a layer's routed slots (``mean``; ``n`` = slots seen);
- ``load_dispersion``: per MoE layer, the distribution over calibration runs of a run's load concentration
  (``load_statistic``: (G - df) per routed slot against the pooled shares, about twice the KL divergence);
- ``latent_norm`` / ``log_latent_norm``: cached KV norms at the last step (and their logs), per layer;
- ``resid_norm`` / ``log_resid_norm``: the residual stream's norm after each block (and its log), per layer x
  position bucket; ``log_resid_growth``: its log change over each block (``resid_growth``);
- ``head_norm`` / ``log_head_norm``: each attention head's output norm (and its log), per layer x head.

``run_norm_entropy``, ``run_log_head_norm``, ``run_log_resid_growth``: the same per-run means (``run_means``),
their distribution over the calibration runs (run-level tests: a shift that lasts the run).

``token_count``: how often each token occurs in the calibration runs (``bucket``: the token id, ``n``: the count);
``novel_share``: the distribution over calibration runs of the share of a run's prompt tokens that no other calibration
run holds (``novel_shares``). A prompt with a larger share of tokens the calibration never saw is text unlike it
(``anomalies.Baseline.novelty``): what its statistics would say of such text is unknown.

The detectors judge norms on the log scale (``log_*``: light tails, a vanished output far down the lower tail);
the plain cells' mean / std serve the root cause's profile evidence.

Buckets: context length ``pos + 1`` falls in bucket b when ``BUCKETS[b] <= pos + 1 < BUCKETS[b + 1]``.

    wb = workbench.open(create=True)   # the default database; create=True: a new one if it is not there yet
    workbench.profile("data/prompts/calibration.jsonl", model=None, db=wb.store)   # record + store
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import polars as pl

from workbench.analysis.repetition import covered_positions
from workbench.data import query
from workbench.data.store import Store

BUCKETS = (1, 8, 32, 128, 512, 2048, 8192, 1 << 30)
PROBS = np.array([0.001, 0.005] + [i / 100 for i in range(1, 100)] + [0.995, 0.999])
BUNDLED = Path(__file__).resolve().parents[2] / "data" / "demo" / "profile.parquet"
SCHEMA = {"checkpoint_sha256": pl.String, "signal": pl.String, "layer": pl.Int32, "head": pl.Int32,
          "expert": pl.Int32, "bucket": pl.Int32, "n": pl.Int64, "mean": pl.Float64, "std": pl.Float64,
          "quantiles": pl.List(pl.Float64), "created_at": pl.Datetime("us"), "source": pl.String}
KEYS = ("signal", "layer", "head", "expert", "bucket")


def bucket_of(length: pl.Expr) -> pl.Expr:
    """The bucket index of a context length (an expression over an integer column)."""
    return pl.lit(0, pl.Int32) + sum((length >= b).cast(pl.Int32) for b in BUCKETS[1:-1])


def _cells(df: pl.DataFrame, signal: str, value: str, keys: list[str]) -> pl.DataFrame:
    """One row per cell of ``keys``: n, mean, std and quantiles of ``value``."""
    df = df.filter(pl.col(value).is_not_null() & pl.col(value).is_finite())
    if df.height == 0:
        return pl.DataFrame(schema={k: SCHEMA[k] for k in KEYS + ("n", "mean", "std", "quantiles")})
    g = df.group_by(keys).agg(pl.len().alias("n"), pl.col(value).mean().alias("mean"),
                              pl.col(value).std().fill_null(0.0).alias("std"),
                              pl.concat_list([pl.col(value).quantile(float(p), "linear") for p in PROBS])
                              .first().alias("quantiles"))
    missing = [k for k in ("layer", "head", "expert", "bucket") if k not in keys]
    return g.with_columns(pl.lit(signal).alias("signal"), *[pl.lit(None, pl.Int32).alias(k) for k in missing]) \
        .select(*[pl.col(k).cast(SCHEMA[k]) for k in KEYS], pl.col("n").cast(pl.Int64), "mean", "std",
                pl.col("quantiles").cast(SCHEMA["quantiles"]))


def build_profile(store: Store, run_ids: list[str]) -> pl.DataFrame:
    """Profile rows (without sha / created_at / source) from the runs ``run_ids`` of one model."""
    def cat(table: str) -> pl.DataFrame:
        frames = [query.signal(store, table, r).with_columns(pl.lit(r).alias("run_id")) for r in run_ids]
        frames = [f for f in frames if f.height]
        return pl.concat(frames, how="vertical_relaxed") if frames else pl.DataFrame()

    att, tok, rt, kvt, rn, hn = (cat(t) for t in ("attention", "tokens", "routing", "kv_tokens", "resid_norm",
                                                  "head_norm"))
    parts = []
    if att.height:
        att = att.with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
        parts.append(_cells(att, "norm_entropy", "norm_entropy", ["layer", "head", "bucket"]))
        parts.append(_cells(run_means(att, "norm_entropy", ["layer", "head", "bucket"]), "run_norm_entropy",
                            "norm_entropy", ["layer", "head", "bucket"]))
    if tok.height:
        parts += token_cells(tok)
        gen = tok.filter(~pl.col("is_prompt") & (pl.col("pos") > 0)).with_columns(
            bucket_of(pl.col("pos")).alias("bucket"), (-pl.col("logprob")).alias("surprise"))
        parts += [_cells(gen, "confidence", "confidence", ["bucket"]), _cells(gen, "surprise", "surprise", ["bucket"])]
    if rt.height and tok.height:  # routing inside repetition loops repeats with the tokens: left out
        loops = pl.DataFrame([{"run_id": r, "pos": p} for (r,), g in tok.group_by("run_id")
                              for p in covered_positions(g)], schema={"run_id": pl.String, "pos": rt.schema["pos"]})
        rt = rt.join(loops, on=["run_id", "pos"], how="anti")
    if rt.height:
        parts.append(_cells(rt.filter(pl.col("slot") == 0), "margin", "margin", ["layer"]))
        share = rt.group_by("layer", "expert").agg(pl.len().alias("k")).with_columns(
            pl.col("k").sum().over("layer").alias("n"))
        parts.append(_dispersion(rt, share, query.run_summary(store, run_ids[0]).n_routed_experts))
        parts.append(share.select(pl.lit("expert_share").alias("signal"), pl.col("layer").cast(pl.Int32),
                                  pl.lit(None, pl.Int32).alias("head"), pl.col("expert").cast(pl.Int32),
                                  pl.lit(None, pl.Int32).alias("bucket"), pl.col("n").cast(pl.Int64),
                                  (pl.col("k") / pl.col("n")).alias("mean"), pl.lit(0.0).alias("std"),
                                  pl.lit(None, SCHEMA["quantiles"]).alias("quantiles")))
    if kvt.height:
        last = kvt.filter(pl.col("step") == pl.col("step").max().over("run_id")) if "run_id" in kvt.columns else kvt
        parts.append(_cells(last, "latent_norm", "latent_norm", ["layer"]))
        parts.append(_cells(last.with_columns(_log("latent_norm")), "log_latent_norm", "latent_norm", ["layer"]))
    if rn.height:
        rn = rn.with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
        parts.append(_cells(rn, "resid_norm", "norm", ["layer", "bucket"]))
        parts.append(_cells(rn.with_columns(_log("norm")), "log_resid_norm", "norm", ["layer", "bucket"]))
        growth = resid_growth(rn)
        parts.append(_cells(growth, "log_resid_growth", "growth", ["layer", "bucket"]))
        parts.append(_cells(run_means(growth, "growth", ["layer", "bucket"]), "run_log_resid_growth", "growth",
                            ["layer", "bucket"]))
    if hn.height:
        parts.append(_cells(hn, "head_norm", "norm", ["layer", "head"]))
        parts.append(_cells(hn.with_columns(_log("norm")), "log_head_norm", "norm", ["layer", "head"]))
        parts.append(_cells(run_means(hn.with_columns(_log("norm")), "norm", ["layer", "head"]), "run_log_head_norm",
                            "norm", ["layer", "head"]))
    return pl.concat(parts, how="vertical_relaxed") if parts else pl.DataFrame(schema={k: SCHEMA[k] for k in KEYS})


def novel_shares(tok: pl.DataFrame) -> pl.DataFrame:
    """Per calibration run (``run_id``, ``token_id``, ``is_prompt`` rows; without ``is_prompt`` every token is the
    prompt's): ``share``, the share of its prompt's tokens that no other run holds, prompt or generated (leave one run
    out: how novel a clean prompt is against a calibration set of the others). The input is judged, never the
    generation: tokens a broken model makes up are a symptom, not text unlike the calibration's."""
    kp = pl.col("is_prompt").sum() if "is_prompt" in tok.columns else pl.len()
    per = tok.group_by("run_id", "token_id").agg(pl.len().alias("k"), kp.alias("kp")).with_columns(
        pl.col("k").sum().over("token_id").alias("total"))
    return per.filter(pl.col("kp").sum().over("run_id") > 0).group_by("run_id").agg(
        ((pl.col("kp") * (pl.col("total") == pl.col("k"))).sum() / pl.col("kp").sum()).alias("share"))


def token_cells(tok: pl.DataFrame) -> list[pl.DataFrame]:
    """The ``token_count`` and ``novel_share`` cells of the calibration runs' ``tokens`` rows."""
    if "token_id" not in tok.columns or tok["token_id"].null_count() == tok.height:
        return []
    tok = tok.filter(pl.col("token_id").is_not_null())
    counts = tok.group_by("token_id").agg(pl.len().alias("n")).sort("token_id").select(
        pl.lit("token_count").alias("signal"), pl.lit(None, pl.Int32).alias("layer"),
        pl.lit(None, pl.Int32).alias("head"), pl.lit(None, pl.Int32).alias("expert"),
        pl.col("token_id").cast(pl.Int32).alias("bucket"), pl.col("n").cast(pl.Int64),
        pl.lit(None, pl.Float64).alias("mean"), pl.lit(None, pl.Float64).alias("std"),
        pl.lit(None, SCHEMA["quantiles"]).alias("quantiles"))
    parts = [counts]
    if "run_id" in tok.columns and tok["run_id"].n_unique() >= 2:
        parts.append(_cells(novel_shares(tok), "novel_share", "share", []))
    return parts


def load_statistic(chosen_slots: np.ndarray, share: np.ndarray) -> float:
    """A layer's load concentration: G of its slot counts against expected shares, less its degrees of freedom
    (what independent draws would give), per routed slot: an estimate of twice the KL divergence of the run's
    load from the shares that does not grow or shrink with the run's length (the profile's ``load_dispersion``
    is its distribution over clean calibration runs)."""
    expected = chosen_slots.sum() * share
    nz = chosen_slots > 0
    g = float(2 * (chosen_slots[nz] * np.log(chosen_slots[nz] / expected[nz])).sum())
    return (g - (len(share) - 1)) / max(float(chosen_slots.sum()), 1.0)


def run_means(df: pl.DataFrame, value: str, keys: list[str]) -> pl.DataFrame:
    """The mean of ``value`` over each run's positions per cell of ``keys`` (``n``: positions): a component's
    level over a whole run, whose spread over clean runs is far narrower than one position's, so a shift that
    lasts the run (a collapsed head, a skipped block, a dead expert's missing contribution) stands out."""
    by = keys + (["run_id"] if "run_id" in df.columns else [])
    return df.filter(pl.col(value).is_not_null() & pl.col(value).is_finite()).group_by(by).agg(
        pl.col(value).mean(), pl.len().alias("positions"))


def resid_growth(rn: pl.DataFrame) -> pl.DataFrame:
    """``growth``: log of the residual norm after a block minus after the block before (after layer 0: its log
    norm), per position: what one block did to the stream, with the token's own scale cancelled."""
    keys = [k for k in ("run_id", "pos") if k in rn.columns]
    return rn.sort(*keys, "layer").with_columns(
        (pl.col("norm").clip(lower_bound=1e-30).log()
         - pl.col("norm").clip(lower_bound=1e-30).log().shift(1).over(keys).fill_null(0.0)).alias("growth"))


def _log(col: str) -> pl.Expr:
    """log of a norm (floored at 1e-30): norms are judged on a log scale, where their tails are light (a
    massive activation is not a 1e-10 event) and a vanished output is far down the lower tail."""
    return pl.col(col).clip(lower_bound=1e-30).log()


def _dispersion(rt: pl.DataFrame, share: pl.DataFrame, n_experts: int) -> pl.DataFrame:
    """``load_dispersion`` per MoE layer: quantiles over the calibration runs of a run's load concentration
    (``load_statistic``, positions inside repetition loops left out). Tokens of one prompt route alike, and prompts of different kinds route differently; the detectors
    judge a run's concentration against this distribution, and widen their per-expert count tests by its 95th
    percentile."""
    rows = []
    for (layer,), g in rt.group_by("layer", maintain_order=True):
        p = np.full(n_experts, 1e-9)
        sh = share.filter(pl.col("layer") == layer)
        p[sh["expert"].to_numpy()] = (sh["k"] / sh["n"]).to_numpy()
        p /= p.sum()
        for (run,), r in g.group_by("run_id"):
            c = np.bincount(r["expert"].to_numpy(), minlength=n_experts)[:n_experts].astype(np.float64)
            rows.append({"layer": int(layer), "stat": load_statistic(c, p)})
    return _cells(pl.DataFrame(rows), "load_dispersion", "stat", ["layer"])


def save_profile(store: Store, sha: str, rows: pl.DataFrame, source: str) -> int:
    """Replace the model's profile with ``rows``; returns the number of cells."""
    stamp = datetime.now(timezone.utc).replace(tzinfo=None)
    full = rows.with_columns(pl.lit(sha).alias("checkpoint_sha256"), pl.lit(stamp).alias("created_at"),
                             pl.lit(source).alias("source")).select([pl.col(c).cast(t) for c, t in SCHEMA.items()])
    store.replace_rows("profiles", {"checkpoint_sha256": sha}, full)
    return full.height


def load_profile(store: Store, sha: str | None) -> pl.DataFrame | None:
    """The model's profile rows, or None. The bundled demo's profile (data/demo/profile.parquet) is copied
    into the store the first time a run of the demo checkpoint asks for it."""
    if not sha:
        return None
    key = (str(store.path), sha)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] == query.profile_stamp(store, sha):
        return cached[1]
    got = query.profile(store, sha)
    have = set(got["signal"].unique().to_list()) if got.height else set()
    if got.height and _stale_bundle(got["source"][0], got["created_at"][0], sha, have, got.height):
        got, have = got.clear(), set()  # an older release's bundle
    # a cell today's detectors read, absent where its profile has what it is made from: an older workbench's (a model
    # that records no head outputs, JetMoE's attention experts, has neither: its profile is current)
    missing = {c for c, base in CURRENT_SIGNALS.items() if c not in have and base in have}
    if missing:  # a profile made by an older workbench: the bundled one replaces it, else it is not used
        bundled = pl.read_parquet(BUNDLED) if BUNDLED.exists() else None
        if bundled is not None and bundled.height and bundled["checkpoint_sha256"][0] == sha:
            got = got.clear()
        else:
            warnings.warn(f"the stored profile of model {sha[:12]} was made by an older workbench (it has no "
                          f"{', '.join(sorted(missing))} cells): runs are judged as without a profile until "
                          "`workbench profile` is run again")
            _CACHE[key] = (query.profile_stamp(store, sha), None)
            return None
    if got.height == 0 and BUNDLED.exists():
        bundled = pl.read_parquet(BUNDLED)
        if bundled.height and bundled["checkpoint_sha256"][0] == sha:
            if getattr(store, "read_only", False):  # a folder of Parquet shards: use it without storing it
                return bundled.drop("checkpoint_sha256").sort(["signal", "layer", "head", "expert", "bucket"],
                                                              nulls_last=True)
            store.replace_rows("profiles", {"checkpoint_sha256": sha}, bundled)
            got = query.profile(store, sha)
    out = got if got.height else None
    _CACHE[key] = (query.profile_stamp(store, sha), out)
    return out


def _stale_bundle(source: str | None, created_at, sha: str, signals: set[str] | None = None,
                  cells: int | None = None) -> bool:
    """Whether a stored profile of model ``sha`` (its cells of ``signals``, ``cells`` of them) is a copy of a bundled
    file of that model other than the one this release bundles (another source, fewer signals or another number of
    cells). A bundle is known by its stamp: no ``created_at`` (scripts/build_activation_profile.py writes none,
    ``workbench profile`` always does) or one of the older releases' stamps (``OLD_BUNDLES``); a profile the user
    made, even from the same prompt file, is never replaced."""
    if not BUNDLED.exists():
        return False
    stamp = (source, None if created_at is None else str(created_at))
    if created_at is not None and stamp not in OLD_BUNDLES:
        return False
    bundle = pl.read_parquet(BUNDLED, columns=["checkpoint_sha256", "source", "signal"])
    if bundle.height == 0 or bundle["checkpoint_sha256"][0] != sha:
        return False
    return (bundle["source"][0] != source or (signals is not None and bool(set(bundle["signal"].unique()) - signals))
            or (created_at is None and cells is not None and cells != bundle.height))


# (source, created_at) of the bundled demo profiles of earlier releases (made by `workbench profile`, so stamped)
OLD_BUNDLES = {('{"prompts": "data/prompts/calibration.jsonl", "runs": 136, "max_new_tokens": 32}',
                "2026-12-02 17:07:38.611399")}
# cells the detectors of this version read -> the cell they are made from (a profile with that one and without them
# was made by an older workbench)
CURRENT_SIGNALS = {"log_head_norm": "head_norm", "run_log_head_norm": "head_norm", "log_resid_growth": "resid_norm",
                   "run_log_resid_growth": "resid_norm", "run_norm_entropy": "norm_entropy"}
_CACHE: dict[tuple[str, str], tuple] = {}  # (db, sha) -> (stamp, rows): detection runs after every recording


def export_profile(store: Store, sha: str, path: str | Path) -> Path:
    """Write a model's profile rows to a Parquet file (how the bundled demo ships its profile)."""
    rows = store.sql("SELECT * FROM profiles WHERE checkpoint_sha256 = ? ORDER BY signal, layer, head, expert, bucket",
                     [sha])
    if rows.height == 0:
        raise ValueError(f"no profile for model {sha[:12]}... in {store.path}")
    rows.write_parquet(str(path))
    return Path(path)


def tail_p(x: np.ndarray, quantiles: np.ndarray, upper: bool = True, min_scale: float = 0.0) -> np.ndarray:
    """P(X >= x) (``upper``) or P(X <= x) under the profile's empirical distribution (quantiles at PROBS).

    ``quantiles`` is one cell's [K] quantiles, or [N, K]: each value against its own cell's (one vectorised
    pass for a whole run instead of one call per cell). Between quantiles the CDF is linear; beyond the
    0.1% / 99.9% quantiles the tail decays exponentially with the scale the 1%..0.1% stretch shows (floored at
    1% of the 1%..99% range, so a near-constant cell does not turn float noise into certainty, and at
    ``min_scale``: a log norm's tail beyond what calibration saw decays by e per ``min_scale``, since its
    extreme tail, a rare token's massive activation, is what a calibration set samples worst).
    """
    x = np.asarray(x, dtype=np.float64)
    q = np.asarray(quantiles, dtype=np.float64)
    if not upper:
        return tail_p(-x, -q[..., ::-1], upper=True, min_scale=min_scale)
    q2 = np.maximum.accumulate(np.atleast_2d(q), axis=-1)  # [1 or N, K]
    scale = np.maximum(_tail_scale(q2), max(min_scale, 1e-9))
    if q.ndim == 1:
        inside = 1.0 - np.interp(x, q2[0], PROBS, left=0.0, right=PROBS[-1])
        return _tail_end(x, inside, q2[0, 0], q2[0, -1], scale[0])
    return _tail_rows(x, q2, scale)


def _tail_scale(q2: np.ndarray) -> np.ndarray:
    """``tail_p``'s decay scale past the last quantile of each row of monotone quantiles [N, K], before min_scale."""
    span = np.maximum(q2[:, -3] - q2[:, 2], 0.0)
    return np.maximum((q2[:, -1] - q2[:, -3]) / math.log((1 - PROBS[-3]) / (1 - PROBS[-1])), 0.01 * span)


def _tail_rows(x: np.ndarray, q2: np.ndarray, scale: np.ndarray, floor: np.ndarray | None = None) -> np.ndarray:
    """P(X >= x) of each value against its own row of monotone quantiles [N, K]: np.interp per row (j = the last
    quantile <= x, linear to the next one) inside, the exponential tail beyond (``floor``: ``CellTails``')."""
    j = (q2 <= x[:, None]).sum(1) - 1
    jc = np.clip(j, 0, q2.shape[1] - 2)
    rows = np.arange(x.size)
    q0, q1 = q2[rows, jc], q2[rows, jc + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        cdf = (PROBS[jc + 1] - PROBS[jc]) / (q1 - q0) * (x - q0) + PROBS[jc]
    cdf = np.where(j < 0, 0.0, np.where(j >= q2.shape[1] - 1, PROBS[-1], cdf))
    return _tail_end(x, 1.0 - cdf, q2[:, 0], q2[:, -1], scale, floor)


def _tail_end(x, inside, lo, hi, scale, floor=None) -> np.ndarray:
    edge = 1 - PROBS[-1] if floor is None else np.maximum(1 - PROBS[-1], floor)
    beyond = edge * np.exp(-np.clip(x - hi, 0, None) / scale)
    p = np.where(x > hi, beyond, np.where(x < lo, 1.0, inside if floor is None else np.maximum(inside, edge)))
    return np.clip(p, 1e-300, 1.0)


@dataclass(frozen=True)
class CellTails:
    """Many cells' quantiles [C, K] prepared once for ``tail_p`` of values that each name their cell: each tail's
    monotone quantiles and decay scale (what ``tail_p`` derives from a cell's quantiles on every call)."""

    upper: np.ndarray  # [C, K] running max of the quantiles
    lower: np.ndarray  # [C, K] running max of the negated, reversed quantiles (the lower tail as an upper one)
    upper_scale: np.ndarray  # [C]
    lower_scale: np.ndarray  # [C]
    floor: np.ndarray | None = None  # [C]: 1 / (n + 1), the least p a value within the cell's range can have

    @classmethod
    def of(cls, quantiles: np.ndarray, n: np.ndarray | None = None) -> "CellTails":
        """``n``: each cell's number of values. A cell of n values resolves no tail beyond 1 / (n + 1): its stored
        0.1% / 99.9% quantiles are its extremes, and from 40 calibration runs a value at the largest one is a 1-in-41
        event, not 1 in 1,000 (nor its decay the near-zero gap between two copies of the maximum). With ``n``, a value
        inside the range has p >= 1 / (n + 1), beyond it p falls from there, at least as slowly as the cell's top
        (bottom) tenth resolves. Without: ``tail_p``'s values exactly."""
        q = np.atleast_2d(np.asarray(quantiles, dtype=np.float64))
        up, lo = np.maximum.accumulate(q, axis=-1), np.maximum.accumulate(-q[:, ::-1], axis=-1)
        su, sl = _tail_scale(up), _tail_scale(lo)
        if n is None:
            return cls(up, lo, su, sl)
        n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
        return cls(up, lo, np.maximum(su, _resolved_scale(up, n)), np.maximum(sl, _resolved_scale(lo, n)),
                   1.0 / (n + 1.0))

    def p(self, x: np.ndarray, cell: np.ndarray, upper: bool = True, min_scale: float = 0.0) -> np.ndarray:
        """``tail_p(x, quantiles[cell], upper, min_scale)``, equal to it value for value (without ``n``)."""
        x = np.asarray(x, dtype=np.float64)
        q2, scale = (self.upper, self.upper_scale) if upper else (self.lower, self.lower_scale)
        return _tail_rows(x if upper else -x, q2[cell], np.maximum(scale[cell], max(min_scale, 1e-9)),
                          None if self.floor is None else self.floor[cell])


def _resolved_scale(q2: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per row of monotone quantiles [C, K] from n values: the exponential tail's scale the top of what n values
    resolve shows, from the quantile at 1 - m / (n + 1) to the one at 1 - 1 / (n + 1) (m = min(10, n / 2)); 0 where
    n resolves the stored extreme quantiles (n >= 1000)."""
    out = np.zeros(q2.shape[0])
    for c in np.flatnonzero(n < 1000):
        m = max(min(10.0, n[c] / 2), 2.0)
        hi, mid = 1 - 1 / (n[c] + 1), 1 - m / (n[c] + 1)
        out[c] = max(np.interp(hi, PROBS, q2[c]) - np.interp(mid, PROBS, q2[c]), 0.0) / math.log(m)
    return out


def profile(prompts, *, model=None, db=None, max_new_tokens: int = 32, tokenizer=None, seed: int = 0,
            progress: bool = False, batch_size: int = 8) -> dict:
    """Record a calibration set with ``model`` (batched, without detection) and store its profile; returns
    {sha, runs, cells, source}.

    Args:
        prompts: a prompt-set path (workbench.capture.prompts: JSONL, folder of .txt, or .txt) or a list of
            prompts (strings or token-id lists). A good set spans the kinds of text the model will see (code of
            several kinds, tests, prose) and lengths up to the context the model will be run at
            (the demo's: data/prompts/calibration.jsonl, code of four kinds up to 1,024 tokens, and
            data/prompts/calibration_text.jsonl, prose, data, SQL, markdown, numbers, seven languages, lists).
    """
    # recording imports torch; reading a profile (the detectors, a stored run's report) must not
    from workbench.capture.prompt_sets import record_many  # lazy: imports torch
    from workbench.capture.prompts import load_prompts  # lazy: beside the recorder it serves
    from workbench.capture.recorder import record_run  # lazy: imports torch

    items = load_prompts(prompts) if isinstance(prompts, (str, Path)) else [{"prompt": p, "id": str(i)}
                                                                           for i, p in enumerate(prompts)]
    if not items:
        raise ValueError("profile needs at least one calibration prompt")
    store = db if isinstance(db, Store) else Store(db)
    if all(isinstance(it["prompt"], str) for it in items):
        res = record_many(items, model=model, tokenizer=tokenizer, db=store, max_new_tokens=max_new_tokens,
                          seed=seed, progress=progress, batch_size=batch_size)
        run_ids = query.batch_runs(store, res.batch_id).filter(pl.col("status") == "complete")["run_id"].to_list()
    else:  # token-id prompts: one at a time (the model is loaded once, then reused)
        run_ids, adapter = [], model
        for it in items:
            rid, _, adapter, tokenizer = record_run(
                it["prompt"], model=adapter, tokenizer=tokenizer, db=store, seed=int(it.get("seed", seed)),
                max_new_tokens=int(it.get("max_new_tokens", max_new_tokens)),
                temperature=float(it.get("temperature", 0.0)))
            run_ids.append(rid)
    if not run_ids:
        raise ValueError("no calibration prompt was recorded completely")
    sha = query.run_row(store, run_ids[0])["checkpoint_sha256"]
    source = json.dumps({"prompts": str(prompts) if isinstance(prompts, (str, Path)) else f"{len(items)} prompts",
                         "runs": len(run_ids), "max_new_tokens": max_new_tokens})
    cells = save_profile(store, sha, build_profile(store, run_ids), source)
    return {"sha": sha, "runs": run_ids, "cells": cells, "source": source,
            "components": profile_activations(store, run_ids, model, source)}


ACTIVATION_TOKENS = 1024  # each calibration run's first tokens, teacher-forced, for the activation profile


def profile_activations(store: Store, run_ids: list[str], model, source: str) -> int:
    """The components' activation profile (workbench.analysis.activations) from the calibration runs' tokens;
    returns the number of components stored."""
    from workbench.analysis import activations  # lazy: imports torch
    from workbench.capture.adapters import adapter_for  # lazy: imports torch
    from workbench.capture.resolve import load_for_run  # lazy: imports torch

    info = query.run_row(store, run_ids[0])
    adapter = load_for_run(info) if model is None or isinstance(model, (str, Path)) else adapter_for(model)
    toks = [query.table(store, "tokens", r, "pos", cols=["token_id"])["token_id"].to_list()[:ACTIVATION_TOKENS]
            for r in run_ids]
    return activations.save(store, info["checkpoint_sha256"], activations.build(adapter, toks), source)
