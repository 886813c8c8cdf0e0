"""Prompt sets: record many prompts as one batch (``workbench.record_many``, ``workbench record --prompts``).

Each prompt becomes its own run (``workbench.record``), and every run of the set carries the same
``runs.batch_id`` and its prompt's key (``runs.batch_item``: the prompt's ``id``, else ``<index>:<text hash>``).
The batch id defaults to a hash of the prompt set and the settings, so running the same command again resumes
the batch: prompts that already have a ``complete`` run in it are skipped. A prompt that fails becomes a
``failed`` run (its error in ``runs.error``) and the batch goes on.

With ``out=DIR`` the runs are written as Parquet shards in the export's Hive layout instead of into a database:
each run is recorded into a temporary DuckDB file and, once finished, written with ``workbench.data.export.write_run``
(every file under a temporary name moved into place, then the run's completion marker), so a killed process
leaves only whole runs; ``workbench.open(DIR)`` reads the folder. ``ray=`` runs the set on a Ray Data actor pool
(``workbench.capture.ray_actors``) that writes the same layout.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from tqdm import tqdm

from workbench.capture.adapters import load_adapter
from workbench.capture.prompts import FIELDS, load_prompt_set, prompt_key
from workbench.capture.recorder import DTYPES, new_run_id, record_batch, record_run, run_after
from workbench.capture.resolve import tokenizer_for
from workbench.capture.settings import PER_PROMPT, RecordSettings
from workbench.data.export import write_run
from workbench.data.store import Store, complete_runs

BATCH_SIZE = 8  # prompts per batched generation (record_many's default)
MAX_BATCH_TOKENS = 8192  # rows x longest prompt of one batched generation


def prompt_items(prompts) -> list[dict]:
    """A prompt set as dicts with ``prompt``, ``key`` and per-prompt settings: a path (``.jsonl``, ``.txt`` or a
    folder: ``workbench.capture.prompts.load_prompt_set``), a list of strings, or a list of dicts (``prompt`` and optional
    ``id``, ``max_new_tokens``, ``temperature``, ``seed``)."""

    if isinstance(prompts, (str, Path)):
        return load_prompt_set(prompts)
    items = []
    for i, p in enumerate(prompts):
        d = {"prompt": p} if isinstance(p, str) else dict(p)
        if not isinstance(d.get("prompt"), str):
            raise ValueError(f"prompt {i}: needs a string 'prompt', got {p!r:.80}")
        unknown = set(d) - set(FIELDS) - {"key"}
        if unknown:
            raise ValueError(f"prompt {i}: unknown keys {sorted(unknown)}; known: {FIELDS}")
        key = str(d.pop("key")) if d.get("key") is not None else prompt_key(d, i)
        d.pop("id", None)
        items.append({**d, "key": key})
    keys = [d["key"] for d in items]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})[:3]
        raise ValueError(f"prompt ids must be unique within a set; repeated: {dup}")
    return items


def batch_id_for(items: list[dict], settings: dict) -> str:
    """The default batch id: a hash of the prompts (keys and texts) and the settings ("b" + 11 hex)."""
    h = hashlib.sha256(json.dumps({"items": items, "settings": settings}, sort_keys=True, default=str).encode())
    return "b" + h.hexdigest()[:11]


def completed(store: Store | None, out: str | Path | None, batch_id: str) -> set[str]:
    """Keys of the batch's prompts that already have a ``complete`` run (in the database, or in ``out``)."""
    if out is not None:
        return {m.get("batch_item") for m in complete_runs(out).values()
                if m.get("batch_id") == batch_id and m.get("status") == "complete"}
    df = store.sql("SELECT DISTINCT batch_item FROM runs WHERE batch_id = ? AND status = 'complete'", [batch_id])
    return set(df["batch_item"].to_list())


def _failed_row(store: Store, run_id: str, item: dict, label: str, error: str, seed, batch_id: str) -> None:
    """A ``failed`` run row of the batch for a prompt that failed before its recording made one (e.g. a bad
    setting)."""
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    store.append({"runs": pl.DataFrame({
        "run_id": [run_id], "created_at": [now], "status": ["failed"], "model": [label], "prompt": [item["prompt"]],
        "params": [json.dumps({k: item[k] for k in PER_PROMPT if k in item})],
        "seed": [seed if isinstance(seed, int) and not isinstance(seed, bool) else None], "finished_at": [now],
        "error": [error], "n_tokens": [0], "pid": [os.getpid()], "batch_id": [batch_id], "batch_item": [item["key"]]},
        schema_overrides={"seed": pl.Int64})})


def record_one(item: dict, *, store: Store, batch_id: str, adapter, tokenizer, label: str, settings: RecordSettings,
               after_run=None) -> dict:
    """Record one prompt of a batch into ``store`` (never raises for the prompt's own failure); returns
    ``{run_id, key, status, n_tokens, generated, error}``."""

    mine = settings.for_item(item)
    run_id = new_run_id()
    error = None
    try:
        record_run(item["prompt"], mine, model=adapter, tokenizer=tokenizer, db=store, run_id=run_id,
                   run_fields={"batch_id": batch_id, "batch_item": item["key"]})
    except Exception as e:  # noqa: BLE001 - one prompt's failure is that run's, not the batch's
        error = f"{type(e).__name__}: {e}"
    return _finished(store, [run_id], [item], [error], label, [mine.seed], batch_id, after_run, adapter)[0]


