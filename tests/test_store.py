"""The DuckDB store: round trips, crash safety, version and corruption checks, clear errors."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.capture.rows import attention_rows, kv_rows, steps_rows, token_frame
from workbench.data.query import RunNotFound
from workbench.data.schema import SCHEMA_VERSION, TABLES, columns
from workbench.data.rows import Rows
from workbench.data.signals import TABLES as SIGNAL_TABLES
from workbench.data.store import Store, StoreError, merge_batches, to_frame

ROOT = Path(__file__).resolve().parent.parent


def test_round_trip_every_signal_table(tmp_path):
    """Frames appended come back equal, column by column, with their types."""
    store = Store(tmp_path / "w.duckdb")
    frames = {
        "runs": pl.DataFrame({"run_id": ["r1"], "created_at": [datetime(2026, 1, 2, 3, 4, 5)], "status": ["complete"],
                              "model": ["m"], "config": ["{}"], "seed": [7], "n_prompt_tokens": [2]}),
        "tokens": pl.DataFrame({"run_id": ["r1", "r1"], "pos": [0, 1], "step": [0, 0], "token_id": [3, 4],
                                "text": ["<b>&", "é\n"], "is_prompt": [True, False], "prob": [None, 0.25],
                                "logprob": [None, -1.386], "confidence": [None, 0.5], "entropy": [None, 1.1],
                                "rank": [None, 2], "topk_ids": [None, [9, 4]], "topk_probs": [None, [0.5, 0.25]]},
                               schema_overrides={"pos": pl.Int32, "step": pl.Int32, "token_id": pl.Int32,
                                                 "rank": pl.Int32, "topk_ids": pl.List(pl.Int32)}),
        "attention": pl.DataFrame({"run_id": ["r1"] * 2, "pos": [1, 1], "layer": [0, 0], "head": [0, 1],
                                   "entropy": [0.5, 0.6], "norm_entropy": [0.7, None], "max_weight": [0.9, 0.8],
                                   "sink_weight": [0.1, 0.2]},
                                  schema_overrides={"pos": pl.Int32, "layer": pl.Int32, "head": pl.Int32}),
        "routing": pl.DataFrame({"run_id": ["r1"], "pos": [1], "layer": [1], "slot": [0], "expert": [5],
                                 "weight": [0.6], "score": [0.7], "margin": [-0.01]},
                                schema_overrides={c: pl.Int32 for c in ("pos", "layer", "slot", "expert")}),
        "kv": pl.DataFrame({"run_id": ["r1"], "step": [0], "layer": [0], "cached_tokens": [2], "bytes": [320]},
                           schema_overrides={"step": pl.Int32, "layer": pl.Int32, "cached_tokens": pl.Int32}),
        "kv_tokens": pl.DataFrame({"run_id": ["r1"], "step": [0], "layer": [0], "pos": [0], "latent_norm": [1.5],
                                   "rope_norm": [0.5], "attn_received": [4.0]},
                                  schema_overrides={"step": pl.Int32, "layer": pl.Int32, "pos": pl.Int32}),
        "steps": pl.DataFrame({"run_id": ["r1"], "step": [0], "kind": ["prefill"], "n_tokens": [2],
                               "wall_ms": [1.25]}, schema_overrides={"step": pl.Int32, "n_tokens": pl.Int32}),
    }
    store.append(frames)
    for table, df in frames.items():
        got = store.sql(f"SELECT {', '.join(df.columns)} FROM {table} ORDER BY ALL")
        assert got.equals(df.sort(df.columns)), table
    # every column of the schema exists in the database, in the documented order
    for table in TABLES:
        cols = store.sql(f"SELECT * FROM {table} LIMIT 0").columns
        assert cols == columns(table), table
    assert store.sql("SELECT value FROM meta WHERE key = 'schema_version'")["value"][0] == str(SCHEMA_VERSION)


def test_append_is_atomic(tmp_path):
    """A batch with one bad table leaves none of its tables written."""
    store = Store(tmp_path / "w.duckdb")
    good = pl.DataFrame({"run_id": ["r"], "step": [0], "kind": ["prefill"], "n_tokens": [1], "wall_ms": [1.0]})
    bad = pl.DataFrame({"run_id": ["r"], "pos": ["not a number"]})
    with pytest.raises(Exception):
        store.append({"steps": good, "tokens": bad})
    assert store.sql("SELECT count(*) AS n FROM steps")["n"][0] == 0


def test_writer_then_runs_after_what_was_put_before_and_is_told_of_a_failed_write(tmp_path):
    """``Writer.then``: the callback sees every batch put before it committed (how a run is marked finished only
    once its rows are in the file); after a failed write it gets the error, and close() raises it."""
    from workbench.data.store import Writer

    store = Store(tmp_path / "w.duckdb")
    steps = lambda i: pl.DataFrame({"run_id": ["r"], "step": [i], "kind": ["decode"], "n_tokens": [1],  # noqa: E731
                                    "wall_ms": [1.0]})
    seen: list = []
    w = Writer(store, interval=5.0)  # one long transaction window: the callback still waits for the commit
    for i in range(3):
        w.put({"steps": [steps(i)]})
    w.then(lambda err: seen.append((err, store.sql("SELECT count(*) AS n FROM steps")["n"][0])))
    w.put({"steps": [steps(3)]})
    w.close()
    assert seen == [(None, 3)] and store.sql("SELECT count(*) AS n FROM steps")["n"][0] == 4
    w = Writer(store, interval=0.01)
    w.put({"tokens": [pl.DataFrame({"run_id": ["r"], "pos": ["not a number"]})]})
    w.then(lambda err: seen.append(err))
    with pytest.raises(StoreError):
        w.close()
    assert seen[-1] is not None


def test_newer_schema_version_is_refused(tmp_path):
    path = tmp_path / "future.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
    con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION + 1)])
    con.close()
    with pytest.raises(StoreError, match=r"schema_version \d+, newer than this workbench"):
        Store(path)


def test_corrupt_file_is_store_error(tmp_path):
    path = tmp_path / "junk.duckdb"
    path.write_bytes(os.urandom(64 * 1024))
    with pytest.raises(StoreError, match="junk.duckdb"):
        Store(path)


def test_foreign_duckdb_is_refused(tmp_path):
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE sales (x INT)")
    con.close()
    with pytest.raises(StoreError, match="not a workbench database"):
        Store(path)


def test_unknown_run_is_run_not_found(tmp_path):
    wb = workbench.open(tmp_path / "w.duckdb", create=True)
    with pytest.raises(RunNotFound, match="no run 'nope'"):
        wb.run("nope")
    with pytest.raises(RunNotFound):
        wb.latest()


def test_cli_errors_are_one_line(tmp_path):
    path = tmp_path / "junk.duckdb"
    path.write_bytes(os.urandom(4096))
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "runs", "--db", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


CHILD = textwrap.dedent("""
    import sys, time, torch
    import workbench
    from workbench.model import ModelArgs, Transformer
    from workbench.data.store import Store

    db = sys.argv[1]
    model = Transformer(ModelArgs.preset("tiny")).init_weights(seed=1, std=0.1).eval()
    store = Store(db)

    def on_token(pos, text):
        # a reader in the same process sees the steps committed so far, while the recording goes on
        n = store.sql("SELECT count(*) AS n FROM steps")["n"][0]
        print(f"token {pos} steps {n}", flush=True)
        if pos >= 12:  # after four steps, wait until they are all committed, then hang: the parent kills us
            while store.sql("SELECT count(*) AS n FROM steps")["n"][0] < 4:
                time.sleep(0.02)
            print("ready", flush=True)
            time.sleep(600)

    workbench.record(list(range(1, 10)), model=model, max_new_tokens=40, db=store, on_token=on_token)
