"""Read-only SQL over a workbench store, for the UI's SQL tab and ``Workbench.sql``.

A query never runs on the store's own connection. That connection is shared with the recorder (DuckDB
allows one read-write instance per file per process, and a second instance cannot open the file beside
it), and it keeps DuckDB's defaults: extension autoinstall/autoload, file and network access, no memory
limit. Instead every query runs in a sandbox, a separate in-memory DuckDB instance inside a worker
process (this file run as a script, ``python -I sqlsafe.py --worker``), and ``run_readonly`` does this,
all of it under ONE wall-clock deadline of ``timeout_s`` that starts when the call does:

1. The worker checks the query with DuckDB's own parser, not with regular expressions:
   ``extract_statements`` (exactly one statement, of type SELECT: no INSERT/UPDATE/DELETE/CREATE/
   DROP, ATTACH, COPY, PRAGMA, SET, INSTALL/LOAD, CALL, EXPORT, ...), then ``json_serialize_sql``, whose
   syntax tree is walked (iteratively): every table it reads is a workbench table of the main schema or
   a CTE *in scope* where it is read (a CTE is visible in its own WITH's query and in the CTEs defined
   after it, a recursive CTE in its recursive part; ``(WITH pg_settings AS ...) x, pg_settings`` does not
   reach ``pg_settings``); the only table functions are ``range``/``generate_series``/``unnest``; a few
   stateful scalar functions (``nextval``, ``current_setting``, ``getenv``, ...) are refused. The walk
   also tells which columns of which tables the query can read (all of them once it has a ``*``,
   ``COLUMNS(...)``, ``#n``, NATURAL join, PIVOT, column aliases on a table, or a row reference).
2. This process copies just those columns of just those tables from the store (one read transaction,
   so tables read together are consistent while a recording writes; waiting for a file another process
   holds counts in the deadline) into Arrow IPC files, at most ``DATA_LIMIT_MB``.
3. The worker memory-maps those files and runs the query in its sandbox, with at most ``max_rows + 1``
   rows kept (``relation.limit``; nothing is pasted around the user's text). A worker serves query after
   query with ONE sandbox, made when it starts: ``enable_external_access=false`` (no files, no network,
   no extension loading), extension autoinstall/autoload off, ``memory_limit`` ``DUCKDB_MEMORY_MB``
   (spilling at most ``SPILL_LIMIT_MB`` to a private temp folder), ``threads`` ``THREADS`` (1 on a
   machine of 2 CPUs or fewer) and ``lock_configuration=true``; the parser of step 1 is another
   connection to it. Every workbench table is created in it, empty, once, so ``SHOW TABLES``/``DESCRIBE``
   look like the store; for one query, each table it reads is dropped and its Arrow data registered
   under the name, and afterwards unregistered and the empty table created again: a query never sees
   data fed to an earlier one (a worker that could not put its tables back stops). The worker process
   cannot allocate more than ``WORKER_MEMORY_MB`` beyond its size once started (``RLIMIT_DATA``), which
   also bounds what DuckDB's memory_limit does not count (huge lists and strings). A worker that ran out
   of memory, or kept much of it, is replaced.

When the deadline passes the worker is killed (a replacement starts in the background), so even work
DuckDB cannot interrupt stops on time. Every failure is a one-line ``SqlError``. POSIX only (pipes and
``select``); the worker's memory limit needs Linux (``/proc/self/statm``; elsewhere only DuckDB's
memory_limit applies). Idle workers are kept for the next queries (one beyond the first is stopped after
``IDLE_S`` seconds unused); ``shutdown()`` stops them (also done at exit).
"""
from __future__ import annotations

import atexit
import io
import json
import math
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb

if __package__:  # imported as workbench.data.sqlsafe; run as a script (the worker) it needs only duckdb/pyarrow/polars
    import polars as pl  # lazy: the worker, run as a script, imports only what it needs
    import pyarrow as pa  # lazy: as above
    import pyarrow.ipc  # lazy: as above

    from workbench.data.schema import TABLES, columns  # lazy: as above
    from workbench.data.store import StoreError  # lazy: as above
if TYPE_CHECKING:
    from workbench.data.store import Store  # lazy: type checking only

MAX_QUERY_CHARS = 100_000   # longer text is refused before anything is parsed
WORKER_MEMORY_MB = 640      # what one query may allocate in the worker process (RLIMIT_DATA above its start)
DUCKDB_MEMORY_MB = 384      # the sandbox's memory_limit (sorts, hash tables, aggregates)
SPILL_LIMIT_MB = 1024       # what the sandbox may spill to its private temp folder
DATA_LIMIT_MB = 512         # table data copied into the sandbox for one query
RESULT_LIMIT_MB = 64        # the result frame sent back
UI_MAX_CELL_CHARS = 2000    # the UI's SQL console: longer text cells are cut (a note says so)
UI_MAX_RESULT_BYTES = 1 << 20  # the UI's SQL console: rows beyond 1 MB of result are left out (a note says so)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


