"""Each tab's callbacks called directly on a recorded store (no server), and the UI faults of issue 24."""
from __future__ import annotations

import inspect
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import polars as pl
import pytest
from helpers import tiny_model

import workbench
from workbench.apps import app as app_mod
from workbench.apps.shared import AppContext
from workbench.apps.tabs import (
    anomalies,
    attention,
    batches,
    code,
    compare,
    experts,
    kv_cache,
    kv_whatif,
    replay,
    run_view,
    runs,
    search,
    sql,
)
from workbench.data import query
from workbench.model import load_tokenizer
from workbench.views import figures
from workbench.views.session import RunFrames, Session

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory, one_thread):
    db = tmp_path_factory.mktemp("tabs") / "wb.duckdb"
    model, tok = tiny_model(vocab_size=4096), load_tokenizer()
    a = workbench.record("alpha = 1\n", model=model, tokenizer=tok, max_new_tokens=6, db=db)
    b = workbench.record("omega = 2\n", model=model, tokenizer=tok, max_new_tokens=6, db=db)
    other = tiny_model(seed=7, vocab_size=4096)
    c = workbench.record("alpha = 1\n", model=other, tokenizer=tok, max_new_tokens=6, db=db)
    return {"app": AppContext(a.store, model, tok), "a": a, "b": b, "c": c, "store": a.store}


def _session(env) -> Session:
    s = env["app"].session()
    runs.refresh_runs(env["app"], s, None)
    return s


def test_one_read_per_table_per_pick(env):
    """Every view of one pick shares one read of each table and of the run row."""
    app, a = env["app"], env["a"]
    s = _session(env)
    run_view.load_run(app, s, a.run_id)
    pos = a.info["n_prompt_tokens"]
    run_view.token_views(app, s, a.run_id, pos)
    run_view.token_views(app, s, a.run_id, pos + 1)
    attention.attention_views(app, s, a.run_id, None, False)
    experts.expert_views(app, s, a.run_id, None, 16)
    kv_cache.kv_views(app, s, a.run_id, "")
    code.code_views(app, s, a.run_id, True)
    replay.replay(app, s, a.run_id, 2)
    reads = s.frames.reads
    assert reads["runs"] == 1 and reads["tokens"] == 1 and reads["attention"] == 1 and reads["routing"] == 1
    assert max(reads.values()) == 1, reads
    f1 = s.frames
    run_view.load_run(app, s, a.run_id)  # picking again reads anew
    assert s.frames is not f1 and s.frames.reads["runs"] == 1


def test_every_tab_callback_on_a_recorded_store(env):
    app, a, b = env["app"], env["a"], env["b"]
    s = _session(env)
    head, rhead, strip, pos, conf, summ, slider, ref = run_view.load_run(app, s, a.run_id)
    assert a.run_id in rhead and len(strip) == a.tokens().height and pos.value == a.info["n_prompt_tokens"]
    info, *figs, msg, causes = run_view.token_views(app, s, a.run_id, pos.value)
    assert info["token"][0] == a.tokens()["text"][pos.value] and all(f is not None for f in figs)
    h, along, pick = attention.attention_views(app, s, a.run_id, ["layer 1, head 2"], True)
    assert [t.name for t in along.data] == ["layer 1, head 2"] and "layer 0, head 0" in [c[1] for c in pick.choices]
    load, coact, along_load, layer = experts.expert_views(app, s, a.run_id, None, 4)
    assert layer.value == min(a.routing()["layer"].to_list())
    kvb, kvr = kv_cache.kv_views(app, s, a.run_id, "0")
    assert len(kvb.data) > 0 and len(kvr.data) == 1
    with pytest.raises(gr.Error):
        kv_cache.kv_views(app, s, a.run_id, "x<b>")
    msg, cstrip, cdf, cplot = code.code_views(app, s, a.run_id, True)
    assert len(cstrip) == a.tokens().height and cdf.height > 0
    f, rows, amsg, kinds = anomalies.anomaly_table(app, s, a.run_id, False, "all", None, "")
    assert f"of {a.anomalies().height} anomaly rows" in amsg and rows.height == a.anomalies().height
    rstrip, rinfo, *rfigs = replay.replay(app, s, a.run_id, 1)
    assert "step 1/" in rinfo and len(rstrip) == a.tokens().filter(pl.col("step") <= 1).height
    kmsg, kdf, kfig = kv_whatif.kv_whatif_stored(app, s, a.run_id)
    assert "No KV what-if results" in kmsg and kdf.columns == kv_whatif.COLUMNS and kdf.height == 0
    rows, smsg = sql.sql(app, "SELECT count(*) AS n FROM runs")
    assert rows["n"][0] == query.runs(env["store"]).height and "1 rows" in smsg
    rows, smsg = sql.sql(app, "DELETE FROM runs")  # refused: a message, and an empty table under a header
    assert "only SELECT" in smsg and rows.height == 0 and rows.columns == ["rows"]
    df, smsg = search.search_runs(app, "omega", False)
    assert df["run_id"].to_list() == [b.run_id]
    brows, blow, bl, be, bmsg = batches.batch_views(app, None)
    assert brows.height == 0 and brows.columns == batches.RUN_COLUMNS and "No batch" in bmsg
    table, lst, refp, ca, cb = runs.refresh_runs(app, s, a.run_id)
    assert set(table["run_id"].to_list()) == {a.run_id, b.run_id, env["c"].run_id} and lst.value == a.run_id


