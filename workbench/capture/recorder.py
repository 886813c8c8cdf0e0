"""The recorder: one loop over any model adapter, driven by the signal registry.

``record_run`` resolves the model to an adapter (``workbench.capture.adapters``), inserts the run row (with the
neutral model summary), attaches every chosen signal's probe to the adapter's seams, streams the
generation, and hands each step's rows to a background ``Writer`` that commits them as whole steps.
It returns the run id; ``workbench.record`` (workbench/run.py) wraps it into a ``Run``.
"""
from __future__ import annotations

import contextlib
import json
import operator
import os
import sys
import time
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator

import polars as pl
import torch
from tqdm import tqdm

from workbench.capture.adapters import Adapter, load_adapter
from workbench.capture.adapters.base import Route
from workbench.capture.batched import BatchRecorder, batch_probe_names
from workbench.capture.interventions import applied as intervening
from workbench.capture.interventions import check as check_interventions
from workbench.capture.interventions import normalize as interventions_of
from workbench.capture.interventions import rows as intervention_rows
from workbench.capture.probes import PROBE_CLASSES, Probe, StepInfo, dispatch
from workbench.capture.resolve import check_folder, tokenizer_for, tokenizer_path
from workbench.capture.settings import RecordSettings, check_generation
from workbench.data.schema import columns
from workbench.data.signals import PROBES, RECORDED_SEAMS
from workbench.data.store import Store, Writer, merge_batches
from workbench.model import file_sha256, state_sha256

__all__ = ["DTYPES", "MAX_PROMPT_CHARS", "RecordSettings", "Recorder", "check_generation", "record_batch",
           "record_run"]

