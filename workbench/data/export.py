"""Parquet export of runs, Hive-partitioned by run, so other engines read traces without this package.

Layout: ``<out>/<table>/run_id=<id>/data.parquet`` for every table keyed by ``run_id`` (``runs``
included), plus ``<out>/meta/data.parquet`` (the schema version) and the completion marker
``<out>/_SUCCESS``. The partition column lives in the folder name, as Hive, Spark, Trino and DuckDB
(``read_parquet(..., hive_partitioning = true)``) expect. Files are written by DuckDB's own
``COPY ... (FORMAT PARQUET)``, so types (lists, timestamps) are kept.

Crash safety: every file is written under a temporary name in its own folder
(``.data.parquet.<pid>.tmp``: a leading dot and no ``.parquet`` ending, so neither Hive-style readers
nor a ``*.parquet`` glob pick it up) and moved onto its final name with ``os.replace``, so a file under
a final name is always whole. An export removes ``_SUCCESS`` before it touches anything and writes it
(atomically too) after its last file: ``_SUCCESS`` present means the last export into the folder
finished; absent means one was cut short (its files are whole but may mix it with an earlier export),
and re-running the export completes it. ``_SUCCESS`` is JSON: the run ids of that export, the files
written and the schema version. The ``runs`` partitions are written last, so a run's ``runs`` row is
exported only after its signal tables. Temporary files left by a killed export are removed by the next.

Nothing else is touched: an export writes only ``<table>/run_id=<id>/data.parquet``, ``meta/data.parquet``
and ``_SUCCESS``, removes only temporary files of exactly its own name pattern in those folders, and refuses a
folder whose ``_SUCCESS`` is not its own (another tool's marker), so a user's files beside it stay.
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from workbench.data import query
from workbench.data.schema import SCHEMA_VERSION, TABLES, columns
from workbench.data.store import MARKER, RUN_MARKERS, Store, complete_runs  # noqa: F401 - the markers' home is the store

RUN_TABLES = tuple(t for t in TABLES if "run_id" in columns(t))
# runs last: a run's row appears (or is refreshed) only once its signal tables are written
_ORDER = tuple(t for t in RUN_TABLES if t != "runs") + ("runs",)


def _literal(s: str) -> str:
    """A SQL string literal (COPY takes no parameters for its target)."""
    return "'" + s.replace("'", "''") + "'"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


_STRAY = re.compile(r"\.(data\.parquet|_SUCCESS)\.\d+\.tmp")


def _is_stray(f: Path) -> bool:
    """A temporary file of an export that did not finish: exactly the name ``_tmp_name`` gives (DuckDB writes
    none of its own: ``USE_TMP_FILE false``). A user's ``.notes.tmp`` or ``tmp_x.parquet`` is not one."""
    return _STRAY.fullmatch(f.name) is not None


def _remove_strays(out: Path) -> None:
    """Remove the temporary files of a killed export, and only where an export writes: ``<table>/run_id=*/``,
    ``meta/`` and the folder itself (``_SUCCESS``'s). Nothing else in the folder is touched."""
    folders = [out, out / "meta"] + [d for t in TABLES if (out / t).is_dir()
                                     for d in (out / t).glob("run_id=*") if d.is_dir()]
    for folder in folders:
        for f in folder.glob(".*.tmp"):  # a literal folder (Path.glob escapes it): only its own entries
            if f.is_file() and not f.is_symlink() and _is_stray(f):
                f.unlink(missing_ok=True)