def test_ranked_causes_follow_the_run_and_position(env):
    """Fault: the Ranked causes table and its status line showed the previous run's causes after a switch."""
    app, a, b = env["app"], env["a"], env["b"]
    s = _session(env)
    pos = a.info["n_prompt_tokens"] + 1
    run_view.load_run(app, s, a.run_id)
    msg, attr, comp, table = run_view.explain(app, s, a.run_id, pos, 4, "")
    assert "ranked causes" in msg and table.height > 0
    *_, msg, causes = run_view.token_views(app, s, a.run_id, pos)  # the stored ranking, this run, this position
    assert f"pos {pos} (stored)" in msg and causes["rank"].to_list() == sorted(causes["rank"].to_list())
    assert causes.height == min(30, query.attributions(env["store"], a.run_id, pos).height)
    *_, msg, causes = run_view.token_views(app, s, a.run_id, pos - 1)  # another position: nothing stored
    assert "No root cause stored" in msg and causes.height == 0 and causes.columns == run_view.CAUSE_COLUMNS
    run_view.load_run(app, s, b.run_id)
    *_, msg, causes = run_view.token_views(app, s, b.run_id, pos)  # another run: its own (none)
    assert "No root cause stored" in msg and b.run_id in msg and causes.height == 0


def test_reference_picker_leaves_out_the_run_and_explains_the_reference(env):
    app, a, b, c = env["app"], env["a"], env["b"], env["c"]
    s = _session(env)
    *_, ref = run_view.load_run(app, s, a.run_id)
    ids = [v for _, v in ref.choices]
    assert a.run_id not in ids and b.run_id in ids and "" in ids
    assert "identical weights" in run_view.reference_note(app, s, a.run_id, b.run_id)
    assert "different prompt" in run_view.reference_note(app, s, a.run_id, b.run_id)
    note = run_view.reference_note(app, s, a.run_id, c.run_id)  # other weights, same prompt
    assert "identical" not in note and "different prompt" not in note
    assert "no reference for itself" in run_view.reference_note(app, s, a.run_id, a.run_id)


def test_compare_warns_for_other_prompts_and_shows_a_table(env):
    app, a, b, c = env["app"], env["a"], env["b"], env["c"]
    table, msg, *figs = compare.compare(app, a.run_id, b.run_id)
    assert isinstance(table, pl.DataFrame) and table.columns == ["what", "value"]
    assert dict(table.iter_rows())["same_prompt"] == "False" and "different prompts" in msg
    assert all(f is not None and f.layout.title.text for f in figs)
    table, msg, *_ = compare.compare(app, a.run_id, c.run_id)
    assert "different prompts" not in msg and dict(table.iter_rows())["same_prompt"] == "True"


