"""The Gradio app's API (gradio_client), its helpers, read-only SQL, and the ui/demo commands."""
from __future__ import annotations

import argparse
import os
import re
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import polars as pl
import pytest
from helpers import free_port, tiny_model

import workbench
from workbench.data import query
from workbench.data.sqlsafe import SqlError, readonly_sql, run_readonly
from workbench.model import load_tokenizer, save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from workbench.apps.app import build_app

    db = tmp_path_factory.mktemp("app") / "wb.duckdb"
    model = tiny_model(vocab_size=4096)
    seed_run = workbench.record("x = 1\n", model=model, tokenizer=load_tokenizer(), max_new_tokens=4, db=db)
    app = build_app(seed_run.store, model=model, tokenizer=load_tokenizer())
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/", seed_run.store, model
    app.close()


def test_client_records_a_run_and_reads_it_back(served):
    from gradio_client import Client

    url, store, model = served
    client = Client(url, verbose=False)
    # pace decoding (20 ms a step) so the per-step commits land while tokens stream, on any machine
    slow = model.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    assert {"/record", "/tokens", "/sql", "/explain"} <= set(client.view_api(return_format="dict")["named_endpoints"])
    job = client.submit("def add(a, b):\n    return", 24, 0.0, 1.0, 0, "", api_name="/record")
    strip, status, run_id = job.result(timeout=120)
    slow.remove()
    assert run_id and "Recorded" in status
    # the recorder's id scheme: never all digits (a Parquet export would read such an id back as a number)
    assert re.fullmatch(r"r[0-9a-f]{11}", run_id), run_id
    # tokens streamed in while recording: several updates, each strip a prefix of the next
    updates = [o[0] for o in job.outputs()]
    assert len(updates) >= 2
    texts = [[d["token"] for d in u] for u in updates]
    assert all(t == texts[-1][: len(t)] for t in texts), texts
    assert {d["class_or_confidence"] for d in updates[-1]} <= {"no prediction", "< 0.2", "0.2-0.5", "0.5-0.8", "≥ 0.8"}
    t = query.tokens(store, run_id)
    assert query.run_row(store, run_id)["status"] == "complete"
    assert t.height == len(load_tokenizer().encode("def add(a, b):\n    return").ids) + 24
    # the streamed strip ends with every token, in order
    assert [d["token"] for d in strip] == [x if x else "\u2205" for x in t["text"].to_list()]
    back = client.predict(run_id, api_name="/tokens")
    assert back["headers"][:3] == ["pos", "token_id", "text"]
    assert [r[1] for r in back["data"]] == t["token_id"].to_list()
    assert [r[2] for r in back["data"]] == t["text"].to_list()
    rows, msg = client.predict(f"SELECT count(*) AS n FROM tokens WHERE run_id = '{run_id}'", api_name="/sql")
    assert rows["data"] == [[t.height]] and "1 rows" in msg
    # root cause through the API uses the in-memory module the app recorded with
    msg, *_ = client.predict(run_id, 5, 4, "", api_name="/explain")
    assert "ranked causes" in msg
    assert query.attributions(store, run_id, 5).height > 0
    # against a reference: one with the same weights would give all zeros, and says so
    msg, *_ = client.predict(run_id, 5, 4, run_id, api_name="/explain")
    assert "same weights" in msg


def test_client_sql_refuses_writes(served):
    from gradio_client import Client

    url, store, _ = served
    n = query.runs(store).height
    rows, msg = Client(url, verbose=False).predict("DELETE FROM runs", api_name="/sql")
    assert "only SELECT" in msg and query.runs(store).height == n


def test_empty_prompt_is_a_clear_error(served):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="empty prompt"):
        Client(served[0], verbose=False).predict("   ", 4, 0.0, 1.0, 0, "", api_name="/record")


def test_tokens_of_an_unknown_run_is_a_clear_escaped_error(served):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="no run &#x27;&lt;b&gt;x&lt;/b&gt;&#x27;"):  # Gradio renders it as HTML
        Client(served[0], verbose=False).predict("<b>x</b>", api_name="/tokens")


