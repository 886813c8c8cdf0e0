"""The Batches tab: a prompt set's runs, its least confident tokens, expert load, its imbalance (MaxVio), an
expert-parallel placement what-if and per-head entropy over all of its runs (``workbench.Batch``)."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.analysis.placement import MAXVIO_CHUNK
from workbench.apps.shared import READ, AppContext, Page, empty_table, table
from workbench.apps.tabs.experts import MAXVIO_COLUMNS
from workbench.apps.tabs.search import pick_run_row
from workbench.data import query
from workbench.run import Batch
from workbench.views.figures import batch_entropy_figure, batch_load_figure, empty_figure
from workbench.views.markup import md_plain

RUN_COLUMNS = ["run_id", "batch_item", "status", "prompt", "n_tokens", "error"]
LOW_COLUMNS = ["run_id", "batch_item", "pos", "text", "confidence", "rank"]


def batch_choices(app: AppContext, current: str | None):
    """The picker, read now: (label, batch_id), newest first."""
    df = query.batches(app.store)
    choices = [(f"{r['batch_id']} · {r['complete']}/{r['runs']} complete · {str(r['started'])[:19]}", r["batch_id"])
               for r in df.iter_rows(named=True)]
    ids = [c[1] for c in choices]
    return gr.Dropdown(choices=choices, value=current if current in ids else (ids[0] if ids else None))


def batch_views(app: AppContext, batch_id: str | None):
    """A batch's runs, its least confident tokens, expert load and per-head entropy over all its runs."""
    if not batch_id:
        return (empty_table(RUN_COLUMNS), empty_table(LOW_COLUMNS), None, None,
                "No batch yet: `workbench record --prompts FILE` records one.")
    b = Batch(app.store, batch_id)
    runs = b.runs()
    low = b.low_confidence(20)
    st = ", ".join(f"{n} {md_plain(k)}" for k, n in b.status().items())
    return (runs.select("run_id", "batch_item", "status", pl.col("prompt").str.slice(0, 80), "n_tokens", "error"),
            low.select("run_id", "batch_item", "pos", "text", pl.col("confidence").round(4), "rank"),
            batch_load_figure(b.expert_load(), batch_id), batch_entropy_figure(b.head_entropy(), batch_id),
            f"Batch {md_plain(batch_id)}: {st}. Views over its complete runs.")


def batch_balance(app: AppContext, batch_id: str | None, devices: float, redundant: float):
    """The batch's MaxVio per MoE layer (``Batch.maxvio``), its note, and the placement what-if figure
    (``Batch.fig_placement``: contiguous vs EPLB on ``devices`` devices with ``redundant`` replicas)."""
    if not batch_id:
        return empty_table(MAXVIO_COLUMNS), "", None
    b = Batch(app.store, batch_id)
    try:
        vio = b.maxvio().with_columns(pl.col("maxvio", "maxvio_chunk_mean", "maxvio_chunk_max").round(3))
    except ValueError as e:  # no complete runs, or a dense model
        return empty_table(MAXVIO_COLUMNS), md_plain(str(e)), None
    note = (f"**MaxVio** (DeepSeek, arXiv 2408.15664) = the busiest expert's load / the mean load - 1 per MoE "
            f"layer over the whole batch (0: balanced; 1: the busiest expert gets twice its share); chunk columns: "
            f"over consecutive chunks of {MAXVIO_CHUNK} tokens. The placement figure replays the batch's routing "
            f"with experts on devices: contiguous (expert e on device e // (E / G)) against EPLB (replicas of the "
            f"hottest experts, balanced packing).")
    try:
        fig = b.fig_placement(int(devices or 0), int(redundant or 0))
    except ValueError as e:  # devices that do not divide experts + redundant
        fig = empty_figure(str(e))
    return vio, note, fig


def build(session: Page) -> None:
    with gr.Tab("Batches", id="batches") as tab:
        with gr.Row():
            pick = gr.Dropdown(label="Batch (a prompt set: workbench record --prompts)", choices=[],
                               elem_id="batch-picker", scale=4)
            btn = gr.Button("↻", scale=0, min_width=60)
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="batch-msg")
        runs = table(RUN_COLUMNS, "Runs (click one to open it)", elem_id="batch-runs", datatype="str")
        with gr.Row():
            load = gr.Plot(label="Expert load over the batch", elem_id="batch-load")
            ent = gr.Plot(label="Per-head entropy across runs", elem_id="batch-entropy")
        bal_note = gr.Markdown(latex_delimiters=[], elem_id="batch-maxvio-note")
        with gr.Row():
            vio = table(MAXVIO_COLUMNS, "Load imbalance per MoE layer (MaxVio)", elem_id="batch-maxvio")
            with gr.Column():
                with gr.Row():
                    devices = gr.Number(value=4, precision=0, minimum=1, label="devices", elem_id="batch-devices")
                    redundant = gr.Number(value=0, precision=0, minimum=0, label="redundant experts",
                                          elem_id="batch-redundant")
                place = gr.Plot(label="Placement what-if: contiguous vs EPLB", elem_id="batch-placement")
        low = table(LOW_COLUMNS, "Least confident tokens of the batch (click one to open its run)",
                    elem_id="batch-low", datatype="str")
    app = session.app
    views, choices = partial(batch_views, app), partial(batch_choices, app)
    out = [runs, low, load, ent, msg]
    balance, bal_in, bal_out = partial(batch_balance, app), [pick, devices, redundant], [vio, bal_note, place]
    tab.select(choices, pick, pick, api_name=False, **READ).then(views, pick, out, api_name=False).then(
        balance, bal_in, bal_out, api_name=False)
    btn.click(choices, pick, pick, api_name=False, **READ)
    pick.input(views, pick, out, api_name=False).then(balance, bal_in, bal_out, api_name=False)
    for c in (devices, redundant):
        c.change(balance, bal_in, bal_out, api_name=False)
    for t in (runs, low):
        t.select(pick_run_row, t, [session.run_pick, session.tabs], api_name=False)