def test_an_unknown_run_clears_the_views(env, monkeypatch):
    app, a = env["app"], env["a"]
    s = _session(env)
    run_view.load_run(app, s, a.run_id)
    warned = []
    monkeypatch.setattr(gr, "Warning", lambda m: warned.append(m))
    head, rhead, strip, pos, conf, summ, slider, ref = run_view.load_run(app, s, "<b>nope</b>")
    assert strip == [] and conf is None and summ == "" and a.run_id not in rhead and s.frames is None
    assert warned and "no run" in warned[0] and "<b>" not in warned[0]
    info, *figs, msg, causes = run_view.token_views(app, s, "<b>nope</b>", 3)
    assert info.height == 0 and info.columns == run_view.TOKEN_COLUMNS and figs == [None] * 5
    assert attention.attention_views(app, s, "<b>nope</b>", None, False)[:2] == (None, None)
    assert replay.replay(app, s, "<b>nope</b>", 1)[0] == []


def test_a_pick_replays_the_new_run_without_reading_the_slider(env):
    """A pick moves the replay slider's range; a step the page sent with the pick chain could be the run picked
    before's, past the new range, which Gradio refuses before any callback runs (seen in CI as an error toast "Value 5
    is greater than maximum value 1."): the chain replays the picked run at its last step, the slider no input."""
    app, a = env["app"], env["a"]
    s = _session(env)
    run_view.load_run(app, s, a.run_id)
    last = query.last_step(app.store, a.run_id)
    assert last > 1 and replay.replay_picked(app, s, a.run_id)[1] == replay.replay(app, s, a.run_id, last)[1]
    assert replay.replay_picked(app, s, None)[0] == []
    built = app_mod.build_app(app.store)
    step = next(b for b in built.blocks.values() if getattr(b, "elem_id", None) == "replay-step")
    picked = [f for f in built.fns.values() if getattr(inspect.unwrap(f.fn), "func", None) is replay.replay_picked]
    assert len(picked) == 1 and step not in picked[0].inputs
    assert any(step in f.inputs for f in built.fns.values())  # the slider's own events do read it


def test_a_position_past_the_run_is_said_when_typed_and_left_alone_when_it_moved_by_itself(env):
    """The position field has no maximum (Gradio refused a value past it before any callback: an event sent before a
    quick re-pick of a shorter run carried the longer run's position, the replay slider's CI flake); a typed position
    past the run is an error naming it, one that moved by itself (a pick, the strip) leaves the views alone."""
    app, a = env["app"], env["a"]
    s = _session(env)
    number = run_view.load_run(app, s, a.run_id)[3]
    assert number.maximum is None
    n = a.tokens().height
    moved = run_view.token_views_moved(app, s, a.run_id, n + 5)
    assert len(moved) == 8 and all(m == gr.skip() for m in moved)
    with pytest.raises(gr.Error, match=str(n + 5)):
        run_view.token_views(app, s, a.run_id, n + 5)
    got, want = run_view.token_views_moved(app, s, a.run_id, 3), run_view.token_views(app, s, a.run_id, 3)
    assert got[0].equals(want[0]) and got[6] == want[6]


def test_page_header_names_the_run_model_family(env):
    app, a = env["app"], env["a"]
    s = _session(env)
    head = run_view.load_run(app, s, a.run_id)[0]
    from workbench.apps.shared import md_text
    assert md_text(a.model_summary.describe()) in head and md_text(a.model_summary.family) in head
    assert "DeepSeek-V3-style" not in run_view.page_header(None, "x.duckdb")


def test_every_plot_has_a_title_and_tables_their_headers():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        blocks = app_mod.build_app(os.path.join(d, "w.duckdb"))
        plots = [b for b in blocks.blocks.values() if isinstance(b, gr.Plot)]
        assert plots and all(p.label and p.label != "Plot" for p in plots)
        frames = [b for b in blocks.blocks.values() if isinstance(b, gr.Dataframe) and b.visible]
        assert all(list(b.value["headers"]) != ["1", "2", "3"] for b in frames), [b.elem_id for b in frames]
        buttons = [b.value for b in blocks.blocks.values() if isinstance(b, gr.Button)]
        assert replay.PAUSE in buttons and "⏸" not in "".join(buttons)


