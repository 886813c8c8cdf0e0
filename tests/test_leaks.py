"""Nothing stored leaks into the UI as markup (issue 26, items 4 and 6): run ids and stored text escaped in plotly
labels and shown as plain text in Markdown (no links, no math), report file names sanitised, the SQL console's
result capped for the UI, the Record tab's checkpoint box held to its roots."""
from __future__ import annotations

import html
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import re
import time
import zipfile
from pathlib import Path

import pytest
from helpers import tiny_model

import workbench
import workbench.views.report
from workbench.analysis.diff import diff_runs
from workbench.apps.shared import AppContext
from workbench.apps.tabs import compare, kv_whatif, run_view, runs, search
from workbench.model import load_tokenizer
from workbench.views.markup import WJ, defuse, md_plain, plotly_text
from workbench.views.session import RunFrames

pytestmark = pytest.mark.usefixtures("one_thread")

LINK_ID = '<a href="http://x">y</a>'
URL_ID = "run/../$$x^2$$ https://evil.example www.evil.example me@evil.example"
NOTE = "see http://evil.example/n and $$\\int$$ or [click](javascript:alert(1))"
# what plotly renders as markup: a tag (an escaped tag is &lt;a ...)
TAG = re.compile(r"<\s*a\b|<[a-z]+\b[^<>]*\b(href|src|on\w+|style)\s*=", re.I)
# what Gradio's Markdown turns into a link or math after escaping (bare URL, www., e-mail, $$)
LIVE = re.compile(r"(https?|ftp)://|www\.|[A-Za-z0-9._+-]@|\$\$", re.I)


@pytest.fixture(scope="module")
def env(tmp_path_factory, one_thread):
    db = tmp_path_factory.mktemp("leaks") / "wb.duckdb"
    model, tok = tiny_model(vocab_size=4096), load_tokenizer()
    a = workbench.record('x = "<a href=http://x>y</a>"\n', model=model, tokenizer=tok, max_new_tokens=3, db=db,
                         run_id=LINK_ID)
    b = workbench.record("see www.evil.example $$x$$\n", model=model, tokenizer=tok, max_new_tokens=3, db=db,
                         run_id=URL_ID)
    a.store.update_run(URL_ID, notes=NOTE)
    return {"app": AppContext(a.store, model, tok), "a": a, "b": b, "store": a.store}


