"""The DuckDB store: opening (with schema checks), appending Arrow/polars batches, a background writer.

One DuckDB connection per database file per process, shared through cursors, so the Gradio app can
read a run while the recorder in the same process is writing it. DuckDB lets only one process hold a
file; a process that finds it held asks for it (``<db>.want``) and the holder lets go as soon as no
cursor is in use, so a recording in one process and the UI in another take turns. Each step's batch
is committed as whole steps in one transaction, and the same transaction moves ``runs.n_tokens`` on:
a process killed mid-run leaves every committed step readable and its run's length right.

Durability and liveness:

- A new database file is made under a temporary name (schema and all) and linked into place, so a
  kill while creating it leaves no half-made file; ``Store(path)`` of a missing file creates nothing
  until the first query, so a recording killed while loading its model leaves no empty database.
- A run's final ``update_run`` (a ``status`` other than ``running``, or ``finished_at``) and every
  ``replace`` of derived rows checkpoint the WAL into the ``.duckdb`` file, so a copy of that file
  alone holds every finished run; closing the connection checkpoints too.
- A ``running`` run belongs to a live process when its ``pid`` exists and, where /proc is available,
  that process has the recorded ``pid_start`` (kernel boot id and process start time), so a reused pid
  is not taken for the recorder. Every open, and every process holding the file at most every
  ``LIVENESS_INTERVAL_S`` seconds, marks a run whose process is gone ``interrupted`` (its ``n_tokens``
  recounted from the rows committed).
- A fatal DuckDB error (``is_fatal``: a checkpoint on a full disk) invalidates the connection; the store drops
  it and raises a one-line StoreError (a run's final update says the run is saved: it is committed in the WAL,
  which the next open writes into the file), and the next action opens the file again, so it works once there
  is space. A transaction that could not be written says its rows are not saved. A file DuckDB cannot read
  (truncated, foreign) or whose schema version is not a number, or newer, is a StoreError naming it.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa

from workbench.data.rows import Rows
from workbench.data.schema import ADDED_COLUMNS, SCHEMA_VERSION, TABLES, columns, ddl
from workbench.data.signals import TABLES as SIGNAL_TABLES

REPO_DATA = Path(__file__).resolve().parent.parent / "data"


class StoreError(RuntimeError):
    """A database that cannot be used: corrupt, locked by another process, or from a newer version."""


# what a failing database raises: StoreError (what the store understood), or DuckDB's own error
DB_ERRORS: tuple[type[BaseException], ...] = (StoreError, duckdb.Error)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def is_fatal(e: BaseException) -> bool:
    """Whether a DuckDB error invalidated its database (a failed checkpoint on a full disk, an internal error):
    every later query of that connection fails ("database has been invalidated") until it is closed and opened
    again."""
    return (isinstance(e, (duckdb.FatalException, duckdb.InternalException))
            or (isinstance(e, duckdb.Error) and "database has been invalidated" in str(e)))


def _write_failed(e: BaseException) -> bool:
    """Whether a DuckDB error is the file system refusing a write (a full disk, a file size limit)."""
    return "could not write" in str(e).lower() or isinstance(e, duckdb.IOException) and "write" in str(e).lower()


def schema_version(path, raw) -> int:
    """The ``meta`` table's schema version as a number; StoreError naming ``path`` when it is not one."""
    if raw is None:
        return 0
    try:
        return int(str(raw).strip())
    except ValueError:
        raise StoreError(f"{path} has schema_version {str(raw)[:40]!r}, not a number: not a workbench database "
                         "this version can read") from None