def test_md_text_leaves_no_markup():
    from workbench.apps.app import fail, md_text
    from workbench.views.markup import WJ, md_plain

    assert md_text("<img src=x onerror=alert(1)>") == "&lt;img src=x onerror=alert(1)&gt;"
    assert md_text('"><svg onload=alert(1)>') == "&quot;&gt;&lt;svg onload=alert(1)&gt;"
    # Markdown images and links, emphasis, code and line breaks are literal text too
    assert md_text("![t](http://x/a.png) [l](javascript:alert(1)) *b* `c`\n# h") == \
        f"\\!\\[t\\](http{WJ}://x/a.png) \\[l\\](javascript:alert(1)) \\*b\\* \\`c\\` # h"
    assert md_text("no-such-checkpoint 0.5") == "no-such-checkpoint 0.5"
    # bare URLs, www., e-mail addresses (Gradio's autolinks) and $$ (its math) are broken by an invisible joiner
    assert md_text("see https://evil.example/x, WWW.evil.example or a.b@evil.example; $$x^2$$ costs $5") == \
        (f"see https{WJ}://evil.example/x, WWW{WJ}.evil.example or a.b{WJ}@evil.example; ${WJ}$x^2${WJ}$ "
         "costs $5")
    assert md_text("ftp://x\nhttp://y") == f"ftp{WJ}://x http{WJ}://y"
    # what the page's messages are made of (page head, report message, fail()) is md_plain's escaping
    for value in ("<a href='http://x'>r/1</a> $$1$$", "r1", "*x* [y](z)"):
        assert md_text(value) == md_plain(value)
    msg = fail("Report export", ValueError("no run https://evil.example $$x$$"))
    assert "https://" not in msg and "$$" not in msg and f"https{WJ}://" in msg


def test_strip_buckets():
    from workbench.apps.app import BUCKETS, bucket, strip_value

    assert [bucket(x) for x in (None, float("nan"), 0.0, 0.19, 0.2, 0.5, 0.79, 0.8, 1.0)] == \
        ["no prediction", "no prediction", "< 0.2", "< 0.2", "0.2-0.5", "0.5-0.8", "0.5-0.8", "≥ 0.8", "≥ 0.8"]
    df = pl.DataFrame({"text": ["a", "", "<b>"], "confidence": [None, 0.9, 0.1]})
    assert strip_value(df) == [("a", "no prediction"), ("\u2205", "≥ 0.8"), ("<b>", "< 0.2")]
    assert len(BUCKETS) == 4


# -- read-only SQL ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    r = workbench.record([3, 4, 5, 6], model=tiny_model(2, vocab_size=4096), max_new_tokens=3,
                         db=tmp_path_factory.mktemp("sql") / "s.duckdb")
    return r.store


@pytest.mark.parametrize("q", [
    "SELECT count(*) FROM tokens", "WITH a AS (SELECT * FROM runs) SELECT run_id FROM a", "FROM runs SELECT run_id;",
    "DESCRIBE tokens", "SHOW TABLES", "SELECT * FROM range(3)", "SELECT 1 AS x -- trailing comment",
    "SELECT t.pos, a.entropy FROM tokens t JOIN attention a USING (run_id, pos) WHERE a.layer = 0",
])
def test_sql_allows_reads(store, q):
    assert isinstance(readonly_sql(store, q), pl.DataFrame)