MAX_PROMPT_CHARS = 200_000
DTYPES = {None: None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class Recorder:
    """The chosen signals' probes over one adapter: ``listeners()`` for its seams, ``collect`` per step."""

    def __init__(self, adapter: Adapter, run_id: str, probes: Iterable[str] = PROBES):
        names = list(dict.fromkeys(probes))
        unknown = set(names) - set(PROBES)
        if unknown:
            raise ValueError(f"unknown probes {sorted(unknown)}; choose from {PROBES}")
        self.names = names
        self.probes: list[Probe] = [PROBE_CLASSES[n](adapter, run_id) for n in names]

    def listeners(self) -> dict[str, Callable]:
        """One dispatching listener per seam, calling every probe that listens there."""
        return dispatch(self.probes)

    def collect(self, step: StepInfo) -> dict:
        return merge_batches([p.collect(step) for p in self.probes])

    def flush(self) -> dict:
        return merge_batches([p.flush() for p in self.probes])

    @staticmethod
    def flush_many(recs: list["Recorder"]) -> list[dict]:
        """``flush()`` of several recorders of the same probes (the rows of one batched generation): each probe
        class reduces its probes of every row together (``Probe.flush_many``); one batch per recorder."""
        if not recs:
            return []
        per_probe = [type(ps[0]).flush_many(list(ps)) for ps in zip(*(r.probes for r in recs))]
        return [merge_batches(list(got)) for got in zip(*per_probe)]

    def pending_bytes(self) -> int:
        return sum(p.pending_bytes() for p in self.probes)


# Decode steps are reduced together: at most this many steps, this long, or these many kept bytes apart
# (the prefill, the last step, and every step of a recording with an ``on_token`` consumer are flushed at
# once). The writer commits every 0.5 s anyway, so this holds back little the store would already have had.
FLUSH_STEPS, FLUSH_SECONDS, FLUSH_BYTES = 64, 0.5, 32 << 20
BATCH_FLUSH_SECONDS = 2.0
# the writer's transaction window (``Writer.interval``): a commit costs tens of ms of CPU whatever its size, so a
# recording nobody watches step by step (no ``on_token``) commits less often; a crash loses at most this long
WRITE_SECONDS, LIVE_WRITE_SECONDS, BATCH_WRITE_SECONDS = 1.0, 0.5, 2.0


def eos_of(tokenizer, adapter: Adapter) -> int | None:
    """The end-of-text id: the tokenizer's ``<|endoftext|>``, else the model config's eos id (if in vocabulary)."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    if eos is None:
        cfg_eos = getattr(getattr(adapter.module, "config", None), "eos_token_id", None)
        cfg_eos = cfg_eos[0] if isinstance(cfg_eos, (list, tuple)) and cfg_eos else cfg_eos
        if isinstance(cfg_eos, int) and 0 <= cfg_eos < adapter.summary.vocab_size:
            eos = cfg_eos
    return eos


def model_identity(model, adapter: Adapter, dtype_changed: bool, weights_sha: str | None = None) -> tuple[str, str]:
    """(label, sha256) of a run's model: its checkpoint folder's file hash when it runs as loaded from one
    (a folder given, or a module loaded from a folder and not cast), else the in-memory weights' hash
    (``weights_sha``: that hash when the caller has it already)."""
    folder = adapter.checkpoint_path
    if folder and Path(folder).is_dir() and (isinstance(model, (str, Path)) or not dtype_changed):
        return os.path.abspath(folder), file_sha256(folder)  # absolute: a replay from another folder finds it
    return str(folder or type(adapter.module).__name__), weights_sha or _state_sha(adapter)


# up to this many bytes of weights, the remembered hash is also keyed on each tensor's checksum (about 0.7 ms per
# 1M parameters on one CPU core, under 1% of a 256-token demo recording): an edit through ``.data`` changes no
# tensor's version counter, only its values. Larger models are keyed on versions only (a full pass per recording).
CHECKSUM_BYTES = 1 << 30
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksums(state: dict) -> tuple | None:
    """Each tensor's bytes summed as 64-bit integers (wrapping; a tensor whose bytes are no whole number of them: as
    integers of its element width), so any changed element changes it (only a permutation inside one tensor that
    keeps its sum is missed), or None past ``CHECKSUM_BYTES`` or for a tensor it cannot view. Summing int64 words is
    several times faster than widening each 32-bit element to int64 first (about 3 against 8 ms on the demo)."""
    tensors = list(state.values())
    if sum(v.numel() * v.element_size() for v in tensors) > CHECKSUM_BYTES:
        return None
    try:
        sums = [_word_sum(v.detach().reshape(-1)) for v in tensors]
        return tuple(torch.stack([x.to(sums[0].device) for x in sums]).tolist()) if sums else ()
    except Exception:  # noqa: BLE001 - an element size with no integer view, a tensor with no data (meta): versions only
        return None


def _word_sum(flat: torch.Tensor) -> torch.Tensor:
    """A flat tensor's checksum: its int64 words' sum where its bytes view as them, else its elements' as integers."""
    if flat.numel() * flat.element_size() % 8 == 0:
        try:
            return flat.view(torch.int64).sum()
        except RuntimeError:  # a storage offset not on an 8-byte boundary
            pass
    return flat.view(_INT_VIEW[flat.element_size()]).sum(dtype=torch.int64)


def _state_sha(adapter: Adapter, state: dict | None = None) -> str:
    """``state_sha256``, remembered on the module until a tensor is replaced or changed in place (``state``: the
    module's ``state_dict()`` when the caller has it already: walking the module costs milliseconds): keyed on each
    tensor's pointer and version, and, up to ``CHECKSUM_BYTES``, its checksum (an edit through ``.data``)."""
    module = adapter.module
    state = state or module.state_dict()
    key = (tuple((k, v.data_ptr(), v._version) for k, v in state.items()), _checksums(state))
    cached = getattr(module, "_workbench_sha", None)
    if cached is None or cached[0] != key:
        cached = (key, state_sha256(module))
        module._workbench_sha = cached  # type: ignore[attr-defined]
    return cached[1]


def _weights_sha(adapter: Adapter) -> str | None:
    """``runs.weights_sha256``: the in-memory weights' hash (``_state_sha``); None when some are offloaded (an
    accelerate device map's meta tensors hold no data here: hashing them would mean loading them all)."""
    state = adapter.module.state_dict()
    if any(v.device.type == "meta" for v in state.values()):
        return None
    return _state_sha(adapter, state)


def _config_json(adapter: Adapter) -> str:
    m = adapter.module
    cfg = m.args.to_dict() if hasattr(m, "args") else m.config.to_dict()
    return json.dumps(cfg, default=str)


