"""The Experts tab: load per expert per MoE layer, its imbalance (MaxVio), co-activation and load along the run in
one layer."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.analysis.placement import MAXVIO_CHUNK, maxvio, routing_loads
from workbench.apps.shared import AppContext, Page, empty_table, frames_of, table
from workbench.views.session import Session


def expert_views(app: AppContext, s: Session, run_id: str | None, layer: int | None, window: float):
    """Expert load, co-activation and load along the run in ``layer`` (default: the first MoE layer), and the
    layer picker's choices (the layers with routing rows)."""
    f = frames_of(s, run_id)
    if f is None:
        return None, None, None, gr.Dropdown(choices=[], value=None)
    layers = f.moe_layers()
    layer = layer if layer in layers else (layers[0] if layers else None)
    return (f.fig_expert_load(), f.fig_coactivation(layer), f.fig_load_along(layer, int(window)),
            gr.Dropdown(choices=layers, value=layer))


MAXVIO_COLUMNS = ["layer", "maxvio", "maxvio_chunk_mean", "maxvio_chunk_max", "chunks", "slots"]
MAXVIO_NOTE = (f"**MaxVio** (DeepSeek, arXiv 2408.15664) = the busiest expert's load / the mean load over all experts "
               f"- 1, per MoE layer: 0 is perfectly balanced, 1 means the busiest expert gets twice its fair share. "
               f"Chunk columns: the mean and max over consecutive chunks of {MAXVIO_CHUNK} positions.")


def maxvio_view(app: AppContext, s: Session, run_id: str | None):
    """The run's MaxVio per MoE layer (``Run.maxvio``) from the routing frame the other views read, and its note."""
    f = frames_of(s, run_id)
    n = f.summary.n_routed_experts if f is not None else 0
    if f is None or not n or f.routing.height == 0:
        return empty_table(MAXVIO_COLUMNS), "" if f is None else "No routed experts in this run: no MaxVio."
    df = maxvio(routing_loads(f.routing, MAXVIO_CHUNK), n)
    return df.with_columns(pl.col("maxvio", "maxvio_chunk_mean", "maxvio_chunk_max").round(3)), MAXVIO_NOTE


def build(session: Page) -> None:
    with gr.Tab("Experts", id="experts"):
        load_plot = gr.Plot(label="Load per expert per layer", elem_id="load-plot")
        vio_note = gr.Markdown(latex_delimiters=[], elem_id="maxvio-note")
        vio = table(MAXVIO_COLUMNS, "Load imbalance per MoE layer (MaxVio)", elem_id="maxvio-table")
        with gr.Row():
            exp_layer = gr.Dropdown(label="MoE layer", choices=[], elem_id="expert-layer")
            exp_window = gr.Slider(2, 128, value=16, step=2, label="window (positions)")
        with gr.Row():
            coact_plot = gr.Plot(label="Co-activation", elem_id="coact-plot")
            along_load_plot = gr.Plot(label="Load along the run", elem_id="load-along-plot")
    fn = partial(expert_views, session.app)
    inputs = [session.state, session.run_pick, exp_layer, exp_window]
    outputs = [load_plot, coact_plot, along_load_plot, exp_layer]
    session.on_pick.append((fn, inputs, outputs))
    session.on_pick.append((partial(maxvio_view, session.app), [session.state, session.run_pick], [vio, vio_note]))
    for c in (exp_layer, exp_window):
        c.input(fn, inputs, outputs, api_name=False)
