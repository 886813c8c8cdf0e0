"""Read-only SQL over a workbench store, for the UI's SQL tab and ``Workbench.sql``.

The store's connection is shared with the recorder (DuckDB allows one read-write instance per file
per process, and a read-only connection cannot be opened beside it), and DuckDB's
``enable_external_access`` switch is global and one-way, so it would break the writer. Instead the
query is checked with DuckDB's own parser, not with regular expressions:

1. ``duckdb.extract_statements``: exactly one statement, of type SELECT (rejects INSERT/UPDATE/
   DELETE/CREATE/DROP, ATTACH, COPY, PRAGMA, SET, INSTALL/LOAD, CALL, EXPORT, ...).
2. ``json_serialize_sql``: the statement's syntax tree is walked; every table it reads must be a
   workbench table (or a CTE the query defines), in the main schema; the only table functions allowed
   are ``range``/``generate_series``/``unnest``, so file and network readers (``read_csv``,
   ``read_parquet``, ``glob``, ``'file.csv'`` replacement scans, ``http...``) never bind; a few
   stateful scalar functions (``nextval``, ``setseed``, ...) are refused.

The query then runs on its own cursor wrapped as ``SELECT * FROM (q) LIMIT max_rows + 1`` and a
timer thread interrupts it after ``timeout_s``.
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass

import duckdb
import polars as pl

from .schema import TABLES
from .store import Store

ALLOWED_TABLE_FUNCTIONS = {"range", "generate_series", "unnest"}
DENIED_FUNCTIONS = {"nextval", "currval", "setseed", "current_setting", "getenv", "getvariable",
                    "json_execute_serialized_sql", "query", "query_table", "sql_auto_complete"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SqlError(ValueError):
    """A query that is not allowed, does not parse, fails or runs too long (message says which)."""


@dataclass
class SqlResult:
    """A query's rows, whether ``max_rows`` cut them, and how long it took."""
    frame: pl.DataFrame
    truncated: bool
    elapsed_ms: float


def _walk(node, visit) -> None:
    if isinstance(node, dict):
        visit(node)
        for v in node.values():
            _walk(v, visit)
    elif isinstance(node, list):
        for v in node:
            _walk(v, visit)


def check_query(query: str) -> str:
    """The single SELECT statement in ``query`` (trailing ``;`` removed); ``SqlError`` if not allowed."""
    if not query or not query.strip():
        raise SqlError("empty query: write a SELECT, e.g. SELECT * FROM runs")
    try:
        stmts = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise SqlError(f"cannot parse the query: {str(e).splitlines()[0]}") from None
    if len(stmts) != 1:
        raise SqlError(f"one statement at a time, got {len(stmts)}")
    st = stmts[0]
    if st.type != duckdb.StatementType.SELECT:
        raise SqlError(f"read-only: only SELECT queries are allowed, not {st.type.name}")
    text = st.query.strip().rstrip(";").strip()
    con = duckdb.connect()  # an empty in-memory instance, only to run the serializer
    try:
        tree = json.loads(con.execute("SELECT json_serialize_sql(?::VARCHAR)", [text]).fetchone()[0])
    finally:
        con.close()
    if tree.get("error"):
        raise SqlError(f"not an allowed SELECT: {tree.get('error_message', 'unsupported statement')}")

    ctes: set[str] = set()

    def cte_names(n: dict) -> None:
        entries = (n.get("cte_map") or {}).get("map") or []
        ctes.update(e["key"].lower() for e in entries if isinstance(e, dict) and "key" in e)

    _walk(tree, cte_names)
    bad_cte = [c for c in ctes if not _IDENT.match(c)]
    if bad_cte:
        raise SqlError(f"CTE names must be plain identifiers, got {bad_cte[0]!r}")
    allowed = set(TABLES) | ctes
    problems: list[str] = []

    def visit(n: dict) -> None:
        kind = n.get("type")
        if kind == "BASE_TABLE":
            name = n.get("table_name", "")
            if n.get("catalog_name") not in ("", None) or n.get("schema_name") not in ("", "main", None):
                problems.append(f"only tables of this database can be read, not {n.get('schema_name')}.{name}")
            elif not _IDENT.match(name) or name.lower() not in allowed:
                problems.append(f"unknown table {name!r}; tables: {', '.join(sorted(TABLES))}")
        elif kind == "TABLE_FUNCTION":
            fn = (n.get("function") or {}).get("function_name", "?")
            if fn.lower() not in ALLOWED_TABLE_FUNCTIONS:
                problems.append(f"table function {fn}() is not allowed (no file or network access)")
        elif n.get("class") == "FUNCTION":
            fn = n.get("function_name", "")
            if fn.lower() in DENIED_FUNCTIONS:
                problems.append(f"function {fn}() is not allowed in read-only queries")
            if n.get("catalog") or n.get("schema") not in ("", "main", "pg_catalog", None):
                problems.append(f"function {n.get('schema')}.{fn}() is not allowed")

    _walk(tree, visit)
    if problems:
        raise SqlError(problems[0])
    return text


def run_readonly(store: Store, query: str, max_rows: int = 1000, timeout_s: float = 5.0) -> SqlResult:
    """Check and run ``query``; at most ``max_rows`` rows, interrupted after ``timeout_s`` seconds."""
    if max_rows < 1:
        raise SqlError(f"max_rows must be >= 1, got {max_rows}")
    text = check_query(query)
    # newline before ")": a trailing "-- comment" must not swallow the wrapper; the wrapped text is
    # checked again so nothing in the user's text can change what the wrapper means
    wrapped = check_query(f"SELECT * FROM ({text}\n) LIMIT {int(max_rows) + 1}")
    cur = store.cursor()
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        cur.interrupt()

    timer = threading.Timer(timeout_s, stop)
    t0 = time.perf_counter()
    timer.start()
    try:
        df = cur.sql(wrapped).pl()
    except duckdb.Error as e:
        if timed_out.is_set():
            raise SqlError(f"query stopped after the {timeout_s:g} s time limit") from None
        raise SqlError(str(e).splitlines()[0]) from None
    finally:
        timer.cancel()
        cur.close()
    if timed_out.is_set():  # finished at the same moment the timer fired
        raise SqlError(f"query stopped after the {timeout_s:g} s time limit")
    return SqlResult(df.head(max_rows), df.height > max_rows, (time.perf_counter() - t0) * 1e3)


def readonly_sql(store: Store, query: str, max_rows: int = 1000, timeout_s: float = 5.0) -> pl.DataFrame:
    """Rows of a read-only query over the store (see the module docstring for what is allowed).

    Args:
        query: one SELECT (WITH, FROM-first, DESCRIBE/SUMMARIZE/SHOW also work).
        max_rows: rows returned at most (the rest is cut).
        timeout_s: wall-clock limit; the query is interrupted after it.
    Raises:
        SqlError (a ValueError) with a one-line reason.
    """
    return run_readonly(store, query, max_rows, timeout_s).frame
