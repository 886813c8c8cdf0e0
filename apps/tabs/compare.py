"""The Compare tab: two runs aligned by position (``workbench.analysis.diff``): a summary table and four plots."""
from __future__ import annotations

import json
from functools import partial

import gradio as gr
import polars as pl

from workbench.analysis.diff import diff_runs
from workbench.apps.shared import AppContext, Page, empty_table, fail, table
from workbench.views.markup import defuse, md_plain

COLUMNS = ["what", "value"]
FIGURES = [("confidence", "Confidence of both runs along positions"), ("delta", "Change in logprob and confidence"),
           ("heads", "Change in mean entropy, layer x head"), ("routing", "Share of routing changed per layer")]


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return "" if v is None else str(v)


def summary_table(summary: dict) -> pl.DataFrame:
    """The diff's summary as rows (what, value): nested values one row per key (``routing_change_share.3``)."""
    rows = []
    for k, v in summary.items():
        if isinstance(v, dict) and v and all(not isinstance(x, (dict, list)) for x in v.values()):
            rows += [(f"{k}.{kk}", _cell(vv)) for kk, vv in v.items()]
        else:
            rows.append((k, _cell(v)))
    return pl.DataFrame(rows, schema={"what": pl.String, "value": pl.String}, orient="row")


def compare(app: AppContext, a: str | None, b: str | None):
    """The summary table, a message (a warning when the prompts differ) and the four figures."""
    if not a or not b:
        return empty_table(COLUMNS), "Choose two runs.", None, None, None, None
    if a == b:
        return empty_table(COLUMNS), "⚠️ Run A and run B are the same run: choose two different runs.", None, None, \
            None, None
    try:
        d = diff_runs(app.store, a, b)
        figs = d.figures()
    except Exception as e:
        return empty_table(COLUMNS), defuse(fail("Comparison", e)), None, None, None, None
    msg = f"Run B {md_plain(b)} against run A {md_plain(a)}."
    if not d.summary.get("same_prompt", True):
        msg += ("  \n⚠️ The runs have different prompts: positions hold different tokens, so every difference "
                "mixes the change you made with the change of text.")
    return (summary_table(d.summary), msg, *[figs.get(k) for k, _ in FIGURES])


def build(session: Page) -> None:
    with gr.Tab("Compare", id="compare") as tab:
        with gr.Row():
            a = gr.Dropdown(label="Run A", choices=[], elem_id="compare-a")
            b = gr.Dropdown(label="Run B", choices=[], elem_id="compare-b")
            btn = gr.Button("Compare", elem_id="compare-button")
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="compare-msg")
        summary = table(COLUMNS, "Summary", elem_id="compare-summary", datatype="str")
        plots = []
        for i in (0, 2):
            with gr.Row():
                plots += [gr.Plot(label=FIGURES[j][1], elem_id=f"compare-{FIGURES[j][0]}") for j in (i, i + 1)]
    session.ui.update(cmp_a=a, cmp_b=b, cmp_tab=tab)
    session.on_pick.append((lambda r: r, session.run_pick, a))  # the picked run becomes run A
    btn.click(partial(compare, session.app), [a, b], [summary, msg, *plots], api_name=False)
