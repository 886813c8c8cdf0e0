"""The DuckDB store: opening (with schema checks), appending Arrow/polars batches, a background writer.

One DuckDB connection per database file per process, shared through cursors, so the Gradio app can
read a run while the recorder in the same process is writing it. DuckDB lets only one process hold a
file; a process that finds it held asks for it (``<db>.want``) and the holder lets go as soon as no
cursor is in use, so a recording in one process and the UI in another take turns. Each step's batch
is committed as whole steps in one transaction: a process killed mid-run leaves every committed step
readable; the next open marks a run whose recording process is gone as ``interrupted``.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import duckdb
import numpy as np
import polars as pl

from .rows import Rows
from .schema import ADDED_COLUMNS, SCHEMA_VERSION, TABLES, columns, ddl

REPO_DATA = Path(__file__).resolve().parent.parent / "data"


class StoreError(RuntimeError):
    """A database that cannot be used: corrupt, locked by another process, or from a newer version."""


def default_db() -> Path:
    """``$WORKBENCH_DB`` if set, else ``data/workbench.duckdb`` in the repository."""
    return Path(os.environ.get("WORKBENCH_DB") or REPO_DATA / "workbench.duckdb")


LOCK_TIMEOUT_S = float(os.environ.get("WORKBENCH_LOCK_TIMEOUT", "20"))


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Shared:
    """This process's one connection to a database file, opened on demand.

    DuckDB lets one process at a time hold a file. A process that finds the file locked touches
    ``<db>.want`` and retries; the holder closes its connection as soon as no cursor is leased, so a
    recording in one process and the UI in another take turns (each step batch is one short lease).
    """

    def __init__(self, path: Path):
        self.path = path
        self.want = path.with_name(path.name + ".want")
        self.con: duckdb.DuckDBPyConnection | None = None
        self.users = 0
        self.lock = threading.RLock()
        self.checked = False
        self._watcher: threading.Thread | None = None

    def acquire(self, connect) -> duckdb.DuckDBPyConnection:
        with self.lock:
            if self.con is None:
                self.con = connect()
                if self._watcher is None or not self._watcher.is_alive():
                    self._watcher = threading.Thread(target=self._watch, name="workbench-store-watch", daemon=True)
                    self._watcher.start()
            self.users += 1
            return self.con.cursor()

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            self._yield_if_wanted()

    def _yield_if_wanted(self) -> None:
        if self.con is not None and self.users == 0 and self.want.exists():
            self.close()

    def _watch(self) -> None:
        while True:
            time.sleep(0.05)
            with self.lock:
                if self.con is None:
                    return
                self._yield_if_wanted()

    def close(self) -> None:
        with self.lock:
            if self.con is not None and self.users == 0:
                self.con.close()
                self.con = None


class _Lease:
    """A cursor on the shared connection; ``close()`` gives the connection back."""

    def __init__(self, cur: duckdb.DuckDBPyConnection, shared: _Shared):
        self._cur, self._shared, self._open = cur, shared, True

    def __getattr__(self, name: str):
        return getattr(self._cur, name)

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._cur.close()
            finally:
                self._shared.release()


_SHARED: dict[str, _Shared] = {}
_LOCK = threading.RLock()


class Store:
    """A workbench database file. ``Store(path).sql(query, params)`` returns a polars frame."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_db()
        key = str(self.path.resolve())
        with _LOCK:
            self._shared = _SHARED.get(key) or _SHARED.setdefault(key, _Shared(self.path.resolve()))
        self.cursor().close()  # open now: a bad or newer-schema file fails here, with a clear message

    def _open_file(self) -> duckdb.DuckDBPyConnection:
        """Connect, waiting (up to LOCK_TIMEOUT_S) while another process holds the file."""
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        want = self._shared.want
        while True:
            try:
                con = duckdb.connect(str(self.path))
                want.unlink(missing_ok=True)
                return con
            except duckdb.IOException as e:
                msg = str(e)
                if "lock" not in msg.lower():
                    raise StoreError(f"cannot open {self.path}: not a readable DuckDB database "
                                     f"({msg.splitlines()[0]})") from None
                if time.monotonic() > deadline:
                    want.unlink(missing_ok=True)
                    raise StoreError(f"{self.path} is in use by another process that did not let go within "
                                     f"{LOCK_TIMEOUT_S:g} s (an older workbench, or a DuckDB client); close it "
                                     f"there or use another --db. ({msg.splitlines()[0]})") from None
                try:
                    want.touch()
                except OSError:
                    pass
                time.sleep(0.02)
            except duckdb.Error as e:
                raise StoreError(f"cannot open {self.path}: {str(e).splitlines()[0]}") from None

    def _connect(self) -> duckdb.DuckDBPyConnection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = self._open_file()
        if self._shared.checked:
            return con
        try:
            existing = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables "
                                                  "WHERE table_schema = 'main'").fetchall()}
            if "meta" in existing:
                row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                version = int(row[0]) if row else 0
                if version > SCHEMA_VERSION:
                    con.close()
                    raise StoreError(f"{self.path} has schema_version {version}, newer than this workbench "
                                     f"understands ({SCHEMA_VERSION}); upgrade moe-workbench to read it")
            elif existing and not existing & set(TABLES):
                con.close()
                raise StoreError(f"{self.path} is a DuckDB file but not a workbench database "
                                 f"(tables: {', '.join(sorted(existing)[:5])})")
            con.execute(ddl())
            for stmt in ADDED_COLUMNS:  # a database made before a column was added gets it (idempotent)
                con.execute(stmt)
            con.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT DO NOTHING", [str(SCHEMA_VERSION)])
            self._mark_interrupted(con)
        except StoreError:
            raise
        except duckdb.Error as e:
            con.close()
            raise StoreError(f"cannot use {self.path}: {str(e).splitlines()[0]}") from None
        self._shared.checked = True
        return con

    @staticmethod
    def _mark_interrupted(con: duckdb.DuckDBPyConnection) -> None:
        """Runs left 'running' by a process that no longer exists were interrupted."""
        for run_id, pid in con.execute("SELECT run_id, pid FROM runs WHERE status = 'running'").fetchall():
            if not _pid_alive(pid):
                con.execute("UPDATE runs SET status = 'interrupted' WHERE run_id = ?", [run_id])

    def cursor(self) -> _Lease:
        """A cursor on this process's connection; close it when done so other processes can get the file."""
        return _Lease(self._shared.acquire(self._connect), self._shared)

    def sql(self, query: str, params: list | dict | None = None) -> pl.DataFrame:
        """Run a query on a fresh cursor and return a polars frame."""
        cur = self.cursor()
        try:
            return cur.sql(query, params=params or None).pl()
        finally:
            cur.close()

    def execute(self, query: str, params: list | dict | None = None) -> list[tuple]:
        cur = self.cursor()
        try:
            res = cur.execute(query, params or [])
            try:
                return res.fetchall()
            except duckdb.Error:
                return []
        finally:
            cur.close()

    @contextlib.contextmanager
    def _transaction(self, cur: duckdb.DuckDBPyConnection | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
        """BEGIN ... COMMIT on ``cur`` (or a fresh cursor, closed after), ROLLBACK on any error."""
        own = cur is None
        cur = cur or self.cursor()
        try:
            cur.execute("BEGIN")
            yield cur
            cur.execute("COMMIT")
        except BaseException:
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        finally:
            if own:
                cur.close()

    @staticmethod
    def _insert(cur: duckdb.DuckDBPyConnection, table: str, batch) -> None:
        """Insert a batch (frame, ``Rows`` or a list of them) into a table, columns matched by name."""
        df = to_frame(batch)
        if df is None or df.height == 0:
            return
        cols = [c for c in columns(table) if c in df.columns]
        cur.register("_batch", df.select(cols).to_arrow())
        cur.execute(f"INSERT INTO {table} ({', '.join(cols)}) SELECT {', '.join(cols)} FROM _batch")
        cur.unregister("_batch")

    def append(self, batches: dict, cur: duckdb.DuckDBPyConnection | None = None) -> None:
        """Insert several tables' rows in one transaction; values are frames, ``Rows`` or lists of them."""
        with self._transaction(cur) as c:
            for table, df in batches.items():
                self._insert(c, table, df)

    def replace(self, table: str, run_id: str, df: pl.DataFrame, where: str = "", params: list | None = None) -> None:
        """Delete a run's rows of a derived table (optionally narrowed) and insert ``df`` atomically."""
        with self._transaction() as c:
            c.execute(f"DELETE FROM {table} WHERE run_id = ? {where}", [run_id, *(params or [])])
            self._insert(c, table, df)

    def update_run(self, run_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        vals = [json.dumps(v) if isinstance(v, (dict, list)) else v for v in fields.values()]
        self.execute(f"UPDATE runs SET {sets} WHERE run_id = ?", [*vals, run_id])

    def close(self) -> None:
        """Close this process's connection to the file now if no cursor is in use (checkpoints the WAL)."""
        self._shared.close()


class Writer:
    """Background thread that commits queued per-step batches, so decoding never waits on the disk.

    Every transaction holds whole steps only. Steps that arrive within ``interval`` seconds of each
    other share one transaction: a DuckDB INSERT + COMMIT costs milliseconds whatever its size, more
    than a small model's decode step, so one commit per step would cost more CPU than the generation.
    """

    def __init__(self, store: Store, interval: float = 0.25):
        self.store = store
        self.interval = interval
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="workbench-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        done = False
        while not done:
            items = [self.queue.get()]
            deadline = time.monotonic() + self.interval
            while items[-1] is not None:
                try:
                    items.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            if items[-1] is None:
                done = True
                items.pop()
            if self.error is None and items:
                try:  # one short lease per transaction: another process may take the file in between
                    self.store.append(_merge(items))
                except BaseException as e:  # keep draining; report at close
                    self.error = e

    def put(self, batches: dict[str, pl.DataFrame]) -> None:
        if self.error is not None:
            raise StoreError(f"writing to {self.store.path} failed: {self.error}")
        self.queue.put(batches)

    def close(self) -> None:
        """Wait until everything queued is committed."""
        self.queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise StoreError(f"writing to {self.store.path} failed: {self.error}")


def _rows_frame(parts: list[Rows]) -> pl.DataFrame:
    first = parts[0]
    cols = {c: np.concatenate([p.cols[c] for p in parts]) if len(parts) > 1 else first.cols[c] for c in first.cols}
    n = len(next(iter(cols.values())))
    series = [pl.Series("run_id", [first.run_id], pl.String).new_from_index(0, n)]
    for c, v in cols.items():
        dt = first.dtypes.get(c)
        if v.dtype == object:
            series.append(pl.Series(c, v.tolist(), dtype=dt))
        elif v.ndim == 2:  # [n, k] -> list column
            series.append(pl.Series(c, v).cast(dt) if dt is not None else pl.Series(c, v))
        else:
            series.append(pl.Series(c, v, dtype=dt, nan_to_null=c in first.nan_to_null))
    return pl.DataFrame(series)


def to_frame(batch) -> pl.DataFrame | None:
    """A table's batch (frame, ``Rows``, or a list of them) as one polars frame (None when empty)."""
    parts = batch if isinstance(batch, list) else [batch]
    frames = [p for p in parts if isinstance(p, pl.DataFrame) and p.height]
    groups: dict[tuple, list[Rows]] = {}
    for p in parts:
        if isinstance(p, Rows) and p.height:
            groups.setdefault((p.run_id, tuple(p.cols)), []).append(p)
    frames += [_rows_frame(g) for g in groups.values()]
    if not frames:
        return None
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")


def _merge(items: list[dict]) -> dict[str, pl.DataFrame | None]:
    """Several steps' batches as one batch: one frame per table."""
    tables: dict[str, list] = {}
    for batch in items:
        for table, part in batch.items():
            if part is not None:
                tables.setdefault(table, []).extend(part if isinstance(part, list) else [part])
    return {t: to_frame(parts) for t, parts in tables.items()}