def test_load_along_axis_starts_at_zero_and_legends_are_plain(env):
    f = RunFrames(env["store"], env["a"].run_id)
    fig = f.fig_load_along(window=4)
    assert fig.layout.xaxis.range[0] == 0 and min(fig.data[0].x) == 2  # the first window's centre: 0..3
    names = [t.name for t in f.fig_tokens().data] + [t.name for t in f.fig_entropy_along().data]
    assert not [n for n in names if n and ("p(" in n or n.startswith("L") and "H" in n)], names


def test_figures_never_read_the_store_or_load_a_tokenizer(env, monkeypatch):
    import inspect

    import workbench.model as model_pkg
    src = inspect.getsource(figures)
    assert "query" not in vars(figures) and "Store" not in vars(figures) and "load_tokenizer" not in src
    monkeypatch.setattr(model_pkg, "load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer was loaded"))
    t = env["a"].tokens()
    pos = env["a"].info["n_prompt_tokens"] + 1
    fig = figures.fig_topk(t, pos)  # texts from the run's own tokens, else #id
    seen = dict(zip(t["token_id"].to_list(), t["text"].to_list()))
    want = [figures.token_label(seen.get(i, f"#{i}"), 20) for i in t["topk_ids"][pos]]
    assert [y.split(". ", 1)[1] for y in list(fig.data[0].y)[::-1]] == want


def test_no_findings_says_what_was_tested(env, monkeypatch):
    from workbench.analysis.anomalies import what_was_tested
    from workbench.run import Run

    app, a = env["app"], env["a"]
    real = Run.findings
    monkeypatch.setattr(Run, "findings", lambda self, **kw: real(self, **kw).head(0))
    found, rows, msg, _ = anomalies.anomaly_table(app, _session(env), a.run_id, False, "all", None, "")
    assert found.height == 0 and msg.startswith("0 findings")
    assert "Tested: " in msg and what_was_tested(env["store"], a.run_id).split(" ")[0] in msg


def test_topk_texts_come_from_a_fitting_tokenizer_the_app_passes(env):
    import json

    app, a = env["app"], env["a"]
    s = _session(env)
    run_view.load_run(app, s, a.run_id)
    assert s.frames.tokenizer is app.tokenizer  # a run of the app's own model: the app's tokenizer
    pos = a.info["n_prompt_tokens"] + 1
    fig = run_view.token_views(app, s, a.run_id, pos)[1]
    want = [figures.token_label(app.tokenizer.decode([i]), 20) for i in a.tokens()["topk_ids"][pos]]
    assert [y.split(". ", 1)[1] for y in list(fig.data[0].y)[::-1]] == want
    # a run whose vocabulary no tokenizer here covers gets none (its own texts, else #id)
    summary = json.loads(a.info["summary"]) | {"vocab_size": 10**9}
    info = a.info | {"checkpoint_sha256": "other", "model": "Elsewhere", "summary": json.dumps(summary)}
    assert app.tokenizer_for(info) is None


def test_apps_hold_short_functions_no_sql_and_no_recording_machinery():
    """Issue 24: one module per tab, no function in apps/ longer than about 80 lines, no SQL run and no process
    or thread loop written there (the Record tab uses workbench.views.recording)."""
    import ast
    from pathlib import Path

    root = Path(app_mod.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert {p.stem for p in (root / "tabs").glob("*.py")} >= {
        "runs", "record", "run_view", "attention", "experts", "kv_cache", "kv_whatif", "code", "anomalies", "compare",
        "replay", "sql", "batches", "search"}
    for path in files:
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 85, f"{path.name}:{node.name}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not {"threading", "multiprocessing", "subprocess", "duckdb", "torch"} & set(names), path.name
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("sql", "execute", "Thread"), f"{path.name}:{node.lineno}"
    for tab in (anomalies, attention, batches, code, compare, experts, kv_cache, kv_whatif, replay, run_view, runs,
                search, sql):
        assert callable(tab.build)
