"""Parquet export: Hive-partitioned by run, read back by DuckDB to the same rows."""
from __future__ import annotations

import duckdb
import polars as pl
import pytest
from helpers import kill_when_ready, tiny_model

from workbench import cli, record
from workbench.data.export import RUN_TABLES, export_parquet
from workbench.data.schema import SCHEMA_VERSION, columns
from workbench.data.store import Store
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    model = tiny_model()
    ckpt = str(save_checkpoint(model, root / "ckpt", tokenizer=DEFAULT_TOKENIZER))
    store = Store(root / "wb.duckdb")
    # an all-digit id: DuckDB's Hive reader would type it BIGINT unless told otherwise
    a = record([5, 17, 42, 7], model=ckpt, max_new_tokens=4, db=store, run_id="200747441128", detect=False)
    b = record([9, 8, 7, 6, 5], model=ckpt, max_new_tokens=3, db=store, temperature=0.8, seed=3, detect=False)
    store.append({"anomalies": pl.DataFrame({"run_id": [a.run_id], "anomaly_id": [0], "kind": ["low_confidence"],
                                             "severity": ["warning"], "pos": [5], "score": [0.1],
                                             "threshold": [0.2], "explanation": ["</script> & 'quotes'"]})})
    return {"root": root, "store": store, "runs": [a.run_id, b.run_id]}


def read_back(out, table: str) -> pl.DataFrame:
    con = duckdb.connect()
    try:
        cols = ", ".join(c if c != "run_id" else "CAST(run_id AS VARCHAR) AS run_id" for c in columns(table))
        return con.sql(f"SELECT {cols} FROM read_parquet('{out}/{table}/*/*.parquet', hive_partitioning = true)").pl()
    finally:
        con.close()


def same_rows(x: pl.DataFrame, y: pl.DataFrame) -> bool:
    keys = [c for c in x.columns if x[c].dtype != pl.List(pl.Int32) and not isinstance(x[c].dtype, pl.List)]
    return x.sort(keys).equals(y.select(x.columns).sort(keys))


def test_all_runs_round_trip_through_duckdb(env, tmp_path):
    store = env["store"]
    files = export_parquet(store, tmp_path / "pq")
    assert all(f.exists() for f in files)
    for table in RUN_TABLES:
        want = store.sql(f"SELECT * FROM {table}").select(columns(table))
        if want.height == 0:
            assert not (tmp_path / "pq" / table).exists()
            continue
        for rid in want["run_id"].unique().to_list():
            assert (tmp_path / "pq" / table / f"run_id={rid}" / "data.parquet").exists()
        got = read_back(tmp_path / "pq", table)
        assert got.height == want.height, table
        assert same_rows(want, got), table
    meta = duckdb.sql(f"SELECT * FROM read_parquet('{tmp_path / 'pq' / 'meta' / 'data.parquet'}')").fetchall()
    assert ("schema_version", str(SCHEMA_VERSION)) in meta


def test_one_run_and_idempotent_reexport(env, tmp_path):
    store = env["store"]
    a, b = env["runs"]
    out = tmp_path / "one"
    files = export_parquet(store, out, run_id=b)
    assert all(f"run_id={b}" in str(f) for f in files if "meta" not in f.parts)
    export_parquet(store, out, run_id=b)  # again: replaced, not duplicated
    got = read_back(out, "tokens")
    want = store.sql("SELECT * FROM tokens WHERE run_id = ?", [b]).select(columns("tokens"))
    assert same_rows(want, got)
    assert not (out / "anomalies").exists()  # b has none
    assert cli.main(["export", "--parquet", str(out), "--run", a, "--db", str(store.path)]) == 0
    assert set(read_back(out, "runs")["run_id"].to_list()) == {a, b}
    assert cli.main(["export", "--parquet", str(out), "--run", "nope", "--db", str(store.path)]) == 2


def whole_files(out) -> dict[str, int]:
    """Every file under a final name, read on its own (a truncated file would fail here): rows per file."""
    con = duckdb.connect()
    try:
        return {str(f.relative_to(out)): con.execute(f"SELECT count(*) FROM read_parquet('{f}')").fetchone()[0]
                for f in sorted(out.rglob("*.parquet"))}
    finally:
        con.close()


def test_export_marker_and_failure_between_files(env, tmp_path, monkeypatch):
    """A failure between two files leaves whole files only, no temporary file and no _SUCCESS; a rerun
    completes with the marker."""
    import json

    import workbench.data.export as export

    store = env["store"]
    out = tmp_path / "pq"
    files = export_parquet(store, out)
    marker = json.loads((out / "_SUCCESS").read_text())
    assert marker["runs"] == sorted(env["runs"], key=lambda r: store.execute(
        "SELECT created_at, run_id FROM runs WHERE run_id = ?", [r])[0]) and len(marker["files"]) == len(files)
    full = whole_files(out)
    real_copy, calls = export._copy, []

    def copy_then_fail(cur, select, path):
        if len(calls) == 5:
            raise RuntimeError("killed between files")
        calls.append(path)
        real_copy(cur, select, path)

    monkeypatch.setattr(export, "_copy", copy_then_fail)
    with pytest.raises(RuntimeError, match="between files"):
        export_parquet(store, out)
    assert not (out / "_SUCCESS").exists()
    assert whole_files(out) == full  # the files rewritten so far are whole; the rest are the earlier export's
    assert not [f for f in out.rglob("*") if f.is_file() and not f.name.endswith(".parquet")]
    monkeypatch.setattr(export, "_copy", real_copy)
    export_parquet(store, out)
    assert (out / "_SUCCESS").exists() and whole_files(out) == full


KILLED_EXPORT = r"""
import os, sys, time
import workbench.data.export as export
from workbench.data.store import Store

real, n = os.replace, []

def replace(src, dst):  # the third file is written under its temporary name; die before moving it
    n.append(dst)
    if len(n) == 3:
        print("ready", flush=True)
        time.sleep(600)
    real(src, dst)

export.os.replace = replace
export.export_parquet(Store(sys.argv[1]), sys.argv[2])
"""


def test_sigkill_mid_export_leaves_no_partial_file(env, tmp_path):
    """An export SIGKILLed mid-way leaves no marker, nothing partial under a final name (its temporary
    file matches no *.parquet glob), and hive readers read the whole files; a rerun finishes it."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    store = env["store"]
    out = tmp_path / "pq"
    kill_when_ready(["-c", KILLED_EXPORT, str(store.path), str(out)], root, [root])
    assert not (out / "_SUCCESS").exists()
    strays = [f for f in out.rglob("*") if f.is_file() and not f.name.endswith(".parquet")]
    assert len(strays) == 1 and strays[0].name.startswith(".data.parquet.")  # the file it was writing
    assert len(whole_files(out)) == 2  # the two files moved into place (both runs' tokens), each whole
    got = read_back(out, "tokens")  # a hive reader sees those whole files only
    assert same_rows(store.sql("SELECT * FROM tokens").select(columns("tokens")), got)
    with pytest.raises(duckdb.IOException, match="No files found"):  # the stray is not taken for a file
        read_back(out, "attention")
    assert not (out / "runs").exists()  # runs partitions come last: no run row without its tables
    export_parquet(store, out)  # the rerun completes it and clears the stray
    assert (out / "_SUCCESS").exists()
    assert not [f for f in out.rglob("*") if f.is_file() and not f.name.endswith(".parquet")
                and f.name != "_SUCCESS"]
    for table in RUN_TABLES:
        want = store.sql(f"SELECT * FROM {table}").select(columns(table))
        if want.height:
            assert same_rows(want, read_back(out, table)), table
