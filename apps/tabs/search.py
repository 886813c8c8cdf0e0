"""The Search tab: runs and positions whose decoded text contains some text (it may span tokens)."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.apps.shared import READ, AppContext, Page, empty_table, table
from workbench.data import query
from workbench.views.markup import md_plain

COLUMNS = ["run_id", "pos", "end_pos", "context"]


def search_runs(app: AppContext, text: str, ignore_case: bool):
    """Runs and positions whose decoded text contains ``text``."""
    if not text:
        return empty_table(COLUMNS), "Type some text to look for."
    df = query.search(app.store, text, ignore_case=bool(ignore_case), limit=200)
    shown = df.select("run_id", "pos", "end_pos", pl.col("context").str.replace_all("\n", " \u21b5 "))
    many = "es" if df.height != 1 else ""
    return shown, f"{df.height} match{many} of “{md_plain(text)}” (click one to open its run)."


def pick_run_row(evt: gr.SelectData, df: pl.DataFrame | None):
    """A row of a table with a run_id column: open that run."""
    if df is None or evt.index is None or "run_id" not in df.columns or evt.index[0] >= df.height:
        return gr.Dropdown(), gr.Tabs()
    return gr.Dropdown(value=str(df["run_id"][evt.index[0]])), gr.Tabs(selected="runview")


def build(session: Page) -> None:
    with gr.Tab("Search", id="search"):
        with gr.Row():
            text = gr.Textbox(label="Text in the runs' decoded text (may span tokens)", scale=4, elem_id="search-text")
            case = gr.Checkbox(label="ignore case", value=False, scale=0, min_width=120)
            btn = gr.Button("Search", scale=0, min_width=100, elem_id="search-button")
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="search-msg")
        df = table(COLUMNS, "Matches", elem_id="search-results", datatype="str")
    for event in (btn.click, text.submit):
        event(partial(search_runs, session.app), [text, case], [df, msg], api_name=False, **READ)
    df.select(pick_run_row, df, [session.run_pick, session.tabs], api_name=False)
