"""Prompt sets (issue #17): record_many / ``workbench record --prompts``, shards (``--out``), reading a shard folder
as a store, import, batch views and text search."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pytest
from helpers import kill_when_ready, tiny_model

import workbench
from workbench import cli
from workbench.capture.prompt_sets import prompt_items
from workbench.capture.prompts import load_prompt_set
from workbench.data import query
from workbench.data.export import complete_runs, export_parquet
from workbench.data.store import Store, StoreError, TraceStore
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def add(a, b):", "for i in range(10):\n", "class Point:", "import os\n", "x = [1, 2, 3]",
           "print('hello world')"]
N = 6  # new tokens per prompt


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    ckpt = save_checkpoint(tiny_model(vocab_size=4096), root / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    jsonl = root / "set.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": f"p{i}"}) + "\n" for i, p in enumerate(PROMPTS)))
    store = Store(root / "wb.duckdb")
    batch = workbench.record_many(PROMPTS, model=str(ckpt), db=store, max_new_tokens=N, progress=False)
    return {"root": root, "ckpt": str(ckpt), "jsonl": jsonl, "store": store, "batch": batch}


def ids_and_logprobs(store, run_id):
    t = query.tokens(store, run_id)
    return t["token_id"].to_list(), t["logprob"].to_list()


def test_record_many_equals_single_records(env, tmp_path):
    store, batch = env["store"], env["batch"]
    runs = batch.runs()
    assert runs.height == 6 and set(runs["status"]) == {"complete"}
    assert len(batch.recorded) == 6 and batch.skipped == []
    assert set(store.sql("SELECT DISTINCT batch_id FROM runs")["batch_id"]) == {batch.batch_id}
    by_prompt = dict(zip(runs["prompt"].to_list(), runs["run_id"].to_list()))
    single = Store(tmp_path / "single.duckdb")
    for p in PROMPTS:
        one = workbench.record(p, model=env["ckpt"], db=single, max_new_tokens=N)
        ids, lps = ids_and_logprobs(single, one.run_id)
        got_ids, got_lps = ids_and_logprobs(store, by_prompt[p])
        assert got_ids == ids
        assert got_lps[1:] == pytest.approx(lps[1:], rel=1e-5, abs=1e-5)  # batched matmuls sum in another order
        assert query.run_row(single, one.run_id)["checkpoint_sha256"] == \
            query.run_row(store, by_prompt[p])["checkpoint_sha256"]
        assert_same_signals(single, one.run_id, store, by_prompt[p])
    assert query.run_row(single, one.run_id)["batch_id"] is None


def assert_same_signals(a: Store, run_a: str, b: Store, run_b: str, tol: float = 1e-4) -> None:
    """Every signal table of two runs: the same rows (keys), equal exact columns, tolerance columns within ``tol``
    (the tables' own replay classification, workbench.data.signals)."""
    from workbench.data.signals import TABLES

    for name, table in TABLES.items():
        q = f"SELECT * EXCLUDE (run_id) FROM {name} WHERE run_id = ? ORDER BY {table.order}"
        x, y = a.sql(q, [run_a]), b.sql(q, [run_b])
        assert x.height == y.height > 0, name
        for c in table.names("key") + table.names("exact"):
            assert x[c].to_list() == y[c].to_list(), (name, c)
        for c in table.names("tol"):
            d = (x[c] - y[c]).abs().max()
            assert d is None or d <= tol, (name, c, d)


def test_batched_generation_equals_single_records_row_by_row(env, tmp_path):
    """record_batch directly: prompts of 1 to 30 tokens (the longer ones fed teacher-forced while the shorter
    decode), per-row settings (new tokens, sampling temperature and seed), a row stopped early; every signal
    table equals the row's own single recording."""
    from workbench.capture.recorder import RecordSettings, new_run_id, record_batch

    prompts = ["x", "def add(a, b):", "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n",
               "for i in range(10):\n    print(i)"]
    settings = {"max_new_tokens": [5, 3, 8, 6], "temperature": [0.0, 1.0, 0.0, 0.7], "top_p": [1.0, 0.9, 1.0, 1.0],
                "seed": [0, 3, 0, 11]}
    rows = [RecordSettings(**{k: v[i] for k, v in settings.items()}) for i in range(4)]
    db = Store(tmp_path / "b.duckdb")
    run_ids = [new_run_id() for _ in prompts]
    errors = record_batch(prompts, rows, model=env["ckpt"], db=db, run_ids=run_ids, run_fields=[None] * 4)
    assert errors == [None] * 4
    single = Store(tmp_path / "s.duckdb")
    for i, p in enumerate(prompts):
        one = workbench.record(p, model=env["ckpt"], db=single, detect=False, **{k: v[i] for k, v in settings.items()})
        assert query.run_row(db, run_ids[i])["status"] == "complete"
        assert query.run_row(db, run_ids[i])["n_tokens"] == one.info["n_tokens"]
        assert_same_signals(single, one.run_id, db, run_ids[i])
    # a prompt refused before its run existed is that prompt's error only
    errors = record_batch(["def f():", "y" * 300_000], [RecordSettings(max_new_tokens=2)] * 2, model=env["ckpt"], db=db,
                          run_ids=["rok", "rbad"], run_fields=[None] * 2)
    assert errors[0] is None and "limit" in errors[1]
    assert query.run_row(db, "rok")["status"] == "complete"
    with pytest.raises(query.RunNotFound):
        query.run_row(db, "rbad")


def test_a_batch_whose_forward_fails_fails_each_of_its_runs(tmp_path):
    """A batched generation that raises mid-way: every run of the group ends ``failed`` with the error and the
    tokens its committed steps hold; the prompt set goes on (``record_group`` returns the rows, never raises)."""
    from workbench.capture.prompt_sets import load_model, record_group
    from workbench.capture.settings import RecordSettings

    model = tiny_model(vocab_size=4096)
    calls = []

    def boom(*_):
        calls.append(1)
        if len(calls) == 4:  # the prefill and two decode steps went through
            raise RuntimeError("boom")
    handle = model.register_forward_pre_hook(boom)
    adapter, tok, label = load_model(model, DEFAULT_TOKENIZER)
    store = Store(tmp_path / "f.duckdb")
    items = [{"prompt": p, "key": f"k{i}"} for i, p in enumerate(PROMPTS[:3])]
    rows = record_group(items, store=store, batch_id="bfail", adapter=adapter, tokenizer=tok, label=label,
                        settings=RecordSettings(max_new_tokens=8), after_run=None)
    handle.remove()
    assert [r["status"] for r in rows] == ["failed"] * 3 and all("boom" in r["error"] for r in rows)
    # n_tokens = what was committed: the rows that had decoded keep their steps; a row still being fed its
    # (longer) prompt had no step yet, so 0, as a single recording failing in its prefill
    grown = []
    for r in rows:
        info = query.run_row(store, r["run_id"])
        assert info["n_tokens"] == query.tokens(store, r["run_id"]).height
        grown.append(info["n_tokens"] > info["n_prompt_tokens"])
    assert any(grown)


def test_groups_put_similar_lengths_together_within_the_limits():
    from workbench.capture.prompt_sets import groups
    from workbench.model import load_tokenizer

    tok = load_tokenizer()
    items = [{"prompt": "x " * n, "key": str(n)} for n in (50, 1, 30, 2, 40, 3, 1000)]
    got = groups(items, tok, batch_size=3, max_batch_tokens=1500)
    lengths = [[len(tok.encode(d["prompt"]).ids) for d in g] for g in got]
    flat = [n for g in lengths for n in g]
    assert flat == sorted(flat) and sorted(d["key"] for g in got for d in g) == sorted(d["key"] for d in items)
    assert all(len(g) <= 3 and (len(g) == 1 or len(g) * max(g) <= 1500) for g in lengths)
    assert lengths[-1] == [max(flat)]  # the longest prompt alone: two of it would exceed the token limit


def test_prompt_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    (tmp_path / "s.jsonl").write_text('{"prompt": "x", "id": "k", "max_new_tokens": 3}\n{"prompt": "y"}\n')
    assert [d["prompt"] for d in load_prompt_set(tmp_path / "a.txt")] == ["one", "two"]
    items = load_prompt_set(tmp_path / "s.jsonl")
    assert items[0] == {"prompt": "x", "key": "k", "max_new_tokens": 3} and items[1]["key"].startswith("1:")
    d = tmp_path / "d"
    d.mkdir()
    (d / "f.txt").write_text("def f():\n    return 1\n")  # a .txt in a folder: one prompt, the whole file
    (d / "g.jsonl").write_text('{"prompt": "z", "id": 7}\n')
    assert [(x["key"], x["prompt"]) for x in load_prompt_set(d)] == [("f", "def f():\n    return 1\n"), ("g/7", "z")]
    with pytest.raises(ValueError, match="unique"):
        prompt_items([{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}])


def test_resume_skips_complete_and_failed_prompt_becomes_failed_run(env, tmp_path):
    db = Store(tmp_path / "r.duckdb")
    items = [{"prompt": p, "id": f"p{i}"} for i, p in enumerate(PROMPTS[:4])]
    items[2]["max_new_tokens"] = 10_000  # over the model's context: this prompt fails, the batch goes on
    b = workbench.record_many(items, model=env["ckpt"], db=db, max_new_tokens=N, progress=False, batch_id="bresume")
    st = dict(zip(b.runs()["batch_item"], b.runs()["status"]))
    assert st == {"p0": "complete", "p1": "complete", "p2": "failed", "p3": "complete"}
    failed = b.runs().filter(pl.col("batch_item") == "p2").row(0, named=True)
    assert "context" in failed["error"] and failed["n_tokens"] == 0
    # the rerun records the failed prompt only (now fixed), and a new one
    items[2]["max_new_tokens"] = N
    items.append({"prompt": PROMPTS[4], "id": "p4"})
    again = workbench.record_many(items, model=env["ckpt"], db=db, max_new_tokens=N, progress=False,
                                  batch_id="bresume")
    assert sorted(again.skipped) == ["p0", "p1", "p3"]
    assert sorted(r["key"] for r in again.recorded) == ["p2", "p4"]
    assert again.status() == {"complete": 5, "failed": 1}
    # the default batch id is the set's: the same call resumes, recording nothing
    same = workbench.record_many(PROMPTS, model=env["ckpt"], db=env["store"], max_new_tokens=N, progress=False)
    assert same.batch_id == env["batch"].batch_id and same.recorded == [] and len(same.skipped) == 6


def test_cli_prompts_jsonl(env, tmp_path, capsys):
    db = tmp_path / "cli.duckdb"
    assert cli.main(["record", "--prompts", str(env["jsonl"]), "--model", env["ckpt"], "--max-new-tokens", "4",
                     "--db", str(db), "--json", "--no-detect"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == {"complete": 6} and sorted(r["key"] for r in out["runs"]) == [f"p{i}" for i in range(6)]
    assert cli.main(["record", "--prompts", str(env["jsonl"]), "--model", env["ckpt"], "--max-new-tokens", "4",
                     "--db", str(db), "--json", "--no-detect"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["batch_id"] == out["batch_id"] and again["recorded"] == 0 and again["skipped"] == 6
    # one at a time: the same batch id (the batch size is not a setting of the runs) and the same tokens
    db1 = tmp_path / "cli1.duckdb"
    assert cli.main(["record", "--prompts", str(env["jsonl"]), "--model", env["ckpt"], "--max-new-tokens", "4",
                     "--db", str(db1), "--json", "--no-detect", "--batch-size", "1"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["batch_id"] == out["batch_id"] and one["status"] == {"complete": 6}
    tokens = {s: {r["key"]: ids_and_logprobs(Store(d), r["run_id"])[0] for r in o["runs"]}
              for s, d, o in (("batched", db, out), ("single", db1, one))}
    assert tokens["batched"] == tokens["single"]
    assert cli.main(["record", "--prompts", str(env["jsonl"]), "--model", env["ckpt"], "--db", str(db1),
                     "--batch-size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err


@pytest.fixture(scope="module")
def shards(env):
    out = env["root"] / "shards"
    assert cli.main(["record", "--prompts", str(env["jsonl"]), "--model", env["ckpt"], "--max-new-tokens", str(N),
                     "--out", str(out), "--json"]) == 0
    return out


def test_out_writes_shards_that_open_as_a_store(env, shards):
    markers = complete_runs(shards)
    assert len(markers) == 6 and {m["status"] for m in markers.values()} == {"complete"}
    wb = workbench.open(shards)
    assert isinstance(wb.store, TraceStore) and wb.store.read_only
    runs = wb.runs()
    assert runs.height == 6 and set(runs["status"]) == {"complete"}
    # the same tokens as the database recording of the same prompts
    db_runs = env["batch"].runs()
    want = dict(zip(db_runs["prompt"], db_runs["run_id"]))
    for r in runs.iter_rows(named=True):
        assert ids_and_logprobs(wb.store, r["run_id"])[0] == ids_and_logprobs(env["store"], want[r["prompt"]])[0]
    run = wb.run(runs["run_id"][0])
    assert run.tokens().height == run.info["n_tokens"] and run.attention().height and run.routing().height
    assert query.expert_load(wb.store, run.run_id)["share"].sum() == pytest.approx(
        len(run.model_summary.moe_layers))
    assert run.anomalies().height == query.anomalies(wb.store, run.run_id).height > 0  # stored with the shard
    assert wb.sql("SELECT count(*) AS n FROM tokens")["n"][0] == query.runs(wb.store)["n_tokens"].sum()
    rep = run.report(env["root"] / "shard-report.html")
    assert run.run_id in Path(rep).read_text()
    with pytest.raises(StoreError, match="read-only"):
        wb.store.update_run(run.run_id, status="failed")
    with pytest.raises(StoreError, match="read-only"):
        wb.store.execute("DELETE FROM tokens")


def test_trace_store_only_marked_runs_and_export_folders(env, shards, tmp_path):
    # an export folder (one _SUCCESS) opens too, with the same rows as the database
    pq = tmp_path / "export"
    export_parquet(env["store"], pq)
    ts = Store(pq)  # a folder: the read-only variant
    assert isinstance(ts, TraceStore)
    assert query.runs(ts).select("run_id", "n_tokens").sort("run_id").equals(
        query.runs(env["store"]).select("run_id", "n_tokens").sort("run_id"))
    # a run whose files are there but whose marker is not is not a run of the folder
    gone = next(iter(complete_runs(shards)))
    copy = tmp_path / "copy"
    import shutil
    shutil.copytree(shards, copy)
    (copy / "_runs" / f"{gone}.json").unlink()
    ts2 = TraceStore(copy)
    assert gone not in query.runs(ts2)["run_id"].to_list() and query.runs(ts2).height == 5
    assert ts2.sql("SELECT count(*) AS n FROM tokens WHERE run_id = ?", [gone])["n"][0] == 0


def test_import_merges_shards(env, shards, tmp_path, capsys):
    db = tmp_path / "merged.duckdb"
    assert cli.main(["import", str(shards), "--db", str(db)]) == 0
    assert "6 runs imported" in capsys.readouterr().out
    merged, src = Store(db), TraceStore(shards)
    for t in ("runs", "tokens", "attention", "routing", "anomalies"):
        n = lambda s: s.sql(f"SELECT count(*) AS n FROM {t}")["n"][0]  # noqa: E731
        assert n(merged) == n(src) > 0, t
    assert cli.main(["import", str(shards), "--db", str(db)]) == 0  # again: nothing doubled
    assert "0 runs imported" in capsys.readouterr().out
    assert merged.sql("SELECT count(*) AS n FROM runs")["n"][0] == 6
    assert workbench.open(db).batch(src.sql("SELECT any_value(batch_id) AS b FROM runs")["b"][0]).runs().height == 6


KILLED = r"""
import os, sys, time
import torch
torch.set_num_threads(1)
import workbench.data.export as export
real, n = os.replace, []

def replace(src, dst):  # the third run: its tokens file is in place, the rest (and its marker) never come
    real(src, dst)
    if "_runs" in str(dst):
        n.append(dst)
    if len(n) == 2 and "/tokens/" in str(dst):
        print("ready", flush=True)
        time.sleep(600)

export.os.replace = replace
from workbench import cli
cli.main(["record", "--prompts", sys.argv[1], "--model", sys.argv[2], "--max-new-tokens", "4", "--out", sys.argv[3],
          "--no-detect"])
"""


def test_killed_worker_leaves_whole_runs_and_rerun_completes(env, tmp_path):
    out = tmp_path / "killed"
    kill_when_ready(["-c", KILLED, str(env["jsonl"]), env["ckpt"], str(out)], ROOT, [ROOT / "tests"])
    assert len(complete_runs(out)) == 2
    half = {p.parent.name.removeprefix("run_id=") for p in (out / "tokens").glob("*/*.parquet")}
    assert len(half) == 3  # the third run's tokens are on disk ...
    ts = TraceStore(out)
    assert query.runs(ts).height == 2 and set(query.runs(ts)["status"]) == {"complete"}  # ... but it is no run
    assert ts.sql("SELECT count(DISTINCT run_id) AS n FROM tokens")["n"][0] == 2
    con = duckdb.connect()
    for f in out.rglob("*.parquet"):  # every file under a final name is whole
        con.execute(f"SELECT count(*) FROM read_parquet('{f}')").fetchone()
    assert cli.main(["record", "--prompts", str(env["jsonl"]), "--model", env["ckpt"], "--max-new-tokens", "4",
                     "--out", str(out), "--no-detect"]) == 0
    assert len(complete_runs(out)) == 6
    runs = query.runs(TraceStore(out))
    assert runs.height == 6 and sorted(query.batch_runs(TraceStore(out), query.batches(TraceStore(out))["batch_id"][0])
                                       ["batch_item"].to_list()) == [f"p{i}" for i in range(6)]
    # recorded without detection: anomalies are computed on the read-only folder, not stored
    rid = runs["run_id"][0]
    computed = workbench.open(out).run(rid).anomalies()
    assert computed.columns == query.anomalies(Store(env["store"].path), env["batch"].run_ids[0]).columns
    assert query.anomalies(TraceStore(out), rid).height == 0 and not query.detected(TraceStore(out), rid)


def test_batch_views(env):
    store, b = env["store"], env["batch"]
    wb = workbench.open(store.path)
    batch = wb.batch(b.batch_id)
    load = batch.expert_load()
    summed = pl.concat([query.expert_load(store, r).select("layer", "expert", "slots") for r in batch.run_ids]) \
        .group_by("layer", "expert").agg(pl.col("slots").sum()).sort("layer", "expert")
    assert load.select("layer", "expert", "slots").equals(summed.with_columns(pl.col("slots").cast(load["slots"].dtype)))
    assert load.group_by("layer").agg(pl.col("share").sum())["share"].to_list() == pytest.approx([1.0] *
                                                                                                  load["layer"].n_unique())
    ent = batch.head_entropy()
    one = batch.run_ids[0]
    want = query.head_entropy(store, one)
    got = ent.filter(pl.col("run_id") == one).select("layer", "head", "norm_entropy")
    assert got["norm_entropy"].to_list() == pytest.approx(want["norm_entropy"].to_list())
    summ = batch.head_entropy_summary()
    assert set(summ["runs"]) == {6} and (summ["min"] <= summ["median"]).all() and (summ["median"] <= summ["max"]).all()
    low = batch.low_confidence(5)
    every = pl.concat([query.tokens(store, r).filter(~pl.col("is_prompt")).select("confidence") for r in batch.run_ids])
    assert low.height == 5 and low["confidence"].to_list() == pytest.approx(sorted(every["confidence"].to_list())[:5])
    r0 = low.row(0, named=True)
    assert query.tokens(store, r0["run_id"]).filter(pl.col("pos") == r0["pos"])["confidence"][0] == r0["confidence"]
    assert len(batch.fig_expert_load().data[0].z) == load["layer"].n_unique()
    assert len(batch.fig_head_entropy().data) == ent["layer"].n_unique()
    assert len(batch.fig_low_confidence(5).data[0].y) == 5
    assert wb.batches().row(0, named=True)["complete"] == 6
    with pytest.raises(query.RunNotFound):
        wb.batch("nope")


def test_search_spans_bpe_pieces(env, capsys):
    store = env["store"]
    run = workbench.open(store.path).run(env["batch"].runs()["run_id"][1])  # "for i in range(10):\n" ...
    toks = run.tokens()
    texts = toks["text"].to_list()
    # a needle from the end of one token to the start of the one after the next: three tokens
    k = next(i for i in range(len(texts) - 2) if len(texts[i]) >= 2 and len(texts[i + 2]) >= 2)
    needle = texts[k][-2:] + texts[k + 1] + texts[k + 2][:2]
    hits = workbench.open(store.path).search(needle)
    mine = hits.filter(pl.col("run_id") == run.run_id)
    whole = "".join(texts)
    assert mine.height == whole.count(needle) >= 1
    first = mine.sort("offset").row(0, named=True)
    offset = whole.index(needle)
    assert first["offset"] == offset and first["match"] == needle and needle in first["context"]
    start = sum(len(t) for t in texts[:k])
    if offset == start + len(texts[k]) - 2:  # the first occurrence is the one we built
        assert (first["pos"], first["end_pos"]) == (k, k + 2)
    # every hit maps back: the token at pos holds the match's first character
    for h in hits.iter_rows(named=True):
        t = query.tokens(store, h["run_id"])["text"].to_list()
        s = sum(len(x) for x in t[:h["pos"]])
        assert s <= h["offset"] < s + len(t[h["pos"]])
    assert workbench.open(store.path).search(needle.upper(), ignore_case=True).height >= mine.height
    assert workbench.open(store.path).search("no such text anywhere \u2603").height == 0
    assert cli.main(["search", needle, "--json", "--db", str(store.path)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {(g["run_id"], g["pos"]) for g in got} == set(zip(hits["run_id"], hits["pos"]))


@pytest.mark.slow
def test_ray_actor_pool_writes_the_same_runs(env, tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    out = tmp_path / "ray"
    items = [{"prompt": p, "id": f"p{i}"} for i, p in enumerate(PROMPTS)]
    b = workbench.record_many(items, model=env["ckpt"], out=out, max_new_tokens=N, ray=True, workers=2,
                              progress=False, detect=False)
    runs = b.runs()
    assert runs.height == 6 and set(runs["status"]) == {"complete"} and len(complete_runs(out)) == 6
    # the same runs as the in-process batch (itself equal to six single recordings: the first test)
    db_runs = env["batch"].runs()
    want = dict(zip(db_runs["prompt"], db_runs["run_id"]))
    for r in runs.iter_rows(named=True):
        ids, lps = ids_and_logprobs(b.store, r["run_id"])
        want_ids, want_lps = ids_and_logprobs(env["store"], want[r["prompt"]])
        assert ids == want_ids
        assert lps[1:] == pytest.approx(want_lps[1:], rel=1e-5, abs=1e-5)


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"Debian chromium not installed at {CHROMIUM}")
def test_ui_serves_a_shard_folder(env, shards):
    """``workbench ui --traces DIR`` in its own process: the runs of the folder, its batch view and search."""
    import time
    import urllib.request

    from helpers import free_port
    from playwright.sync_api import sync_playwright

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "ui", "--traces", str(shards), "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.5)
        ts = TraceStore(shards)
        run_ids = query.runs(ts)["run_id"].to_list()
        text = query.tokens(ts, run_ids[0])["text"].to_list()
        needle = "".join(text[1:3])
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            pg = b.new_page(viewport={"width": 1800, "height": 1600})  # every tab in the row, Search included
            pg.goto(url)
            pg.wait_for_function("(ids) => ids.every(i => (document.querySelector('#runs-table')?.innerText || '')"
                                 ".includes(i))", arg=run_ids, timeout=60_000)
            assert "read-only folder of Parquet shards" in pg.inner_text("body")
            pg.get_by_role("tab", name="Batches").click()
            pg.wait_for_function("() => (document.querySelector('#batch-msg')?.innerText || '').includes('6 complete')",
                                 timeout=60_000)
            pg.wait_for_function("() => { const p = document.querySelector('#batch-load .js-plotly-plot'); "
                                 "return p && p.data && p.data.length > 0; }", timeout=30_000)
            pg.get_by_role("tab", name="Search").click()
            pg.locator("#search-text textarea, #search-text input").first.fill(needle)
            pg.locator("#search-button").click()
            pg.wait_for_function("(id) => (document.querySelector('#search-results')?.innerText || '').includes(id)",
                                 arg=run_ids[0], timeout=30_000)
            assert pg.locator(".toast-body").count() == 0
            b.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_record_batch_rows_share_what_one_generation_shares(tmp_path):
    from workbench.capture.recorder import RecordSettings, record_batch

    for rows, message in [([RecordSettings(topk=3), RecordSettings(topk=4)], "share dtype, probes, topk"),
                          ([RecordSettings(device_map="auto")] * 2, "single recordings"),
                          ([RecordSettings()], "one settings, run id")]:
        with pytest.raises(ValueError, match=message):
            record_batch(["a", "b"], rows, model=tiny_model(), db=tmp_path / "w.duckdb", run_ids=["r1", "r2"],
                         run_fields=[None, None])
    assert not (tmp_path / "w.duckdb").exists()


def test_a_groups_rows_are_read_in_one_query_and_say_what_was_generated(env, tmp_path, monkeypatch):
    """record_many's rows come from one read of the group's runs rows (was two per run), ``after_run`` sees each
    run complete, and ``generated`` is the run's new tokens."""
    from workbench.capture import prompt_sets
    store = Store(tmp_path / "rows.duckdb")
    reads, seen = [], {}
    real = prompt_sets._run_rows
    monkeypatch.setattr(prompt_sets, "_run_rows", lambda st, ids: reads.append(list(ids)) or real(st, ids))

    def after(st, run_id, model=None):
        seen[run_id] = query.run_row(st, run_id)["status"]

    batch = prompt_sets.record_many(PROMPTS, model=env["ckpt"], db=store, max_new_tokens=N, progress=False,
                                    batch_size=3, after_run=after)
    runs = store.sql("SELECT * FROM runs WHERE batch_id = ?", [batch.batch_id])
    assert [len(r) for r in reads] == [3, 3] and sorted(sum(reads, [])) == sorted(runs["run_id"].to_list())
    assert seen == {r: "complete" for r in runs["run_id"]}
    for r in batch.recorded:
        row = runs.filter(pl.col("run_id") == r["run_id"]).row(0, named=True)
        assert r["status"] == "complete" and r["generated"] == row["n_tokens"] - row["n_prompt_tokens"] == N
