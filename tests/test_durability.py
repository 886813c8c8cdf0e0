"""Durability of the store: finished runs in the .duckdb file itself, liveness that survives pid reuse,
runs.n_tokens right after a crash, no orphan or empty-but-complete runs from a kill while starting."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import polars as pl
import pytest
from helpers import kill_when_ready, tiny_model

import workbench
import workbench.data.store as store_mod
from workbench.data import query
from workbench.data.store import Store, process_identity

ROOT = Path(__file__).resolve().parent.parent
HAS_PROC = Path("/proc/self/stat").exists()
SIGNAL_TABLES = ("tokens", "attention", "routing", "kv", "kv_tokens", "resid_norm", "steps", "anomalies")


def counts(store: Store, run_id: str) -> dict[str, int]:
    return {t: store.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id])[0][0] for t in SIGNAL_TABLES}


def test_finished_run_is_in_the_duckdb_file_without_its_wal(tmp_path):
    """A copy of the .duckdb file alone (the recording process still holding the original) has the run."""
    path = tmp_path / "w.duckdb"
    run = workbench.record([1, 2, 3], model=tiny_model(), max_new_tokens=3, db=path)
    store = run.store
    want = counts(store, run.run_id)
    assert want["tokens"] == 3 + 3 and want["steps"] == 3
    copy = tmp_path / "copy" / "w.duckdb"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)  # the .wal stays behind
    assert not copy.with_name("w.duckdb.wal").exists()
    con = duckdb.connect(str(copy), read_only=True)  # plain DuckDB, no workbench code in between
    try:
        row = con.execute("SELECT status, n_tokens, finished_at FROM runs WHERE run_id = ?", [run.run_id]).fetchone()
        got = {t: con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run.run_id]).fetchone()[0]
               for t in SIGNAL_TABLES}
    finally:
        con.close()
    assert row[0] == "complete" and row[1] == 6 and row[2] is not None
    assert got == want  # every signal table, and the anomalies stored after the run finished
    assert Store(copy).sql("SELECT run_id FROM runs")["run_id"].to_list() == [run.run_id]


def test_close_checkpoints(tmp_path):
    path = tmp_path / "w.duckdb"
    store = Store(path)
    store.append({"steps": pl.DataFrame({"run_id": ["r"], "step": [0], "kind": ["prefill"], "n_tokens": [1],
                                         "wall_ms": [1.0]})})
    store.close()
    copy = tmp_path / "c.duckdb"
    shutil.copyfile(path, copy)
    con = duckdb.connect(str(copy), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 1
    finally:
        con.close()


def running_row(run_id: str, pid: int | None, **extra) -> pl.DataFrame:
    return pl.DataFrame({"run_id": [run_id], "status": ["running"], "pid": [pid], "n_prompt_tokens": [2],
                         "n_tokens": [2], **{k: [v] for k, v in extra.items()}},
                        schema_overrides={"pid": pl.Int32, "pid_start": pl.String} if "pid_start" in extra
                        else {"pid": pl.Int32})


def status_of(store: Store) -> dict[str, str]:
    return dict(store.execute("SELECT run_id, status FROM runs"))


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_reused_pid_is_not_taken_for_the_recorder(tmp_path, monkeypatch):
    """A run whose pid is alive but names another process (other start time, other boot) is interrupted;
    an already-open store finds out by itself, without being reopened."""
    store = Store(tmp_path / "w.duckdb")
    store.sql("SELECT 1")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        ident = process_identity(sleeper.pid)
        boot, ticks = ident.rsplit(":", 1)
        assert ident and ident != process_identity()
        store.append({"runs": running_row("me", os.getpid())})  # pid_start filled in by the store
        store.append({"runs": running_row("me_before", os.getpid(), pid_start=f"{boot}:{int(ticks) + 7}")})
        store.append({"runs": running_row("sleeper", sleeper.pid, pid_start=ident)})
        store.append({"runs": running_row("reused", sleeper.pid, pid_start=f"{boot}:{int(ticks) - 1}")})
        store.append({"runs": running_row("rebooted", sleeper.pid, pid_start=f"another-boot:{ticks}")})
        store.append({"runs": running_row("legacy", sleeper.pid, pid_start=None)})  # older rows: pid only
        assert store.execute("SELECT pid_start FROM runs WHERE run_id = 'me'")[0][0] == process_identity()
        monkeypatch.setattr(store_mod, "LIVENESS_INTERVAL_S", 0.05)
        time.sleep(0.1)
        assert status_of(store) == {"me": "running", "me_before": "interrupted", "sleeper": "running",
                                    "reused": "interrupted", "rebooted": "interrupted", "legacy": "running"}
    finally:
        sleeper.kill()
        sleeper.wait()
    time.sleep(0.1)
    st = status_of(store)
    assert st["sleeper"] == "interrupted" and st["legacy"] == "interrupted" and st["me"] == "running"
    # n_tokens of an interrupted run is what was committed: nothing here
    assert store.execute("SELECT n_tokens FROM runs WHERE run_id = 'sleeper'")[0][0] == 0


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_zombie_recorder_is_not_alive(tmp_path, monkeypatch):
    """A recorder that died but was not reaped yet (its parent, e.g. the UI, did not wait) is gone."""
    monkeypatch.setattr(store_mod, "LIVENESS_INTERVAL_S", 0.0)
    store = Store(tmp_path / "w.duckdb")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while store_mod._proc_stat(child.pid)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        store.append({"runs": running_row("z", child.pid, pid_start=process_identity(child.pid))})
        assert status_of(store) == {"z": "interrupted"}
    finally:
        child.wait()


def test_interrupted_run_counts_committed_tokens(tmp_path, monkeypatch):
    """The interrupted-marking recounts n_tokens from the signal rows (rows of a process gone)."""
    monkeypatch.setattr(store_mod, "LIVENESS_INTERVAL_S", 1e9)  # only the forced check below
    store = Store(tmp_path / "w.duckdb")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.append({"runs": running_row("r", dead.pid, pid_start=None)})
    store.append({"steps": pl.DataFrame({"run_id": ["r", "r"], "step": [0, 1], "kind": ["prefill", "decode"],
                                         "n_tokens": [2, 1], "wall_ms": [1.0, 1.0]})})
    # the same transaction that committed the steps moved n_tokens on: prompt 2 + 2 steps
    assert store.execute("SELECT status, n_tokens FROM runs")[0] == ("running", 4)
    store.update_run("r", n_tokens=99)  # a wrong count (e.g. from an older recorder) is recounted
    store.check_liveness(force=True)
    assert store.execute("SELECT status, n_tokens FROM runs")[0] == ("interrupted", 4)


CHILD = textwrap.dedent("""
    import sys, time
    import workbench
    import workbench.capture.recorder as recorder
    import workbench.data.store as store
    from helpers import tiny_model

    db, where = sys.argv[1], sys.argv[2]

    def hang(*a, **k):
        print("ready", flush=True)
        time.sleep(600)

    if where == "load":      # killed while loading the model
        recorder.load_adapter = hang
    elif where == "first":   # killed after the run row, before any step is committed
        store.Writer.put = hang
    workbench.record([1, 2, 3], model=tiny_model(), max_new_tokens=5, db=db)
