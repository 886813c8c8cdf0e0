"""The Anomalies tab: the findings (the diagnosis, one per component or token span) and the anomaly rows under
the filters; a click on a row opens its token in the Run view."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.analysis.anomalies import select as select_anomalies
from workbench.analysis.anomalies import what_was_tested
from workbench.apps.shared import AppContext, Page, empty_table, fail, table
from workbench.views.markup import defuse, md_plain
from workbench.views.session import Session

FINDING_COLUMNS = ["rank", "severity", "explanation", "component", "layer", "head", "expert", "pos_start", "pos_end",
                   "score"]
ANOMALY_COLUMNS = ["anomaly_id", "kind", "severity", "pos", "layer", "head", "expert", "score", "threshold", "explanation"]


def anomaly_table(app: AppContext, s: Session, run_id: str | None, recompute: bool = False,
                  severity: str = "warning", kinds: list[str] | None = None, layers: str = ""):
    """The findings and the anomaly rows under the filters, a message, and the kinds the run has."""
    none = empty_table(FINDING_COLUMNS), empty_table(ANOMALY_COLUMNS)
    if not run_id:
        return *none, "Choose a run.", gr.Dropdown()
    run = app.run(run_id)
    try:
        df = run.anomalies(recompute=bool(recompute))
        found = run.findings()
        wanted = [int(x) for x in str(layers or "").replace(",", " ").split()]
        rows = select_anomalies(df, kinds or None, None if severity in (None, "", "all") else severity, wanted)
    except ValueError as e:
        return *none, defuse(fail("Filter", e)), gr.Dropdown()
    except Exception as e:
        return *none, defuse(fail("Anomaly detection", e)), gr.Dropdown()
    shown = rows.with_columns(pl.col(pl.Float64).round(4))  # display only; the store keeps full precision
    fshown = found.select(*FINDING_COLUMNS[:-1], pl.col("score").round(2))
    msg = (f"{found.height} finding{'s' if found.height != 1 else ''}; {rows.height} of {df.height} anomaly rows "
           "shown (click a row to jump to its token).")
    if found.height == 0:  # what "nothing found" means: what the detectors tested
        try:
            msg += f"  \nTested: {md_plain(what_was_tested(app.store, run_id))}"
        except Exception as e:  # noqa: BLE001 - the line must never fail the tab
            msg += f"  \n{defuse(fail('What was tested', e))}"
    return fshown, shown, msg, gr.Dropdown(choices=sorted(set(df["kind"].to_list())), value=kinds or [])


def pick_anomaly(evt: gr.SelectData, df: pl.DataFrame | None):
    """A click on a finding or an anomaly row: its token in the Run view."""
    row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
    col = "pos" if df is not None and "pos" in df.columns else "pos_start"
    if df is None or col not in df.columns or row >= df.height or df[col][row] is None:
        return gr.Number(), gr.Tabs()
    return gr.Number(value=int(df[col][row])), gr.Tabs(selected="runview")


def build(session: Page) -> None:
    with gr.Tab("Anomalies", id="anomalies") as tab:
        with gr.Row():
            btn = gr.Button("Detect / refresh")
            re_box = gr.Checkbox(label="recompute", value=False)
        with gr.Row():
            sev = gr.Dropdown(label="severity at least", choices=["all", "warning", "critical"], value="warning",
                              elem_id="anom-severity")
            kinds = gr.Dropdown(label="kinds", choices=[], multiselect=True, elem_id="anom-kinds")
            layers = gr.Textbox(label="layers (e.g. 2 3; empty: all)", value="", elem_id="anom-layers")
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="anom-msg")
        find_df = table(FINDING_COLUMNS, "Findings: the diagnosis, one per component or token span",
                        elem_id="findings-table")
        anom_df = table(ANOMALY_COLUMNS, "Anomalies (click to jump to the token)", elem_id="anomalies-table")
    fn = partial(anomaly_table, session.app)
    inputs = [session.state, session.run_pick, re_box, sev, kinds, layers]
    outputs = [find_df, anom_df, msg, kinds]
    for event in (btn.click, tab.select, sev.input, kinds.input, layers.submit):  # user edits only: no loop
        event(fn, inputs, outputs, api_name=False)
    for t in (anom_df, find_df):
        t.select(pick_anomaly, t, [session.ui["pos"], session.tabs], api_name=False)
