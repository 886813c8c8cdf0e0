"""Parquet export: Hive-partitioned by run, read back by DuckDB to the same rows."""
from __future__ import annotations

import duckdb
import polars as pl
import pytest

from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.model import save_checkpoint
from workbench import cli
from workbench.export import RUN_TABLES, export_parquet
from workbench import record
from workbench.schema import SCHEMA_VERSION
from workbench.schema import columns
from workbench.store import Store
from helpers import tiny_model


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