def check_ids(ids: list, vocab_size: int) -> list[int]:
    """Token ids as ints inside the vocabulary, or a ValueError naming the first bad one."""
    out = []
    for i, t in enumerate(ids):
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)  # ints and numpy / torch integers, never floats
        except TypeError:
            raise ValueError(f"token id at position {i} is not an integer: {t!r}") from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} at position {i} is outside the model's vocabulary (0..{vocab_size - 1})")
        out.append(t)
    return out


def _check_request(prompt, settings: RecordSettings, run_fields) -> list[str]:
    """ValueError (one line) for a request no recording can run, before any model is loaded or row written;
    returns the probe names."""
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("empty prompt: type some text to record")
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt of {len(prompt)} characters is over the {MAX_PROMPT_CHARS} limit")
    settings.check()
    bad = set(run_fields or {}) - (set(columns("runs")) - {"run_id", "status", "model", "config", "params", "prompt"})
    if bad:
        raise ValueError(f"run_fields may set only other columns of runs, not {sorted(bad)}")
    return settings.probe_names


def _encode(prompt, adapter: Adapter, tokenizer, max_new_tokens: int) -> list[int]:
    """The prompt's token ids, checked against the vocabulary and the model's context."""
    ids = check_ids(list(prompt), adapter.summary.vocab_size) if not isinstance(prompt, str) else \
        tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens" if isinstance(prompt, str) else "empty prompt: no token ids")
    vocab = adapter.summary.vocab_size
    if isinstance(prompt, str) and max(ids) >= vocab:  # a tokenizer larger than the model (a module passed in)
        raise ValueError(f"the prompt encodes to token id {max(ids)}, past the model's vocabulary of {vocab}: the "
                         "tokenizer does not fit the model; pass the model's own (--tokenizer PATH)")
    limit = adapter.summary.max_seq_len
    if len(ids) + max_new_tokens - 1 > limit:  # the last new token is produced, never fed: it needs no slot
        raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                         f"context of {limit} tokens (the prompt and every new token but the last are fed)")
    return ids


def _insert_run(store: Store, run_id: str, adapter: Adapter, source: dict, prompt, ids: list[int], tokenizer,
                params: dict, seed: int, parent_run_id: str | None, run_fields: dict | None) -> None:
    """The run's first ``runs`` row (status ``running``), with the neutral model summary and ``source``
    (``_open``'s provenance: model, checkpoint_sha256, tokenizer, weights_sha256)."""
    store.append({"runs": _run_row(run_id, adapter, source, prompt, ids, tokenizer, params, seed, parent_run_id,
                                   run_fields)})


def _run_row(run_id: str, adapter: Adapter, source: dict, prompt, ids: list[int], tokenizer, params: dict, seed: int,
             parent_run_id: str | None, run_fields: dict | None) -> pl.DataFrame:
    summary = adapter.summary
    return pl.DataFrame({
        "run_id": [run_id], "created_at": [datetime.now(timezone.utc).replace(tzinfo=None)], "status": ["running"],
        "config": [_config_json(adapter)], **{k: [v] for k, v in source.items()},
        "dtype": [str(adapter.dtype).removeprefix("torch.")], "device": [str(adapter.device)],
        "prompt": [prompt if isinstance(prompt, str) else tokenizer.decode(ids)], "params": [json.dumps(params)],
        "seed": [seed], "parent_run_id": [parent_run_id], "n_prompt_tokens": [len(ids)], "n_tokens": [len(ids)],
        "pid": [os.getpid()], "summary": [json.dumps(summary.to_dict())],
        "notes": ["; ".join(summary.notes) or None], **{k: [v] for k, v in (run_fields or {}).items()},
    })


