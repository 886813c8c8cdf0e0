"""Recording for a long-lived server (the app's Record tab): in the worker process of
``workbench.capture.background`` where it can run, else in a thread of this process.

``Recorder.start(run_id, prompt, checkpoint, settings)`` returns a ``queue.Queue`` of events, the same from
both: ``("token", (pos, text))`` per generated token, then ``("done", error or None)`` once the run's rows are
committed. A run recorded in a thread keeps its adapter and tokenizer in ``Recorder.recorded`` (root cause
then runs on that same module). Importing this module imports torch (the recorder's): only the app does.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
import warnings

import torch

from workbench.analysis.anomalies import detect as detect_anomalies
from workbench.capture import background
from workbench.capture.recorder import record_run
from workbench.data.store import Store


def record_thread_count() -> int:
    return int(os.environ.get("WORKBENCH_RECORD_THREADS", max(1, (os.cpu_count() or 2) // 2)))


@contextlib.contextmanager
def record_threads():
    """torch's intra-op threads while the app records in this process: half the CPUs, at least one.

    A parallel region waits for its slowest thread, and with one thread per core while the app (or anything
    else) keeps the cores busy, a preempted thread stalls every op: 64 demo-model tokens took 22-29 s with
    torch's 2 threads on 2 busy CPUs, 0.9-1.1 s with 1. ``$WORKBENCH_RECORD_THREADS`` sets the number (0: leave
    torch's setting); torch's setting is put back afterwards.
    """
    n = record_thread_count()
    before = torch.get_num_threads()
    if n <= 0 or n >= before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Recorder:
    """Records into ``store`` for a server: the worker process first, a thread where that cannot run.

    ``default_model``: called (once, in the recording thread) for the model when none was given and no
    checkpoint is named (e.g. the bundled demo's loader)."""

    def __init__(self, store: Store, model=None, tokenizer=None, default_model=None):
        self.store, self.model, self.tokenizer = store, model, tokenizer
        self.default_model = default_model
        self.recorded: dict[str, tuple] = {}  # run_id -> (adapter, tokenizer) of runs recorded in a thread
        self._worker: background.RecordingProcess | None = None
        self._use_worker = background.enabled() and not store.read_only
        self._loaded: list = []

    def start(self, run_id: str, prompt: str, checkpoint: str = "", settings: dict | None = None) -> queue.Queue:
        """Start recording ``prompt`` as ``run_id`` (``checkpoint``: a folder, empty: the app's model) with
        ``settings`` (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``); returns the events queue."""
        settings = dict(settings or {})
        if self._use_worker:
            try:
                if self._worker is None:
                    self._worker = background.RecordingProcess(self.store, self.model, self.tokenizer,
                                                               threads=record_thread_count())
                return self._worker.record(run_id, prompt, checkpoint.strip() or None, after_run=detect_anomalies,
                                           **settings)
            except Exception as e:  # e.g. a model that cannot be pickled: record in a thread from now on
                warnings.warn(f"recording in a worker process failed to start ({e}); recording in a thread")
                self._use_worker = False
        events: queue.Queue = queue.Queue()
        threading.Thread(target=self._record, args=(run_id, prompt, checkpoint.strip(), settings, events),
                         name=f"record-{run_id}", daemon=True).start()
        return events

    def _model(self):
        if self.model is not None:
            return self.model
        if not self._loaded:
            if self.default_model is None:
                raise FileNotFoundError("no model: give the app one, or name a checkpoint folder")
            self._loaded.append(self.default_model())
        return self._loaded[0]

    def _record(self, run_id: str, prompt: str, checkpoint: str, settings: dict, events: queue.Queue) -> None:
        error = None
        try:
            with record_threads():
                model = checkpoint or self._model()
                rid, _, adapter, tok = record_run(
                    prompt, model=model, tokenizer=None if checkpoint else self.tokenizer, db=self.store,
                    run_id=run_id, on_token=lambda pos, text: events.put(("token", (pos, text))),
                    after_run=detect_anomalies, **settings)
                self.recorded[rid] = (adapter, tok)
        except BaseException as e:  # shown to the user
            error = e
        finally:
            events.put(("done", error))
