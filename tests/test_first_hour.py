"""Issue 26, items 1 (the CLI and store part) and 2: checks before expensive work, one-line errors naming the file,
and a store that survives a full disk (a real one: a file size limit; and an injected fatal error)."""
from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import duckdb
import gradio as gr
import polars as pl
import pytest
import torch
from helpers import free_port, tiny_model

import workbench
from workbench import cli
from workbench.apps.app import build_app, read_tokens
from workbench.apps.shared import AppContext
from workbench.apps.tabs import record as record_tab
from workbench.capture import background
from workbench.commands import demo
from workbench.commands import eval as eval_cmd
from workbench.commands import ui as ui_cmd
from workbench.commands.ui import check_port
from workbench.data import store as store_mod
from workbench.data.store import Store, StoreError
from workbench.model import load_tokenizer, save_checkpoint
from workbench.model.evaluate import model_nll_bits
from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.run import Workbench

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys, command: str, after_progress: bool = False) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    if after_progress:  # a recording's progress bar comes first
        err = err.splitlines()[-1]
    assert "\n" not in err, err
    assert err.startswith(f"workbench {command}: error:"), err
    return err


@pytest.fixture
def busy_port():
    """A port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A database holding one short run of a tiny model."""
    db = tmp_path_factory.mktemp("rec") / "w.duckdb"
    run = workbench.record([1, 2, 3, 4], model=tiny_model(vocab_size=256), max_new_tokens=3, db=db)
    run.store.close()
    return db


# -- 1. a busy port, before anything is opened or recorded ----------------------------------------------------------