def record_group(items: list[dict], *, store: Store, batch_id: str, adapter, tokenizer, label: str,
                 settings: RecordSettings, after_run=None) -> list[dict]:
    """Record prompts of a batch together, in one batched generation (``workbench.capture.recorder.record_batch``) when
    the model's adapter has one (ours, and transformers models: ``HFAdapter.stream_batch``, except the families of
    ``workbench.capture.adapters.hf.SINGLE_ONLY``, whose rows would differ from their single recordings), else one by
    one (``record_one``); one row per prompt, as ``record_one``'s."""
    if len(items) == 1 or not adapter.supports_batch:
        return [record_one(item, store=store, batch_id=batch_id, adapter=adapter, tokenizer=tokenizer, label=label,
                           settings=settings, after_run=after_run) for item in items]
    rows = [settings.for_item(item) for item in items]
    run_ids = [new_run_id() for _ in items]
    try:
        errors = record_batch([item["prompt"] for item in items], rows, model=adapter, tokenizer=tokenizer, db=store,
                              run_ids=run_ids,
                              run_fields=[{"batch_id": batch_id, "batch_item": item["key"]} for item in items])
    except Exception as e:  # noqa: BLE001 - the group's failure is its runs', not the batch's
        errors = [f"{type(e).__name__}: {e}"] * len(items)
    return _finished(store, run_ids, items, errors, label, [row.seed for row in rows], batch_id, after_run, adapter)


def _finished(store: Store, run_ids: list[str], items: list[dict], errors: list[str | None], label: str, seeds: list,
              batch_id: str, after_run, adapter=None) -> list[dict]:
    """Recorded prompts' rows ``{run_id, key, status, n_tokens, generated, error}``: ``after_run`` run on each that
    completed, a ``failed`` run made for a prompt refused before it had one; their runs rows read in one query."""
    for run_id, error in zip(run_ids, errors):
        if error is None:
            run_after(after_run, store, run_id, adapter)
    info = _run_rows(store, run_ids)
    missing = [i for i, run_id in enumerate(run_ids) if run_id not in info]
    for i in missing:  # it failed before the recorder made its row
        _failed_row(store, run_ids[i], items[i], label, errors[i] or "no run recorded", seeds[i], batch_id)
    if missing:
        info = _run_rows(store, run_ids)
    return [{"run_id": run_id, "key": item["key"], "status": info[run_id]["status"],
             "n_tokens": info[run_id]["n_tokens"] or 0,
             "generated": max(0, int(info[run_id]["n_tokens"] or 0) - int(info[run_id]["n_prompt_tokens"] or 0)),
             "error": info[run_id]["error"]} for run_id, item in zip(run_ids, items)]


def _run_rows(store: Store, run_ids: list[str]) -> dict[str, dict]:
    """run id -> its status, n_tokens, n_prompt_tokens and error (the runs that have a row)."""
    got = store.sql("SELECT run_id, status, n_tokens, n_prompt_tokens, error FROM runs WHERE run_id IN "
                    "(SELECT unnest(?::VARCHAR[]))", [list(run_ids)])
    return {r["run_id"]: r for r in got.iter_rows(named=True)}


def groups(items: list[dict], tokenizer, batch_size: int, max_batch_tokens: int = MAX_BATCH_TOKENS) -> list[list[dict]]:
    """The prompts in groups of at most ``batch_size`` recorded together, by prompt length (a batch feeds every
    row the longest prompt's positions, so similar lengths waste the least), each group's rows x longest prompt
    at most ``max_batch_tokens`` (what one batched prefill holds)."""
    n_tok = {id(d): len(tokenizer.encode(d["prompt"]).ids) for d in items}
    out: list[list[dict]] = []
    for d in sorted(items, key=lambda d: n_tok[id(d)]):
        g = out[-1] if out else None
        if g is None or len(g) >= batch_size or (len(g) + 1) * n_tok[id(d)] > max_batch_tokens:
            out.append([d])
        else:
            g.append(d)
    return out


def load_model(model=None, tokenizer=None, settings: RecordSettings | None = None):
    """(adapter, tokenizer, label) for a batch: the model loaded once (in ``settings.dtype``, through
    ``settings.backend``), its tokenizer resolved once."""

    settings = settings or RecordSettings()
    if settings.dtype not in DTYPES:
        settings.check()  # the dtype's one-line error
    adapter = load_adapter(model, DTYPES[settings.dtype], backend=settings.backend)
    tok = tokenizer_for(adapter, tokenizer)
    label = str(adapter.checkpoint_path or type(adapter.module).__name__)
    return adapter, tok, label


