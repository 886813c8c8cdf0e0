"""Parquet export of runs, Hive-partitioned by run, so other engines read traces without this package.

Layout: ``<out>/<table>/run_id=<id>/data.parquet`` for every table keyed by ``run_id`` (``runs``
included), plus ``<out>/meta/data.parquet`` (the schema version). The partition column lives in the
folder name, as Hive, Spark, Trino and DuckDB (``read_parquet(..., hive_partitioning = true)``) expect.
Files are written by DuckDB's own ``COPY ... (FORMAT PARQUET)``, so types (lists, timestamps) are kept.
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from . import query
from .schema import TABLES, columns
from .store import Store

RUN_TABLES = tuple(t for t in TABLES if "run_id" in columns(t))


def _literal(s: str) -> str:
    """A SQL string literal (COPY takes no parameters for its target)."""
    return "'" + s.replace("'", "''") + "'"


def export_parquet(store: Store, out_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """Write one run (or all runs) as Hive-partitioned Parquet under ``out_dir``; return the files written.

    A run's partition is replaced if it exists (re-exporting is idempotent); tables where the run has no
    rows get no file. Raises ``RunNotFound`` for an unknown ``run_id``.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--parquet {out} is a file, not a folder")
    if run_id is not None:
        query.run_row(store, run_id)
        run_ids = [run_id]
    else:
        run_ids = store.sql("SELECT run_id FROM runs ORDER BY created_at, run_id")["run_id"].to_list()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    cur = store.cursor()
    try:
        for table in RUN_TABLES:
            counts = dict(cur.execute(f"SELECT run_id, count(*) FROM {table} GROUP BY run_id").fetchall())
            for rid in run_ids:
                # partition values are URL-encoded in folder names, as Hive writers do
                path = out / table / f"run_id={quote(rid, safe='')}" / "data.parquet"
                if not counts.get(rid):
                    path.unlink(missing_ok=True)  # a stale file from an earlier export would resurrect rows
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                cur.execute(f"COPY (SELECT * EXCLUDE (run_id) FROM {table} WHERE run_id = {_literal(rid)}) "
                            f"TO {_literal(str(path))} (FORMAT PARQUET)")
                written.append(path)
        meta = out / "meta" / "data.parquet"
        meta.parent.mkdir(parents=True, exist_ok=True)
        cur.execute(f"COPY (SELECT * FROM meta ORDER BY key) TO {_literal(str(meta))} (FORMAT PARQUET)")
        written.append(meta)
    finally:
        cur.close()
    return written