def key_filter(table: str, keys: dict[str, Any]) -> tuple[str, list]:
    """(WHERE clause, parameters) matching ``keys`` (``{column: value or collection of values}``) in ``table``:
    the clause holds only the schema's own table and column names and ``?`` marks; a ValueError names an
    unknown table or column."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; the workbench's tables are {sorted(TABLES)}")
    if not isinstance(keys, dict):
        raise TypeError(f"keys must be a dict of column -> value, got {type(keys).__name__}")
    declared = columns(table)
    terms, params = [], []
    for col, value in keys.items():
        if col not in declared:
            raise ValueError(f"{table} has no column {col!r}; its columns are {list(declared)}")
        if value is None:
            terms.append(f'"{col}" IS NULL')
        elif isinstance(value, (list, tuple, set, frozenset)):
            values = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
            terms.append(f'"{col}" IN ({", ".join("?" for _ in values)})' if values else "false")
            params += values
        else:
            terms.append(f'"{col}" = ?')
            params.append(value)
    return " AND ".join(terms) or "true", params


def default_db() -> Path:
    """``$WORKBENCH_DB`` if set, else ``data/workbench.duckdb`` in the repository."""
    return Path(os.environ.get("WORKBENCH_DB") or REPO_DATA / "workbench.duckdb")


LOCK_TIMEOUT_S = float(os.environ.get("WORKBENCH_LOCK_TIMEOUT", "20"))
# how often (seconds) a process holding the file re-checks that the recorders of 'running' runs still live
LIVENESS_INTERVAL_S = float(os.environ.get("WORKBENCH_LIVENESS_INTERVAL", "2"))
FINAL_STATUSES = ("complete", "failed", "interrupted")
PROC = Path("/proc")


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of a process from /proc/<pid>/stat; None if it is gone."""
    try:
        text = (PROC / str(int(pid)) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # field 2 (comm) is in parentheses and may hold spaces or parentheses: split after the last one
    rest = text[text.rindex(")") + 2:].split()
    return rest[0], int(rest[19])  # fields 3 (state) and 22 (starttime)


def process_identity(pid: int | None = None) -> str | None:
    """``<boot id>:<start ticks>`` of a live process (this one by default): with its pid, it names the
    process uniquely, a reused pid or a reboot gives another. None where /proc is unavailable."""
    try:
        st = _proc_stat(os.getpid() if pid is None else pid)
    except (ValueError, IndexError):
        return None
    return None if st is None else f"{_boot_id()}:{st[1]}"


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or not a possible pid
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _run_alive(pid: int | None, pid_start: str | None) -> bool:
    """Whether the process that recorded a run still runs: its pid exists, is not a zombie, and (when
    the run stored one) has the same ``pid_start``; pid alone where /proc does not show the process
    (no /proc, or another user's process hidden by ``hidepid``)."""
    if not pid:
        return False
    try:
        st = _proc_stat(pid)
    except (ValueError, IndexError):  # an unexpected /proc format: fall back to the pid
        st = None
    if st is None:
        return _pid_alive(pid)
    if st[0] in ("Z", "X", "x"):
        return False
    return not pid_start or pid_start == f"{_boot_id()}:{st[1]}"


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
        self.last_check = 0.0  # time.monotonic() of the last liveness check of 'running' runs
        self.check_lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self.stopping = False  # the interpreter is exiting: no watcher runs any more

    def acquire(self, connect) -> duckdb.DuckDBPyConnection:
        with self.lock:
            if self.con is None:
                self.con = connect()
                if not self.stopping and (self._watcher is None or not self._watcher.is_alive()):
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
                if self.con is None or self.stopping:
                    return
                self._yield_if_wanted()

    def stop_watching(self) -> None:
        """At exit: end the watcher thread before the interpreter finalizes. A daemon thread still inside DuckDB
        then (closing the connection for another process's ``.want``) is ended by the interpreter with a forced
        unwind that DuckDB's C++ cannot pass through: the process aborted (SIGABRT) after it had finished."""
        with self.lock:
            self.stopping = True
            watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=10)

    def close(self) -> None:
        with self.lock:
            if self.con is not None and self.users == 0:
                self.con.close()
                self.con = None

    def reset(self) -> None:
        """Drop the connection whatever uses it (it is invalidated: every cursor of it fails anyway); the next
        ``acquire`` opens the file again, which replays its WAL."""
        with self.lock:
            con, self.con = self.con, None
            self.checked = False
        if con is not None:
            try:
                con.close()
            except duckdb.Error:
                pass


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
            except duckdb.Error:  # its connection was invalidated and dropped (Store._broken)
                pass
            finally:
                self._shared.release()


_SHARED: dict[str, _Shared] = {}
_LOCK = threading.RLock()


_PID = os.getpid()


@atexit.register
def _stop_watchers() -> None:
    if os.getpid() != _PID:  # a forked child: the watchers are its parent's threads (and a lock it copied may be
        return  # held by one of them forever)
    with _LOCK:
        shared = list(_SHARED.values())
    for sh in shared:
        sh.stop_watching()