THREADS = 1 if _cpus() <= 2 else 2  # the sandbox's DuckDB threads (on 2 CPUs a second one only competes)
MAX_WORKERS = 4             # queries running at once in this process (more wait, within their deadline)
IDLE_S = 60.0               # an idle worker beyond the first is stopped after this long unused

ALLOWED_TABLE_FUNCTIONS = {"range", "generate_series", "unnest"}
DENIED_FUNCTIONS = {"nextval", "currval", "setval", "setseed", "current_setting", "getenv", "getvariable",
                    "json_execute_serialized_sql", "query", "query_table", "sql_auto_complete", "which_secret",
                    "write_log"}
TABLE_REFS = {"BASE_TABLE", "JOIN", "SUBQUERY", "TABLE_FUNCTION", "EXPRESSION_LIST", "EMPTY", "PIVOT", "SHOW_REF"}
SHOW_SPECIAL = {'"tables"', "__show_tables_expanded"}  # SHOW TABLES, SHOW ALL TABLES
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SqlError(ValueError):
    """A query that is not allowed, does not parse, fails or runs too long (message says which)."""


@dataclass
class SqlResult:
    """A query's rows, whether ``max_rows`` cut them, and how long the whole call took; with the caps of
    ``run_readonly``'s ``max_cell_chars`` / ``max_result_bytes``: how many text cells were cut
    (``cells_cut``) and how many rows the size cap left out (``rows_cut``, of ``rows_before_cut``)."""
    frame: pl.DataFrame
    truncated: bool
    elapsed_ms: float
    cells_cut: int = 0
    rows_cut: int = 0
    max_cell_chars: int | None = None
    max_result_bytes: int | None = None

    @property
    def note(self) -> str:
        """What the caps cut, in words ("" when nothing was cut)."""
        parts = []
        if self.rows_cut:
            kept = self.frame.height
            parts.append(f"result cut to {kept} of {kept + self.rows_cut} rows "
                         f"({_size(self.max_result_bytes)} at most)")
        if self.cells_cut:
            parts.append(f"{self.cells_cut} long text cell{'s' if self.cells_cut != 1 else ''} cut to "
                         f"{self.max_cell_chars} characters (ending in \u2026)")
        return "; ".join(parts)


def _size(n: int | None) -> str:
    if not n:
        return "no limit"
    return f"{n / 2**20:g} MB" if n >= 2**20 else f"{n / 2**10:g} KB" if n >= 2**10 else f"{n} bytes"


