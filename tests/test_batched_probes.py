"""Batch-wide probes (issue 29): one probe per signal takes the batch's ``[B, ...]`` tensors at each seam (one call per
seam and forward, not one per row) and splits its rows by run only when it writes them; every run's tables equal its
single recording, whatever the flushes cut (rows still in their prompt, rows ended, flushes by steps or bytes)."""
from __future__ import annotations

import pytest
from helpers import tiny_model
from test_batch import assert_same_signals

import workbench
from workbench.capture import batched, recorder
from workbench.capture.recorder import RecordSettings, new_run_id, record_batch
from workbench.data import query
from workbench.data.store import Store
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# 1 to ~30 tokens: the longer prompts are fed one token a forward while the shorter rows decode
PROMPTS = ["x", "def add(a, b):", "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n",
           "for i in range(10):\n    print(i)"]
NEW = [5, 3, 8, 6]  # rows end at different forwards


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(save_checkpoint(tiny_model(vocab_size=4096), tmp_path_factory.mktemp("bp") / "ckpt",
                               tokenizer=DEFAULT_TOKENIZER))


@pytest.fixture(scope="module")
def singles(ckpt, tmp_path_factory):
    db = Store(tmp_path_factory.mktemp("bp_single") / "s.duckdb")
    return db, [workbench.record(p, model=ckpt, db=db, detect=False, max_new_tokens=n).run_id
                for p, n in zip(PROMPTS, NEW)]


@pytest.mark.parametrize("due", ["steps", "bytes", "end"])
def test_each_run_of_a_batch_equals_its_single_recording_whatever_the_flushes_cut(due, ckpt, singles, tmp_path,
                                                                                  monkeypatch):
    if due == "steps":
        monkeypatch.setattr(recorder, "FLUSH_STEPS", 2)
    elif due == "bytes":
        monkeypatch.setattr(recorder, "FLUSH_BYTES", 1)
    flushes: list[tuple[list[int], list[bool], list[int]]] = []  # (rows flushed, rows live, rows' last collected)
    flush = batched.BatchRecorder.flush

    def spy(self, rows):
        flushes.append((list(rows), list(self.tape.live), list(self.tape.done)))
        return flush(self, rows)
    monkeypatch.setattr(batched.BatchRecorder, "flush", spy)
    db = Store(tmp_path / "b.duckdb")
    run_ids = [new_run_id() for _ in PROMPTS]
    errors = record_batch(PROMPTS, [RecordSettings(max_new_tokens=n) for n in NEW], model=ckpt, db=db,
                          run_ids=run_ids, run_fields=[None] * len(PROMPTS))
    assert errors == [None] * len(PROMPTS)
    single_db, single_ids = singles
    for rid, one in zip(run_ids, single_ids):
        assert query.run_row(db, rid)["status"] == "complete"
        assert query.run_row(db, rid)["n_tokens"] == query.run_row(single_db, one)["n_tokens"]
        assert_same_signals(single_db, one, db, rid)
    assert flushes
    if due == "end":  # no flush is due before a row ends: each flush is some row's end
        assert len(flushes) <= len(PROMPTS)
    else:  # flushes while the longest prompt's row is still in its prefill (nothing collected of it yet)
        assert any(done[2] == -1 and live[2] and 2 not in rows for rows, live, done in flushes)


def test_a_batch_calls_each_seam_once_per_forward_not_once_per_row(ckpt, tmp_path, monkeypatch):
    calls: dict[str, int] = {}
    listeners = batched.BatchRecorder.listeners

    def counted(self):
        def wrap(seam, fn):
            def call(*a):
                calls[seam] = calls.get(seam, 0) + 1
                fn(*a)
            call.batched = True
            return call
        return {seam: wrap(seam, fn) for seam, fn in listeners(self).items()}
    monkeypatch.setattr(batched.BatchRecorder, "listeners", counted)
    row_seams: list[dict] = []
    row_listeners = recorder.Recorder.listeners

    def spy(self):
        got = row_listeners(self)
        row_seams.append(got)
        return got
    monkeypatch.setattr(recorder.Recorder, "listeners", spy)
    forwards = []
    end_forward = batched.BatchRecorder.end_forward
    monkeypatch.setattr(batched.BatchRecorder, "end_forward", lambda self, *a: (forwards.append(a), end_forward(self, *a)))
    db = Store(tmp_path / "b.duckdb")
    prompts = ["def add(a, b):", "class Point:", "import os\n"]
    assert record_batch(prompts, [RecordSettings(max_new_tokens=4)] * 3, model=ckpt, db=db,
                        run_ids=[new_run_id() for _ in prompts], run_fields=[None] * 3) == [None] * 3
    n_layers = workbench.capture.adapters.load_adapter(ckpt).summary.n_layers
    assert row_seams and all(not d for d in row_seams)  # no probe of a row listens to a seam itself
    assert calls["resid_post"] == calls["head_out"] == len(forwards) * n_layers
    assert calls["attn_stats"] + calls["attn_row"] == len(forwards) * n_layers


