"""The app in headless Chromium: stored markup stays text on every surface; run lists and views follow
the run that was picked or recorded; the Runs table shows all its columns.

Same browser and helpers as tests/test_browser.py (Debian chromium, never ``playwright install``).
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
from helpers import free_port, tiny_model
from test_browser import browser, page, pytestmark  # noqa: F401 - fixtures and the chromium skip

import workbench
from workbench.data import query
from workbench.model import load_tokenizer

IMG = "<img src=x onerror=alert(1)>"
SCRIPT = "<script>alert(1)</script>"
SVG = '"><svg onload=alert(1)>'
STATUS = SVG + " done"
PROMPT = SCRIPT + " prompt"
ERROR = IMG + " boom"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An app over: a run whose token texts / status / prompt / error are markup, and two runs A and B
    with the same number of steps (different prompts), one with a long prompt."""
    from workbench.apps.app import build_app

    db = tmp_path_factory.mktemp("ui_state") / "wb.duckdb"
    model, tok = tiny_model(vocab_size=4096), load_tokenizer()
    xss = workbench.record("print('hi')\n", model=model, tokenizer=tok, max_new_tokens=4, db=db)
    for pos, text in ((2, IMG), (3, SCRIPT), (4, SVG)):
        xss.store.execute("UPDATE tokens SET text = ? WHERE run_id = ? AND pos = ?", [text, xss.run_id, pos])
    xss.store.execute("UPDATE runs SET status = ?, prompt = ?, error = ? WHERE run_id = ?",
                      [STATUS, PROMPT, ERROR, xss.run_id])
    a = workbench.record("alpha = 1\n", model=model, tokenizer=tok, max_new_tokens=6, db=db)
    b = workbench.record("omega = 2  # " + "a long prompt, wrapped in the Runs table " * 3, model=model,
                         tokenizer=tok, max_new_tokens=6, db=db)
    assert query.last_step(a.store, a.run_id) == query.last_step(b.store, b.run_id)  # the replay fault needs it
    app = build_app(a.store, model=model, tokenizer=tok)
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield {"url": f"http://127.0.0.1:{port}/", "xss": xss, "a": a, "b": b, "store": a.store, "model": model,
           "tok": tok}
    app.close()


def _watch_requests(pg) -> list[str]:
    seen: list[str] = []
    pg.on("request", lambda r: seen.append(r.url))
    return seen


def _no_markup_ran(pg, requests: list[str]) -> None:
    """No element from a payload exists, no handler ran, no request for the payload's image went out."""
    assert pg.locator("img[src='x']").count() == 0
    assert pg.evaluate("() => document.querySelectorAll('[onerror], [onload], svg[onload]').length") == 0
    assert pg.evaluate("() => [...document.querySelectorAll('script')].filter(s => s.textContent.includes('alert(1)')).length") == 0
    assert pg.dialogs == [] and pg.evaluate("() => window.__alerts") == []
    assert not [u for u in requests if re.search(r"/x($|\?)", u)], requests


def _open(pg, url: str) -> None:
    """Load the page; ready once the page load has filled the run lists (and picked the newest run)."""
    pg.goto(url)
    pg.wait_for_selector("#runs-table", timeout=30_000)
    pg.wait_for_function("() => (document.querySelector('#run-picker input')?.value || '') !== ''", timeout=30_000)


def _pick(pg, run_id: str) -> None:
    """Choose a run in the run picker (the dropdown above the tabs)."""
    pg.locator("#run-picker input").click()
    pg.locator("#run-picker li[role=option]", has_text=run_id).first.click()


def _options(pg, elem: str) -> str:
    """The labels a dropdown offers (opened, read, closed)."""
    pg.locator(f"#{elem} input").click()
    pg.wait_for_selector(f"#{elem} li[role=option]", timeout=15_000)
    text = pg.locator(f"#{elem} [role=listbox]").first.inner_text()
    pg.keyboard.press("Escape")
    return text


def _wait_text(pg, elem: str, want: str, timeout: int = 45_000) -> None:
    """Until the element's text (line breaks removed: a token strip puts one between tokens) has ``want``."""
    pg.wait_for_function("([e, w]) => (document.querySelector('#' + e)?.innerText || '').replace(/\\n/g, '')"
                         ".includes(w)", arg=[elem, want], timeout=timeout)


