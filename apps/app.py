"""The Gradio workbench: the page assembled from one module per tab (``apps/tabs/<tab>.py``).

Each tab module has a ``build(session)`` (its layout and wiring; ``session`` is the ``apps.shared.Page``) and
plain callback functions, which tests call directly on a recorded store. The callbacks read a run through the
user's ``workbench.views.session.Session`` (one read of each of a run's tables per pick, shared by every view)
and draw with ``workbench.views.figures``; the apps hold no SQL and no recording machinery.

Every run list (Runs table, run picker, reference and Compare pickers) is computed when a page loads, on
Refresh, when the Runs or Compare tab is opened and after a recording (which selects the new run), never when
the app is built.

    python -m workbench.apps.app --db data/workbench.duckdb      # or: workbench ui
"""
from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported
# Gradio's queue rebuilds a pandas frame of its last GRADIO_ANALYTICS_MAX_EVENTS (10,000) events after every
# event, for its /monitoring summary, which this app does not use: with 8 clients polling, 22% of the app's
# CPU (py-spy, benchmarks/ui_load.py), growing with uptime. Every 1,000 events over the last 1,000 instead.
os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", "1000")
os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "1000")

import tempfile
from functools import partial
from pathlib import Path

import gradio as gr

from workbench.apps.shared import (  # noqa: F401 - re-exported: the app's helpers by their old names
    BUCKETS,
    COLOR_MAP,
    LAST,
    READ,
    AppContext,
    Page,
    bucket,
    error_text,
    fail,
    md_text,
    readable_errors,
    strip_value,
)
from workbench.apps.tabs import (
    anomalies,
    atlas,
    attention,
    batches,
    code,
    compare,
    contrast,
    experts,
    kv_cache,
    kv_whatif,
    record,
    replay,
    run_view,
    runs,
    search,
    sql,
)
from workbench.apps.tabs.runs import refresh_runs, run_choices, runs_table, runs_table_empty  # noqa: F401 - re-exported
from workbench.data import query
from workbench.data.store import Store
from workbench.views.session import Session

CSS = """
#token-strip .token { cursor: pointer; }
.wb-message { font-size: 0.95em; }
"""
#: the tabs, in page order
TABS = [runs, record, run_view, attention, experts, kv_cache, kv_whatif, code, anomalies, compare, replay, sql,
        batches, atlas, contrast, search]


def export_report(app: AppContext, run_id: str | None):
    """The picked run's HTML report as a file to download, and a message."""
    if not run_id:
        return gr.File(visible=False), "Choose a run first."
    out = Path(tempfile.mkdtemp(prefix="workbench-report-"))  # a folder: the report names its file (sanitised)
    try:
        path = app.run(run_id).report(out, "html")
    except gr.Error:
        raise
    except Exception as e:
        return gr.File(visible=False), fail("Report export", e)
    return gr.File(value=str(path), visible=True), f"Report written: {md_text(Path(path).name)}"


def read_tokens(app: AppContext, run_id: str):
    """API: a run's tokens (pos, text, confidence, ...) as a table. Reads the store only (no ``Run``, no model):
    the cheapest read there is, for clients that poll."""
    if not run_id:
        raise gr.Error("choose a run first (Runs tab or the run picker)")
    try:
        query.run_row(app.store, run_id)
    except query.RunNotFound as e:
        raise gr.Error(error_text(e)) from None
    return query.tokens(app.store, run_id).select("pos", "token_id", "text", "is_prompt", "prob", "confidence",
                                                  "entropy", "rank")


def after_record(app: AppContext, s: Session, rid: str | None, current: str | None, ref: str | None, a: str | None,
                 b: str | None):
    """Every run list after a recording: the new run is listed and becomes the picked one."""
    return refresh_runs(app, s, current, ref, a, b, select=rid or None)


def _wire_pick_chain(page: Page) -> None:
    """A pick runs every tab's views of the run, one after the other; outputs named by string are components
    another tab made (``page.ui``)."""
    chain = None
    for fn, inputs, outputs in page.on_pick:
        outs = [page.ui[o] if isinstance(o, str) else o for o in (outputs if isinstance(outputs, list) else [outputs])]
        chain = (page.run_pick.change if chain is None else chain.then)(fn, inputs, outs, **LAST)


def build_app(db: str | Path | Store | None = None, model=None, tokenizer=None) -> gr.Blocks:
    """The workbench as a ``gr.Blocks`` app over the database ``db``.

    Args:
        db: database path or ``Store`` (default ``$WORKBENCH_DB`` or ``data/workbench.duckdb``).
        model: a module (or checkpoint folder) the Record tab uses by default; None: the bundled demo.
        tokenizer: its tokenizer (None: the checkpoint's or the bundled one).
    """
    store = db if isinstance(db, Store) else Store(db)
    app = AppContext(store, model, tokenizer)
    with gr.Blocks(title="MoE workbench", analytics_enabled=False) as blocks:
        page_head = gr.Markdown(run_view.page_header(None, store.path.name, store.read_only), elem_id="page-head")
        with gr.Row():
            run_pick = gr.Dropdown(label="Run", choices=[], value=None, scale=4,  # choices: at page load
                                   elem_id="run-picker", allow_custom_value=True)
            refresh_btn = gr.Button("↻ Refresh", scale=0, min_width=100)
            report_btn = gr.Button("Export report", scale=0, min_width=140, elem_id="export-report")
            report_file = gr.File(label="Report", scale=2, visible=False, interactive=False, height=80)
        report_msg = gr.Markdown(elem_classes=["wb-message"])
        state = gr.State(app.session())  # each browser session gets its own (a deep copy: a fresh Session)
        with gr.Tabs(selected="runs") as tabs:
            page = Page(app, state, run_pick, tabs, ui={"page_head": page_head})
            for tab in TABS:
                tab.build(page)
        _wire_pick_chain(page)
        runs.wire_lists(page, blocks, refresh_btn)
        lists = [page.ui["runs_df"], run_pick, page.ui["rc_ref"], page.ui["cmp_a"], page.ui["cmp_b"]]
        page.ui["record_event"].then(partial(after_record, app), [state, page.ui["record_id"], *lists[1:]], lists,
                                     api_name=False)
        report_btn.click(partial(export_report, app), run_pick, [report_file, report_msg], api_name=False)
        # API only: read a run back (gradio_client)
        api_run = gr.Textbox(visible=False)
        api_tokens = gr.Dataframe(visible=False)
        api_run.submit(partial(read_tokens, app), api_run, api_tokens, api_name="tokens", **READ)
    for block_fn in blocks.fns.values():  # a failed database read: its message, not a bare "Error" badge
        block_fn.fn = readable_errors(block_fn.fn)
    return blocks


def launch(db: str | Path | Store | None = None, host: str = "127.0.0.1", port: int | None = 7860,
           auth: str | None = None, **kw) -> None:
    """Serve the app (blocking). ``auth`` is ``USER:PASS``."""
    creds = None
    if auth:
        user, sep, password = auth.partition(":")
        if not sep or not user or not password:
            raise ValueError("--auth must be USER:PASS (both non-empty)")
        creds = (user, password)
    app = build_app(db)
    app.queue(default_concurrency_limit=2).launch(server_name=host, server_port=port, auth=creds, css=CSS,
                                                  footer_links=["api"], **kw)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="MoE workbench UI")
    ap.add_argument("--db", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--auth", default=None)
    a = ap.parse_args()
    launch(a.db, a.host, a.port, a.auth)