class _Recording:
    """One run being recorded: its probes, the steps collected but not yet handed to the writer, its length."""

    writer: Writer  # set once the run's row exists

    def __init__(self, run_id: str, adapter, probes: list[str], ids: list[int], tokenizer, max_new_tokens: int,
                 eos: int | None, topk: int, on_token=None, bar=None, flush_seconds: float = FLUSH_SECONDS,
                 batch: tuple[BatchRecorder, int] | None = None):
        self.run_id, self.tokenizer, self.eos, self.topk = run_id, tokenizer, eos, topk
        self.flush_seconds = flush_seconds
        self.rec = Recorder(adapter, run_id, probes)
        self.batch = batch  # (the batch-wide probes of the other signals, this run's row in them)
        self.texts = [tokenizer.decode([i]) for i in ids]
        self.end = len(ids) + max_new_tokens
        self.n_tokens = len(ids)
        self.on_token, self.bar = on_token, bar
        self.pending: list[dict] = []  # collected steps not yet flushed
        self.last_flush = time.monotonic()

    def step(self, step, wall_ms: float) -> bool:
        """Collect one finished generation step; True when it was the run's last."""
        final, new_text = self.collect(step, wall_ms)
        if self.due(step, final):
            self.writer.put(merge_batches(self.pending + [self.rec.flush()]))  # whole steps, one put
            self.flushed()
        if self.on_token:
            self.on_token(self.n_tokens - 1, new_text)
        if self.bar:
            self.bar.update(1)
        return final

    def collect(self, step, wall_ms: float) -> tuple[bool, str]:
        """The probes' rows of one finished step kept (not yet flushed); (whether it was the last, its new text)."""
        new_pos = step.start_pos + len(step.input_ids)
        new_text = self.tokenizer.decode([step.next_token])
        final = new_pos + 1 >= self.end or step.next_token == self.eos
        info = StepInfo(self.run_id, step.index, step.start_pos, step.input_ids, step.logits, step.next_token,
                        new_text, self.texts, final, wall_ms, self.topk)
        self.pending.append(self.rec.collect(info))
        if self.batch is not None:
            self.pending.append(self.batch[0].collect(self.batch[1], info))
        self.n_tokens = new_pos + 1
        return final, new_text

    def due(self, step, final: bool) -> bool:
        """Whether the steps collected so far are reduced and handed to the writer now: a live consumer
        (on_token) may read the store, or block, before the next step, so it gets every step handed to the
        writer before it is told of it; else the prefill, the last step, and every FLUSH_STEPS steps, FLUSH_BYTES
        kept or ``flush_seconds``."""
        return self.on_token is not None or final or step.index == 0 or self.due_batched()

    def due_batched(self) -> bool:
        """``due`` for a row of a batched generation (no live consumer; its prefill waits for the next flush)."""
        return (len(self.pending) >= FLUSH_STEPS or self.rec.pending_bytes() > FLUSH_BYTES
                or time.monotonic() - self.last_flush > self.flush_seconds)

    def flushed(self) -> None:
        self.pending, self.last_flush = [], time.monotonic()

    def flush_kept(self) -> None:
        """Hand the steps collected before an interruption to the writer (they are kept)."""
        if self.pending:
            with torch.inference_mode():  # the kept tensors are the stream's inference tensors
                own = [self.batch[0].flush([self.batch[1]])[0]] if self.batch is not None else []
                self.writer.put(merge_batches(self.pending + [self.rec.flush()] + own))
            self.pending = []

    def finish(self, store: Store, status: str, error: str | None) -> None:
        """The run's final row, set once the writer has committed everything before it (a failed write fails it)."""
        self.writer.then(lambda write_error: store.update_run(self.run_id, **self.final(status, error, write_error)))

    def final(self, status: str, error: str | None, write_error: BaseException | None) -> dict:
        """The fields of the run's final update."""
        return {"status": status if write_error is None else "failed",
                "error": error if write_error is None else f"StoreError: {write_error}", "n_tokens": self.n_tokens,
                "finished_at": datetime.now(timezone.utc).replace(tzinfo=None)}