def test_a_row_that_ended_before_a_failing_forward_is_complete_and_the_others_failed(tmp_path):
    """A row that ended waits for the batch's next flush to be written and finished; a forward failing before that
    flush leaves it complete, with all its steps, and fails the rows still generating."""
    model = tiny_model(vocab_size=4096)
    calls = []

    def boom(*_):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("boom")
    handle = model.register_forward_pre_hook(boom)
    db = Store(tmp_path / "f.duckdb")
    run_ids = [new_run_id() for _ in range(3)]
    prompts = ["import os\n", "class Point:", "def add(a, b):"]  # 3, 5 and 7 tokens: row 0 ends at the 2nd forward
    with pytest.raises(RuntimeError, match="boom"):
        record_batch(prompts, [RecordSettings(max_new_tokens=n) for n in (2, 8, 8)], model=model,
                     tokenizer=DEFAULT_TOKENIZER, db=db, run_ids=run_ids, run_fields=[None] * 3)
    handle.remove()
    got = {r: query.run_row(db, r) for r in run_ids}
    assert got[run_ids[0]]["status"] == "complete" and got[run_ids[0]]["error"] is None
    assert [got[r]["status"] for r in run_ids[1:]] == ["failed", "failed"]
    assert all("boom" in got[r]["error"] for r in run_ids[1:])
    single = Store(tmp_path / "s.duckdb")
    one = workbench.record(prompts[0], model=model, tokenizer=DEFAULT_TOKENIZER, db=single, detect=False,
                           max_new_tokens=2)
    assert_same_signals(single, one.run_id, db, run_ids[0])
    for r in run_ids:
        assert got[r]["n_tokens"] == query.tokens(db, r).height


def test_a_transformers_batch_flushed_mid_prefill_equals_its_single_recordings(tmp_path, monkeypatch):
    """The same on a tiny transformers Mixtral (attention probabilities, experts run again at the flush), flushed
    every two steps while the longest prompt is still being fed."""
    pytest.importorskip("transformers")
    from test_hf_batch import assert_same_signals as hf_same

    from workbench.capture.adapters import load_adapter
    from workbench.capture.tiny import make_folder

    adapter = load_adapter(str(make_folder("mixtral", tmp_path / "mixtral")))
    monkeypatch.setattr(recorder, "FLUSH_STEPS", 2)
    db = Store(tmp_path / "b.duckdb")
    run_ids = [new_run_id() for _ in PROMPTS]
    assert record_batch(PROMPTS, [RecordSettings(max_new_tokens=n) for n in NEW], model=adapter, db=db,
                        run_ids=run_ids, run_fields=[None] * len(PROMPTS)) == [None] * len(PROMPTS)
    single = Store(tmp_path / "s.duckdb")
    for p, n, rid in zip(PROMPTS, NEW, run_ids):
        one = workbench.record(p, model=adapter, db=single, detect=False, max_new_tokens=n)
        hf_same(single, one.run_id, db, rid)


def test_rows_that_end_together_are_finished_in_one_update_and_one_checkpoint(ckpt, tmp_path, monkeypatch):
    """``Store.update_runs``: the batch's rows that end together get their final fields in one transaction and one
    checkpoint; a store that overrides ``update_run`` (the background relay) still gets one call per run."""
    checkpoints = []
    checkpoint = Store.checkpoint
    monkeypatch.setattr(Store, "checkpoint", lambda self: (checkpoints.append(1), checkpoint(self))[1])
    db = Store(tmp_path / "b.duckdb")
    prompts = ["def add(a, b):", "class Point:", "import os\n"]
    run_ids = [new_run_id() for _ in prompts]
    assert record_batch(prompts, [RecordSettings(max_new_tokens=n) for n in (2, 3, 4)], model=ckpt, db=db,
                        run_ids=run_ids, run_fields=[None] * 3) == [None] * 3
    assert len(checkpoints) == 1  # the rows ended at three forwards; one flush, one update, one checkpoint
    for rid in run_ids:
        info = query.run_row(db, rid)
        assert info["status"] == "complete" and info["finished_at"] is not None
        assert info["n_tokens"] == query.tokens(db, rid).height

    calls = []

    class Relay(Store):
        def update_run(self, run_id, **fields):
            calls.append(run_id)
            super().update_run(run_id, **fields)
    relay = Relay(tmp_path / "b.duckdb")
    relay.update_runs([(rid, {"error": "x"}) for rid in run_ids])
    assert calls == run_ids
    assert [query.run_row(db, r)["error"] for r in run_ids] == ["x"] * 3
