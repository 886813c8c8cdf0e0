"""The Attention tab: mean entropy per layer x head, and entropy along the run for chosen heads."""
from __future__ import annotations

from functools import partial

import gradio as gr

from workbench.apps.shared import AppContext, Page, frames_of
from workbench.views.session import Session


def head_choices(n_layers: int, n_heads: int) -> list[str]:
    return [f"layer {l}, head {h}" for l in range(n_layers) for h in range(n_heads)]


def attention_views(app: AppContext, s: Session, run_id: str | None, heads: list[str] | None, normalised: bool):
    """The mean entropy heat map, entropy along positions for the chosen heads (none: the 4 most diffuse), and
    the head picker's choices for this run's model."""
    f = frames_of(s, run_id)
    if f is None:
        return None, None, gr.CheckboxGroup(choices=[], value=[])
    ms = f.summary
    choices = head_choices(ms.n_layers, ms.n_heads)
    chosen = [c for c in (heads or []) if c in choices]
    pairs = [(int(c.split(",")[0].split()[1]), int(c.split(",")[1].split()[1])) for c in chosen]
    return (f.fig_head_entropy(), f.fig_entropy_along(heads=pairs or None, normalised=bool(normalised)),
            gr.CheckboxGroup(choices=choices, value=chosen))


def build(session: Page) -> None:
    with gr.Tab("Attention", id="attention"):
        head_plot = gr.Plot(label="Mean entropy, layer x head", elem_id="head-plot")
        heads_pick = gr.CheckboxGroup(label="Heads to follow along the run (none: the 4 most diffuse)",
                                      elem_id="heads-pick")
        norm_box = gr.Checkbox(label="normalised entropy (/ log keys)", value=False)
        along_plot = gr.Plot(label="Entropy along positions", elem_id="along-plot")
    fn = partial(attention_views, session.app)
    inputs = [session.state, session.run_pick, heads_pick, norm_box]
    outputs = [head_plot, along_plot, heads_pick]
    session.on_pick.append((fn, inputs, outputs))
    heads_pick.input(fn, inputs, outputs, api_name=False)
    norm_box.change(fn, inputs, outputs, api_name=False)