def _open(model, tokenizer, db, settings: RecordSettings, device_map=None, text: bool = True):
    """(store, adapter, tokenizer, provenance) of a recording: a model folder's config and tokenizer are checked
    before its weights are read and before the store is opened (``resolve.check_folder``); the provenance is
    the ``runs`` columns model (absolute folder, or class name), checkpoint_sha256, tokenizer (its file) and
    weights_sha256 (the weights in memory now, as they will run: an in-place edit or a weight fault shows)."""
    tok_file = tokenizer_path(model if isinstance(model, (str, Path)) else None, tokenizer)
    tokenizer = check_folder(model, tokenizer, settings.dtype, device_map, text)
    # a Store, or a stand-in with its append / update_run / replace_rows (workbench.capture.background's relay)
    store = Store(db) if db is None or isinstance(db, (str, Path)) else db
    adapter = load_adapter(model, DTYPES[settings.dtype], backend=settings.backend, device_map=device_map)
    if tok_file is None and tokenizer is None:
        tok_file = tokenizer_path(adapter)
    tokenizer = tokenizer_for(adapter, tokenizer)
    weights = _weights_sha(adapter)  # once: its checksums read every weight
    label, sha = model_identity(model, adapter, dtype_changed=settings.dtype is not None, weights_sha=weights)
    for note in adapter.summary.notes:
        warnings.warn(f"recording {label}: {note}", stacklevel=4)
    source = {"model": label, "checkpoint_sha256": sha, "tokenizer": tok_file, "weights_sha256": weights}
    return store, adapter, tokenizer, source


