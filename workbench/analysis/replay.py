"""Replay: a recorded run's state after any step (from the database alone) and re-execution of a run.

Step conventions (see ``recorder.py``): step 0 is the prefill, which feeds the prompt (positions
``0..n_prompt-1``) and produces the token at ``n_prompt``; decode step ``s >= 1`` feeds the token at
``n_prompt + s - 1`` and produces the one at ``n_prompt + s``. Attention and routing rows exist for
fed positions, so the newest token fed at step ``t`` is ``n_prompt - 1`` for ``t = 0`` and
``n_prompt + t - 1`` otherwise. The last produced token is never fed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl

from workbench.analysis.anomalies import detect
from workbench.analysis.diff import first_divergence
from workbench.capture.interventions import of_run as interventions_of_run
from workbench.capture.recorder import record_run
from workbench.capture.resolve import load_for_run, run_tokenizer
from workbench.capture.settings import RecordSettings
from workbench.data import query
from workbench.data.store import Store


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
    try:
        t = query.as_position(t, "step")
    except ValueError:
        pass  # said below, with the valid range
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


# -- re-execution -----------------------------------------------------------------------------------

def replay_run(store: Store, run_id: str, *, model=None, tokenizer=None, tol: float = 1e-4,
               progress: bool = False) -> dict:
    """Re-run a recorded run (prompt ids, settings, seed, checkpoint, dtype, and the interventions it was recorded
    under: ``interventions`` table) and compare it with the record.

    Args:
        model: None to reload the run's checkpoint folder; or a checkpoint folder / module whose weights
            hash to the recorded ``checkpoint_sha256`` (needed for runs recorded from an in-memory module).
        tol: absolute tolerance for real-valued signals (token ids, experts, cache sizes must be equal).
        progress: show a progress bar on stderr while re-generating.
    Returns: ``{"match", "run_id" (new), "parent_run_id" (replayed), "first_divergence" (None or
        {"step", "pos", "signal", "magnitude", ...}), "tokens_match" (None: no tokens rows to compare),
        "n_tokens" (each run's tokens), "tolerance"}``.
    Raises:
        ValueError: checkpoint hash differs, the model is not available, or the run has no prompt ids.
    """

    info = query.run_row(store, run_id)
    params = json.loads(info["params"] or "{}")
    ids = params.get("prompt_ids")
    if not ids:
        raise ValueError(f"run {run_id} has no recorded prompt_ids in its params; it cannot be replayed")
    adapter = load_for_run(info, model)
    # the tokenizer given, else the one the run was recorded with, else its checkpoint folder's
    tokenizer = run_tokenizer(info, adapter if adapter.checkpoint_path else None, tokenizer)
    new_id = record_run(list(ids), RecordSettings.of_run(info), model=adapter, tokenizer=tokenizer, db=store,
                        parent_run_id=run_id, progress=progress, interventions=interventions_of_run(store, run_id))[0]
    detect(store, new_id, model=adapter)
    div = first_divergence(store, run_id, new_id, tol, n_prompt=len(ids))
    ta, tb = (query.table(store, "tokens", r, "pos", cols=["pos", "token_id"]) for r in (run_id, new_id))
    new = query.run_row(store, new_id)
    return {  # tokens_match None: neither run has tokens rows to compare (recorded without the tokens probe)
        "match": div is None, "run_id": new_id, "parent_run_id": run_id, "first_divergence": div,
        "tokens_match": ta.equals(tb) if ta.height or tb.height else None,
        "n_tokens": [int(info["n_tokens"] or ta.height), int(new["n_tokens"] or tb.height)], "tolerance": tol,
        "status": new["status"],
    }
