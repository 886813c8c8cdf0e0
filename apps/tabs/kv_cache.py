"""The KV cache tab: bytes per layer over steps, attention received per cached token."""
from __future__ import annotations

from functools import partial

import gradio as gr

from workbench.apps.shared import AppContext, Page, error_text, frames_of
from workbench.views.session import Session


def kv_views(app: AppContext, s: Session, run_id: str | None, layer: str | None):
    """KV bytes per layer over steps; attention received per cached token in ``layer`` (empty: all layers)."""
    f = frames_of(s, run_id)
    if f is None:
        return None, None
    text = str(layer or "").strip()
    if text not in ("", "all") and not text.isdigit():
        raise gr.Error(error_text(f"layer must be a number or empty, not {text[:40]!r}"))
    try:
        received = f.fig_kv_received(None if text in ("", "all") else int(text))
    except ValueError as e:
        raise gr.Error(error_text(e)) from None
    return f.fig_kv_bytes(), received


def build(session: Page) -> None:
    with gr.Tab("KV cache", id="kv"):
        kv_plot = gr.Plot(label="Bytes per layer over steps", elem_id="kv-plot")
        kv_layer = gr.Textbox(label="Layer for attention received (empty: all layers)", value="")
        kv_recv_plot = gr.Plot(label="Attention received per cached token", elem_id="kv-received-plot")
    fn = partial(kv_views, session.app)
    inputs = [session.state, session.run_pick, kv_layer]
    session.on_pick.append((fn, inputs, [kv_plot, kv_recv_plot]))
    kv_layer.submit(fn, inputs, [kv_plot, kv_recv_plot], api_name=False)