def _sql(pg, text: str) -> None:
    pg.get_by_role("tab", name="SQL").click()
    editor = pg.locator("#sql-text .cm-content")
    editor.click()
    pg.keyboard.press("Control+A")
    pg.keyboard.press("Delete")
    pg.keyboard.insert_text(text)  # no auto-closed brackets or quotes
    assert " ".join(editor.inner_text().split()) == " ".join(text.split())
    pg.locator("#sql-run").click()


# -- 1. stored markup and error messages are text --------------------------------------------------

def test_stored_markup_is_text_on_every_surface(server, page):
    """Markup in tokens.text, runs.status, runs.prompt and runs.error, shown through the Runs table, the
    run picker, the Run view header, the SQL tab's rows and its error message (DuckDB quotes the value
    that failed a cast), appears as its text and creates no element, runs no handler, fetches nothing."""
    requests = _watch_requests(page)
    rid = server["xss"].run_id
    _open(page, server["url"])
    _wait_text(page, "runs-table", PROMPT)
    assert STATUS in page.locator("#runs-table").inner_text()
    assert PROMPT[:30] in _options(page, "run-picker")
    # the Run view header: status and error, as text
    page.locator("#runs-table").get_by_text(rid, exact=True).locator("visible=true").first.click()
    _wait_text(page, "run-head", rid)
    _wait_text(page, "run-head", STATUS)
    _wait_text(page, "run-head", ERROR)
    tokens = page.locator("#token-strip").inner_text()
    assert IMG in tokens and SCRIPT in tokens and SVG in tokens
    # the SQL tab: the innocent query whose error message quotes the stored text
    for column, want in (("text", IMG), ("status", STATUS), ("prompt", PROMPT), ("error", ERROR)):
        where = f"run_id = '{rid}'" + (" AND pos = 2" if column == "text" else "")
        table = "tokens" if column == "text" else "runs"
        _sql(page, f"SELECT CAST({column} AS INTEGER) FROM {table} WHERE {where}")
        _wait_text(page, "sql-msg", f"Could not convert string '{want}'")
        assert "⚠️" in page.locator("#sql-msg").inner_text()
    # and its rows
    _sql(page, f"SELECT pos, text FROM tokens WHERE run_id = '{rid}' AND pos BETWEEN 2 AND 4 ORDER BY pos")
    _wait_text(page, "sql-msg", "3 rows")
    rows = page.locator("#sql-rows").inner_text()
    assert IMG in rows and SCRIPT in rows and SVG in rows
    _no_markup_ran(page, requests)


def test_an_error_toast_quoting_a_run_id_is_text(server, page):
    """A run id typed into the picker reaches gr.Error's message (which Gradio renders as HTML): text."""
    requests = _watch_requests(page)
    _open(page, server["url"])
    shown = page.locator("#run-picker input").input_value().split(" ")[0]
    page.get_by_role("tab", name="Run view").click()
    _wait_text(page, "run-head", shown)
    page.locator("#run-picker input").fill(IMG)
    page.locator("#run-picker input").press("Enter")
    page.wait_for_selector(".toast-body", timeout=15_000)
    assert "no run" in page.locator(".toast-body").first.inner_text()
    assert IMG in page.locator(".toast-body").first.inner_text()
    # and the views are cleared: the run picked before is gone from the header and the token strip
    _wait_text(page, "run-head", "Choose a run")
    assert shown not in _strip_text(page, "run-head") and page.locator("#token-strip .token").count() == 0
    _no_markup_ran(page, requests)


# -- 2. state: every view and list follows the run --------------------------------------------------

def _strip_text(pg, elem: str) -> str:
    return pg.evaluate(f"() => (document.querySelector('#{elem}')?.innerText || '').replace(/\\n/g, '')")


def test_replay_follows_the_picked_run(server, page):
    """(a) Switching to a run with the same number of steps replays the new run, not the old one."""
    a, b = server["a"], server["b"]
    _open(page, server["url"])
    _pick(page, a.run_id)
    page.get_by_role("tab", name="Replay").click()
    _wait_text(page, "replay-strip", "alpha", timeout=60_000)
    _wait_text(page, "replay-info", "newest fed pos")
    info_a = _strip_text(page, "replay-info .prose")
    _pick(page, b.run_id)
    _wait_text(page, "replay-strip", "omega", timeout=60_000)
    assert "alpha" not in _strip_text(page, "replay-strip")
    _wait_text(page, "replay-info", "newest fed pos")
    # the same step of the other run
    assert _strip_text(page, "replay-info .prose").split("·")[0] == info_a.split("·")[0], info_a


