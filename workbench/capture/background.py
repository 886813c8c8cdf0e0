"""Recording in a process of its own, for a long-lived server (the Gradio app's Record tab).

Every Gradio handler is mostly Python and holds the GIL while it runs; a recording in the app's own process
needs the GIL between every torch op, so each request served beside it slows its steps (8 reading clients
made a Record-tab recording 4-5x slower: benchmarks/RESULTS.md "UI under load"). ``RecordingProcess`` runs
recordings in one long-lived worker process instead (started on the first recording, the default model
loaded there once): the worker has an interpreter of its own and does all the model's and the probes' work.

The database file stays with the app's process: the worker's ``record_run`` (and then ``after_run``, e.g. the detectors)
write into a ``RelayStore``: a private DuckDB file of the worker (the detectors read the run back there) whose
every write (appended rows, replaced rows, run updates) is also sent over a connection, and a thread of the
app applies them to the app's ``Store`` in order (a DuckDB file can be held by one process at a time; handing
it over at every commit would cost a reconnect and a checkpoint each time). The run row carries the worker's pid, so a worker killed mid-run is
marked ``interrupted`` by the store's liveness check like any crashed recorder; the app reports it at once
and the next recording starts a new worker.
"""
from __future__ import annotations

import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import torch

from workbench.capture.recorder import record_run
from workbench.capture.settings import RecordSettings
from workbench.data.store import FINAL_STATUSES, Store, StoreError

START_TIMEOUT_S = 120.0  # for the worker to import torch and connect back

PROFILE_TABLES = ("profiles", "activation_profiles")  # what a recording's detectors read from the app's store


class _Events:
    """The worker's end of the connection: one message at a time from any of its threads."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def put(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)


class RelayStore(Store):
    """A store whose writes also go to another process: each ``append``, ``replace_rows`` (and so ``replace``)
    and ``update_run`` is applied to this (private) database file, then sent as ``(kind, run_id, payload)`` through
    ``events.put``: ``("append", None, batches)``, ``("replace_rows", None, (table, keys, df))``, ``("update",
    run_id, fields)``. Reads are this file's. ``RecordingProcess._pump`` applies the messages in order."""

    def __init__(self, path, events: _Events):
        super().__init__(path)
        self.events = events

    def append(self, batches: dict, cur=None) -> None:
        super().append(batches, cur)
        self.events.put(("append", None, batches))

    def update_run(self, run_id: str, **fields: Any) -> None:
        super().update_run(run_id, **fields)
        self.events.put(("update", run_id, fields))

    def replace_rows(self, table: str, keys: dict, df, *, all_rows: bool = False) -> None:
        super().replace_rows(table, keys, df, all_rows=all_rows)
        self.events.put(("replace_rows", None, (table, keys, df, all_rows)))


