"""The Code tab: does the run's text parse as Python, each token's Python class, confidence by class."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.analysis.codeview import code_view, run_compile_check, token_classes
from workbench.apps.shared import READ, AppContext, Page, empty_table, fail, frames_of, table
from workbench.views.markup import defuse, md_plain
from workbench.views.session import Session

CODE_COLOR_MAP = {"keyword": "#c77dff", "name": "#a2d2ff", "number": "#ffb703", "string": "#95d5b2",
                  "operator": "#dee2e6", "comment": "#adb5bd", "newline": "#f8f9fa", "indent": "#f8f9fa",
                  "whitespace": "#f8f9fa", "error": "#e63946", "syntax error here": "#e63946"}
COLUMNS = ["class", "tokens", "mean_confidence", "median_confidence", "mean_entropy", "low_confidence_share"]


def code_strip(classes: pl.DataFrame, error_pos: int | None = None) -> list[tuple[str, str | None]]:
    """HighlightedText value: one (text, Python token class) per model token; the token of the first syntax
    error is marked instead."""
    return [(t if t else "\u2205", "syntax error here" if p == error_pos else c)
            for p, t, c in zip(classes["pos"].to_list(), classes["text"].to_list(), classes["class"].to_list())]


def compile_message(check: dict, text: str | None = None) -> str:
    """The compile check in one escaped line of Markdown."""
    if check["ok"]:
        return f"✅ The run's text parses as Python ({check['lines']} lines)."
    what = "Incomplete (the text ends mid-statement)" if check["status"] == "incomplete" else "❌ Syntax error"
    where = f"line {check['line']}, col {check['col']}"
    if check.get("pos") is not None:
        where += f", token pos {check['pos']}" + (f" “{md_plain(text)}”" if text else "")
    return (f"{'⚠️ ' if check['status'] == 'incomplete' else ''}{what}: {md_plain(check['message'])} at {where}; "
            f"the first {check['ok_lines']} of {check['lines']} lines parse.")


def code_views(app: AppContext, s: Session, run_id: str | None, generated_only: bool = True):
    """Compile check, each token's Python class, confidence by class (``workbench.analysis.codeview``)."""
    f = frames_of(s, run_id)
    if f is None:
        return "Choose a run.", [], empty_table(COLUMNS), None
    t = f.tokens
    try:
        classes, check, by_class = token_classes(t), run_compile_check(t), code_view(t, bool(generated_only))
    except Exception as e:
        return defuse(fail("Code view", e)), [], empty_table(COLUMNS), None
    text = None
    if check.get("pos") is not None:
        row = classes.filter(pl.col("pos") == check["pos"])
        text = row["text"][0] if row.height else None
    shown = by_class.with_columns(pl.col(pl.Float64).round(4))  # display only
    return (compile_message(check, text), code_strip(classes, check.get("pos")), shown,
            f.fig_code_view(generated_only=bool(generated_only)))


def build(session: Page) -> None:
    with gr.Tab("Code", id="code") as tab:
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="code-msg")
        strip = gr.HighlightedText(label="Tokens by Python token class (tokenize); red: the first syntax error",
                                   color_map=CODE_COLOR_MAP, show_legend=True, show_inline_category=False,
                                   elem_id="code-strip")
        gen = gr.Checkbox(label="generated tokens only", value=True, elem_id="code-generated")
        with gr.Row():
            df = table(COLUMNS, "Confidence by token class", elem_id="code-table")
            plot = gr.Plot(label="Confidence and entropy by class", elem_id="code-plot")
    fn = partial(code_views, session.app)
    inputs, outputs = [session.state, session.run_pick, gen], [msg, strip, df, plot]
    session.on_pick.append((fn, inputs, outputs))
    tab.select(fn, inputs, outputs, api_name=False, **READ)
    gen.input(fn, inputs, outputs, api_name=False)