""")


def kill_at(tmp_path: Path, where: str) -> Path:
    db = tmp_path / "w.duckdb"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    kill_when_ready([str(script), str(db), where], ROOT, [ROOT, ROOT / "tests"])
    return db


def test_kill_while_loading_the_model_leaves_no_file(tmp_path):
    db = kill_at(tmp_path, "load")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py"]  # no database, no .wal, no temp file
    assert not db.exists()


def test_kill_before_the_first_step_leaves_an_interrupted_empty_run(tmp_path):
    db = kill_at(tmp_path, "first")
    store = Store(db)
    runs = store.sql("SELECT run_id, status, n_prompt_tokens, n_tokens, finished_at FROM runs")
    assert runs.height == 1
    row = runs.row(0, named=True)
    # interrupted, not complete; and n_tokens says nothing was recorded, as the tokens table does
    assert row["status"] == "interrupted" and row["finished_at"] is None
    assert row["n_prompt_tokens"] == 3 and row["n_tokens"] == 0
    assert query.runs(store)["n_tokens"].to_list() == [0]
    assert workbench.open(store).run(row["run_id"]).status == "interrupted"


def test_stray_file_of_a_killed_creator_is_ignored_and_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stray = tmp_path / f".w.duckdb.{dead.pid}.new"
    stray.write_bytes(b"half a header")
    store = Store(tmp_path / "w.duckdb")
    assert store.sql("SELECT count(*) AS n FROM runs")["n"][0] == 0
    assert not stray.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.duckdb"]


def test_unknown_probe_leaves_no_run(tmp_path):
    path = tmp_path / "w.duckdb"
    with pytest.raises(ValueError, match="unknown probes"):
        workbench.record([1, 2], model=tiny_model(), probes=["nope"], db=path)
    assert not path.exists()  # nothing was created, let alone a run row
    store = Store(path)
    with pytest.raises(ValueError, match="unknown probes"):
        workbench.record([1, 2], model=tiny_model(), probes=["tokens", "nope"], db=store)
    assert store.sql("SELECT count(*) AS n FROM runs")["n"][0] == 0


def test_failure_before_the_first_step_counts_no_tokens(tmp_path):
    """A recording that fails in its prefill is `failed` with n_tokens 0 (nothing was recorded), not the
    prompt length; one that fails later keeps the tokens it committed."""
    store = Store(tmp_path / "w.duckdb")
    model = tiny_model()

    def boom(*a):
        raise RuntimeError("broken block")

    handle = model.layers[0].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="broken block"):
        workbench.record([1, 2, 3], model=model, max_new_tokens=4, db=store)
    handle.remove()
    assert store.execute("SELECT status, n_prompt_tokens, n_tokens FROM runs")[0] == ("failed", 3, 0)

    def stop(pos, text):
        if pos == 4:
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        workbench.record([1, 2, 3], model=model, max_new_tokens=6, db=store, on_token=stop, run_id="rlater")
    row = store.execute("SELECT status, n_tokens, (SELECT count(*) FROM tokens WHERE run_id = 'rlater') "
                        "FROM runs WHERE run_id = 'rlater'")[0]
    assert row == ("failed", 5, 5)