def _portable(e: BaseException) -> BaseException:
    """The exception if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def _serve(address: str, authkey: bytes) -> None:
    """The worker (``python -m workbench.capture.background ADDRESS``): connect, take the model, record each job until
    told to stop (None) or the app goes away."""
    conn = Client(address, authkey=authkey)
    model, tokenizer, threads, path = conn.recv()

    if threads > 0:
        torch.set_num_threads(threads)


    events = _Events(conn)
    tmp = Path(tempfile.mkdtemp(prefix="workbench-recorder-"))
    mirror = Store(tmp / "mirror.duckdb")  # the private file, written here without relaying
    relay = RelayStore(tmp / "mirror.duckdb", events)  # the same file (one connection), writes relayed
    default: list = []
    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:
                return
            if job is None:
                return
            rid, prompt, checkpoint, settings, profiles, after_run = job
            try:
                chosen = checkpoint or model
                if chosen is None:  # the bundled demo, loaded once
                    if not default:
                        from workbench.model import load_checkpoint  # lazy: only when the demo is asked for
                        default.append(load_checkpoint())
                    chosen = default[0]
                for table, rows in profiles.items():  # the app's baselines (both kinds), for detect
                    mirror.replace_rows(table, {}, rows, all_rows=True)
                record_run(prompt, settings, model=chosen, tokenizer=None if checkpoint else tokenizer, db=relay,
                           run_id=rid, on_token=lambda pos, text, rid=rid: events.put(("token", rid, (pos, text))),
                           after_run=after_run)
            except BaseException as e:  # noqa: BLE001 - reported to the app
                try:
                    mirror.delete_run(rid)  # what it committed is in the app's store
                finally:
                    events.put(("done", rid, _portable(e)))
                continue
            try:
                mirror.delete_run(rid)  # the app's store has it now
            finally:
                events.put(("done", rid, None))
    finally:
        mirror.close()
        shutil.rmtree(tmp, ignore_errors=True)


class RecordingProcess:
    """One worker process recording into ``store`` on behalf of this process (see the module docstring).

    ``record(...)`` queues a recording and returns a ``queue.Queue`` of its events: ``("token", (pos, text))``
    for each generated token, then ``("done", error or None)`` once its rows are committed.
    """

    def __init__(self, store: Store, model=None, tokenizer=None, threads: int = 0):
        self.store, self.model, self.tokenizer, self.threads = store, model, tokenizer, threads
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._lock = threading.Lock()
        self._waiting: dict[str, queue.Queue] = {}

    def _start(self) -> None:
        # a fresh interpreter started as a module (not a fork of this process's threads and torch state, and
        # not multiprocessing's spawn, which re-imports the caller's __main__)
        init = pickle.dumps((self.model, self.tokenizer, self.threads, str(self.store.path)))  # fails here if the
        authkey = os.urandom(16)                                                               # model can't cross
        listener = Listener(family="AF_UNIX", authkey=authkey)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "workbench.capture.background", listener.address],
                                    stdin=subprocess.PIPE, env={**os.environ, "WORKBENCH_RECORD_PROCESS": "0"})
            proc.stdin.write(authkey.hex().encode() + b"\n")
            proc.stdin.close()
            got: list = []

            def accept() -> None:
                try:
                    got.append(listener.accept())
                except OSError:  # closed below: the worker never connected
                    pass
            waiter = threading.Thread(target=accept, daemon=True)
            waiter.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            while not got and proc.poll() is None and time.monotonic() < deadline:
                waiter.join(0.1)
        finally:
            listener.close()
        if not got:
            proc.kill()
            raise RuntimeError(f"the recording process did not start (exit code {proc.poll()})")
        conn = got[0]
        conn.send_bytes(init)
        self._proc, self._conn = proc, conn
        threading.Thread(target=self._pump, args=(proc, conn), name="workbench-recorder-pump", daemon=True).start()

    def record(self, run_id: str, prompt: str, checkpoint: str | None = None, after_run=None,
               settings: RecordSettings | None = None, **setting_kw) -> queue.Queue:
        """Queue one recording (``settings``, or ``RecordSettings`` fields as keywords; ``after_run(store,
        run_id, model=adapter)``: a module-level function (it is pickled by name) run there once the run is
        recorded, against this store's baseline and activation profiles, e.g. the anomaly detectors as
        ``workbench.record`` does); its events come on the returned queue."""
        settings = RecordSettings.of(settings, **setting_kw)
        profiles = {t: self.store.sql(f"SELECT * FROM {t}") for t in PROFILE_TABLES}
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            q: queue.Queue = queue.Queue()
            self._waiting[run_id] = q
            self._conn.send((run_id, prompt, checkpoint, settings, profiles, after_run))
        return q

    def _pump(self, proc, conn) -> None:
        """Apply the worker's writes to the store, in order, and hand each recording its events."""
        write_error: BaseException | None = None
        while True:
            try:
                kind, rid, payload = conn.recv()
            except (EOFError, OSError):
                proc.wait()
                with self._lock:
                    waiting, self._waiting = self._waiting, {}
                for q in waiting.values():
                    q.put(("done", RuntimeError(f"the recording process exited (code {proc.returncode}); its run "
                                                "is marked interrupted")))
                return
            if kind == "append":
                try:
                    self.store.append(payload)
                except BaseException as e:  # noqa: BLE001 - the run fails with it below
                    write_error = write_error or e
            elif kind == "replace_rows":
                try:
                    table, keys, df, all_rows = payload
                    self.store.replace_rows(table, keys, df, all_rows=all_rows)
                except BaseException as e:  # noqa: BLE001
                    write_error = write_error or e
            elif kind == "update":
                if write_error is not None and payload.get("status") in FINAL_STATUSES:
                    payload = {**payload, "status": "failed", "error": f"StoreError: {write_error}"}
                    write_error = None
                try:
                    self.store.update_run(rid, **payload)
                except BaseException as e:  # noqa: BLE001
                    write_error = write_error or e
            else:
                if kind == "done" and write_error is not None:
                    # a write that failed after the final status (after_run's rows) is this run's error, never the
                    # next run's
                    # a StoreError says itself what happened and whether the run is saved (a full disk: the store
                    # dropped its connection, which reopens at the next write)
                    payload = payload or (write_error if isinstance(write_error, StoreError)
                                          else RuntimeError(f"storing the run's rows failed: {write_error}"))
                    write_error = None
                with self._lock:
                    q = self._waiting.pop(rid, None) if kind == "done" else self._waiting.get(rid)
                if q is not None:
                    q.put((kind, payload))

    def close(self) -> None:
        """Stop the worker (it finishes the recording it is on)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._conn.send(None)
                    self._proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    self._proc.kill()
            self._proc = None


def enabled() -> bool:
    """Whether servers record in a worker process (``$WORKBENCH_RECORD_PROCESS=0``: in a thread of their own)."""
    return os.environ.get("WORKBENCH_RECORD_PROCESS", "1") != "0"


if __name__ == "__main__":
    _serve(sys.argv[1], bytes.fromhex(sys.stdin.readline().strip()))
