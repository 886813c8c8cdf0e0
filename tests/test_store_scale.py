"""benchmarks/store_scale.py's synthetic store reads back consistently through the query layer, and the query
layer's rowid ranges (a finished run's rows of a signal table) give the same rows as the plain run_id filter,
including after rows are deleted and for runs still being written."""
from __future__ import annotations

import importlib.util
import random
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from workbench.data import query
from workbench.data.signals import TABLES as SIGNAL_TABLES
from workbench.data.store import Store
from workbench.run import Run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("store_scale", ROOT / "benchmarks" / "store_scale.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["store_scale"] = mod  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(scale, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("scale") / "s.duckdb")
    stats = scale.build(store, 20, 60, scale.Shape.demo(), seed=3, per_append=7, progress=False)
    return store, stats


def _plain(store: Store, table: str, run_id: str) -> pl.DataFrame:
    return store.sql(f"SELECT * EXCLUDE (run_id) FROM {table} WHERE run_id = ? ORDER BY {SIGNAL_TABLES[table].order}",
                     [run_id])


def test_synthetic_store_reads_back(scale, built):
    store, stats = built
    shape = scale.Shape.demo()
    runs = query.runs(store)
    assert runs.height == 20 and sorted(runs["run_id"]) == sorted(stats["run_ids"])
    rows = store.sql("SELECT run_id, n_prompt_tokens, n_tokens FROM runs")
    assert runs.join(rows, on="run_id").filter(pl.col("n_tokens") != pl.col("n_tokens_right")).height == 0
    assert stats["values"] > 0 and stats["transactions"] == 3
    for rid, n_prompt, n in rows.iter_rows():
        run = Run(store, rid)
        t = run.tokens()
        assert t.height == n and t["pos"].to_list() == list(range(n))
        assert t.filter(pl.col("is_prompt")).height == n_prompt
        assert t["prob"][0] is None and t["topk_ids"][0] is None and len(t["topk_ids"][1]) == 5
        fed = n - 1
        a = run.attention()
        assert a.height == fed * shape.n_layers * shape.n_heads and a["pos"].max() == fed - 1
        assert a.filter(pl.col("pos") == 0)["norm_entropy"].null_count() == shape.n_layers * shape.n_heads
        r = run.routing()
        assert r.height == fed * len(shape.moe_layers) * shape.top_k
        assert sorted(set(r["layer"])) == shape.moe_layers
        assert r.group_by("pos", "layer").agg(pl.col("expert").n_unique())["expert"].min() == shape.top_k
        load = run.expert_load()
        assert np.allclose(load.group_by("layer").agg(pl.col("share").sum())["share"].to_numpy(), 1.0)
        assert run.signal("resid_norm").height == fed * shape.n_layers
        assert run.signal("head_norm").height == fed * shape.n_layers * shape.n_heads
        last = n - n_prompt - 1
        assert query.last_step(store, rid) == last
        assert run.steps()["step"].to_list() == list(range(last + 1))
        kv = run.kv()
        assert kv.filter(pl.col("step") == last)["cached_tokens"].unique().to_list() == [n - 1]
        kt = run.kv_tokens()
        assert kt.filter(pl.col("step") == 0).height == n_prompt * shape.n_layers
        assert kt.filter(pl.col("step") == last).height == (n - 1) * shape.n_layers
        assert query.detected(store, rid)
        assert run.anomalies().height == store.sql("SELECT count(*) AS n FROM anomalies WHERE run_id = ?", [rid])["n"][0]
        st = run.at_step(last)
        assert st.tokens.height == n


def test_rowid_ranges_match_the_plain_filter(scale, built, tmp_path):
    store, stats = built
    rng = random.Random(0)
    for rid in rng.sample(stats["run_ids"], 5):
        for table in SIGNAL_TABLES:
            assert query._rows(store, table, rid).startswith("rowid BETWEEN")
            assert query.signal(store, table, rid).equals(_plain(store, table, rid))
    a, b = stats["run_ids"][:2]
    assert query.head_shift(store, a, b).height == 6 * 4
    assert query.routing_agreement(store, a, b)["layer"].to_list() == [1, 2, 3, 4, 5]

    # a copy of the store where a run's rows are deleted, and a running run grows
    s2 = Store(tmp_path / "s2.duckdb")
    shape = scale.Shape.demo()
    texts = scale.vocab_texts(shape.vocab)
    g = np.random.default_rng(1)
    ids = [f"rtest{i:07d}" for i in range(4)]
    for i, rid in enumerate(ids):
        s2.append(scale.synth_run(g, rid, 10, 40, shape, texts, datetime(2025, 1, 1, i)))
    before = {r: query.attention(s2, r) for r in ids}
    assert all(query._rows(s2, "attention", r) for r in ids)
    s2.execute("DELETE FROM attention WHERE run_id = ?", [ids[1]])
    s2.checkpoint()
    assert query.attention(s2, ids[1]).height == 0
    for r in (ids[0], ids[2], ids[3]):
        assert query.attention(s2, r).equals(before[r])
    # a run still being written: the plain filter, and every row once it has finished
    live = scale.synth_run(g, "rlive0000000", 10, 40, shape, texts, datetime(2025, 2, 1))
    live["runs"] = live["runs"].with_columns(pl.lit("running").alias("status"), pl.lit(None, pl.Int32).alias("pid"))
    att = live.pop("attention")
    half = att.cols["pos"] < 20
    from workbench.data.rows import Rows
    first = Rows(att.run_id, {c: v[half] for c, v in att.cols.items()}, nan_to_null=att.nan_to_null)
    rest = Rows(att.run_id, {c: v[~half] for c, v in att.cols.items()}, nan_to_null=att.nan_to_null)
    s2._shared.last_check = 1e18  # no liveness check: the run stays 'running' though no process records it
    s2.append(live | {"attention": first})
    assert query._rows(s2, "attention", "rlive0000000") == ""
    assert query.attention(s2, "rlive0000000").height == first.height
    s2.append(scale.synth_run(g, "rmid00000000", 10, 40, shape, texts, datetime(2025, 2, 2)))
    assert query.attention(s2, "rmid00000000").equals(_plain(s2, "attention", "rmid00000000"))  # a scan sees rlive
    s2.append(scale.synth_run(g, "rlater000000", 10, 40, shape, texts, datetime(2025, 3, 1)))
    s2.append({"attention": rest})  # rlive's other part, after newer runs
    s2.execute("UPDATE runs SET status = 'complete' WHERE run_id = 'rlive0000000'")
    assert query.attention(s2, "rlive0000000").equals(_plain(s2, "attention", "rlive0000000"))
    assert query.attention(s2, "rlive0000000").height == att.height
    assert query._rows(s2, "attention", "rlive0000000").startswith("rowid BETWEEN")  # rescanned once finished
    assert query.attention(s2, "rlater000000").equals(_plain(s2, "attention", "rlater000000"))


def test_rowid_ranges_of_a_file_made_anew(scale, tmp_path):
    """A database deleted and made again at the same path, with the same run id: the new rows, not the old range."""
    shape = scale.Shape.demo()
    texts = scale.vocab_texts(shape.vocab)
    g = np.random.default_rng(2)
    path = tmp_path / "again.duckdb"
    s = Store(path)
    s.append(scale.synth_run(g, "rsame0000000", 10, 30, shape, texts, datetime(2025, 1, 1)))
    assert query.attention(s, "rsame0000000").height == 29 * shape.n_layers * shape.n_heads
    s.close()
    for f in (path, path.with_name(path.name + ".wal")):
        f.unlink(missing_ok=True)
    s = Store(path)
    s.append(scale.synth_run(g, "rsame0000000", 10, 50, shape, texts, datetime(2025, 1, 2)))
    assert query.attention(s, "rsame0000000").height == 49 * shape.n_layers * shape.n_heads
    assert query.attention(s, "rsame0000000").equals(_plain(s, "attention", "rsame0000000"))