def test_recording_selects_the_new_run_everywhere(server, page):
    """(b) After the Record tab records, the run picker, the Run view, the Runs table and the Compare
    pickers show the new run; its id carries the recorder's "r" prefix."""
    _open(page, server["url"])
    _pick(page, server["a"].run_id)
    page.get_by_role("tab", name="Run view").click()
    _wait_text(page, "run-head", server["a"].run_id)
    page.get_by_role("tab", name="Record").click()
    page.locator("#record-prompt textarea").fill("gamma = 3\n")
    page.locator("#record-button").click()
    _wait_text(page, "record-status", "Recorded", timeout=120_000)
    rid = page.locator("#record-id textarea, #record-id input").first.input_value()
    assert query.run_row(server["store"], rid)["status"] == "complete"
    page.wait_for_function("(r) => (document.querySelector('#run-picker input')?.value || '').includes(r)",
                           arg=rid, timeout=30_000)
    page.get_by_role("tab", name="Run view").click()
    _wait_text(page, "run-head", rid)
    page.get_by_role("tab", name="Runs").click()
    _wait_text(page, "runs-table", rid)
    page.get_by_role("tab", name="Compare").click()
    assert rid in _options(page, "compare-a") and rid in _options(page, "compare-b")
    page.get_by_role("tab", name="Run view").click()
    refs = _options(page, "reference-picker")  # every other run; the picked one is no reference for itself
    assert rid not in refs and server["a"].run_id in refs
    # never all digits (a Parquet/Hive export would read such an id back as an integer)
    assert re.fullmatch(r"r[0-9a-f]{11}", rid), rid


def test_lists_follow_runs_recorded_after_the_server_started(server, page):
    """(c) A run recorded outside the UI after the app was built appears in every run list after a page
    (re)load, and after Refresh on an open page."""
    kw = {"model": server["model"], "tokenizer": server["tok"], "max_new_tokens": 2, "db": server["store"]}
    late = workbench.record("late = 1\n", **kw)
    _open(page, server["url"])
    _wait_text(page, "runs-table", late.run_id)
    assert late.run_id in _options(page, "run-picker")
    page.get_by_role("tab", name="Compare").click()
    assert late.run_id in _options(page, "compare-a") and late.run_id in _options(page, "compare-b")
    later = workbench.record("later = 2\n", **kw)
    page.get_by_role("button", name="↻ Refresh").click()
    page.get_by_role("tab", name="Runs").click()
    _wait_text(page, "runs-table", later.run_id)
    assert later.run_id in _options(page, "run-picker")
    page.get_by_role("tab", name="Compare").click()
    assert later.run_id in _options(page, "compare-a")


@pytest.mark.parametrize("width", [1400, 1000])
def test_runs_table_shows_every_column(server, browser, width):
    """(d) Every column of the Runs table, the last included, lies inside the table's box; nothing
    scrolls sideways."""
    pg = browser.new_page(viewport={"width": width, "height": 1000})
    try:
        _open(pg, server["url"])
        _wait_text(pg, "runs-table", server["b"].run_id)
        box = pg.evaluate("""() => {
            const t = document.querySelector('#runs-table');
            const r = t.getBoundingClientRect();
            const heads = [...t.querySelectorAll('thead th')].filter(h => h.offsetParent !== null)
                .map(h => { const b = h.getBoundingClientRect(); return [h.innerText.trim(), b.left, b.right]; });
            const scrolls = [...t.querySelectorAll('*')].filter(e => e.scrollWidth > e.clientWidth + 1 &&
                ['auto', 'scroll'].includes(getComputedStyle(e).overflowX)).map(e => e.className);
            return {left: r.left, right: r.right, heads, scrolls}; }""")
        names = [h[0] for h in box["heads"]]
        assert [n for n in names if n][-2:] == ["n_tokens", "n_anomalies"], names
        assert all(box["left"] - 1 <= h[1] and h[2] <= box["right"] + 1 for h in box["heads"]), box
        assert box["scrolls"] == [], box
    finally:
        pg.close()