def _strings(obj):
    """Every string in a figure's JSON."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def _markup(fig) -> list[str]:
    d = fig.to_plotly_json()
    d["layout"].pop("template", None)
    return [s for s in _strings(d) if TAG.search(s)]


def test_helpers():
    assert plotly_text(LINK_ID) == '&lt;a href="http://x"&gt;y&lt;/a&gt;'
    plain = md_plain(URL_ID + " " + NOTE)
    assert not LIVE.search(plain) and "<" not in plain, plain
    assert "https://evil.example" in plain.replace(WJ, "") and "$$x^2$$" in plain.replace(WJ, "")
    assert defuse("ftp://a HTTP://b WWW.c $$$") == f"ftp{WJ}://a HTTP{WJ}://b WWW{WJ}.c ${WJ}${WJ}$"
    assert defuse("no link here: pos 3, 0.5 nats") == "no link here: pos 3, 0.5 nats"


def test_run_ids_are_escaped_in_compare_and_diff_figures(env):
    app = env["app"]
    table, msg, *figs = compare.compare(app, LINK_ID, URL_ID)
    assert all(f is not None for f in figs)
    for f in [*figs, *diff_runs(env["store"], LINK_ID, URL_ID).figures().values()]:
        assert not _markup(f), _markup(f)
    names = [t.name for t in figs[0].data]
    assert names == ['A &lt;a href="http://x"&gt;y&lt;/a&gt;', f"B {URL_ID}"]
    assert not LIVE.search(msg) and "&lt;a href" in msg


def test_every_run_figure_shows_stored_text_as_text(env):
    for rid in (LINK_ID, URL_ID):
        f = RunFrames(env["store"], rid)
        pos = f.n_prompt_tokens
        figs = [f.fig_tokens(), f.fig_topk(pos), f.fig_token_heads(pos), f.fig_head_entropy(), f.fig_entropy_along(),
                f.fig_token_routing(pos), f.fig_expert_load(), f.fig_coactivation(), f.fig_load_along(),
                f.fig_kv_bytes(), f.fig_kv_received(), f.fig_attribution(pos), f.fig_components(pos),
                f.fig_expert_cache(), f.fig_code_view(), f.fig_kv_pareto()]
        assert [s for fig in figs for s in _markup(fig)] == []
    ticks = RunFrames(env["store"], LINK_ID).fig_tokens().layout.xaxis.ticktext
    assert any("&lt;" in t for t in ticks) and not any("<" in t for t in ticks), ticks


def test_markdown_messages_have_no_links_and_no_math(env):
    app = env["app"]
    s = app.session()
    runs.refresh_runs(app, s, None)
    page, head, *_ = run_view.load_run(app, s, URL_ID)
    assert not LIVE.search(page) and not LIVE.search(head), (page, head)
    assert "evil.example/n" in head.replace(WJ, "") and "\\[click\\]" in head  # the note, shown as text
    note = run_view.reference_note(app, s, URL_ID, LINK_ID)
    assert not LIVE.search(note)
    _, msg = search.search_runs(app, "http://evil.example $$x$$", False)
    assert not LIVE.search(msg) and "evil.example" in msg
    msg, *_ = kv_whatif.kv_whatif_stored(app, s, URL_ID)
    assert not LIVE.search(msg)
    msg, *_ = compare.compare(app, "http://nope.example", URL_ID)[1:2]
    assert not LIVE.search(msg) and "nope" in msg  # the failure quotes the id: as text


def test_the_sql_console_caps_cells_and_result_size(env):
    from workbench.apps.tabs import sql
    from workbench.data import sqlsafe

    t0 = time.monotonic()
    rows, msg = sql.sql(env["app"], "SELECT repeat('x', 60000) AS s FROM range(1000)")
    assert time.monotonic() - t0 < 20
    assert rows.estimated_size() <= sqlsafe.UI_MAX_RESULT_BYTES and 0 < rows.height < 1000
    assert rows["s"].str.len_chars().max() == sqlsafe.UI_MAX_CELL_CHARS + 1 and rows["s"][0].endswith("\u2026")
    assert f"result cut to {rows.height} of 1000 rows (1 MB at most)" in msg
    assert f"{rows.height} long text cells cut to {sqlsafe.UI_MAX_CELL_CHARS} characters" in msg
    rows, msg = sql.sql(env["app"], "SELECT run_id FROM runs ORDER BY run_id")  # small results: nothing cut
    assert rows["run_id"].to_list() == sorted([LINK_ID, URL_ID]) and "cut" not in msg
    # the API without the caps returns the whole cells (and fails past RESULT_LIMIT_MB, as before)
    r = sqlsafe.run_readonly(env["store"], "SELECT repeat('x', 3000) AS s FROM range(3)", timeout_s=30)
    assert r.frame["s"].str.len_chars().to_list() == [3000] * 3 and r.note == ""


def test_the_checkpoint_box_loads_only_folders_under_its_roots(env, tmp_path, monkeypatch):
    from workbench.apps.tabs import record
    from workbench.model import DEFAULT_CHECKPOINT

    app = env["app"]
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    (root / "mine").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    monkeypatch.setattr(record, "CHECKPOINT_ROOTS", [])
    record.set_checkpoint_roots([root])
    assert record.allowed_checkpoint(app, "") == ""  # the app's model
    assert record.allowed_checkpoint(app, str(root / "mine")) == str((root / "mine").resolve())
    assert record.allowed_checkpoint(app, str(DEFAULT_CHECKPOINT)) == str(DEFAULT_CHECKPOINT.resolve())
    refused = [str(outside), str(root / "escape"), str(root / "mine" / ".." / ".." / "elsewhere"), "/etc",
               str(root / "no-such-folder"), "/no/such/folder", "~root", "\x00"]
    assert [record.allowed_checkpoint(app, p) for p in refused] == [None] * len(refused)

    def status(path):
        out = list(record.record_stream(app, "x = 1", 2, 0.0, 1.0, 0, path))
        assert len(out) == 1 and out[0][0] == [] and out[0][2] == ""
        return out[0][1].replace(md_plain(repr(path)), "PATH")

    # one message, whether the folder exists (and is not allowed) or not: it reveals nothing but the input
    messages = {status(p) for p in (str(outside), "/etc", str(root / "no-such-folder"), "/no/such/folder")}
    assert len(messages) == 1 and next(iter(messages)).startswith("⚠️ Recording failed: checkpoint folder PATH")
    assert app.recorder is None  # nothing was started
    record.set_checkpoint_roots([])
    assert record.allowed_checkpoint(app, str(root / "mine")) is None


def test_report_file_names_are_sanitised(env, tmp_path):
    from workbench.views.report import report_name

    names = {rid: report_name(rid) for rid in (LINK_ID, URL_ID, "../../etc/x", "..", "a/b", "a_b", "x" * 5000,
                                                "r0123abcd")}
    assert names["r0123abcd"] == "report_r0123abcd.html"  # an ordinary id keeps its name
    for rid, name in names.items():
        assert re.fullmatch(r"report_[A-Za-z0-9_][A-Za-z0-9_.-]*\.html", name) and len(name) < 120, (rid, name)
    assert len(set(names.values())) == len(names)  # a/b and a_b differ
    # written into the folder given, under that name, for a run id with path characters
    path = env["a"].report(tmp_path, "md")
    assert path.parent == tmp_path and path.name == report_name(LINK_ID, "md") and path.read_text()
    path = workbench.views.report.write_report(env["b"], tmp_path, "json")
    assert path.parent == tmp_path and path.exists()


def test_export_report_in_the_ui_works_for_a_run_id_with_a_slash(env):
    from workbench.apps import app as app_mod

    file, msg = app_mod.export_report(env["app"], URL_ID)
    assert file.visible and file.value and os.path.exists(file.value["path"] if isinstance(file.value, dict)
                                                          else file.value), msg
    assert "Report written" in msg and "/" not in msg.split(":", 1)[1]


# -- newcomer polish (item 6): the README as written in a fresh shell, a quiet build -------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_readme_commands_work_in_a_fresh_shell():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.S)
    for kind, body in blocks:
        assert "/tmp/" not in body, body  # outputs go to a temporary or project folder, never a fixed /tmp path
        if kind == "bash":
            active = False
            for line in body.splitlines():
                active = active or line.startswith("source .venv/bin/activate")
                cmd = re.sub(r"^(\w+=\S+ )+", "", line)  # MALLOC_...=x workbench ...
                if cmd.startswith("workbench "):  # bare: only after activating the venv in the same block
                    assert active, line
    # inside a with block Jupyter shows nothing: the faults example prints its findings, and says what they hold
    faults = next(body for kind, body in blocks if "faults.break_head" in body)
    inside = faults.split("faults.break_head", 1)[1].split("\nsorted(", 1)[0]
    assert "print(bad.findings()" in inside and "layer 2 head 1" in inside


@pytest.mark.slow
def test_building_the_package_prints_no_warning_of_ours(built_wheel):
    wheel, out = built_wheel  # tests/conftest.py: pip wheel -v of the packaged sources, once a session
    assert "BuildBackendWarning" not in out and "SetuptoolsDeprecationWarning" not in out, \
        "\n".join(line for line in out.splitlines() if "Warning" in line)
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {"workbench/model/presets/tiny.json", "workbench/views/templates/report.html.j2"} <= shipped


def test_stored_method_and_kind_names_are_escaped_in_the_components_and_attribution_figures():
    import polars as pl

    from workbench.views import figures

    hostile = '<a href="http://x">m</a>'
    attributions = pl.DataFrame({"target_pos": [3, 3], "kind": [hostile, "token"], "layer": [1, None],
                                 "head": [None, None], "expert": [None, None], "source_pos": [None, 1],
                                 "score": [0.5, 0.2], "rank": [1, 2], "method": [hostile, hostile], "delta": [None, None],
                                 "restored": [None, None]})
    tokens = pl.DataFrame({"pos": [0, 1, 2, 3], "text": ["a", hostile, "b", "c"]})
    for fig in (figures.fig_components(attributions, 3), figures.fig_attribution(attributions, tokens, 3)):
        assert not _markup(fig), _markup(fig)
    assert "&lt;a href" in figures.fig_components(attributions, 3).layout.title.text


@pytest.mark.browser
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="Debian chromium not installed at /usr/bin/chromium")
def test_gradio_renders_plain_markdown_without_links_or_math():
    """In the page itself: Gradio's Markdown makes links and math of the old escaping (the control), none of
    md_plain's, with Gradio's default LaTeX delimiters and with LaTeX off."""
    import gradio as gr
    from helpers import free_port
    from playwright.sync_api import sync_playwright

    def old_escaping(value):  # what md_text did before: HTML and Markdown syntax escaped, autolinks and math not
        return html.escape(re.sub(r"([\\`*_\[\]!~])", r"\\\1", " ".join(str(value).splitlines())), quote=True)

    text = f"{URL_ID} {LINK_ID}"
    with gr.Blocks() as blocks:
        gr.Markdown("control " + old_escaping(text), elem_id="control")
        gr.Markdown("plain " + md_plain(text), elem_id="plain")
        gr.Markdown("plain " + md_plain(text), elem_id="plain-nolatex", latex_delimiters=[])
    port = free_port()
    blocks.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox"])
            pg = b.new_page()
            pg.goto(f"http://127.0.0.1:{port}/")
            pg.wait_for_selector("#control a", timeout=30_000)  # the control's links: the page has rendered
            pg.wait_for_timeout(1000)  # KaTeX loads after the Markdown
            seen = {el: (pg.eval_on_selector_all(f"#{el} a", "e => e.length"),
                         pg.eval_on_selector_all(f"#{el} .katex", "e => e.length"),
                         pg.inner_text(f"#{el}").replace(WJ, ""))
                    for el in ("control", "plain", "plain-nolatex")}
            b.close()
    finally:
        blocks.close()
    assert seen["control"][0] >= 3 and seen["control"][1] >= 1, seen["control"]  # what the page would do
    for el in ("plain", "plain-nolatex"):
        links, math, shown = seen[el]
        assert links == 0 and math == 0 and shown == f"plain {text}", seen[el]