""")


def test_sigkill_mid_run_keeps_finished_steps(tmp_path):
    db = tmp_path / "w.duckdb"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), str(db)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip() == "ready":
                break
        assert lines and lines[-1] == "ready", (lines, proc.stderr.read() if proc.poll() is not None else "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # the in-process reader saw earlier steps while recording went on
    seen = [int(ln.split()[-1]) for ln in lines if ln.startswith("token")]
    assert len(seen) == 4 and seen == sorted(seen)  # monotonic: committed steps never disappear
    # straight from the file (no workbench code marking anything): the transactions that committed the
    # steps moved runs.n_tokens on with them, so the run's length is right although it never finished
    con = duckdb.connect(str(db))
    try:
        status, n_tokens, n_rows = con.execute(
            "SELECT status, n_tokens, (SELECT count(*) FROM tokens) FROM runs").fetchone()
    finally:
        con.close()
    assert status == "running" and n_tokens == n_rows > 9
    store = Store(db)
    runs = store.sql("SELECT run_id, status, n_tokens FROM runs")
    assert runs.height == 1 and runs["status"][0] == "interrupted"
    assert runs["n_tokens"][0] == n_rows  # and the interrupted-marking's recount agrees
    run = workbench.open(store).run(runs["run_id"][0])
    steps = run.steps()
    assert steps["step"].to_list()[:4] == [0, 1, 2, 3]
    assert run.status == "interrupted"
    tok = run.tokens()
    assert tok["pos"].to_list() == list(range(tok.height))  # no gaps: whole steps only
    assert tok.height >= 9 + 4
    n_steps = steps.height
    assert run.kv()["step"].max() == n_steps - 1
    assert run.attention()["pos"].max() == 9 + n_steps - 2  # the prompt and each fed token


def test_schema_doc_matches_schema_and_its_queries_run(tmp_path):
    """docs/schema.md names every table and column of workbench/data/schema.py, in order; its SQL runs."""
    import re

    doc = (ROOT / "docs" / "schema.md").read_text()
    sections = re.split(r"^### `(\w+)`.*$", doc, flags=re.M)
    documented = {sections[i]: re.findall(r"^\| (\w+) \|", sections[i + 1], flags=re.M)
                  for i in range(1, len(sections), 2)}
    assert set(documented) == set(TABLES)
    for table in TABLES:
        assert [c for c in documented[table] if c != "column"] == columns(table), table
    assert f"{SCHEMA_VERSION} today" in doc
    model = tiny_model()
    store = Store(tmp_path / "w.duckdb")
    workbench.record([1, 2, 3, 4, 5], model=model, max_new_tokens=4, db=store)
    queries = re.findall(r"```sql\n(.*?)```", doc, flags=re.S)
    assert len(queries) >= 5
    for q in queries:
        df = store.sql(q.strip().rstrip(";"))
        assert df.height > 0 or "status <> 'complete'" in q, q


def test_replace_rows_takes_typed_keys_and_a_hostile_value_is_data(tmp_path):
    """``replace_rows(table, {column: value}, df)``: the WHERE is built from declared column names only; a value
    is a bound parameter, so a value that reads as SQL matches only rows holding that very string."""
    store = Store(tmp_path / "w.duckdb")
    hostile = "x' OR '1'='1"

    def frame(run_id: str, policies: list[str], kept: int) -> pl.DataFrame:
        return pl.DataFrame({"run_id": run_id, "policy": policies, "bytes_kept": kept})

    store.replace_rows("policy_results", {"run_id": "ra"}, frame("ra", ["full", "window", hostile], 1))
    store.replace_rows("policy_results", {"run_id": "rb"}, frame("rb", ["full"], 2))

    def rows() -> list[tuple]:
        return store.sql("SELECT run_id, policy, bytes_kept FROM policy_results ORDER BY run_id, policy").rows()

    # the hostile string as a key value: only its own row of run ra goes, every other row stays
    store.replace_rows("policy_results", {"run_id": "ra", "policy": hostile}, frame("ra", [hostile], 7))
    assert rows() == [("ra", "full", 1), ("ra", "window", 1), ("ra", hostile, 7), ("rb", "full", 2)]
    # a list of values: any of them; an empty list matches nothing
    store.replace_rows("policy_results", {"run_id": "ra", "policy": ["full", "window"]}, frame("ra", ["full"], 3))
    assert rows() == [("ra", "full", 3), ("ra", hostile, 7), ("rb", "full", 2)]
    store.replace_rows("policy_results", {"run_id": hostile}, frame("rc", ["full"], 4))
    store.replace_rows("policy_results", {"policy": []}, frame("rd", ["full"], 5))
    assert len(rows()) == 5
    # Store.replace is replace_rows keyed by the run
    store.replace("policy_results", "rb", frame("rb", ["window"], 6))
    assert [r for r in rows() if r[0] == "rb"] == [("rb", "window", 6)]
    # names are checked against the schema: SQL in a column or table name is refused before any SQL runs
    for table, keys, message in [("policy_results", {"run_id = run_id OR 1=1 --": "x"}, "has no column"),
                                 ("policy_results; DROP TABLE runs", {"run_id": "x"}, "unknown table"),
                                 ("nope", {}, "unknown table")]:
        with pytest.raises(ValueError, match=message):
            store.replace_rows(table, keys, frame("rz", ["full"], 0))
    assert len(rows()) == 5 and store.sql("SELECT count(*) AS n FROM runs")["n"][0] == 0
    with pytest.raises(TypeError):
        store.replace_rows("policy_results", "run_id = 'ra'", frame("ra", ["full"], 0))  # type: ignore[arg-type]
    # {} is every row of the table (the background recorder's copy of the app's profiles), only when asked for
    with pytest.raises(ValueError, match="all_rows=True"):
        store.replace_rows("policy_results", {}, frame("re", ["full"], 8))
    assert len(rows()) == 5
    store.replace_rows("policy_results", {}, frame("re", ["full"], 8), all_rows=True)
    assert rows() == [("re", "full", 8)]


def test_a_folder_of_shards_refuses_replace_rows(tmp_path):
    from workbench.data.store import StoreError, TraceStore

    (tmp_path / "shards").mkdir()
    with pytest.raises(StoreError, match="read-only"):
        TraceStore(tmp_path / "shards").replace_rows("anomalies", {"run_id": "r1"}, pl.DataFrame({"run_id": ["r1"]}))


def test_a_folder_that_holds_no_shards_is_refused_with_what_to_pass(tmp_path):
    from workbench.data.store import StoreError, TraceStore

    other = tmp_path / "scripts"
    other.mkdir()
    (other / "a.py").write_text("print(1)\n")
    with pytest.raises(StoreError, match="not one of Parquet shards"):
        TraceStore(other)
    with pytest.raises(StoreError, match="not one of Parquet shards"):
        Store(other)  # a folder given as the database opens as shards
    (tmp_path / "empty").mkdir()
    assert TraceStore(tmp_path / "empty").sql("SELECT count(*) AS n FROM runs")["n"][0] == 0  # runs may come later


def test_a_commits_runs_move_on_as_far_as_its_rows_prove_whether_parts_or_frames(tmp_path):
    """Several runs' rows in one commit (a batch's writer): each running run's n_tokens moves on to what its rows
    prove, read from the Rows parts themselves (each names its run) as from the frame they become."""
    def batch(rid: str, steps: list[int], pos: list[int]) -> dict:
        return {"steps": Rows(rid, {"step": np.array(steps, np.int32), "kind": np.array(["decode"] * len(steps), object),
                                    "n_tokens": np.ones(len(steps), np.int32), "wall_ms": np.ones(len(steps))}),
                "resid_norm": Rows(rid, {"pos": np.array(pos, np.int32), "layer": np.zeros(len(pos), np.int32),
                                         "norm": np.ones(len(pos))})}

    got = {}
    for how in ("parts", "frames"):
        store = Store(tmp_path / f"{how}.duckdb")
        store.append({"runs": pl.DataFrame({"run_id": ["a", "b"], "status": ["running"] * 2,
                                            "n_prompt_tokens": [3, 5], "n_tokens": [3, 5]})})
        items = [batch("a", [1, 4], [2, 6]), batch("b", [2], [9, 11]), batch("a", [2], [12])]
        merged = merge_batches(items)
        store.append(merged if how == "parts" else {t: to_frame(p) for t, p in merged.items()})
        got[how] = dict(store.execute("SELECT run_id, n_tokens FROM runs ORDER BY run_id"))
    # a: last step 4 -> 3 + 4 + 1 = 8; its fed position 12 -> 14 tokens; b: step 2 -> 8, position 11 -> 13
    assert got["parts"] == got["frames"] == {"a": 14, "b": 13}


def test_rows_go_in_as_arrow_and_come_back_as_their_frames_would(tmp_path):
    """A commit of ``Rows`` only goes into DuckDB as Arrow built from the numpy columns (no polars frame): every
    signal table holds what the same parts inserted as frames (``to_frame``) hold, NaN kept where it is data and
    NULL where the part says so (``nan_to_null``), list and string columns, several runs and an empty part."""
    rng = np.random.default_rng(0)

    def parts(rid: str, n: int) -> dict:
        stats = {c: rng.random((n, 3)) for c in ("entropy", "norm_entropy", "max_weight", "sink_weight")}
        stats["norm_entropy"][0, 1] = np.nan  # one key visible: NULL, as the attention probe writes it
        stats["entropy"][1, 2] = np.nan  # a non-finite statistic stays NaN
        logits = torch.randn(n, 50)
        logits[0, 3] = float("nan")
        out = {"attention": attention_rows(rid, [{"pos": np.arange(n, dtype=np.int32), "layer": 1, **stats}]),
               "tokens": token_frame(rid, np.arange(n), list(range(1, n + 1)), list(range(n)),
                                     ["<b>&", "é\n", "", "'; DROP TABLE runs; --"][:n], [False] * n, logits, 3),
               "steps": steps_rows(rid, np.arange(n), np.ones(n, np.int32), rng.random(n)),
               "resid_norm": Rows(rid, {"pos": np.arange(n, dtype=np.int32), "layer": np.zeros(n, np.int32),
                                        "norm": rng.random(n)}),
               "routing": Rows(rid, {"pos": np.arange(n, dtype=np.int32), "layer": np.ones(n, np.int32),
                                     "slot": np.zeros(n, np.int32), "expert": np.arange(n, dtype=np.int32),
                                     "weight": rng.random(n), "score": rng.random(n), "margin": -rng.random(n)})}
        out.update(kv_rows(rid, 2, [(0, n, 64 * n), (1, n, 64 * n)],
                           [{"layer": np.zeros(n, np.int32), "pos": np.arange(n, dtype=np.int32),
                             "latent_norm": rng.random(n), "rope_norm": rng.random(n),
                             "attn_received": rng.random(n)}]))
        return out

    merged = merge_batches([parts("a", 4), parts("b", 3), parts("a", 2),
                            {"resid_norm": Rows("b", {"pos": np.zeros(0, np.int32), "layer": np.zeros(0, np.int32),
                                                      "norm": np.zeros(0)})}])
    assert set(merged) <= set(SIGNAL_TABLES)
    got = {}
    for how in ("arrow", "frames"):
        store = Store(tmp_path / f"{how}.duckdb")
        store.append(merged if how == "arrow" else {t: to_frame(p) for t, p in merged.items()})
        got[how] = {t: store.sql(f"SELECT * FROM {t} ORDER BY ALL") for t in merged}
    for t in merged:
        a, f = got["arrow"][t], got["frames"][t]
        assert a.schema == f.schema and a.height == f.height > 0, t
        assert a.equals(f), t  # NaN equals NaN, NULL equals NULL, and neither the other
    att = got["arrow"]["attention"]
    assert att["norm_entropy"].null_count() == 3 and att["entropy"].is_nan().sum() == 3  # one of each a part
    assert got["arrow"]["tokens"]["entropy"].is_nan().sum() == 3


def test_rows_typed_unlike_each_other_go_in_through_the_frame_path(tmp_path):
    """Two parts of one table whose columns Arrow cannot concatenate as they are (int32 and int64 positions) take
    the frame path's relaxed concat: the commit stands, every row stored."""
    store = Store(tmp_path / "w.duckdb")
    parts = [Rows("a", {"pos": np.arange(3, dtype=np.int32), "layer": np.zeros(3, np.int32), "norm": np.ones(3)}),
             Rows("b", {"pos": np.arange(2, dtype=np.int64), "layer": np.zeros(2, np.int32), "norm": np.ones(2)})]
    store.append({"resid_norm": parts})
    got = store.sql("SELECT run_id, pos FROM resid_norm ORDER BY run_id, pos")
    assert got["run_id"].to_list() == ["a"] * 3 + ["b"] * 2 and got["pos"].to_list() == [0, 1, 2, 0, 1]
