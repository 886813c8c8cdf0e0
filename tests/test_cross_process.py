"""A recording in one process and a reader in another take turns on the same DuckDB file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workbench.data.store import Store

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys, time
import torch
from workbench.model import ModelArgs, Transformer, load_tokenizer
import workbench
m = Transformer(ModelArgs.preset("tiny")).init_weights(seed=1, std=0.1).eval()
workbench.record(list(range(1, 9)), model=m, tokenizer=load_tokenizer(), max_new_tokens=30, db=sys.argv[1],
                 run_id="rcross", on_token=lambda pos, text: time.sleep(0.15))
"""


def test_reader_process_sees_a_live_recording(tmp_path):
    db = tmp_path / "live.duckdb"
    first = Store(db)
    first.sql("SELECT 1")  # create it (a Store of a missing file creates it at its first query)
    first.close()  # then let go of the file
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    store = Store(db)
    seen: list[tuple[str, int]] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = store.sql("SELECT r.status, (SELECT count(*) FROM tokens t WHERE t.run_id = r.run_id) AS n "
                             "FROM runs r WHERE run_id = 'rcross'")
            if rows.height:
                seen.append((rows["status"][0], int(rows["n"][0])))
                if rows["status"][0] != "running":
                    break
            time.sleep(0.1)
        assert child.wait(timeout=120) == 0, child.stderr.read()[-2000:]
    finally:
        child.kill()
    live = [n for status, n in seen if status == "running"]
    assert len(set(live)) >= 2, seen  # several different partial states were read while it recorded
    final = store.sql("SELECT status, n_tokens FROM runs WHERE run_id = 'rcross'").row(0)
    assert final == ("complete", 8 + 30)
    assert store.sql("SELECT count(*) AS n FROM tokens WHERE run_id = 'rcross'")["n"][0] == 38


def test_open_store_sees_a_killed_recording_interrupted(tmp_path):
    """A store already open in this process marks a recording SIGKILLed in another process `interrupted`
    by itself (liveness is re-checked while the file is held, not only at the first open), with
    n_tokens equal to the tokens committed."""
    db = tmp_path / "killed.duckdb"
    store = Store(db)
    store.sql("SELECT 1")  # created and held here before the child starts
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        n = 0
        while time.monotonic() < deadline and n < 12:
            rows = store.sql("SELECT status, (SELECT count(*) FROM tokens) AS n FROM runs WHERE run_id = 'rcross'")
            if rows.height:
                assert rows["status"][0] == "running"
                n = rows["n"][0]
            assert child.poll() is None, child.stderr.read()[-2000:]
            time.sleep(0.1)
        assert n >= 12
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = store.sql("SELECT status FROM runs WHERE run_id = 'rcross'")["status"][0]
        if status != "running":
            break
        time.sleep(0.2)
    assert status == "interrupted"
    n_tokens, n_rows = store.execute("SELECT n_tokens, (SELECT count(*) FROM tokens) FROM runs")[0]
    assert n_tokens == n_rows and 12 <= n_rows < 38


EXITS = r"""
import atexit, sys, threading
# registered before the store module: runs after its own exit handler (atexit runs last-registered first)
atexit.register(lambda: print("watchers:", [t.name for t in threading.enumerate()
                                           if t.name == "workbench-store-watch"]))
from workbench.data.store import Store
s = Store(sys.argv[1])
s.sql("SELECT 1")
assert any(t.name == "workbench-store-watch" for t in threading.enumerate())
"""


def test_no_watcher_thread_is_left_inside_duckdb_at_exit(tmp_path):
    """The thread that gives the file up to another process (``.want``) is ended before the interpreter finalizes:
    left running, it could be inside DuckDB's close then, and the interpreter's forced unwind of a daemon thread
    through DuckDB's C++ aborted the finished process (SIGABRT, "FATAL: exception not rethrown"; seen in CI)."""
    out = subprocess.run([sys.executable, "-c", EXITS, str(tmp_path / "x.duckdb")], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "watchers: []"


def test_a_forked_child_exits_though_its_parent_held_a_store_lock(tmp_path):
    """A child forked while a thread of its parent held a store's lock (the watcher takes it every 50 ms) inherits the
    lock held by a thread it does not have: its exit handler must not wait for it (it did, forever)."""
    from workbench.data import store as store_mod

    import threading

    s = Store(tmp_path / "f.duckdb")
    s.sql("SELECT 1")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # another thread holds the lock while the main thread forks
        with s._shared.lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: the parent's exit handler, then out
        try:
            store_mod._stop_watchers()
        finally:
            os._exit(0)
    release.set()
    t.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung in the store's exit handler")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    s.close()