class Bars:
    """Two tqdm bars on stderr: prompts, and tokens generated (updated per finished prompt)."""

    def __init__(self, n_prompts: int, n_tokens: int, desc: str, enabled: bool = True):

        self.t0 = time.monotonic()
        self.prompts = tqdm(total=n_prompts, desc=f"{desc} prompts", unit="prompt", file=sys.stderr,
                            disable=not enabled, position=0)
        self.tokens = tqdm(total=n_tokens, desc=f"{desc} tokens", unit="tok", file=sys.stderr,
                           disable=not enabled, position=1)
        self.failed = 0

    def done(self, row: dict, generated: int) -> None:
        self.failed += row["status"] != "complete"
        self.tokens.update(generated)
        self.prompts.set_postfix(failed=self.failed, refresh=False)
        self.prompts.update(1)

    def close(self) -> None:
        self.tokens.close()
        self.prompts.close()


def prepare(prompts, *, model=None, batch_id: str | None = None, settings: RecordSettings | None = None,
            **setting_kw) -> tuple[list[dict], RecordSettings, str]:
    """(items, settings, batch_id) of a prompt set: what ``record_many`` and the Ray pool both record. The default
    batch id hashes the items, ``settings.batch_dict()`` and the model's name (``batch_id_for``)."""
    items = prompt_items(prompts)
    settings = RecordSettings.of(settings, **setting_kw)
    model_id = str(model) if isinstance(model, (str, Path)) or model is None else type(model).__name__
    return items, settings, batch_id or batch_id_for(items, {**settings.batch_dict(), "model": model_id})


def record_many(prompts, *, model=None, tokenizer=None, db=None, out: str | Path | None = None,
                batch_id: str | None = None, settings: RecordSettings | None = None, after_run=None,
                progress: bool = True, batch_size: int = BATCH_SIZE, **setting_kw) -> Recorded:
    """Record every prompt of a set as its own run, all with one ``batch_id``; returns what it recorded.

    Args:
        prompts: a ``.jsonl`` / ``.txt`` file or a folder of them (``workbench.capture.prompts.load_prompt_set``), a list
            of strings, or a list of dicts (``prompt``; optional ``id``, ``max_new_tokens``, ``temperature``,
            ``seed``, which override the settings of the same name for that prompt).
        db: database path or ``Store`` (ignored with ``out``).
        out: write each finished run as Parquet shards under this folder (export layout, atomic per run)
            instead of into ``db``; ``workbench.open(out)`` reads it.
        batch_id: default: a hash of the set and the settings, so the same call again resumes the batch
            (prompts with a ``complete`` run in it are skipped).
        settings: ``RecordSettings`` (keyword fields of it, ``max_new_tokens=...`` etc., override it).
        batch_size: prompts recorded together in one batched generation (similar lengths together; 1: one at
            a time). Each run equals its single recording up to floating-point summation order. Our models and
            transformers models are batched; the few transformers families whose rows would differ from their
            single recordings (``workbench.capture.adapters.hf.SINGLE_ONLY``; their runs' notes say so) and models
            whose adapter has no batched generation record one at a time.
        The other arguments are ``workbench.record``'s.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    items, settings, batch_id = prepare(prompts, model=model, batch_id=batch_id, settings=settings, **setting_kw)
    if not items:
        raise ValueError("no prompts given: a prompt set needs at least one")
    if settings.device_map is not None:
        raise ValueError("device_map applies to single recordings (workbench.record), not prompt sets")
    skip = completed(Store(db) if out is None and not isinstance(db, Store) else db, out, batch_id)
    todo = [d for d in items if d["key"] not in skip]
    batch = Recorded(None, batch_id)
    batch.skipped = [d["key"] for d in items if d["key"] in skip]
    if not todo:
        batch.store = Store(out) if out is not None else (db if isinstance(db, Store) else Store(db))
        return batch
    adapter, tok, label = load_model(model, tokenizer, settings)
    bars = Bars(len(todo), sum(int(d.get("max_new_tokens", settings.max_new_tokens)) for d in todo), "batch",
                progress)
    rows: list[dict] = []
    tmp = None
    try:
        if out is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix="wb-shard-"))
            store = Store(tmp / "shard.duckdb")
        else:
            store = db if isinstance(db, Store) else Store(db)
        for group in groups(todo, tok, batch_size):
            for row in record_group(group, store=store, batch_id=batch_id, adapter=adapter, tokenizer=tok,
                                    label=label, settings=settings, after_run=after_run):
                if out is not None:
                    flush_run(store, out, row["run_id"])
                rows.append(row)
                bars.done(row, row["generated"])
    finally:
        bars.close()
        if tmp is not None:
            Store(tmp / "shard.duckdb").close()
            shutil.rmtree(tmp, ignore_errors=True)
    batch.store = Store(out) if out is not None else store
    batch.recorded = rows
    return batch


def flush_run(store: Store, out: str | Path, run_id: str) -> None:
    """Write a finished run from a worker's temporary store into the shard folder, then drop it there."""

    write_run(store, out, run_id)
    store.delete_run(run_id)


@dataclass
class Recorded:
    """What one ``record_many`` call did: the store holding the batch, its id, the rows (run_id, key, status,
    n_tokens, generated, error) of the prompts it recorded, and the keys it skipped as already complete."""

    store: Store | None
    batch_id: str
    recorded: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
