"""The Experts tab: load per expert per MoE layer, co-activation and load along the run in one layer."""
from __future__ import annotations

from functools import partial

import gradio as gr

from workbench.apps.shared import AppContext, Page, frames_of
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


def build(session: Page) -> None:
    with gr.Tab("Experts", id="experts"):
        load_plot = gr.Plot(label="Load per expert per layer", elem_id="load-plot")
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
    for c in (exp_layer, exp_window):
        c.input(fn, inputs, outputs, api_name=False)
