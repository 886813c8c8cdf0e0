"""Recording in a worker process (workbench/capture/background.py), as the app's Record tab does: the same run as a
recording in this process, written by this process's store; errors come back; a killed worker is reported
and its run ends ``interrupted``; the next recording starts a new worker."""
from __future__ import annotations

import json
import os
import signal

import pytest
from helpers import tiny_model

import workbench
from workbench.analysis.anomalies import detect
from workbench.capture.background import RecordingProcess
from workbench.data import query
from workbench.data.store import Store
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER


def events_of(q, timeout: float = 120) -> tuple[list, object]:
    tokens = []
    while True:
        kind, item = q.get(timeout=timeout)
        if kind == "done":
            return tokens, item
        tokens.append(item)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(save_checkpoint(tiny_model(vocab_size=4096), tmp_path_factory.mktemp("bg") / "ckpt",
                               tokenizer=DEFAULT_TOKENIZER))


def test_worker_records_the_same_run_into_this_process_store(ckpt, tmp_path):
    store = Store(tmp_path / "wb.duckdb")
    # both profiles of this model: the worker's detectors read them from a mirror of this store
    workbench.profile([[5 + i, 17, 101 + i, 3, 40 + i, 9] for i in range(8)], model=ckpt, db=store, max_new_tokens=4)
    rp = RecordingProcess(store, model=ckpt, threads=1)
    try:
        tokens, error = events_of(rp.record("rbg1", "def add(a, b):", None, after_run=detect, max_new_tokens=6))
        assert error is None and len(tokens) == 6
        info = query.run_row(store, "rbg1")
        assert info["status"] == "complete" and info["pid"] != os.getpid()  # recorded over there, stored here
        one = workbench.record("def add(a, b):", model=ckpt, db=store, max_new_tokens=6)
        a, b = query.tokens(store, "rbg1"), one.tokens()
        assert a["token_id"].to_list() == b["token_id"].to_list()
        assert [p for p, _ in tokens] == list(range(a.height - 6, a.height))
        # fp32 at |logprob| ~ 10, one worker thread against this process's threads: summation order differs
        assert a["logprob"][1:].to_list() == pytest.approx(b["logprob"][1:].to_list(), abs=1e-5)
        for table in ("attention", "routing", "kv_tokens"):
            n = lambda rid: store.sql(f"SELECT count(*) AS n FROM {table} WHERE run_id = ?", [rid])["n"][0]  # noqa: E731
            assert n("rbg1") == n(one.run_id) > 0
        # the detectors ran over there, on the same rows: the same findings here, the components judged too
        assert info["detection"] is not None and json.loads(info["detection"])["component_tests"] > 0
        drop = ["run_id", "anomaly_id"]
        a_an = query.anomalies(store, "rbg1").drop(drop, strict=False)
        b_an = query.anomalies(store, one.run_id).drop(drop, strict=False)
        assert a_an.drop("score").equals(b_an.drop("score"))
        # (1 torch thread there, 2 here: the sums differ in the last digits)
        assert a_an["score"].to_list() == pytest.approx(b_an["score"].to_list(), rel=1e-4)
        # a refused prompt: its error, with its type, and no run
        _, error = events_of(rp.record("rbg2", "x" * 300_000, None, max_new_tokens=2))
        assert isinstance(error, ValueError) and "limit" in str(error)
        with pytest.raises(query.RunNotFound):
            query.run_row(store, "rbg2")
    finally:
        rp.close()


def test_killed_worker_is_reported_and_replaced(ckpt, tmp_path):
    store = Store(tmp_path / "wb.duckdb")
    rp = RecordingProcess(store, model=ckpt, threads=1)
    try:
        q = rp.record("rkill", "def f(x):", None, max_new_tokens=200)
        kind, _ = q.get(timeout=120)  # the first token: the run row exists, the worker is recording
        assert kind == "token"
        os.kill(rp._proc.pid, signal.SIGKILL)
        _, error = events_of(q)
        assert isinstance(error, RuntimeError) and "exited" in str(error)
        store.check_liveness(force=True)
        assert query.run_row(store, "rkill")["status"] == "interrupted"
        _, error = events_of(rp.record("rnext", "def g():", None, max_new_tokens=3))  # a new worker
        assert error is None and query.run_row(store, "rnext")["status"] == "complete"
    finally:
        rp.close()


def test_relay_store_messages_rebuild_the_same_rows_elsewhere(tmp_path):
    """``RelayStore``: every write is made in its own file, then sent; applying the messages in order to another
    store (as ``RecordingProcess._pump`` does) gives that store the same rows: recording, detectors and all."""
    from helpers import tiny_model

    from workbench.capture.background import RelayStore
    from workbench.capture.recorder import record_run

    class Events:
        def __init__(self):
            self.got: list = []

        def put(self, message):
            self.got.append(message)

    events = Events()
    relay = RelayStore(tmp_path / "mirror.duckdb", events)
    rid = record_run([1, 2, 3], model=tiny_model(), db=relay, max_new_tokens=4)[0]
    detect(relay, rid)
    kinds = [k for k, _, _ in events.got]
    assert kinds[0] == "append" and "replace_rows" in kinds and kinds.count("update") >= 2
    app = Store(tmp_path / "app.duckdb")
    for kind, run_id, payload in events.got:
        if kind == "append":
            app.append(payload)
        elif kind == "update":
            app.update_run(run_id, **payload)
        else:
            table, keys, df, all_rows = payload
            app.replace_rows(table, keys, df, all_rows=all_rows)
    for table, order in [("runs", "run_id"), ("tokens", "pos"), ("routing", "pos, layer"), ("anomalies", "anomaly_id")]:
        a, b = (s.sql(f"SELECT * FROM {table} ORDER BY {order}") for s in (relay, app))
        assert (a.height > 0 or table == "anomalies") and a.equals(b), table
    assert query.run_row(app, rid)["status"] == "complete" and query.run_row(app, rid)["detection"] is not None