@pytest.mark.parametrize("command", ["ui", "demo"])
def test_busy_port_is_one_line_and_nothing_is_made(command, busy_port, tmp_path, capsys, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the demo loaded its model before checking the port")
    monkeypatch.setattr(demo, "load_checkpoint", no_model)
    db = tmp_path / "sub" / "w.duckdb"
    assert cli.main([command, "--port", str(busy_port), "--db", str(db)]) == 2
    err = one_line_error(capsys, command)
    assert f"port {busy_port} is in use" in err
    assert not (tmp_path / "sub").exists()


def test_free_port_passes_the_check():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port("127.0.0.1", port)  # nothing listens: no error
    with pytest.raises(ValueError, match="--port must be 1..65535"):
        check_port("127.0.0.1", 70000)


# -- 2. unknown flags are named ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, unknown", [
    (["record", "--promt", "x"], "--promt"),                # a required group is missing too
    (["record", "--prompt", "x", "--max-tokens", "3"], "--max-tokens"),
    (["explain", "--stpes", "3", "r1"], "--stpes"),          # would be "invalid int value: 'r1'"
    (["kv-whatif", "r1", "--polcy", "full"], "--polcy"),     # --policy is required
    (["profile", "--promts", "p.jsonl"], "--promts"),        # --prompts is required
])
def test_unknown_flags_are_named(argv, unknown, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {unknown}" in err, err
    assert "is required" not in err and "invalid int" not in err


def test_other_argument_errors_are_argparses_own(capsys):
    with pytest.raises(SystemExit):
        cli.main(["record"])
    assert "one of the arguments --prompt --prompt-file --prompts is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["explain", "r1", "x"])
    assert "invalid int value: 'x'" in capsys.readouterr().err


# -- 3. a missing database is refused by what only reads, and nothing is created --------------------------------------

@pytest.mark.parametrize("argv", [["runs"], ["search", "x"], ["anomalies", "r1"], ["export", "--parquet", "OUT"],
                                  ["diff", "a", "b"]])
def test_read_only_commands_refuse_a_missing_database(argv, tmp_path, capsys):
    db = tmp_path / "typo" / "x.duckdb"
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    assert cli.main([*argv, "--db", str(db)]) == 2
    err = one_line_error(capsys, argv[0])
    assert str(db) in err and "no database" in err
    assert sorted(tmp_path.iterdir()) == []


def test_open_refuses_a_missing_database_unless_asked_to_create(tmp_path):
    db = tmp_path / "typo" / "x.duckdb"
    with pytest.raises(FileNotFoundError, match="typo/x.duckdb"):
        workbench.open(db)
    assert not (tmp_path / "typo").exists()
    wb = workbench.open(db, create=True)
    assert wb.runs().height == 0 and db.exists()
    assert workbench.open(db).runs().height == 0  # it exists now


@pytest.fixture
def no_server(monkeypatch):
    """``workbench ui`` up to the server: the databases ``launch`` was given (nothing is served); the Record tab's
    checkpoint roots restored afterwards."""
    launched: list = []
    monkeypatch.setattr(ui_cmd, "launch", lambda db, host, port, auth: launched.append(db))
    monkeypatch.setattr(record_tab, "CHECKPOINT_ROOTS", [])
    return launched


def test_ui_refuses_a_missing_database_unless_asked_to_create(tmp_path, recorded, capsys, monkeypatch, no_server):
    db = tmp_path / "typo" / "x.duckdb"
    assert cli.main(["ui", "--db", str(db), "--port", str(free_port())]) == 2
    err = one_line_error(capsys, "ui")
    assert str(db) in err and "no database" in err and "--create" in err
    assert sorted(tmp_path.iterdir()) == [] and no_server == []
    # --create: served (the store makes the file at its first query)
    assert cli.main(["ui", "--db", str(db), "--create", "--port", str(free_port())]) == 0
    assert no_server == [str(db)]
    # the default database, not made yet (a first `workbench ui`): served as before, by name or by default
    default = tmp_path / "default" / "workbench.duckdb"
    monkeypatch.setenv("WORKBENCH_DB", str(default))
    assert cli.main(["ui", "--port", str(free_port())]) == 0
    assert cli.main(["ui", "--db", str(default), "--port", str(free_port())]) == 0
    assert no_server[1:] == [None, str(default)]
    # an existing database needs no flag
    assert cli.main(["ui", "--db", str(recorded), "--port", str(free_port())]) == 0
    assert no_server[-1] == str(recorded)


def test_ui_checkpoint_roots_reach_the_record_tab(tmp_path, recorded, capsys, no_server):
    a, b, outside = tmp_path / "a", tmp_path / "b", tmp_path / "outside"
    for folder in (a / "m1", b / "m2", outside / "m3"):
        folder.mkdir(parents=True)
    assert cli.main(["ui", "--checkpoint-root", str(a), "--checkpoint-root", str(b / "m2" / ".."),
                     "--db", str(recorded), "--port", str(free_port())]) == 0
    assert no_server == [str(recorded)] and record_tab.CHECKPOINT_ROOTS == [a.resolve(), b.resolve()]
    app = AppContext(Store(recorded))  # the Record tab's callback, as the served app calls it
    assert record_tab.allowed_checkpoint(app, str(a / "m1")) == str((a / "m1").resolve())
    assert record_tab.allowed_checkpoint(app, str(b / "m2")) == str((b / "m2").resolve())
    assert record_tab.allowed_checkpoint(app, str(outside / "m3")) is None
    out = list(record_tab.record_stream(app, "x = 1", 2, 0.0, 1.0, 0, str(outside / "m3")))
    assert len(out) == 1 and "cannot be loaded here" in out[0][1] and app.recorder is None
    # started again without the flag: only the bundled demo (and the app's model folder) are roots
    assert cli.main(["ui", "--db", str(recorded), "--port", str(free_port())]) == 0
    assert record_tab.CHECKPOINT_ROOTS == [] and record_tab.allowed_checkpoint(app, str(a / "m1")) is None
    # a root that is not a folder: one line, exit 2, nothing served
    assert cli.main(["ui", "--checkpoint-root", str(tmp_path / "nope"), "--db", str(recorded),
                     "--port", str(free_port())]) == 2
    assert "--checkpoint-root" in one_line_error(capsys, "ui") and len(no_server) == 2


def test_record_still_creates_its_database(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_model(vocab_size=4096), ckpt, tokenizer=DEFAULT_TOKENIZER)
    shutil.copy(DEFAULT_TOKENIZER, ckpt / "tokenizer.json")
    db = tmp_path / "new" / "w.duckdb"
    assert cli.main(["record", "--prompt", "x = 1", "--model", str(ckpt), "--max-new-tokens", "2", "--json",
                     "--db", str(db)]) == 0
    assert cli.main(["runs", "--json", "--db", str(db)]) == 0
    assert '"status": "complete"' in capsys.readouterr().out


# -- 4. a broken, foreign or newer file: one line naming it -----------------------------------------------------------

def _broken_copies(recorded: Path, folder: Path) -> dict[str, Path]:
    data = recorded.read_bytes()
    out = {k: folder / f"{k}.duckdb" for k in ("truncated", "text", "abc", "newer")}
    out["truncated"].write_bytes(data[: len(data) // 2])
    out["text"].write_text("this is not a database\n" * 200)
    for k, version in (("abc", "abc"), ("newer", "999")):
        shutil.copy(recorded, out[k])
        con = duckdb.connect(str(out[k]))
        con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [version])
        con.close()
    return out


def test_broken_files_are_one_line_naming_the_file(recorded, tmp_path, capsys):
    files = _broken_copies(recorded, tmp_path)
    expect = {"truncated": "", "text": "not a readable DuckDB database", "abc": "schema_version 'abc', not a number",
              "newer": "schema_version 999, newer"}
    for kind, path in files.items():
        for argv in (["runs"], ["anomalies", "r1"], ["search", "x"]):
            assert cli.main([*argv, "--db", str(path)]) == 2, (kind, argv)
            err = one_line_error(capsys, argv[0])
            assert str(path) in err and expect[kind] in err, (kind, argv, err)
        with pytest.raises(StoreError, match=f"{kind}.duckdb"):
            workbench.open(path).runs()


def test_a_file_that_breaks_mid_command_is_one_line(recorded, tmp_path, capsys, monkeypatch):
    db = tmp_path / "w.duckdb"
    shutil.copy(recorded, db)

    def broken(*a, **k):
        raise duckdb.IOException('IO Error: Could not read enough bytes from file "w.duckdb"')
    monkeypatch.setattr(Workbench, "runs", broken)
    assert cli.main(["runs", "--db", str(db)]) == 2
    err = one_line_error(capsys, "runs")
    assert str(db) in err and "Could not read enough bytes" in err


# -- 5. a full disk ---------------------------------------------------------------------------------------------------

FULL_DISK = textwrap.dedent("""
    import os, resource, signal, sys
    from workbench.data.store import Store, StoreError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
    path = sys.argv[1]
    store = Store(path)
    store.execute("INSERT INTO runs (run_id, status, pid) VALUES ('r1', 'running', ?)", [os.getpid()])
    store.execute("CREATE TABLE filler AS SELECT md5(i::VARCHAR) || md5((i + 1)::VARCHAR) AS x FROM range(40000) r(i)")
    store.checkpoint()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 100_000, hard))  # the disk is nearly full
    try:  # a commit whose WAL does not fit
        store.execute("INSERT INTO filler SELECT md5(i::VARCHAR) || md5(i::VARCHAR) FROM range(80000) r(i)")
        print("COMMIT: no error")
    except StoreError as e:
        print("COMMIT:", e)
    store.execute("INSERT INTO filler SELECT md5(i::VARCHAR) || 'y' FROM range(1000) r(i)")  # the WAL still fits
    try:
        store.update_run("r1", status="complete")  # its checkpoint grows the file past the limit
        print("FINAL: no error")
    except StoreError as e:
        print("FINAL:", e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
    print("READ:", store.execute("SELECT status FROM runs WHERE run_id = 'r1'")[0][0])
    store.execute("INSERT INTO runs (run_id, status) VALUES ('r2', 'complete')")
    store.checkpoint()
    print("WRITE:", store.execute("SELECT count(*) FROM runs")[0][0])
    print("FILLER:", store.execute("SELECT count(*) FROM filler")[0][0])
""")


@pytest.mark.skipif(sys.platform != "linux", reason="a file size limit (RLIMIT_FSIZE) stands in for a full disk")
def test_a_full_disk_at_the_final_checkpoint_is_reported_and_the_store_reopens(tmp_path):
    db = tmp_path / "w.duckdb"
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(db)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    # what happened, and that the run is saved (the checkpoint's failure is not swallowed)
    assert lines["FINAL"].startswith("run r1 is saved (complete), but writing"), lines
    assert "w.duckdb.wal" in lines["FINAL"] and "\n" not in lines["FINAL"]
    assert lines["COMMIT"].endswith("these rows are not saved (free disk space first if the disk is full)"), lines
    assert lines["READ"] == "complete" and lines["WRITE"] == "2"  # the connection reopened; the next actions work
    assert lines["FILLER"] == "41000"  # the refused commit left nothing
    assert Store(db).execute("SELECT status FROM runs WHERE run_id = 'r1'") == [("complete",)]


@pytest.fixture
def fatal_once(monkeypatch):
    """Make the next statement matching a prefix raise DuckDB's FatalException, as a full disk does (the real
    connection is not invalidated, so the test also checks the store dropped it: a new connection object)."""
    armed: dict = {}
    real = store_mod._Lease.__getattr__

    def getattr_(self, name):
        attr = real(self, name)
        if name not in ("execute", "sql"):
            return attr

        def call(query, *a, **k):
            prefix = armed.get("prefix")
            if prefix is not None and query.lstrip().upper().startswith(prefix):
                armed.clear()
                raise duckdb.FatalException('FATAL Error: Failed to create checkpoint because of error: Could not '
                                            'write file "w.duckdb": No space left on device')
            return attr(query, *a, **k)
        return call
    monkeypatch.setattr(store_mod._Lease, "__getattr__", getattr_)
    return armed


def test_a_fatal_error_in_a_recording_says_the_run_is_saved_and_the_next_command_works(tmp_path, capsys, fatal_once):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_model(vocab_size=4096), ckpt, tokenizer=DEFAULT_TOKENIZER)
    shutil.copy(DEFAULT_TOKENIZER, ckpt / "tokenizer.json")
    db = tmp_path / "w.duckdb"
    fatal_once["prefix"] = "CHECKPOINT"  # the final update's checkpoint
    assert cli.main(["record", "--prompt", "x = 1", "--model", str(ckpt), "--max-new-tokens", "3",
                     "--db", str(db)]) == 2
    err = one_line_error(capsys, "record", after_progress=True)
    assert "is saved (complete)" in err and "No space left on device" in err and str(db) in err, err
    assert cli.main(["runs", "--json", "--db", str(db)]) == 0
    assert '"status": "complete"' in capsys.readouterr().out


def test_a_fatal_read_drops_the_connection_and_the_next_read_works(recorded, tmp_path, fatal_once):
    db = tmp_path / "w.duckdb"
    shutil.copy(recorded, db)
    store = Store(db)
    before = store._shared.con
    fatal_once["prefix"] = "SELECT"
    with pytest.raises(StoreError, match="reopens at the next action"):
        store.sql("SELECT * FROM runs")
    assert store._shared.con is None  # dropped
    assert store.sql("SELECT * FROM runs").height == 1
    assert store._shared.con is not None and store._shared.con is not before
    fatal_once["prefix"] = "COMMIT"  # a write transaction: not saved, and said so; the next one works
    with pytest.raises(StoreError, match="reopens at the next action"):
        store.append({"runs": store.sql("SELECT * FROM runs").with_columns(run_id=pl.lit("r2"))})
    assert store.execute("SELECT count(*) FROM runs") == [(1,)]
    store.append({"runs": store.sql("SELECT * FROM runs").with_columns(run_id=pl.lit("r2"))})
    assert store.execute("SELECT count(*) FROM runs") == [(2,)]


def test_a_fatal_error_in_the_ui_is_a_readable_message_and_the_next_view_works(recorded, tmp_path, fatal_once):
    db = tmp_path / "w.duckdb"
    shutil.copy(recorded, db)
    store = Store(db)
    rid = store.execute("SELECT run_id FROM runs")[0][0]
    blocks = build_app(store)
    tokens = next(f for f in blocks.fns.values() if f.api_name == "tokens").fn
    fatal_once["prefix"] = "SELECT"
    with pytest.raises(gr.Error) as e:
        tokens(rid)
    assert "the database failed" in str(e.value.message) and "reopens at the next action" in e.value.message
    assert tokens(rid).height == 7  # 4 prompt + 3 generated tokens, read on the reopened connection


def test_the_background_recorder_passes_the_stores_message_on(tmp_path, monkeypatch):
    class Conn:
        def __init__(self, messages):
            self.messages = list(messages)

        def recv(self):
            if not self.messages:
                raise EOFError
            return self.messages.pop(0)

    class Proc:
        returncode = 0

        def wait(self):
            return 0

    store = Store(tmp_path / "w.duckdb")
    saved = StoreError("run r1 is saved (complete), but writing w.duckdb failed (No space left on device)")

    def update_run(run_id, **fields):
        raise saved
    monkeypatch.setattr(store, "update_run", update_run)
    rp = background.RecordingProcess(store)
    q: queue.Queue = queue.Queue()
    rp._waiting["r1"] = q
    rp._pump(Proc(), Conn([("update", "r1", {"status": "complete"}), ("done", "r1", None)]))
    assert q.get_nowait() == ("done", saved)


# -- 6. eval shows progress -------------------------------------------------------------------------------------------

def test_eval_prints_each_step_and_an_estimate(monkeypatch, capsys):
    """The whole evaluation takes minutes even capped (the bigram reads every training file): its steps are driven
    here by a stand-in with evaluate's signature; the model loop's callback is checked for real below."""
    def fake(model, max_tokens=None, progress=None, on_batch=None):
        progress("loading the model")
        progress("scoring 100 tokens with the model")
        for i in range(1, 4):
            on_batch(i, 3)
        return {"bits_per_byte": {"model": 1.0}}
    monkeypatch.setattr(eval_cmd, "evaluate", fake)
    monkeypatch.setattr(eval_cmd.Progress, "EVERY", 0.0)  # a line for every batch
    assert cli.main(["eval", "--max-tokens", "64", "--json"]) == 0
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert lines[0].startswith("eval: loading the model (") and lines[-1].startswith("eval: done (")
    assert any("window batch 1/3, about" in x and "s left" in x for x in lines), lines
    assert out.out.strip().startswith("{")  # --json: stdout holds the result only


def test_model_scoring_reports_each_batch():
    calls = []
    model_nll_bits(tiny_model(vocab_size=256), torch.arange(200) % 256, seq_len=32, batch=2,
                   on_batch=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 4) for i in range(1, 5)]  # 6 full windows in 3 batches of 2, then the partial one


def test_a_full_disk_at_the_end_of_a_record_tab_recording_says_the_run_is_saved(tmp_path, fatal_once, monkeypatch):
    """The Record tab (recording in a thread here; the worker process relays the same StoreError, tested above):
    the status says what happened and that the run is saved; the next view reads it on the reopened connection."""
    monkeypatch.setenv("WORKBENCH_RECORD_PROCESS", "0")
    store = Store(tmp_path / "w.duckdb")
    app = AppContext(store, model=tiny_model(vocab_size=4096), tokenizer=load_tokenizer())
    fatal_once["prefix"] = "CHECKPOINT"
    out = list(record_tab.record_stream(app, "x = 1", 3, 0.0, 1.0, 0, ""))
    strip, status, rid = out[-1]
    assert status.startswith("⚠️ Recording failed") and "is saved (complete)" in status, status
    assert "No space left on device" in status and rid
    assert store.execute("SELECT status FROM runs WHERE run_id = ?", [rid]) == [("complete",)]
    assert read_tokens(app, rid).height == len(strip) > 0