def record_run(prompt: str | list[int], settings: RecordSettings | None = None, *, model=None, tokenizer=None,
               db=None, progress: bool = False, on_token: Callable[[int, str], None] | None = None,
               parent_run_id: str | None = None, run_id: str | None = None, run_fields: dict | None = None,
               after_run: Callable[..., object] | None = None, interventions=None,
               **setting_kw) -> tuple[str, Store, Adapter, object]:
    """Record one generation; returns (run_id, store, adapter, tokenizer). See ``workbench.record``.

    ``settings``: how to generate and what to record (``RecordSettings``; keyword fields of it, e.g.
    ``max_new_tokens=8``, override it). ``run_fields``: more ``runs`` columns for the run's first row (e.g. a
    prompt set's ``batch_id``), so they are there from the start, a run killed mid-way included.
    ``after_run``: run on the stored run once it is recorded (``run_after``; e.g. the anomaly detectors).
    ``interventions``: ``workbench.capture.interventions`` values or specs to record under (checked against the
    model before the run row exists; stored in the ``interventions`` table with the run)."""
    settings = RecordSettings.of(settings, **setting_kw)
    probes = _check_request(prompt, settings, run_fields)
    ivs = interventions_of(interventions)
    store, adapter, tokenizer, source = _open(model, tokenizer, db, settings, settings.device_map,
                                              text=isinstance(prompt, str))
    ids = _encode(prompt, adapter, tokenizer, settings.max_new_tokens)
    check_interventions(adapter, ivs)
    run_id = run_id or new_run_id()
    bar = None
    if progress:
        bar = tqdm(total=settings.max_new_tokens, desc=f"record {run_id}", unit="tok", file=sys.stderr)
    run = _Recording(run_id, adapter, probes, ids, tokenizer, settings.max_new_tokens, eos_of(tokenizer, adapter),
                     settings.topk, on_token, bar)  # the probes are made before the run row exists
    _insert_run(store, run_id, adapter, source, prompt, ids, tokenizer,
                settings.params(ids, adapter.summary.backend), settings.seed, parent_run_id, run_fields)
    if ivs:
        store.append({"interventions": pl.DataFrame(intervention_rows(run_id, ivs), schema=_INTERVENTION_TYPES)})
    run.writer = writer = Writer(store, interval=WRITE_SECONDS if on_token is None else LIVE_WRITE_SECONDS)
    try:
        # the interventions' hooks come first: the probes see what the model computed under them
        with _finishing(lambda: [run], store, writer), intervening(adapter, ivs), adapter.seams(run.rec.listeners()):
            t0 = time.perf_counter()
            for step in adapter.stream(ids, settings.max_new_tokens, settings.temperature, settings.top_p,
                                       settings.seed, run.eos):
                run.step(step, (time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
    finally:
        if bar:
            bar.close()
    run_after(after_run, store, run_id, adapter)
    return run_id, store, adapter, tokenizer


_INTERVENTION_TYPES = {"run_id": pl.String, "idx": pl.Int32, "kind": pl.String, "layer": pl.Int32, "expert": pl.Int32,
                      "head": pl.Int32, "path": pl.String, "value": pl.Float64, "spec": pl.String}


def run_after(after_run: Callable[..., object] | None, store: Store, run_id: str, adapter=None) -> None:
    """``after_run(store, run_id, model=adapter)`` on a recorded run (capture never imports the analyses: the
    caller hands in, e.g., the anomaly detectors, which judge the run's components with the model it was
    recorded with). Its failure is a warning, never the recording's: the run is stored already."""
    if after_run is None:
        return
    try:
        after_run(store, run_id, model=adapter)
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"{getattr(after_run, '__name__', 'after_run')} failed for run {run_id}: {e}")


@contextlib.contextmanager
def _finishing(unfinished: Callable[[], list[_Recording]], store: Store, writer: Writer) -> Iterator[None]:
    """The end of a recording loop, whatever ends it: the runs ``unfinished()`` names then (its steps collected
    so far handed to the writer) get their final status (complete, or interrupted / failed with the error, which
    is raised on), and the writer is closed once everything is committed."""
    status, error = "complete", None
    try:
        yield
    except KeyboardInterrupt:
        status, error = "interrupted", "KeyboardInterrupt"
        raise
    except BaseException as e:
        status, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        runs = unfinished()
        try:
            for run in runs:
                run.flush_kept()
        finally:
            for run in runs:
                run.finish(store, status, error)
            writer.close()


def new_run_id() -> str:
    return "r" + uuid.uuid4().hex[:11]  # never all digits: Hive partitions would read it as BIGINT


class _RowView:
    """The adapter as one row of a batch sees it: that row's KV cache; everything else is the adapter's."""

    def __init__(self, adapter: Adapter, row: int):
        self._adapter, self._row = adapter, row

    def __getattr__(self, name: str):
        return getattr(self._adapter, name)

    def kv_state(self):
        return self._adapter.kv_state(row=self._row)


def fan_out(rows: list[dict[str, Callable] | None]) -> dict[str, Callable]:
    """Batch-level seam listeners that hand each row's listeners that row's slice: ``[B, ...]`` tensors by
    row, a route's ``N = B * T`` rows (batch-major) by row. ``rows[b]`` set to None stops row b's listeners."""
    seams = set().union(*(d.keys() for d in rows if d))
    unknown = seams - RECORDED_SEAMS  # the recorded signals' seams; interventions' seams are per row
    if unknown:
        raise ValueError(f"batched recording cannot split the seams {sorted(unknown)}")

    def attn_probs(layer: int, probs: torch.Tensor, q_start: int, *rest) -> None:  # [B, Tc, H, S]
        for b, d in enumerate(rows):
            if d is not None:
                d["attn_probs"](layer, probs[b], q_start, *rest)
    attn_probs.batched = True  # type: ignore[attr-defined]

    def attn_row(layer: int, probs: torch.Tensor, q_start: int) -> None:  # [B, 1, H, S]
        for b, d in enumerate(rows):
            if d is not None:
                d["attn_row"](layer, probs[b], q_start)
    attn_row.batched = True  # type: ignore[attr-defined]

    def attn_stats(layer: int, stats: torch.Tensor, received: torch.Tensor, q_start: int, *rest) -> None:
        for b, d in enumerate(rows):  # [B, Tc, H, 3], [B, S]
            if d is not None:
                d["attn_stats"](layer, stats[b], received[b], q_start, *rest)
    attn_stats.batched = True  # type: ignore[attr-defined]

    def by_row(seam: str) -> Callable:
        def call(layer: int, x: torch.Tensor) -> None:  # [B, T, ...]
            for b, d in enumerate(rows):
                if d is not None:
                    d[seam](layer, x[b:b + 1])
        return call

    # each MoE layer's last choice [N, K], its expert count, and (once asked) its rows per expert and batch row [E][B]:
    # how expert_out's calls split by row
    chosen: dict[int, list] = {}

    def routed(layer: int, r: Route) -> None:
        t = r.logits.size(0) // len(rows)
        chosen[layer] = [r.indices, r.math.n_experts, None]
        for b, d in enumerate(rows):
            if d is not None and "routed" in d:
                s = slice(b * t, (b + 1) * t)
                d["routed"](layer, Route(layer, r.logits[s], r.indices[s], r.weights[s], r.math))

    def expert_out(layer: int, expert: int, y: torch.Tensor, act: torch.Tensor | None) -> None:
        # an expert's rows are in row order (batch-major): each batch row's come as one block
        got = chosen[layer]
        if got[2] is None:  # one count per forward, not per expert call
            idx, n_e, n_b = got[0], got[1], len(rows)
            flat = idx.reshape(-1)
            row = torch.arange(n_b, device=idx.device).repeat_interleave(flat.numel() // n_b)
            ok = (flat >= 0) & (flat < n_e)
            got[2] = torch.bincount((flat * n_b + row)[ok], minlength=n_e * n_b).view(n_e, n_b).tolist()
        per_row = got[2][expert]
        ys = y.split(per_row)
        acts = act.split(per_row) if act is not None else [None] * len(rows)
        for b, d in enumerate(rows):
            if d is not None and per_row[b]:  # a row calls only the experts it chose
                d["expert_out"](layer, expert, ys[b], acts[b])

    own = {"attn_probs": attn_probs, "attn_stats": attn_stats, "attn_row": attn_row, "routed": routed,
           "expert_out": expert_out}
    return {seam: own.get(seam) or by_row(seam) for seam in seams}


def record_batch(prompts: list, settings: list[RecordSettings], *, model=None, tokenizer=None, db=None,
                 run_ids: list[str], run_fields: list[dict | None]) -> list[str | None]:
    """Record several prompts in one batched generation (``Adapter.stream_batch``), each as its own run that
    equals its single recording (``record_run``) up to floating-point summation order. Per-row settings
    (``settings[b]``; what the rows share, dtype, probes, topk and backend, must be the same in all of them).

    Returns one error per prompt (None: recorded ``complete``; a string: the run is ``failed`` with it, or, for a
    prompt refused before its run row existed, there is no run). Needs ``adapter.supports_batch``."""
    n = len(prompts)
    if len(settings) != n or len(run_ids) != n or len(run_fields) != n:
        raise ValueError(f"record_batch needs one settings, run id and run_fields per prompt ({n} prompts; got "
                         f"{len(settings)}, {len(run_ids)}, {len(run_fields)})")
    if not n:
        return []
    shared = {(s.dtype, tuple(s.probes), s.topk, s.backend) for s in settings}
    if len(shared) > 1:
        raise ValueError("the rows of one batched generation share dtype, probes, topk and backend; these differ")
    if any(s.device_map is not None for s in settings):
        raise ValueError("device_map applies to single recordings (record_run), not batched ones")
    first = settings[0]
    errors: list[str | None] = [None] * n
    for b in range(n):
        try:
            _check_request(prompts[b], settings[b], run_fields[b])
        except ValueError as e:
            errors[b] = f"ValueError: {e}"
    if first.dtype not in DTYPES:  # no model can load in it: the rows' common error, raised
        first.check()
    store, adapter, tokenizer, source = _open(model, tokenizer, db, first,
                                              text=any(isinstance(p, str) for p in prompts))
    if not adapter.supports_batch:
        raise ValueError(f"{type(adapter).__name__} records one prompt at a time (no batched generation)")
    probes = first.probe_names
    ids: dict[int, list[int]] = {}
    for b in range(n):
        if errors[b] is None:
            try:
                ids[b] = _encode(prompts[b], adapter, tokenizer, settings[b].max_new_tokens)
            except ValueError as e:
                errors[b] = f"ValueError: {e}"
    live = sorted(ids)
    if not live:
        return errors
    eos = eos_of(tokenizer, adapter)
    # the signals whose probes take the batch's [B, ...] tensors (one object for all rows); the others keep a probe
    # per row, fed its slice of every seam
    whole = batch_probe_names(adapter, probes)
    batch = BatchRecorder(adapter, [run_ids[b] for b in live], whole)
    per_row = [p for p in probes if p not in whole]
    # a batch flushes its rows less often by time (the steps rule holds)
    runs = [_Recording(run_ids[b], _RowView(adapter, r), per_row, ids[b], tokenizer, settings[b].max_new_tokens, eos,
                       first.topk, flush_seconds=BATCH_FLUSH_SECONDS, batch=(batch, r)) for r, b in enumerate(live)]
    writer = Writer(store, interval=BATCH_WRITE_SECONDS)
    for run in runs:
        run.writer = writer
    listening: list[dict | None] = [r.rec.listeners() for r in runs]
    open_runs: set[int] = set()  # rows with a run row and no final status yet
    with _finishing(lambda: [runs[r] for r in sorted(open_runs)], store, writer):
        # every row's run row in one transaction
        store.append({"runs": pl.concat([_run_row(run_ids[b], adapter, source, prompts[b], ids[b], tokenizer,
                                                  settings[b].params(ids[b], adapter.summary.backend),
                                                  settings[b].seed, None, run_fields[b]) for b in live],
                                        how="diagonal_relaxed")})
        open_runs.update(range(len(live)))
        ended: list[int] = []  # rows that ended: written and finished at the next flush (one commit for several)

        def write(flush: list[int]) -> None:
            """Every row of ``flush`` with collected steps, at once (each probe reduces all their kept steps
            together)."""
            flush = [r for r in flush if runs[r].pending]
            if flush:
                got = Recorder.flush_many([runs[r].rec for r in flush])
                whole_rows = batch.flush(flush)
                writer.put(merge_batches([p for r in flush for p in runs[r].pending] + got + whole_rows))
                for r in flush:
                    runs[r].flushed()

        def close(done: list[int]) -> None:
            """The rows complete once their last steps, handed to the writer, are committed: one update for all
            (``Store.update_runs``: one checkpoint; a stand-in store without it updates them one by one)."""
            if not done:
                return
            ended_runs = [runs[r] for r in done]
            open_runs.difference_update(done)
            many = getattr(store, "update_runs", None)

            def update(write_error: BaseException | None) -> None:
                got = [(run.run_id, run.final("complete", None, write_error)) for run in ended_runs]
                if many is not None:
                    many(got)
                else:
                    for rid, fields in got:
                        store.update_run(rid, **fields)
            writer.then(update)

        with adapter.seams(_joined(fan_out(listening), batch.listeners())):
            t0 = [time.perf_counter()] * len(runs)
            rows = [settings[b] for b in live]
            try:
                for bstep in adapter.stream_batch([ids[b] for b in live], [s.max_new_tokens for s in rows],
                                                  [s.temperature for s in rows], [s.top_p for s in rows],
                                                  [s.seed for s in rows], eos):
                    batch.end_forward(bstep.start_pos, bstep.n_fed)
                    due = False
                    for r, step in enumerate(bstep.steps):
                        if step is None:
                            continue
                        now = time.perf_counter()
                        last, _ = runs[r].collect(step, (now - t0[r]) * 1e3)
                        due = due or runs[r].due_batched()
                        if last:  # the row is still fed until the batch ends: nothing more of it is kept
                            listening[r] = None
                            batch.stop(r)
                            ended.append(r)
                        t0[r] = now
                    due = due or batch.pending_bytes() > FLUSH_BYTES * len(runs)
                    # the rows flush together when one is due by steps, bytes or time, and when every row has ended;
                    # a row that ended waits for that flush (a commit and a status per row cost the writer tens of ms)
                    if due or len(ended) == len(open_runs):
                        write(sorted(open_runs))
                        close(ended)
                        ended = []
            except BaseException:
                if ended:  # the rows that ended before the failure are complete: written and finished as such
                    with contextlib.suppress(BaseException), torch.inference_mode():
                        write(ended)
                        close(ended)
                raise
            write(ended)  # none: the last forward ends every row
            close(ended)
    return errors


def _joined(a: dict[str, Callable], b: dict[str, Callable]) -> dict[str, Callable]:
    """Two sets of batch-level seam listeners as one (a seam both listen to calls both, ``a``'s first)."""
    out = dict(a)
    for seam, fn in b.items():
        if seam not in out:
            out[seam] = fn
            continue
        first = out[seam]

        def both(*args, f=first, g=fn) -> None:
            f(*args)
            g(*args)
        both.batched = True  # type: ignore[attr-defined]
        out[seam] = both
    return out