@pytest.mark.parametrize("q, why", [
    ("INSERT INTO meta VALUES ('a', 'b')", "only SELECT"), ("DELETE FROM runs", "only SELECT"),
    ("UPDATE runs SET status = 'x'", "only SELECT"), ("DROP TABLE runs", "only SELECT"),
    ("CREATE TABLE z AS SELECT 1", "only SELECT"), ("ATTACH '/tmp/other.db' AS o", "only SELECT"),
    ("COPY runs TO '/tmp/runs.csv'", "only SELECT"), ("PRAGMA version", "only SELECT"),
    ("SET threads = 1", "only SELECT"), ("INSTALL httpfs", "only SELECT"), ("LOAD httpfs", "only SELECT"),
    ("CALL pragma_version()", "only SELECT"), ("EXPORT DATABASE '/tmp/x'", "only SELECT"),
    ("SELECT 1; SELECT 2", "one statement"), ("SELECT * FROM read_csv('/etc/passwd')", "read_csv"),
    ("SELECT * FROM '/etc/passwd'", "unknown table"), ("SELECT * FROM read_parquet('x.parquet')", "read_parquet"),
    ("SELECT * FROM glob('/*')", "glob"), ("SELECT * FROM 'https://example.com/x.csv'", "unknown table"),
    ("SELECT * FROM read_json('x.json')", "read_json"), ("SELECT * FROM read_text('/etc/hostname')", "read_text"),
    ("WITH x AS (SELECT * FROM read_csv('/etc/passwd')) SELECT * FROM x", "read_csv"),
    ("SELECT * FROM runs, LATERAL read_blob('/etc/passwd')", "read_blob"),
    ("SELECT * FROM query('SELECT 1')", "query"), ("SELECT nextval('s')", "nextval"),
    ("SELECT * FROM information_schema.tables", "only tables of this database"),
    ('WITH "/etc/passwd" AS (SELECT 1) SELECT * FROM "/etc/passwd"', "plain identifiers"),
    ("SELECT 1) UNION SELECT * FROM read_csv('/etc/passwd') --", "cannot parse"), ("", "empty"),
])
def test_sql_refuses(store, q, why):
    before = query.runs(store)
    with pytest.raises(SqlError, match=why):
        readonly_sql(store, q)
    assert query.runs(store).equals(before)


def test_sql_row_and_time_limits(store):
    r = run_readonly(store, "SELECT * FROM range(50)", max_rows=10)
    assert r.frame["range"].to_list() == list(range(10)) and r.truncated
    assert not run_readonly(store, "SELECT * FROM range(10)", max_rows=10).truncated
    with pytest.raises(SqlError, match="time limit"):
        readonly_sql(store, "SELECT count(*) FROM range(100000000000) a", timeout_s=0.3)
    # the store still works after an interrupted query
    assert readonly_sql(store, "SELECT count(*) AS n FROM runs")["n"][0] == 1
    assert workbench.Workbench(store).sql("SELECT 2 AS x")["x"][0] == 2


# -- commands -----------------------------------------------------------------------------------------

def test_launch_rejects_bad_auth(tmp_path):
    from workbench.apps.app import launch
    with pytest.raises(ValueError, match="USER:PASS"):
        launch(tmp_path / "x.duckdb", auth="nopassword")


def test_demo_records_each_prompt_once(tmp_path, monkeypatch, capsys):
    import workbench.model as model_pkg
    from workbench.commands import demo

    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_model(3, vocab_size=4096), ckpt, tokenizer=DEFAULT_TOKENIZER)
    monkeypatch.setattr(demo, "load_checkpoint", lambda *a, **k: model_pkg.checkpoint.load_checkpoint(ckpt))
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for i, text in enumerate(["def f(x):\n", "import os\n"]):
        (prompts / f"{i}.txt").write_text(text)
    monkeypatch.setattr(demo, "PROMPTS", prompts)
    db = tmp_path / "demo.duckdb"
    ns = argparse.Namespace(db=str(db), no_ui=True, max_new_tokens=3, host="127.0.0.1", port=0)
    assert demo.main(ns) == 0
    assert demo.main(ns) == 0  # second time: everything already recorded
    runs = workbench.open(db).runs()
    assert sorted(runs["prompt"].to_list()) == ["def f(x):\n", "import os\n"]
    assert "already recorded" in capsys.readouterr().err
    assert [p.name for p in demo.prompt_files()] == ["0.txt", "1.txt"]


def test_bundled_prompts_exist():
    from workbench.commands import demo
    files = demo.prompt_files(demo.Path(__file__).resolve().parents[1] / "data" / "prompts")
    assert len(files) >= 4 and all(f.read_text().strip() for f in files)


def test_cli_ui_bad_port_is_one_line(capsys):
    from workbench.cli import main
    assert main(["ui", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_record_with_a_missing_checkpoint_says_why(served, tmp_path):
    from gradio_client import Client

    strip, status, run_id = Client(served[0], verbose=False).predict(
        "x = 1", 2, 0.0, 1.0, 0, str(tmp_path / "no-such-checkpoint"), api_name="/record")
    assert status.startswith("⚠️ Recording failed") and "no-such-checkpoint" in status
