"""The Runs tab: every recorded run (click one to open it), and every run list of the page read anew."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.apps.shared import READ, AppContext, Page, short_model
from workbench.data import query
from workbench.data.store import Store
from workbench.views.session import Session

RUN_COLUMNS = ["run_id", "status", "created_at", "model", "prompt", "n_tokens", "n_anomalies"]
# the Runs table fits its box: fixed shares of its width, the prompt wraps in its own column
RUN_COLUMN_WIDTHS = ["13%", "9%", "15%", "12%", "35%", "8%", "8%"]


def runs_table_empty() -> pl.DataFrame:
    return pl.DataFrame({c: [] for c in RUN_COLUMNS}, schema={c: pl.String for c in RUN_COLUMNS})


def runs_table(store: Store, runs: pl.DataFrame | None = None) -> pl.DataFrame:
    """The Runs tab's table: selected columns of ``query.runs``, prompt shortened."""
    df = query.runs(store) if runs is None else runs
    if df.height == 0:
        return runs_table_empty()
    return df.select(
        "run_id", "status", pl.col("created_at").cast(pl.String).str.slice(0, 19),
        pl.col("model").map_elements(short_model, return_dtype=pl.String),
        pl.col("prompt").str.replace_all("\n", " \u21b5 ").str.slice(0, 80), "n_tokens", "n_anomalies")


def run_choices(store: Store, runs: pl.DataFrame | None = None) -> list[tuple[str, str]]:
    """(label, run_id) for the run pickers; the label is shown as plain text by the dropdown."""
    df = query.runs(store) if runs is None else runs
    return [(f"{r['run_id']} · {r['status']} · {r['n_tokens']} tok · {(r['prompt'] or '')[:40]!r}", r["run_id"])
            for r in df.iter_rows(named=True)]


def reference_choices(choices: list[tuple[str, str]], run_id: str | None) -> list[tuple[str, str]]:
    """The reference picker's runs: every run but the picked one (a run is no reference for itself)."""
    return [("none", "")] + [c for c in choices if c[1] != run_id]


def refresh_runs(app: AppContext, s: Session, current: str | None, ref: str | None = None, a: str | None = None,
                 b: str | None = None, select: str | None = None):
    """Every run list, read now (one query): the Runs table, the run picker (on ``select`` if it is a run, else
    ``current`` if it still exists, else the newest), the reference picker (without the picked run) and the two
    Compare pickers. The picked run's frames are read anew at its next view (it may have grown)."""
    runs = query.runs(app.store)
    choices = run_choices(app.store, runs)
    s.runs = choices
    ids = [v for _, v in choices]
    keep = lambda v: v if v in ids else None
    value = keep(select) or keep(current) or (ids[0] if ids else None)
    if s.frames is not None:
        s.frames.forget()
    ref = keep(ref) if ref != value else None
    return (runs_table(app.store, runs), gr.Dropdown(choices=choices, value=value),
            gr.Dropdown(choices=reference_choices(choices, value), value=ref or ""),
            gr.Dropdown(choices=choices, value=keep(a)), gr.Dropdown(choices=choices, value=keep(b)))


def pick_from_table(evt: gr.SelectData, table: pl.DataFrame | None):
    """A click on the Runs table opens that run in the Run view."""
    row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
    rid = evt.row_value[0] if getattr(evt, "row_value", None) else None
    if rid is None and table is not None and row is not None and row < table.height:
        rid = table["run_id"][row]
    return gr.Dropdown(value=rid), gr.Tabs(selected="runview")


def build(session: Page) -> None:
    with gr.Tab("Runs", id="runs") as tab:
        runs_df = gr.Dataframe(value=runs_table_empty(), interactive=False, type="polars",
                               label="Recorded runs (click a row to open it)", elem_id="runs-table", wrap=True,
                               column_widths=RUN_COLUMN_WIDTHS, datatype="str")
    session.ui.update(runs_df=runs_df, runs_tab=tab)
    runs_df.select(pick_from_table, runs_df, [session.run_pick, session.tabs], api_name=False)


def wire_lists(session: Page, app_block: gr.Blocks, refresh_btn: gr.Button) -> None:
    """Every run list is read when a page loads, on Refresh and when the Runs or Compare tab is opened (never
    when the app is built)."""
    ui = session.ui
    lists = [ui["runs_df"], session.run_pick, ui["rc_ref"], ui["cmp_a"], ui["cmp_b"]]
    inputs = [session.state, session.run_pick, ui["rc_ref"], ui["cmp_a"], ui["cmp_b"]]
    fn = partial(refresh_runs, session.app)
    for event in (refresh_btn.click, ui["runs_tab"].select, ui["cmp_tab"].select, app_block.load):
        event(fn, inputs, lists, api_name=False, **READ)