def _line(e: BaseException | str, limit: int = 400) -> str:
    """The first non-empty line of an error, shortened: messages are one line."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- the checks (run in the worker by run_readonly; check_query runs them here) ------------------------

def _analyse(query: str, tables: dict[str, list[str]], max_chars: int | None = None,
             parser: duckdb.DuckDBPyConnection | None = None) -> tuple[str, dict[str, list[str]]]:
    """Check ``query``; return its text and the columns it can read, per table whose rows it reads.

    A table the query only DESCRIBEs (or SHOWs) is not in the answer: its schema is enough. ``parser``:
    a connection that only parses (the worker's, kept for all its queries); else an empty in-memory
    instance is made for this call.
    """
    max_chars = MAX_QUERY_CHARS if max_chars is None else max_chars
    if not isinstance(query, str) or not query.strip():
        raise SqlError("empty query: write a SELECT, e.g. SELECT * FROM runs")
    if len(query) > max_chars:
        raise SqlError(f"query too long: {len(query)} characters, at most {max_chars}")
    con = parser if parser is not None else duckdb.connect(config={
        "enable_external_access": False, "autoload_known_extensions": False,
        "autoinstall_known_extensions": False})
    try:  # the parser and the serializer only: nothing is bound or run
        try:
            stmts = con.extract_statements(query)
        except duckdb.Error as e:
            raise SqlError(f"cannot parse the query: {_line(e)}") from None
        if len(stmts) != 1:
            raise SqlError(f"one statement at a time, got {len(stmts)}")
        st = stmts[0]
        if st.type != duckdb.StatementType.SELECT:
            raise SqlError(f"read-only: only SELECT queries are allowed, not {st.type.name}")
        text = st.query.strip().rstrip(";").strip()
        del stmts, st
        try:
            raw = con.execute("SELECT json_serialize_sql(?::VARCHAR)", [text]).fetchone()[0]
        except duckdb.Error as e:
            raise SqlError(f"cannot parse the query: {_line(e)}") from None
    finally:
        if parser is None:
            con.close()
    try:
        tree = json.loads(raw)
    except RecursionError:
        raise SqlError("query nested too deeply") from None
    del raw
    if tree.get("error"):
        raise SqlError(f"not an allowed SELECT: {tree.get('error_message', 'unsupported statement')}")
    if len(tree.get("statements") or []) != 1:
        raise SqlError("one statement at a time")

    known = {t.lower(): t for t in tables}
    problems: list[str] = []
    data: set[str] = set()          # workbench tables whose rows the query reads (not only DESCRIBEs)
    names: set[str] = set()         # every identifier of every column reference and USING list
    last_parts: set[str] = set()    # the last identifier of each column reference
    relations: set[str] = set()     # table names, aliases and CTE names (a column ref to one is a row)
    prune = True                    # False once the query can reach columns it does not name

    stack: list[tuple[Any, frozenset, bool]] = [(tree["statements"][0], frozenset(), False)]
    while stack:
        node, scope, schema_only = stack.pop()
        if isinstance(node, list):
            stack.extend((v, scope, schema_only) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        inner = scope
        cte_map = node.get("cte_map")
        if isinstance(cte_map, dict):
            defined: list[str] = []
            for entry in cte_map.get("map") or []:
                key = str(entry.get("key", "")) if isinstance(entry, dict) else ""
                if not _IDENT.match(key):
                    problems.append(f"CTE names must be plain identifiers, got {key!r}")
                # a CTE's body sees the CTEs defined before it (and outer ones), not itself or later ones
                stack.append((entry.get("value") if isinstance(entry, dict) else None,
                              scope | frozenset(defined), schema_only))
                defined.append(key.lower())
            inner = scope | frozenset(defined)
            relations.update(defined)
        kind, cls = node.get("type"), node.get("class")
        rest = {k: v for k, v in node.items() if k != "cte_map"}

        if cls is None and kind == "RECURSIVE_CTE_NODE":  # its recursive part sees its own name
            own = str(node.get("cte_name", "")).lower()
            stack.append((rest.pop("left", None), inner, schema_only))
            stack.append((list(rest.values()), inner | {own}, schema_only))
            continue
        if cls is None and isinstance(kind, str) and "query_location" in node and not kind.endswith("_NODE"):
            if kind not in TABLE_REFS:
                problems.append(f"{kind.lower()} is not allowed in read-only queries")
                continue
            if node.get("alias"):
                relations.add(str(node["alias"]).lower())
            if node.get("column_name_alias"):
                prune = False
            if kind == "BASE_TABLE":
                name = str(node.get("table_name", ""))
                relations.add(name.lower())
                if node.get("catalog_name") not in ("", None) or node.get("schema_name") not in ("", "main", None):
                    problems.append(f"only tables of this database can be read, not {node.get('schema_name')}.{name}")
                elif not node.get("schema_name") and name.lower() in inner:
                    pass  # a CTE in scope
                elif _IDENT.match(name) and name.lower() in known:
                    if not schema_only:
                        data.add(known[name.lower()])
                else:
                    problems.append(f"unknown table {name!r}; tables: {', '.join(sorted(tables))}")
            elif kind == "TABLE_FUNCTION":
                fn = str((node.get("function") or {}).get("function_name", "?"))
                if fn.lower() not in ALLOWED_TABLE_FUNCTIONS:
                    problems.append(f"table function {fn}() is not allowed (no file or network access)")
            elif kind == "JOIN":
                if node.get("ref_type") == "NATURAL":
                    prune = False
                names.update(str(c).lower() for c in node.get("using_columns") or [])
            elif kind == "PIVOT":
                prune = False
            elif kind == "SHOW_REF":
                show = node.get("show_type")
                target = str(node.get("table_name", ""))
                if show in ("DESCRIBE", "SUMMARY") and node.get("query"):
                    stack.append((node["query"], inner, schema_only or show == "DESCRIBE"))
                elif show == "SHOW" and _IDENT.match(target) and target.lower() in known:
                    pass  # SHOW tokens: the schema only
                elif show == "SHOW_SPECIAL" and target.lower() in SHOW_SPECIAL:
                    pass
                else:
                    problems.append(f"SHOW {target or show} is not allowed; SHOW TABLES and DESCRIBE <table> are")
                continue
        elif cls == "STAR" or cls == "POSITIONAL_REFERENCE":
            prune = False
        elif cls == "COLUMN_REF":
            parts = [str(p).lower() for p in node.get("column_names") or []]
            names.update(parts)
            if parts:
                last_parts.add(parts[-1])
        if cls is not None and "function_name" in node:
            fn = str(node.get("function_name", ""))
            if fn.lower() in DENIED_FUNCTIONS:
                problems.append(f"function {fn}() is not allowed in read-only queries")
            if node.get("catalog") or node.get("schema") not in ("", "main", "pg_catalog", None):
                problems.append(f"function {node.get('schema')}.{fn}() is not allowed")
        stack.append((list(rest.values()), inner, schema_only))
    if problems:
        raise SqlError(problems[0])
    if last_parts & relations:  # SELECT t FROM tokens t: the whole row
        prune = False
    return text, {t: [c for c in tables[t] if not prune or c.lower() in names] for t in sorted(data)}


def check_query(query: str) -> str:
    """The single SELECT statement in ``query`` (trailing ``;`` removed); ``SqlError`` if not allowed."""
    return _analyse(query, {t: columns(t) for t in TABLES})[0]


# -- messages between this process and a worker: a JSON header and optional bytes, length-prefixed -----

_HEAD = struct.Struct(">QQ")


def _frame(obj: dict, blob: bytes = b"") -> bytes:
    head = json.dumps(obj).encode()
    return _HEAD.pack(len(head), len(blob)) + head + blob


class _Timeout(Exception):
    pass


class _Died(Exception):
    pass


# -- the worker process -----------------------------------------------------------------------------

def _cap(df, max_cell_chars: int | None, max_result_bytes: int | None):
    """``df`` with text cells longer than ``max_cell_chars`` cut (ending in U+2026) and then its last rows left out
    until it is at most ``max_result_bytes`` (polars' estimate); returns (frame, cells cut in the rows kept, rows
    left out)."""
    import polars as pl  # lazy: the worker, run as a script, has polars from _worker_main (no module-level pl)

    cut = []  # per text column: which rows were cut
    if max_cell_chars:
        k = int(max_cell_chars)
        for name, dtype in df.schema.items():
            if dtype == pl.String:
                long = df[name].str.len_chars() > k
                if long.any():
                    cut.append(long)
                    df = df.with_columns(pl.when(long).then(pl.col(name).str.slice(0, k) + "\u2026")
                                         .otherwise(pl.col(name)).alias(name))
    rows = 0
    if max_result_bytes and df.height and df.estimated_size() > max_result_bytes:
        lo, hi = 0, df.height  # the most rows that fit: a slice's estimate counts only its rows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if df.head(mid).estimated_size() <= max_result_bytes:
                lo = mid
            else:
                hi = mid - 1
        rows, df = df.height - lo, df.head(lo)
    return df, sum(int(m.head(df.height).sum()) for m in cut), rows


def _worker_main(limits: dict) -> None:  # pragma: no cover - runs in the worker process
    import resource  # lazy: the worker process's own imports (this module's importers need none of them)
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError):
        pass
    import polars  # noqa: F401  # lazy: imported up front in the worker so that no query pays for it
    import pyarrow  # lazy: the worker's own
    import pyarrow.ipc  # lazy: the worker's own
    pyarrow.set_cpu_count(int(limits["threads"]))
    pyarrow.set_io_thread_count(int(limits["threads"]))
    page = os.sysconf("SC_PAGE_SIZE")

    def data_bytes() -> int:
        """The process's data segment (what RLIMIT_DATA limits: private writable memory)."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[5]) * page
        except (OSError, ValueError, IndexError):
            return 0

    # the messages use private copies of stdin/stdout; fd 0 and 1 become /dev/null and stderr, so that
    # nothing printed (by Python or by a library) can corrupt the message stream
    rfd, wfd = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def read_exact(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = os.read(rfd, n - len(out))
            if not chunk:
                sys.exit(0)  # the parent went away
            out += chunk
        return bytes(out)

    def send(obj: dict, blob: bytes = b"") -> None:
        data = memoryview(_frame(obj, blob))
        while data:
            data = data[os.write(wfd, data):]

    def sandbox() -> duckdb.DuckDBPyConnection:
        spill = os.path.join(limits["dir"], "spill")
        return duckdb.connect(":memory:", config={
            "enable_external_access": False, "autoinstall_known_extensions": False,
            "autoload_known_extensions": False, "allow_community_extensions": False,
            "python_enable_replacements": False, "memory_limit": f"{int(limits['duckdb_mb'])}MB",
            "threads": int(limits["threads"]), "temp_directory": spill,
            "max_temp_directory_size": f"{int(limits['spill_mb'])}MB", "lock_configuration": True})

    def failure(e: BaseException) -> str:
        if isinstance(e, SqlError):
            return _line(e)
        if isinstance(e, (MemoryError, duckdb.OutOfMemoryException)):
            return (f"out of memory: the query needs more than the SQL console allows "
                    f"({int(limits['memory_mb'])} MB) ({_line(e, 200)})")
        if isinstance(e, RecursionError):
            return "query nested too deeply"
        if isinstance(e, duckdb.Error):
            msg = _line(e)
            if "extension" in msg and isinstance(e, duckdb.CatalogException):
                msg += " (the SQL console neither installs nor loads extensions)"
            return msg
        return f"{type(e).__name__}: {_line(e)}"

    # ONE sandbox for the worker's life, its settings locked; the parser is another connection to it that
    # only parses (extract_statements, json_serialize_sql: nothing is bound or run there). Every workbench
    # table exists in it, empty, from the start; a query's data replaces its tables only while it runs.
    hlen, _ = _HEAD.unpack(read_exact(_HEAD.size))  # the first message: the tables (DDL and columns)
    init = json.loads(read_exact(hlen))
    ddl: dict[str, str] = init["ddl"]
    cols: dict[str, list[str]] = init["columns"]
    con = sandbox()
    parser = con.cursor()
    for stmt in ddl.values():
        con.execute(stmt)
    state = {"broken": False}  # the sandbox could not be put back as it was: this worker must not go on

    def run(text: str, req: dict) -> tuple[dict, bytes]:
        dropped: list[str] = []
        fed: list[str] = []
        try:
            for name, path in req["files"].items():
                if name not in ddl:
                    raise SqlError(f"internal: {name!r} is not a workbench table")
                table = pyarrow.ipc.open_file(pyarrow.memory_map(path)).read_all()  # zero-copy
                con.execute(f"DROP TABLE main.{_quote(name)}")  # the empty one: SHOW TABLES lists the name once
                dropped.append(name)
                con.register(name, table)
                fed.append(name)
                del table
            n = int(req["max_rows"])
            df = con.sql(text).limit(n + 1).pl()
        finally:  # the next query sees the empty tables again, never this one's data
            try:
                for name in fed:
                    con.unregister(name)
                for name in dropped:
                    con.execute(ddl[name])
            except BaseException:
                state["broken"] = True
                raise
        truncated = df.height > n
        df = df.head(n)
        df, cells_cut, rows_cut = _cap(df, req.get("max_cell_chars"), req.get("max_result_bytes"))
        size, limit = df.estimated_size(), int(req["result_limit"])
        if size > limit:
            raise SqlError(f"result too large: {size / 2**20:.1f} MB, at most {limit / 2**20:g} MB; "
                           f"select fewer rows or columns")
        buf = io.BytesIO()
        df.write_ipc(buf)
        return {"ok": True, "truncated": truncated, "cells_cut": cells_cut, "rows_cut": rows_cut}, buf.getvalue()

    # warm up (thread pools, allocator arenas, the parser, a fed table), then allow each query
    # WORKER_MEMORY_MB on top of that
    warm = next(iter(ddl))
    path = os.path.join(limits["dir"], "warm.arrow")
    with pyarrow.OSFile(path, "wb") as f, pyarrow.ipc.new_file(f, pyarrow.schema([("x", pyarrow.int64())])) as w:
        w.write_table(pyarrow.table({"x": [1, 2, 3]}))
    try:
        _analyse(f"SELECT sum(x) AS x FROM {warm}", {warm: ["x"]}, MAX_QUERY_CHARS, parser)
        run(f"SELECT sum(x) AS x FROM {warm}", {"files": {warm: path}, "max_rows": 1, "result_limit": 1 << 20})
    finally:
        os.unlink(path)
    budget = int(limits["memory_mb"]) << 20
    base = data_bytes()
    if base:
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (base + budget, base + budget))
        except (ValueError, OSError):
            pass

    def bloated() -> bool:
        """Freed memory that stayed with the process, near the limit: a fresh worker should take over."""
        return bool(base) and data_bytes() > base + budget // 2

    send({"ready": True})
    pending: str | None = None
    while True:
        hlen, blen = _HEAD.unpack(read_exact(_HEAD.size))
        req = json.loads(read_exact(hlen))
        if blen:
            read_exact(blen)
        signal.alarm(max(1, math.ceil(float(req.get("timeout", 60))) + 5))  # in case the parent hangs
        error, retire = None, False
        try:
            if req["op"] == "check":
                pending = None
                text, need = _analyse(req["query"], cols, int(req["max_chars"]), parser)
                pending = text
                send({"need": need})
            elif req["op"] == "run":
                if pending is None:
                    raise SqlError("internal: no checked query to run")
                text, pending = pending, None
                head, blob = run(text, req)
                head["retire"] = bloated()
                send(head, blob)
            else:
                raise SqlError(f"internal: unknown request {req['op']!r}")
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - every failure becomes one line for the parent
            error = failure(e)
            retire = isinstance(e, (MemoryError, RecursionError, duckdb.OutOfMemoryException))
        finally:
            signal.alarm(0)
        if error is not None:  # outside the except block: the failed query's memory is released by now
            # after running out of memory, or near the limit, the parent replaces this worker (freed memory
            # may stay with the process)
            send({"error": error, "retire": retire or state["broken"] or bloated()})
        if state["broken"]:
            sys.exit(3)  # the answer is sent; the parent replaces this worker


# -- this process's side: a small pool of workers ---------------------------------------------------

class _Worker:
    """One worker process, its private temp folder, and the bytes read from it so far."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="workbench-sql-")
        limits = {"memory_mb": WORKER_MEMORY_MB, "duckdb_mb": DUCKDB_MEMORY_MB, "spill_mb": SPILL_LIMIT_MB,
                  "threads": THREADS, "dir": self.dir}
        self.buf = bytearray()
        self.ready = False
        self.pending = False  # a request was sent and its answer not fully read
        self.retired = False  # the worker asked to be replaced (it ran out of memory, or is near the limit)
        self.used = time.monotonic()  # when it last finished a query
        # Arrow's default allocator (mimalloc) reserves 1 GiB of writable address space up front, which the
        # worker's memory limit could not see into; the system allocator reserves nothing
        env = dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system", POLARS_MAX_THREADS=str(THREADS))
        try:
            with open(os.path.join(self.dir, "stderr"), "wb") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", os.path.abspath(__file__), "--worker", json.dumps(limits)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=self.dir, env=env, bufsize=0,
                    close_fds=True, start_new_session=True)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        try:  # the tables, before anything else (a few KB: the empty pipe takes them at once)
            self.proc.stdin.write(_frame({"ddl": _DDL, "columns": _COLUMNS}))
        except OSError:
            pass  # it died already: the first call says why
        os.set_blocking(self.proc.stdin.fileno(), False)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _died(self) -> _Died:
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        rc = self.proc.returncode
        try:
            with open(os.path.join(self.dir, "stderr"), "rb") as f:
                tail = [s for s in f.read()[-2000:].decode(errors="replace").splitlines() if s.strip()]
        except OSError:
            tail = []
        why = f"signal {-rc}" if rc is not None and rc < 0 else f"exit status {rc}"
        if rc is not None and rc < 0 and -rc in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS):
            why += f"; out of memory? the SQL console allows {WORKER_MEMORY_MB} MB"
        return _Died(f"the SQL worker stopped ({why}){': ' + _line(tail[-1], 200) if tail else ''}")

    def send(self, obj: dict, deadline: float) -> None:
        data = memoryview(_frame(obj))
        fd = self.proc.stdin.fileno()
        self.pending = True
        while data:
            try:  # a request fits in the pipe: written at once, no select first
                data = data[os.write(fd, data):]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, OSError):
                raise self._died() from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout
            select.select([], [fd], [], left)

    def recv(self, deadline: float) -> tuple[dict, bytes]:
        fd = self.proc.stdout.fileno()
        while True:
            if len(self.buf) >= _HEAD.size:
                hlen, blen = _HEAD.unpack_from(self.buf)
                end = _HEAD.size + hlen + blen
                if len(self.buf) >= end:
                    head = json.loads(bytes(self.buf[_HEAD.size:_HEAD.size + hlen]))
                    blob = bytes(self.buf[_HEAD.size + hlen:end])
                    del self.buf[:end]
                    self.pending = False
                    return head, blob
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise self._died()
                self.buf += chunk

    def call(self, obj: dict, deadline: float) -> tuple[dict, bytes]:
        self.send(obj, deadline)
        head, blob = self.recv(deadline)
        self.retired = self.retired or bool(head.get("retire"))
        if "error" in head:
            raise SqlError(head["error"])
        return head, blob

    def wait_ready(self, deadline: float) -> None:
        if not self.ready:
            self.recv(deadline)
            self.ready = True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


class _Pool:
    """Idle workers of this process, and a cap on workers busy at once.

    A worker serves query after query. Idle ones are kept (the most recently used is taken first), so
    that concurrent callers do not each start a process; one beyond the first that stayed unused for
    ``IDLE_S`` seconds is stopped.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.slots = threading.BoundedSemaphore(MAX_WORKERS)

    def get(self, deadline: float) -> _Worker:
        if not self.slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise _Timeout
        try:
            with self.lock:
                while self.idle:
                    w = self.idle.pop()
                    if w.alive():
                        return w
                    w.close()
            return _Worker()
        except BaseException:
            self.slots.release()
            raise

    def _trim(self) -> list[_Worker]:
        """(With the lock held) take out the idle workers to stop: unused for IDLE_S, beyond the newest."""
        now = time.monotonic()
        old = [w for w in self.idle[:-1] if now - w.used > IDLE_S]
        self.idle = [w for w in self.idle if w not in old]
        return old

    def put(self, w: _Worker) -> None:
        """Keep a worker that is idle and in step; kill one that is busy, dead or behind (and start a spare)."""
        try:
            if w.alive() and not w.pending and not w.buf and not w.retired:
                w.used = time.monotonic()
                with self.lock:
                    self.idle.append(w)
                    stale = self._trim()
                for old in stale:
                    old.close()
                return
            w.close()
            with self.lock:
                if self.idle:
                    return
            try:
                spare = _Worker()  # starts now, in the background: the next query need not wait for it
            except OSError:
                return
            with self.lock:
                self.idle.insert(0, spare)
        finally:
            self.slots.release()

    def shutdown(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for w in idle:
            w.close()

    def forget(self) -> None:  # in a forked child: the workers belong to the parent
        self.lock = threading.Lock()
        self.idle = []
        self.slots = threading.BoundedSemaphore(MAX_WORKERS)


_POOL = _Pool()
atexit.register(_POOL.shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.forget)


def shutdown() -> None:
    """Stop this process's idle SQL workers (the next query starts a fresh one)."""
    _POOL.shutdown()


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


if __package__:  # what every worker is started with: each table's DDL and columns
    _DDL = {t: f"CREATE TABLE main.{_quote(t)} ({TABLES[t].ddl()}\n)" for t in TABLES}
    _COLUMNS = {t: columns(t) for t in TABLES}


class _Watchdog:
    """One thread of this process that interrupts a store read at its deadline (a thread per query would
    cost a start, and a hand-over of the GIL, every time). It sleeps until the earliest deadline it knows
    of and is woken only for an earlier one: queries one after the other do not wake it."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.due: dict[int, tuple[float, Any]] = {}
        self.next = 0
        self.wake = math.inf  # when the thread wakes up next (inf: when notified)
        self.thread: threading.Thread | None = None

    def add(self, deadline: float, fn) -> int:
        with self.cond:
            self.next += 1
            self.due[self.next] = (deadline, fn)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="workbench-sql-watchdog", daemon=True)
                self.thread.start()
            elif deadline < self.wake:
                self.cond.notify()
            return self.next

    def cancel(self, key: int) -> None:
        with self.cond:
            self.due.pop(key, None)

    def _run(self) -> None:
        while True:
            with self.cond:
                now = time.monotonic()
                late = [k for k, (d, _) in self.due.items() if d <= now]
                fns = [self.due.pop(k)[1] for k in late]
                if not fns:
                    self.wake = min((d for d, _ in self.due.values()), default=math.inf)
                    self.cond.wait(None if self.wake == math.inf else self.wake - now)
                    self.wake = 0.0  # awake: an add need not notify until it sleeps again
                    continue
            for fn in fns:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a cursor closed meanwhile
                    pass

    def forget(self) -> None:  # in a forked child: the thread is not there
        self.cond = threading.Condition(threading.Lock())
        self.due, self.wake, self.thread = {}, math.inf, None


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG.forget)


def _fetch(store: Store, need: dict[str, list[str]], folder: str, deadline: float) -> dict[str, str]:
    """Copy the columns ``need`` names from the store into Arrow IPC files, in one read transaction."""
    if not need:
        return {}
    limit = DATA_LIMIT_MB << 20
    files: dict[str, str] = {}
    total = 0
    try:  # waiting for the file (another process holding it) counts in the deadline too
        cur = store.cursor(timeout_s=max(0.0, deadline - time.monotonic()))
    except StoreError as e:
        if time.monotonic() >= deadline:
            raise _Timeout from None
        raise SqlError(f"cannot read the store: {_line(e)}") from None
    alarm = _WATCHDOG.add(deadline, cur.interrupt)
    name, ok = "", False
    try:
        if len(need) > 1:  # one statement reads one snapshot anyway
            cur.execute("BEGIN TRANSACTION")
        for name, cols in need.items():
            sel = ", ".join(_quote(c) for c in cols) if cols else "NULL AS _rows"  # count(*) needs rows only
            rel = cur.sql(f"SELECT {sel} FROM main.{_quote(name)}")
            reader = rel.to_arrow_reader(65536) if hasattr(rel, "to_arrow_reader") else rel.fetch_record_batch(65536)
            path = os.path.join(folder, f"{name}.arrow")
            files[name] = path
            with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, reader.schema) as w:
                for batch in reader:
                    total += batch.nbytes
                    if total > limit:
                        raise SqlError(f"the query reads over {DATA_LIMIT_MB} MB of table data (at {name}); "
                                       f"name fewer columns or tables")
                    if time.monotonic() > deadline:
                        raise _Timeout
                    w.write_batch(batch)
        if len(need) > 1:
            cur.execute("COMMIT")
        ok = True
    except duckdb.InterruptException:
        raise _Timeout from None
    except duckdb.Error as e:
        if time.monotonic() >= deadline:
            raise _Timeout from None
        raise SqlError(f"cannot read {name} from the store: {_line(e)}") from None
    finally:
        _WATCHDOG.cancel(alarm)
        cur.close()  # an unfinished transaction rolls back with the cursor
        for path in ([] if ok else files.values()):
            try:
                os.unlink(path)
            except OSError:
                pass
    return files


def run_readonly(store: Store, query: str, max_rows: int = 1000, timeout_s: float = 5.0, *,
                 max_cell_chars: int | None = None, max_result_bytes: int | None = None) -> SqlResult:
    """Check and run ``query`` in the sandbox; at most ``max_rows`` rows, all within ``timeout_s`` seconds.

    ``max_cell_chars``: text cells longer than this are cut (ending in U+2026); ``max_result_bytes``: the last rows
    are left out until the result is at most this size (the UI's caps, ``UI_MAX_CELL_CHARS`` / ``UI_MAX_RESULT_BYTES``;
    ``SqlResult.note`` says what was cut). Without them a result over ``RESULT_LIMIT_MB`` is an error."""
    t0 = time.monotonic()
    deadline = t0 + float(timeout_s)
    if not isinstance(max_rows, int) or max_rows < 1:
        raise SqlError(f"max_rows must be an integer >= 1, got {max_rows!r}")
    if not timeout_s or timeout_s <= 0:
        raise SqlError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not isinstance(query, str) or not query.strip():
        raise SqlError("empty query: write a SELECT, e.g. SELECT * FROM runs")
    if len(query) > MAX_QUERY_CHARS:
        raise SqlError(f"query too long: {len(query)} characters, at most {MAX_QUERY_CHARS}")
    if os.name != "posix":
        raise SqlError("the SQL console needs a POSIX system (worker processes with resource limits)")
    files: dict[str, str] = {}
    worker = None
    try:
        worker = _POOL.get(deadline)
        worker.wait_ready(deadline)
        head, _ = worker.call({"op": "check", "query": query, "max_chars": MAX_QUERY_CHARS,
                               "timeout": deadline - time.monotonic()}, deadline)
        files = _fetch(store, head["need"], worker.dir, deadline)
        head, blob = worker.call({"op": "run", "files": files, "max_rows": max_rows,
                                  "result_limit": RESULT_LIMIT_MB << 20, "max_cell_chars": max_cell_chars,
                                  "max_result_bytes": max_result_bytes,
                                  "timeout": deadline - time.monotonic()}, deadline)
        try:
            frame = pl.read_ipc(io.BytesIO(blob))
        except Exception as e:  # noqa: BLE001
            raise SqlError(f"cannot read the result: {_line(e)}") from None
    except _Timeout:
        raise SqlError(f"query stopped after the {timeout_s:g} s time limit") from None
    except _Died as e:
        raise SqlError(f"query failed: {e}") from None
    except OSError as e:
        raise SqlError(f"cannot run the query: {_line(e)}") from None
    finally:
        for path in files.values():
            try:
                os.unlink(path)
            except OSError:
                pass
        if worker is not None:
            _POOL.put(worker)
    return SqlResult(frame, bool(head.get("truncated")), (time.monotonic() - t0) * 1e3,
                     int(head.get("cells_cut") or 0), int(head.get("rows_cut") or 0), max_cell_chars, max_result_bytes)


def readonly_sql(store: Store, query: str, max_rows: int = 1000, timeout_s: float = 5.0) -> pl.DataFrame:
    """Rows of a read-only query over the store (see the module docstring for what is allowed).

    Args:
        query: one SELECT (WITH, FROM-first, DESCRIBE/SUMMARIZE/SHOW also work).
        max_rows: rows returned at most (the rest is cut).
        timeout_s: wall-clock limit for the whole call; the query is stopped after it.
    Raises:
        SqlError (a ValueError) with a one-line reason.
    """
    return run_readonly(store, query, max_rows, timeout_s).frame


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:  # pragma: no cover
    _worker_main(json.loads(sys.argv[2]))