class Store:
    """A workbench database file. ``Store(path).sql(query, params)`` returns a polars frame.

    ``Store(folder)`` of a folder of Parquet shards (``workbench export`` / ``record --out``) gives a read-only
    ``TraceStore`` over it."""

    read_only = False  # TraceStore: every write raises StoreError

    def __new__(cls, path: str | Path | None = None, *args, **kwargs):
        if cls is Store and path is not None and Path(path).is_dir():
            cls = TraceStore
        return super().__new__(cls)

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_db()
        key = str(self.path.resolve())
        with _LOCK:
            self._shared = _SHARED.get(key) or _SHARED.setdefault(key, _Shared(self.path.resolve()))
        if self.path.exists():  # open now: a bad or newer-schema file fails here, with a clear message
            self.cursor().close()
        elif self.path.parent.exists() and not self.path.parent.is_dir():
            raise StoreError(f"cannot create {self.path}: {self.path.parent} is a file, not a folder")
        # a missing file is created (atomically) by the first query: a process killed before it leaves none

    def _open_file(self) -> duckdb.DuckDBPyConnection:
        """Connect, waiting (up to LOCK_TIMEOUT_S) while another process holds the file."""
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        want = self._shared.want
        if not self.path.exists():
            self._create_file()
        while True:
            try:
                con = duckdb.connect(str(self.path))
                want.unlink(missing_ok=True)
                return con
            except duckdb.IOException as e:
                msg = str(e)
                if _write_failed(e):
                    raise StoreError(f"cannot open {self.path}: writing its WAL into it failed "
                                     f"({msg.splitlines()[0]}); free disk space and try again") from None
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

    def _create_file(self) -> None:
        """Make a new database (schema included) under a temporary name, then link it into place: a kill
        mid-way leaves no half-made file under the real name. Another process creating it at the same
        time wins the link; this one then opens theirs."""
        name = self.path.name
        for stray in self.path.parent.glob(f".{name}.*.new"):  # left by a creator that was killed
            pid = stray.name[len(name) + 2:-4]
            if pid.isdigit() and not _pid_alive(int(pid)):
                for f in (stray, stray.with_name(stray.name + ".wal")):
                    f.unlink(missing_ok=True)
        tmp = self.path.with_name(f".{name}.{os.getpid()}.new")
        tmp_wal = tmp.with_name(tmp.name + ".wal")
        try:
            tmp.unlink(missing_ok=True)
            tmp_wal.unlink(missing_ok=True)
            try:
                con = duckdb.connect(str(tmp))
            except duckdb.Error as e:
                raise StoreError(f"cannot create {self.path}: {str(e).splitlines()[0]}") from None
            try:
                con.execute(ddl())
                con.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT DO NOTHING",
                            [str(SCHEMA_VERSION)])
                con.execute("CHECKPOINT")
            finally:
                con.close()
            try:
                os.link(tmp, self.path)  # fails if the file appeared meanwhile: keep that one
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                if not self.path.exists():
                    os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
            tmp_wal.unlink(missing_ok=True)

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
                try:
                    version = schema_version(self.path, row[0] if row else None)
                except StoreError:
                    con.close()
                    raise
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
            self._shared.last_check = time.monotonic()
        except StoreError:
            raise
        except duckdb.Error as e:
            con.close()
            raise StoreError(f"cannot use {self.path}: {str(e).splitlines()[0]}") from None
        self._shared.checked = True
        return con

    @staticmethod
    def _mark_interrupted(con: duckdb.DuckDBPyConnection) -> None:
        """Runs left 'running' by a process that no longer exists (or whose pid now names another
        process) were interrupted; their ``n_tokens`` is recounted from the rows committed."""
        for run_id, pid, pid_start in con.execute(
                "SELECT run_id, pid, pid_start FROM runs WHERE status = 'running'").fetchall():
            if not _run_alive(pid, pid_start):
                con.execute(f"UPDATE runs SET status = 'interrupted', n_tokens = {_RECORDED_SQL} "
                            "WHERE run_id = $r AND status = 'running'", {"r": run_id})

    def check_liveness(self, cur: duckdb.DuckDBPyConnection | None = None, force: bool = False) -> None:
        """Mark runs whose recording process is gone ``interrupted``; at most every ``LIVENESS_INTERVAL_S``
        seconds per process unless ``force``. ``cursor()`` calls it, so long-lived readers see crashes."""
        sh = self._shared
        if not force and time.monotonic() - sh.last_check < LIVENESS_INTERVAL_S:
            return
        if not sh.check_lock.acquire(blocking=False):
            return  # another thread is checking right now
        try:
            sh.last_check = time.monotonic()
            own = cur is None
            cur = cur or self.cursor()
            try:
                self._mark_interrupted(cur)
            except duckdb.Error:
                pass  # e.g. a write conflict with another thread: the next check retries
            finally:
                if own:
                    cur.close()
        finally:
            sh.check_lock.release()

    def cursor(self, timeout_s: float | None = None) -> _Lease:
        """A cursor on this process's connection; close it when done so other processes can get the file.

        ``timeout_s``: wait at most that long for the connection (another process holding the file, or
        another thread of this process opening it), then raise ``StoreError``, instead of up to
        ``LOCK_TIMEOUT_S``. The wait then goes on in a background thread, which closes what it gets late.
        """
        sh = self._shared
        if timeout_s is None:
            cur = sh.acquire(self._connect)
        else:
            cur = None
            if sh.lock.acquire(blocking=False):  # nobody is opening it right now
                try:
                    if sh.con is not None:
                        cur = sh.acquire(self._connect)  # open: no waiting
                finally:
                    sh.lock.release()
            if cur is None:
                box: list = []  # what the waiting thread got (a lease or an error); None: the caller gave up
                guard, done = threading.Lock(), threading.Event()

                def wait() -> None:
                    try:
                        got: Any = self.cursor()
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        got = e
                    with guard:
                        late = bool(box)
                        if not late:
                            box.append(got)
                    if late and isinstance(got, _Lease):
                        got.close()
                    done.set()

                threading.Thread(target=wait, name="workbench-store-cursor", daemon=True).start()
                done.wait(max(0.0, timeout_s))
                with guard:
                    if not box:
                        box.append(None)
                        raise StoreError(f"{self.path}: no connection within {timeout_s:g} s (another process "
                                         f"holds the file)")
                if isinstance(box[0], BaseException):
                    raise box[0]
                return box[0]
        lease = _Lease(cur, sh)
        if time.monotonic() - self._shared.last_check >= LIVENESS_INTERVAL_S:
            try:
                self.check_liveness(lease._cur)
            except BaseException:
                lease.close()
                raise
        return lease

    def _broken(self, e: duckdb.Error) -> BaseException:
        """What to raise for a DuckDB error: for one that invalidated the database (``is_fatal``: e.g. a
        checkpoint on a full disk), the connection is dropped, so the next action opens the file again (and
        works once there is space), and a one-line StoreError says so; a write the file system refused, or a file
        that cannot be read, a StoreError naming the file; any other error as it is."""
        if _write_failed(e) and not is_fatal(e):  # the commit's WAL write: the transaction is rolled back
            return StoreError(f"{self.path}: could not write ({_first_line(e)}); these rows are not saved (free "
                              "disk space first if the disk is full)")
        if isinstance(e, duckdb.IOException) and not is_fatal(e):  # a damaged or truncated file, read past its end
            return StoreError(f"cannot use {self.path}: {_first_line(e)}")
        if not is_fatal(e):
            return e
        self._shared.reset()
        return StoreError(f"{self.path}: the database failed and was closed ({_first_line(e)}); it reopens at the "
                          "next action (free disk space first if the disk is full)")

    def checkpoint(self) -> None:
        """Write the WAL into the database file now. Another transaction still open makes it wait for the next
        checkpoint (or the close), silently; a write that fails (a full disk) raises StoreError: what was
        committed stays in the WAL (``<db>.wal``), which the next open writes into the file, and the connection,
        which the failure invalidated, is dropped and reopens at the next action."""
        cur = self.cursor()
        try:
            cur.execute("CHECKPOINT")
        except duckdb.Error as e:
            if is_fatal(e) or isinstance(e, duckdb.IOException):
                if is_fatal(e):
                    self._broken(e)
                raise StoreError(f"writing {self.path} failed ({_first_line(e)}); what was committed is kept in "
                                 f"{self.path.name}.wal, written into the file when it is next opened with space "
                                 "free") from None
            # e.g. "there are other write transactions active": the next checkpoint or the close writes it
        finally:
            cur.close()

    def sql(self, query: str, params: list | dict | None = None) -> pl.DataFrame:
        """Run a query on a fresh cursor and return a polars frame."""
        cur = self.cursor()
        try:
            return cur.sql(query, params=params or None).pl()
        except duckdb.Error as e:
            raise self._broken(e) from None
        finally:
            cur.close()

    def execute(self, query: str, params: list | dict | None = None) -> list[tuple]:
        cur = self.cursor()
        try:
            try:
                res = cur.execute(query, params or [])
            except duckdb.Error as e:
                raise self._broken(e) from None
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
        except BaseException as e:
            try:
                cur.execute("ROLLBACK")
            except duckdb.Error:
                pass
            if isinstance(e, duckdb.Error):
                raise self._broken(e) from None
            raise
        finally:
            if own:
                cur.close()

    @staticmethod
    def _insert(cur: duckdb.DuckDBPyConnection, table: str, batch) -> pl.DataFrame | pa.Table | None:
        """Insert a batch (frame, ``Rows`` or a list of them) into a table, columns matched by name;
        returns what was inserted, a frame or (a batch of ``Rows`` only) an Arrow table (None when empty)."""
        arrow = _rows_arrow(batch, columns(table)) if table != "runs" else None
        if arrow is not None:  # the probes' rows: numpy columns straight into Arrow, no polars frame on the way
            if arrow.num_rows:
                cur.from_arrow(arrow).insert_into(table)
            return arrow if arrow.num_rows else None
        df = to_frame(batch)
        if df is None or df.height == 0:
            return None
        if table == "runs" and "pid" in df.columns and "pid_start" not in df.columns:
            # the recording process's identity beyond its pid (see _run_alive)
            df = df.with_columns(pl.Series("pid_start", [process_identity(p) if p else None
                                                          for p in df["pid"].to_list()], pl.String))
        every = columns(table)
        cols = [c for c in every if c in df.columns]
        if len(cols) == len(every):  # every column, in the table's order: the relation API's insert (cheaper)
            cur.from_arrow(df.select(cols).to_arrow()).insert_into(table)
        else:
            cur.register("_batch", df.select(cols).to_arrow())
            cur.execute(f"INSERT INTO {table} ({', '.join(cols)}) SELECT {', '.join(cols)} FROM _batch")
            cur.unregister("_batch")
        return df

    def append(self, batches: dict, cur: duckdb.DuckDBPyConnection | None = None) -> None:
        """Insert several tables' rows in one transaction; values are frames, ``Rows`` or lists of them.

        Signal rows of a ``running`` run move its ``runs.n_tokens`` on in the same transaction, so the
        runs table is right after a crash too."""
        with self._transaction(cur) as c:
            last_step: dict[str, int] = {}
            fed: dict[str, int] = {}
            for table, df in batches.items():
                frame = self._insert(c, table, df)
                if frame is not None and table in SIGNAL_TABLES:
                    steps, n_fed = _reach(table, frame, df)
                    for rid, v in steps.items():
                        last_step[rid] = max(last_step.get(rid, -1), v)
                    for rid, v in n_fed.items():
                        fed[rid] = max(fed.get(rid, 0), v)
            rids = sorted(last_step.keys() | fed.keys())
            if rids:  # one statement for every run of the transaction (a batch's rows: one each cost ms apiece)
                c.execute("UPDATE runs SET n_tokens = greatest(coalesce(runs.n_tokens, 0), CASE WHEN u.s >= 0 THEN "
                          "coalesce(runs.n_prompt_tokens, 0) + u.s + 1 ELSE 0 END, u.n) "
                          "FROM (SELECT unnest($r::VARCHAR[]) AS r, unnest($s::BIGINT[]) AS s, "
                          "unnest($n::BIGINT[]) AS n) AS u WHERE runs.run_id = u.r AND runs.status = 'running'",
                          {"r": rids, "s": [last_step.get(r, -1) for r in rids], "n": [fed.get(r, 0) for r in rids]})

    def replace(self, table: str, run_id: str, df: pl.DataFrame) -> None:
        """Replace a run's rows of a derived table with ``df`` atomically (``replace_rows`` keyed by ``run_id``)."""
        self.replace_rows(table, {"run_id": run_id}, df)

    def replace_rows(self, table: str, keys: dict[str, Any], df: pl.DataFrame, *, all_rows: bool = False) -> None:
        """Delete the rows of ``table`` that match ``keys`` and insert ``df``, in one transaction.

        ``keys``: ``{column: value}``, every column one the schema declares for ``table``; a row matches when
        each column equals its value (a list, tuple or set: any of its values; None: NULL). Values are bound
        as parameters, never spliced into the SQL. ``{}`` matches every row of the table, so it must be asked
        for: ``all_rows=True``."""
        where, params = key_filter(table, keys)
        if not keys and not all_rows:
            raise ValueError(f"replace_rows({table!r}, {{}}) would replace every row of {table}: pass all_rows=True "
                             "if that is meant")
        with self._transaction() as c:
            c.execute(f"DELETE FROM {table} WHERE {where}", params)
            self._insert(c, table, df)
        self.checkpoint()  # derived rows are written once a run is finished: into the file itself

    def delete_run(self, run_id: str) -> None:
        """Drop every row of a run, its ``runs`` row included, in one transaction (a worker's temporary store,
        once the run is written elsewhere)."""
        with self._transaction() as c:
            for t in TABLES:
                if "run_id" in columns(t):
                    c.execute(f"DELETE FROM {t} WHERE run_id = ?", [run_id])

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set fields of a run's row. A final update (``status`` other than ``running``, or ``finished_at``)
        checkpoints, so the finished run is in the ``.duckdb`` file itself, not only in its WAL. A run
        ending ``failed`` or ``interrupted`` gets the ``n_tokens`` its committed rows hold (a failure
        before the first step leaves 0, not the prompt length)."""
        recount = fields.get("status") in ("failed", "interrupted")
        sets, params = [], {"r": run_id}
        for i, (k, v) in enumerate(fields.items()):
            if recount and k == "n_tokens":
                continue
            sets.append(f"{k} = $f{i}")
            params[f"f{i}"] = json.dumps(v) if isinstance(v, (dict, list)) else v
        if recount:
            sets.append(f"n_tokens = {_RECORDED_SQL}")  # what was committed, whatever the caller counted
        self.execute(f"UPDATE runs SET {', '.join(sets)} WHERE run_id = $r", params)
        if fields.get("status") in FINAL_STATUSES or fields.get("finished_at") is not None:
            try:
                self.checkpoint()
            except StoreError as e:
                what = f" ({fields['status']})" if "status" in fields else ""
                raise StoreError(f"run {run_id} is saved{what}, but {e}") from None

    def update_runs(self, updates: list[tuple[str, dict[str, Any]]]) -> None:
        """``update_run(run_id, **fields)`` of several runs (the rows of a batch that end together): one transaction
        and one checkpoint for all of them (a checkpoint costs tens of ms whatever it writes). A subclass that
        overrides ``update_run`` (a relay) gets its own ``update_run`` per run."""
        if type(self).update_run is not Store.update_run or len(updates) < 2 or any(
                f.get("status") in ("failed", "interrupted") for _, f in updates):
            for run_id, fields in updates:
                self.update_run(run_id, **fields)
            return
        with self._transaction() as c:
            for run_id, fields in updates:
                sets = [f"{k} = $f{i}" for i, k in enumerate(fields)]
                params = {"r": run_id, **{f"f{i}": json.dumps(v) if isinstance(v, (dict, list)) else v
                                          for i, v in enumerate(fields.values())}}
                c.execute(f"UPDATE runs SET {', '.join(sets)} WHERE run_id = $r", params)
        if any(f.get("status") in FINAL_STATUSES or f.get("finished_at") is not None for _, f in updates):
            try:
                self.checkpoint()
            except StoreError as e:
                raise StoreError(f"runs {', '.join(r for r, _ in updates)} are saved, but {e}") from None

    def close(self) -> None:
        """Close this process's connection to the file now if no cursor is in use (checkpoints the WAL)."""
        self._shared.close()