def _check_marker(marker: Path) -> None:
    """A ``_SUCCESS`` that is not an export's own (JSON with ``files`` and ``schema_version``) belongs to
    someone else (a Spark / Hadoop job, a user): refused, in one line, before anything is written."""
    if not marker.exists() and not marker.is_symlink():
        return
    try:
        ours = marker.is_file() and not marker.is_symlink() and {"files", "schema_version"} <= set(
            json.loads(marker.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        ours = False
    if not ours:
        raise ValueError(f"{marker} exists and is not a workbench export marker: export into a new (or empty) "
                         "folder; nothing was written")


def _copy(cur, select: str, path: Path) -> None:
    """``COPY (select) TO path`` written under a temporary name, then moved into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        cur.execute(f"COPY ({select}) TO {_literal(str(tmp))} (FORMAT PARQUET, USE_TMP_FILE false)")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def export_parquet(store: Store, out_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """Write one run (or all runs) as Hive-partitioned Parquet under ``out_dir``; return the files written.

    A run's partition is replaced if it exists (re-exporting is idempotent); tables where the run has no
    rows get no file. Each file appears whole under its final name, and ``out_dir/_SUCCESS`` is written
    last (see the module docstring). Raises ``RunNotFound`` for an unknown ``run_id``.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--parquet {out} is a file, not a folder")
    if run_id is not None:
        query.run_row(store, run_id)
        run_ids = [run_id]
    else:
        run_ids = store.sql("SELECT run_id FROM runs ORDER BY created_at, run_id")["run_id"].to_list()
    marker = out / MARKER
    _check_marker(marker)
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # from here until the end, the folder is not a finished export
    _remove_strays(out)
    written: list[Path] = []
    cur = store.cursor()
    try:
        for table in _ORDER:
            counts = dict(cur.execute(f"SELECT run_id, count(*) FROM {table} GROUP BY run_id").fetchall())
            for rid in run_ids:
                # partition values are URL-encoded in folder names, as Hive writers do
                path = out / table / f"run_id={quote(rid, safe='')}" / "data.parquet"
                if not counts.get(rid):
                    path.unlink(missing_ok=True)  # a stale file from an earlier export would resurrect rows
                    continue
                _copy(cur, f"SELECT * EXCLUDE (run_id) FROM {table} WHERE run_id = {_literal(rid)}", path)
                written.append(path)
        meta = out / "meta" / "data.parquet"
        _copy(cur, "SELECT * FROM meta ORDER BY key", meta)
        written.append(meta)
    finally:
        cur.close()
    tmp = _tmp_name(marker)
    try:
        tmp.write_text(json.dumps({
            "runs": run_ids, "files": [str(p.relative_to(out)) for p in written],
            "schema_version": SCHEMA_VERSION,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=1) + "\n")
        os.replace(tmp, marker)
    finally:
        tmp.unlink(missing_ok=True)
    return written


# -- one run at a time: shards (``workbench record --prompts ... --out DIR``) ----------------------------
# Several processes (Ray actors) may write runs into one folder at once: each writes only its own runs'
# partitions, every file under a temporary name moved into place, then the run's own completion marker
# ``<out>/_runs/<run id>.json`` (written last, atomically). A run without a marker is not a run of the
# folder (readers skip it), so a worker killed mid-run leaves no half-written run behind.
def run_marker(out_dir: str | Path, run_id: str) -> Path:
    return Path(out_dir) / RUN_MARKERS / f"{quote(run_id, safe='')}.json"


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_run(store: Store, out_dir: str | Path, run_id: str) -> list[Path]:
    """Write one run's partitions (every table it has rows in) under ``out_dir``, then its completion marker
    ``<out>/_runs/<id>.json`` (JSON: run_id, status, batch_id, batch_item, files, schema_version). Other
    runs' files and markers, and the folder's ``_SUCCESS``, are left alone; returns the files written."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    info = query.run_row(store, run_id)
    marker = run_marker(out, run_id)
    marker.unlink(missing_ok=True)
    written: list[Path] = []
    cur = store.cursor()
    try:
        for table in _ORDER:
            path = out / table / f"run_id={quote(run_id, safe='')}" / "data.parquet"
            if not cur.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", [run_id]).fetchone()[0]:
                path.unlink(missing_ok=True)
                continue
            _copy(cur, f"SELECT * EXCLUDE (run_id) FROM {table} WHERE run_id = {_literal(run_id)}", path)
            written.append(path)
        meta = out / "meta" / "data.parquet"
        if not meta.exists():
            _copy(cur, "SELECT * FROM meta ORDER BY key", meta)
    finally:
        cur.close()
    _write_json(marker, {"run_id": run_id, "status": info["status"], "batch_id": info.get("batch_id"),
                         "batch_item": info.get("batch_item"), "files": [str(p.relative_to(out)) for p in written],
                         "schema_version": SCHEMA_VERSION,
                         "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    return written


def import_traces(src: Store, dest: Store) -> tuple[list[str], list[str]]:
    """Merge the runs of a shard folder (a ``TraceStore``: only runs with a completion marker) into the
    database ``dest``, one transaction per run (its ``runs`` row and every table's rows together). Runs
    ``dest`` already has are left as they are. Returns (run ids imported, run ids already there)."""
    have = set(dest.sql("SELECT run_id FROM runs")["run_id"].to_list())
    ids = src.sql("SELECT run_id FROM runs ORDER BY created_at, run_id")["run_id"].to_list()
    added = []
    for rid in ids:
        if rid in have:
            continue
        rows = {t: src.sql(f"SELECT * FROM {t} WHERE run_id = ?", [rid]) for t in ("runs",) + _ORDER[:-1]}
        dest.append({t: df for t, df in rows.items() if df.height})
        added.append(rid)
    if added:
        dest.checkpoint()
    return added, [r for r in ids if r in have]
