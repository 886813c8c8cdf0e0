"""Replay: a recorded run's state after any step (from the database alone) and re-execution of a run.

Step conventions (see ``recorder.py``): step 0 is the prefill, which feeds the prompt (positions
``0..n_prompt-1``) and produces the token at ``n_prompt``; decode step ``s >= 1`` feeds the token at
``n_prompt + s - 1`` and produces the one at ``n_prompt + s``. Attention and routing rows exist for
fed positions, so the newest token fed at step ``t`` is ``n_prompt - 1`` for ``t = 0`` and
``n_prompt + t - 1`` otherwise. The last produced token is never fed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from . import query
from .store import Store

# compared signals per table: (key columns, exact columns, columns compared within a tolerance)
SIGNALS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "tokens": (("pos",), ("token_id", "rank"), ("prob", "logprob", "confidence", "entropy")),
    "attention": (("pos", "layer", "head"), (), ("entropy", "norm_entropy", "max_weight", "sink_weight")),
    "routing": (("pos", "layer", "slot"), ("expert",), ("weight", "score", "margin")),
    "kv": (("step", "layer"), ("cached_tokens", "bytes"), ()),
    "kv_tokens": (("step", "layer", "pos"), (), ("latent_norm", "rope_norm", "attn_received")),
}
# order among signals of the same step and position: the token fed there first, then what it caused
_TABLE_ORDER = {"tokens": 0, "kv": 1, "attention": 2, "routing": 3, "kv_tokens": 4}


@dataclass
class StepState:
    """The state of a generation right after step ``step``, read back from the store.

    Attributes:
        tokens: every token known after the step (prompt + produced so far), with confidence etc.
        heads: entropy per layer x head of the newest token fed at this step.
        routing: expert per layer x slot of that token (empty for dense-only models).
        kv: cached tokens and bytes per layer after the step.
        kv_tokens: per cached token norms / attention received, where recorded at this step (prefill
            and final step), else an empty frame.
    """

    run_id: str
    step: int
    last_step: int
    kind: str  # prefill | decode
    n_prompt: int
    fed_positions: list[int]
    newest_pos: int  # newest token fed at this step
    produced_pos: int  # token produced by this step
    tokens: pl.DataFrame
    heads: pl.DataFrame
    routing: pl.DataFrame
    kv: pl.DataFrame
    kv_tokens: pl.DataFrame
    wall_ms: float | None

    @property
    def cached_tokens(self) -> int:
        return int(self.kv["cached_tokens"].max()) if self.kv.height else 0

    @property
    def kv_bytes(self) -> int:
        """KV-cache bytes summed over layers."""
        return int(self.kv["bytes"].sum()) if self.kv.height else 0

    @property
    def produced(self) -> dict | None:
        """The row of the token this step produced (None if it was not recorded)."""
        row = self.tokens.filter(pl.col("pos") == self.produced_pos)
        return row.row(0, named=True) if row.height else None

    @property
    def text(self) -> str:
        return "".join(self.tokens["text"].to_list())


def fed_step(pos: int, n_prompt: int) -> int:
    """The step at which the token at ``pos`` was fed to the model."""
    return 0 if pos < n_prompt else pos - n_prompt + 1


def newest_fed_pos(step: int, n_prompt: int) -> int:
    """The newest position fed at ``step``."""
    return n_prompt - 1 if step == 0 else n_prompt + step - 1


def step_range(store: Store, run_id: str) -> tuple[int, int]:
    """(first, last) valid step of a run, for a slider; ValueError if it recorded no step."""
    query.run_row(store, run_id)
    last = query.last_step(store, run_id)
    if last is None:
        raise ValueError(f"run {run_id} has no recorded steps")
    return 0, int(last)


def at_step(store: Store, run_id: str, t: int) -> StepState:
    """State of run ``run_id`` after step ``t`` (0 = prefill, n = n-th decode step), from the store alone.

    Raises:
        RunNotFound: unknown run. ValueError: ``t`` outside the run's recorded steps.
    """
    info = query.run_row(store, run_id)
    first, last = step_range(store, run_id)
    if isinstance(t, bool) or not isinstance(t, int) or not first <= t <= last:
        raise ValueError(f"step {t!r} is out of range for run {run_id}: valid steps are {first}..{last} "
                         f"(0 = prefill, n = n-th decode step)")
    n_prompt = int(info["n_prompt_tokens"] or 0)
    newest = newest_fed_pos(t, n_prompt)
    produced = n_prompt + t
    fed = list(range(n_prompt)) if t == 0 else [newest]
    s = query.step_signals(store, run_id, t, produced, newest)
    timing = s["timing"]
    return StepState(
        run_id=run_id, step=t, last_step=last, kind="prefill" if t == 0 else "decode", n_prompt=n_prompt,
        fed_positions=fed, newest_pos=newest, produced_pos=produced, tokens=s["tokens"], heads=s["heads"],
        routing=s["routing"], kv=s["kv"], kv_tokens=s["kv_tokens"],
        wall_ms=float(timing["wall_ms"][0]) if timing.height and timing["wall_ms"][0] is not None else None,
    )


# -- comparing two runs signal by signal ------------------------------------------------------------

def _signal_frame(store: Store, table: str, run_id: str) -> pl.DataFrame:
    keys, exact, tol = SIGNALS[table]
    return query.table(store, table, run_id, ", ".join(keys), cols=[*keys, *exact, *tol])


def _differs(a: Any, b: Any, tol: float) -> tuple[bool, float | None]:
    """(differs, magnitude) for two values; NULL equals NULL and NaN equals NaN (both recorded the same)."""
    if a is None or b is None:
        return (a is None) != (b is None), None
    if isinstance(a, float) or isinstance(b, float):
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) != math.isnan(fb), None
        if math.isinf(fa) or math.isinf(fb):
            return fa != fb, None
        d = abs(fa - fb)
        return d > tol, d
    return a != b, float(abs(a - b)) if isinstance(a, (int, float)) else None


def _plain(x: Any) -> Any:
    """JSON-safe value: non-finite floats become the strings "nan" / "inf" / "-inf"."""
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def first_divergence(store: Store, a: str, b: str, tol: float = 1e-4,
                     n_prompt: int | None = None) -> dict | None:
    """The earliest (by step, then position) signal on which run ``b`` departs from run ``a``.

    Discrete signals (token ids, ranks, experts, cache sizes) must be equal; real-valued ones within
    ``tol`` (absolute). Returns None when everything matches, else ``{"step", "pos", "signal",
    "magnitude", "a", "b", ...}``; ``signal`` is ``table.column`` and ``magnitude`` the absolute
    difference (None for a missing row or a NULL/NaN mismatch).
    """
    if n_prompt is None:
        n_prompt = int(query.run_row(store, a)["n_prompt_tokens"] or 0)
    best: tuple | None = None
    for table, (keys, exact, tolerant) in SIGNALS.items():
        fa, fb = _signal_frame(store, table, a), _signal_frame(store, table, b)
        if fa.height == 0 and fb.height == 0:
            continue
        # a full join leaves the absent side's columns NULL; the marker columns tell absent from NULL
        fa = fa.with_columns(pl.lit(True).alias("_a"))
        fb = fb.with_columns(pl.lit(True).alias("_b"))
        j = fa.join(fb, on=list(keys), how="full", suffix="_b", coalesce=True, nulls_equal=True) \
            .with_columns(pl.col("_a").fill_null(False), pl.col("_b").fill_null(False))
        if "step" in keys:
            j = j.with_columns(pl.col("step").alias("_step"))
        elif table == "tokens":  # produced at step pos - n_prompt; the prompt comes with the prefill
            j = j.with_columns(pl.max_horizontal(pl.col("pos") - n_prompt, pl.lit(0)).alias("_step"))
        else:  # attention / routing rows belong to the step that fed the position
            j = j.with_columns(pl.max_horizontal(pl.col("pos") - n_prompt + 1, pl.lit(0)).alias("_step"))
        if "step" in keys:  # per-step snapshots are ordered at the step's newest fed position
            j = j.with_columns(pl.when(pl.col("step") == 0).then(n_prompt - 1)
                               .otherwise(n_prompt + pl.col("step") - 1).alias("_pos"))
        else:
            j = j.with_columns(pl.col("pos").alias("_pos"))
        bad = [~pl.col("_a") | ~pl.col("_b")]
        for c in exact:
            bad.append(pl.col(c).is_null() != pl.col(f"{c}_b").is_null())
            bad.append((pl.col(c) != pl.col(f"{c}_b")).fill_null(False))
        for c in tolerant:
            a_, b_ = pl.col(c).cast(pl.Float64), pl.col(f"{c}_b").cast(pl.Float64)
            bad.append(a_.is_null() != b_.is_null())
            bad.append((a_.is_nan() != b_.is_nan()).fill_null(False))
            bad.append(((a_ - b_).abs() > tol).fill_null(False))
        hits = j.filter(pl.any_horizontal(bad)).sort(["_step", "_pos", *keys])
        if hits.height == 0:
            continue
        row = hits.row(0, named=True)
        order = (row["_step"], row["_pos"], _TABLE_ORDER[table])
        if best is not None and order >= best[0]:
            continue
        if not row["_a"] or not row["_b"]:
            hit = {"signal": f"{table}.missing", "magnitude": None,
                   "a": "present" if row["_a"] else "absent", "b": "present" if row["_b"] else "absent"}
        else:
            hit = {}
            for c in (*exact, *tolerant):
                differs, mag = _differs(row[c], row[f"{c}_b"], 0.0 if c in exact else tol)
                if differs:
                    hit = {"signal": f"{table}.{c}", "magnitude": mag, "a": _plain(row[c]), "b": _plain(row[f"{c}_b"])}
                    break
        where = {("cached_pos" if k == "pos" else k): row[k] for k in keys
                 if k != "step" and not (k == "pos" and table != "kv_tokens")}
        best = (order, {"step": int(row["_step"]), "pos": int(row["_pos"]), **hit, **where})
    return best[1] if best else None


# -- re-execution -----------------------------------------------------------------------------------

def _resolve_for_replay(info: dict, model):
    """The module to re-run a recorded run with, after checking its identity against the record."""
    import torch

    from workbench.model import file_sha256, load_checkpoint, state_sha256

    want = info["checkpoint_sha256"]
    dtype = getattr(torch, info["dtype"] or "float32", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"run {info['run_id']} has an unknown dtype {info['dtype']!r}")
    if model is None:
        path = Path(info["model"] or "")
        if not info["model"] or not (path / "config.json").exists():
            raise ValueError(f"run {info['run_id']} was recorded from {info['model']!r}, an in-memory module or a "
                             "checkpoint that is not here; pass model=<module or checkpoint folder> to replay it")
        have = file_sha256(path)
        if have != want:
            raise ValueError(f"checkpoint {path} has sha256 {have[:12]}..., but run {info['run_id']} was recorded "
                             f"with {str(want)[:12]}...: the weights changed, so a replay would not be comparable")
        return load_checkpoint(path, dtype=dtype)
    if isinstance(model, (str, Path)):
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a checkpoint folder (no config.json)")
        have = file_sha256(path)
        if have != want:
            raise ValueError(f"checkpoint {path} has sha256 {have[:12]}..., but run {info['run_id']} was recorded "
                             f"with {str(want)[:12]}...")
        return load_checkpoint(path, dtype=dtype)
    module = model
    p = next(module.parameters())
    if p.dtype != dtype:
        import copy
        module = copy.deepcopy(module).to(dtype)  # leave the caller's module as it was
    ckpt = getattr(module, "checkpoint_path", None)
    ok = state_sha256(module) == want or (ckpt is not None and Path(ckpt).exists() and file_sha256(ckpt) == want)
    if not ok:
        raise ValueError(f"the module passed has weights whose sha256 differs from the one run {info['run_id']} was "
                         f"recorded with ({str(want)[:12]}...)")
    return module


def replay_run(store: Store, run_id: str, *, model=None, tokenizer=None, tol: float = 1e-4,
               progress: bool = False) -> dict:
    """Re-run a recorded run (prompt ids, settings, seed, checkpoint, dtype) and compare it with the record.

    Args:
        model: None to reload the run's checkpoint folder; or a checkpoint folder / module whose weights
            hash to the recorded ``checkpoint_sha256`` (needed for runs recorded from an in-memory module).
        tol: absolute tolerance for real-valued signals (token ids, experts, cache sizes must be equal).
        progress: show a progress bar on stderr while re-generating.
    Returns: ``{"match", "run_id" (new), "parent_run_id" (replayed), "first_divergence" (None or
        {"step", "pos", "signal", "magnitude", ...}), "tokens_match", "n_tokens", "tolerance"}``.
    Raises:
        ValueError: checkpoint hash differs, the model is not available, or the run has no prompt ids.
    """
    from .recorder import PROBES, record

    info = query.run_row(store, run_id)
    params = json.loads(info["params"] or "{}")
    ids = params.get("prompt_ids")
    if not ids:
        raise ValueError(f"run {run_id} has no recorded prompt_ids in its params; it cannot be replayed")
    module = _resolve_for_replay(info, model)
    new = record(list(ids), model=module, tokenizer=tokenizer, db=store,
                 max_new_tokens=int(params.get("max_new_tokens", 64)),
                 temperature=float(params.get("temperature", 0.0)), top_p=float(params.get("top_p", 1.0)),
                 seed=int(info["seed"] or 0), probes=params.get("probes") or PROBES, topk=int(params.get("topk", 5)),
                 parent_run_id=run_id, progress=progress)
    div = first_divergence(store, run_id, new.run_id, tol, n_prompt=len(ids))
    ta, tb = (query.table(store, "tokens", r, "pos", cols=["pos", "token_id"]) for r in (run_id, new.run_id))
    return {
        "match": div is None, "run_id": new.run_id, "parent_run_id": run_id, "first_divergence": div,
        "tokens_match": ta.equals(tb), "n_tokens": [ta.height, tb.height], "tolerance": tol,
        "status": new.refresh().info["status"],
    }