# Completion markers of a Parquet folder (``workbench export``, shards): written by workbench/export.py,
# read here by ``TraceStore``: a whole export lists its runs in ``_SUCCESS``, a shard run has ``_runs/<id>.json``.
MARKER = "_SUCCESS"
RUN_MARKERS = "_runs"


def complete_runs(out_dir: str | Path) -> dict[str, dict]:
    """The runs of a folder that have a completion marker: those listed by its ``_SUCCESS`` (a whole
    export) and those with a ``_runs/<id>.json`` (shards); run id -> what the marker says of it."""
    out = Path(out_dir)
    done: dict[str, dict] = {}
    try:
        for rid in json.loads((out / MARKER).read_text()).get("runs", []):
            done[str(rid)] = {"run_id": str(rid)}
    except (OSError, ValueError, AttributeError):
        pass
    for f in sorted((out / RUN_MARKERS).glob("*.json")):
        try:
            m = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("run_id"):
            done[str(m["run_id"])] = m
    return done


class Writer:
    """Background thread that commits queued per-step batches, so decoding never waits on the disk.

    Every transaction holds whole steps only. Steps that arrive within ``interval`` seconds of each
    other share one transaction: a DuckDB INSERT + COMMIT costs milliseconds whatever its size (about 20 ms
    of CPU for the seven signal tables), more than a small model's decode step, so one commit per step would
    cost more CPU than the generation. A crash loses at most the last ``interval`` seconds of steps.
    """

    def __init__(self, store: Store, interval: float = 0.5):
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
            batches: list[dict] = []
            for item in items + [None]:  # batches up to each callback are committed before it runs
                if isinstance(item, dict):
                    batches.append(item)
                    continue
                if self.error is None and batches:
                    try:  # one short lease per transaction: another process may take the file in between
                        self.store.append(merge_batches(batches))  # each table's parts: frames built on insert
                    except BaseException as e:  # keep draining; report at close
                        self.error = e
                batches = []
                if item is not None:
                    try:
                        item(self.error)
                    except BaseException as e:  # noqa: BLE001
                        self.error = self.error or e

    def _failed(self) -> StoreError:
        """The write error as a StoreError: one the store raised says what happened (and names the file) itself."""
        if isinstance(self.error, StoreError):
            return self.error
        return StoreError(f"writing to {self.store.path} failed: {self.error}")

    def put(self, batches: dict[str, pl.DataFrame]) -> None:
        if self.error is not None:
            raise self._failed()
        self.queue.put(batches)

    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` in the writer's thread once everything put before it is committed (``error``: the
        write error so far, or None), e.g. to mark a run finished only when its rows are in the file."""
        self.queue.put(fn)

    def close(self) -> None:
        """Wait until everything queued is committed."""
        self.queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self._failed()


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


def _rows_arrow(batch, cols: list[str]) -> pa.Table | None:
    """A batch of ``Rows`` that each hold every column of a table (``cols``: its columns, ``run_id`` first) as one
    Arrow table in the table's column order, built from the numpy columns as ``to_frame`` would type them (the
    run id dictionary-encoded; object columns as strings, 2-D ones as lists, ``nan_to_null`` columns with NaN as
    NULL); None for anything else (a frame among the parts, a column more or less: ``to_frame`` then)."""
    parts = batch if isinstance(batch, list) else [batch]
    if not parts or not all(isinstance(p, Rows) for p in parts) or cols[0] != "run_id":
        return None
    want = set(cols[1:])
    if any(p.cols.keys() != want for p in parts):
        return None
    tables = []
    try:
        for p in parts:
            n = p.height
            if not n:
                continue
            run = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([p.run_id], pa.string()))
            arrays = [run]
            for c in cols[1:]:
                v = p.cols[c]
                if v.dtype == object:
                    arrays.append(pa.array(v.tolist(), pa.string()))
                elif v.ndim == 2:  # [n, k] -> a list column
                    offsets = np.arange(n + 1, dtype=np.int32) * v.shape[1]
                    flat = pa.array(np.ascontiguousarray(v).ravel())
                    arrays.append(pa.ListArray.from_arrays(pa.array(offsets), flat))
                else:
                    arrays.append(pa.array(v, from_pandas=c in p.nan_to_null))  # from_pandas: NaN -> NULL
            tables.append(pa.Table.from_arrays(arrays, names=cols))
        if not tables:
            return pa.table({c: pa.array([], pa.null()) for c in cols})
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    except (pa.ArrowException, TypeError, ValueError):  # parts typed unlike each other, a value Arrow cannot take:
        return None  # the frame path, whose relaxed concat and casts take them (or say what is wrong)


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


def merge_batches(items: list[dict]) -> dict[str, list]:
    """Several ``{table: rows | [rows] | None}`` batches as one: the parts of each table in one list (frames are
    built later, by ``to_frame``)."""
    tables: dict[str, list] = {}
    for batch in items:
        for table, part in batch.items():
            if part is not None:
                tables.setdefault(table, []).extend(part if isinstance(part, list) else [part])
    return tables


def _reach(table: str, df: pl.DataFrame, parts=None) -> tuple[dict[str, int], dict[str, int]]:
    """What a signal table's rows prove of each run's length: ({run: last step}, {run: n_tokens}).
    A row of step s means the step producing the token at ``n_prompt_tokens + s`` committed; a row at
    fed position p (tables without a step) means the token at p + 1 was produced. ``parts``: the batch ``df`` was
    built from; where they are all ``Rows`` (each names its run) the maxima are read from them, a numpy max per part,
    instead of a group-by of the frame per table and commit."""
    names = df.column_names if isinstance(df, pa.Table) else df.columns  # what ``Store._insert`` inserted
    col = "step" if "step" in names else "pos" if "pos" in names else None
    if "run_id" not in names or col is None or len(df) == 0:
        return {}, {}
    parts = parts if isinstance(parts, list) else [parts]
    if all(isinstance(p, Rows) for p in parts):
        maxima: dict[str, int] = {}
        for p in parts:
            v = p.cols.get(col)
            if v is not None and len(v):
                maxima[p.run_id] = max(maxima.get(p.run_id, -1), int(np.max(v)))
        return (maxima, {}) if col == "step" else ({}, {r: v + 2 for r, v in maxima.items()})
    runs = df["run_id"]
    if runs[0] == runs[-1] and runs.n_unique() == 1:  # the recorder's batches: one run (no group_by per commit)
        v = df[col].max()
        maxima = {} if v is None else {runs[0]: int(v)}
    else:
        agg = df.group_by("run_id").agg(pl.col(col).max())
        maxima = {r: int(v) for r, v in agg.iter_rows() if v is not None}
    return (maxima, {}) if col == "step" else ({}, {r: v + 2 for r, v in maxima.items()})


def _recorded_sql() -> str:
    """SQL for a run's ``n_tokens`` from the rows committed (the run as ``$r``; 0 when none)."""
    terms = []
    for name in SIGNAL_TABLES:
        cols = columns(name)
        if "step" in cols:
            terms.append(f"(SELECT max(step) FROM {name} WHERE run_id = $r) + coalesce(n_prompt_tokens, 0) + 1")
        elif "pos" in cols:
            terms.append(f"(SELECT max(pos) FROM {name} WHERE run_id = $r) + 2")
    return f"coalesce(greatest({', '.join(terms)}), 0)" if terms else "n_tokens"


_RECORDED_SQL = _recorded_sql()


class TraceStore(Store):
    """A read-only store over a folder of Parquet shards in the export's Hive layout
    (``DIR/<table>/run_id=<id>/*.parquet``, written by ``workbench export`` or ``workbench record --out``).

    An in-memory DuckDB holds one view per workbench table, ``SELECT <the schema's columns> FROM
    read_parquet('DIR/<table>/*/*.parquet', hive_partitioning = true)`` limited to the runs with a completion
    marker (the folder's ``_SUCCESS`` or the run's ``_runs/<id>.json``), so every query of the query layer, the
    app and the report reads it as it reads a database file. Columns a shard lacks (written before they were
    added) read as NULL; tables without shards are empty. Runs that get their marker later (a batch still
    writing) appear within ``REFRESH_S`` seconds. Every write raises ``StoreError``.
    """

    read_only = True
    REFRESH_S = 2.0

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise StoreError(f"{self.path} is not a folder of Parquet shards")
        names = {p.name for p in self.path.iterdir()}
        if names and not names & (set(TABLES) | {"_SUCCESS", "_runs"}):  # empty: a folder runs will be written to
            raise StoreError(f"{self.path} is a folder but not one of Parquet shards (no table folders such as runs/, "
                             "no _SUCCESS): pass a .duckdb file, or a folder written by `workbench export` or "
                             "`workbench record --out`")
        key = "traces:" + str(self.path.resolve())
        with _LOCK:
            self._shared = _SHARED.get(key) or _SHARED.setdefault(key, _Shared(self.path.resolve()))
        self._shared.last_check = 0.0  # a new TraceStore sees the runs finished until now
        self.cursor().close()

    def _stamp(self) -> tuple:
        """What changes when runs are added: the markers and the table folders."""

        def mtime(p: Path):
            try:
                return p.stat().st_mtime_ns
            except OSError:
                return None
        runs = self.path / RUN_MARKERS
        return (mtime(self.path / MARKER), mtime(runs), mtime(self.path),
                tuple(sorted(p.name for p in runs.glob("*.json"))) if runs.is_dir() else ())

    def _connect(self) -> duckdb.DuckDBPyConnection:
        con = duckdb.connect(":memory:")
        try:
            self._views(con)
        except BaseException:
            con.close()
            raise
        return con

    def _views(self, con) -> None:

        stamp = self._stamp()
        lit = lambda s: "'" + str(s).replace("'", "''") + "'"  # noqa: E731 - paths in table functions
        # a folder's own name is never a pattern: * ? [ ] in it match only themselves (DuckDB globs every path)
        esc = lambda p: re.sub(r"([*?\[\]])", r"[\1]", str(p))  # noqa: E731
        con.execute("CREATE SCHEMA IF NOT EXISTS _wb")
        con.execute(ddl().replace("CREATE TABLE IF NOT EXISTS ", "CREATE TABLE IF NOT EXISTS _wb."))
        types: dict[str, list[tuple[str, str]]] = {}
        for t, c, ty in con.execute("SELECT table_name, column_name, data_type FROM information_schema.columns "
                                    "WHERE table_schema = '_wb' ORDER BY table_name, ordinal_position").fetchall():
            types.setdefault(t, []).append((c, ty))
        con.execute("CREATE OR REPLACE TABLE _wb._complete AS SELECT unnest($ids::VARCHAR[]) AS run_id",
                    {"ids": sorted(complete_runs(self.path))})
        meta = self.path / "meta" / "data.parquet"
        if meta.exists():
            try:
                row = con.execute(f"SELECT value FROM read_parquet({lit(esc(meta))}) WHERE key = 'schema_version'").fetchone()
            except duckdb.Error as e:
                raise StoreError(f"cannot read {meta}: {str(e).splitlines()[0]}") from None
            version = schema_version(meta, row[0] if row else None)
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema_version {version}, newer than this workbench understands "
                                 f"({SCHEMA_VERSION}); upgrade moe-workbench to read it")
            con.execute(f"CREATE OR REPLACE VIEW main.meta AS SELECT * FROM read_parquet({lit(esc(meta))})")
        else:
            con.execute("INSERT INTO _wb.meta VALUES ('schema_version', ?) ON CONFLICT DO NOTHING", [str(SCHEMA_VERSION)])
            con.execute("CREATE OR REPLACE VIEW main.meta AS SELECT * FROM _wb.meta")
        for table in TABLES:
            if table == "meta":
                continue
            cols = types[table]
            files = self.path / table
            if "run_id" not in dict(cols) or not next(files.glob("*/*.parquet"), None):
                con.execute(f"CREATE OR REPLACE VIEW main.{table} AS SELECT * FROM _wb.{table}")
                continue
            src = (f"read_parquet({lit(esc(files) + '/*/*.parquet')}, hive_partitioning = true, union_by_name = true, "
                   "hive_types = {'run_id': VARCHAR})")
            try:
                present = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
            except duckdb.Error as e:
                raise StoreError(f"cannot read the {table} shards under {files}: {str(e).splitlines()[0]}") from None
            sel = ", ".join("run_id" if c == "run_id" else f'CAST("{c}" AS {ty}) AS "{c}"' if c in present
                            else f'CAST(NULL AS {ty}) AS "{c}"' for c, ty in cols)
            con.execute(f"CREATE OR REPLACE VIEW main.{table} AS SELECT {sel} FROM {src} "
                        "WHERE run_id IN (SELECT run_id FROM _wb._complete)")
        self._shared.stamp = stamp  # type: ignore[attr-defined]
        self._shared.last_check = time.monotonic()

    def cursor(self, timeout_s: float | None = None) -> _Lease:
        sh = self._shared
        lease = _Lease(sh.acquire(self._connect), sh)
        if time.monotonic() - sh.last_check >= self.REFRESH_S:
            with sh.check_lock:
                sh.last_check = time.monotonic()
                if self._stamp() != getattr(sh, "stamp", None):
                    try:
                        self._views(lease._cur)
                    except BaseException:
                        lease.close()
                        raise
        return lease

    def check_liveness(self, cur=None, force: bool = False) -> None:
        return None  # every run of a folder is finished: it has a completion marker

    def _refuse(self, what: str):
        raise StoreError(f"{self.path} is a read-only folder of Parquet shards: cannot {what} "
                         f"(`workbench import {self.path} --db FILE` makes a database that can be written)")

    def append(self, batches: dict, cur=None) -> None:
        self._refuse(f"write rows of {', '.join(batches)}")

    def replace_rows(self, table: str, keys: dict[str, Any], df: pl.DataFrame, *, all_rows: bool = False) -> None:
        self._refuse(f"store {table} rows")

    def update_run(self, run_id: str, **fields: Any) -> None:
        self._refuse(f"update run {run_id}")

    def checkpoint(self) -> None:
        return None

    def execute(self, query: str, params: list | dict | None = None) -> list[tuple]:
        if query.lstrip().split(None, 1)[0].upper() not in ("SELECT", "WITH", "DESCRIBE", "SHOW", "FROM"):
            self._refuse("run " + query.lstrip().split(None, 1)[0].upper())
        return super().execute(query, params)
