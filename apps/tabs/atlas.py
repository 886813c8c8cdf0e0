"""The Atlas tab: a batch's expert atlas (``workbench.Batch.atlas``): a layer x expert heat map of load share, and
the card of the expert picked beside it: its label, top contexts (the routed token marked), token classes,
top tokens and the experts chosen with it.

Token text is untrusted: the card is HTML with every stored string passed through ``html.escape``, the heat
map's hover text through ``plotly_text``."""
from __future__ import annotations

import html
import json
from functools import partial

import gradio as gr
import plotly.graph_objects as go
import polars as pl

from workbench.apps.shared import READ, AppContext, Page
from workbench.apps.tabs.batches import batch_choices
from workbench.data import query
from workbench.run import Batch
from workbench.views.markup import md_plain, plotly_text

CARD_CSS = ("<style>#atlas-card .ctx{white-space:pre-wrap;font-family:monospace;margin:2px 0;padding:2px 4px;"
            "background:#f6f6f6} #atlas-card mark{background:#ffd166;outline:1px solid #e09f3e} "
            "#atlas-card .bar{display:inline-block;height:0.8em;background:#4c78a8;vertical-align:middle}</style>")
EMPTY = "<div class='atlas-empty'>Pick a batch and an expert.</div>"


def grid_figure(df: pl.DataFrame, batch_id: str | None) -> go.Figure:
    """Heat map of load share, MoE layers x experts; the hover names each expert's label (escaped)."""
    layers = sorted(set(df["layer"].to_list()))
    experts = sorted(set(df["expert"].to_list()))
    cell = {(r["layer"], r["expert"]): r for r in df.iter_rows(named=True)}
    z = [[cell[(lay, e)]["load_share"] if (lay, e) in cell else None for e in experts] for lay in layers]
    text = [[plotly_text(cell[(lay, e)]["label"]) + ("<br>⚠ super expert" if cell[(lay, e)].get("super") else "")
             if (lay, e) in cell else "" for e in experts] for lay in layers]
    fig = go.Figure(go.Heatmap(z=z, x=[str(e) for e in experts], y=[f"layer {lay}" for lay in layers], text=text,
                               colorscale="Viridis", colorbar={"title": "load share"},
                               hovertemplate="%{y}, expert %{x}<br>load share %{z:.1%}<br>%{text}<extra></extra>"))
    fig.update_layout(title=f"Load share per expert: batch {plotly_text(batch_id or '')}",
                      height=120 + 40 * len(layers), xaxis_title="expert", yaxis={"autorange": "reversed"},
                      margin={"l": 70, "r": 20, "t": 50, "b": 40})
    return fig


def _e(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _bars(names: list, shares: list, prefix: str = "") -> str:
    return "".join(f"<div>{_e(prefix)}{_e(n)} <span class='bar' style='width:{max(1, round(160 * s))}px'></span> "
                   f"{s:.0%}</div>" for n, s in zip(names, shares))


def _super(row: dict) -> str:
    """The super-expert line of a card: the flag (``workbench.analysis.atlas``: its largest activation over 10x
    the layer's clean extreme) or the largest activation; nothing for runs recorded without ``expert_extremes``."""
    act = row.get("max_act")
    if act is None:
        return ""
    if row.get("super"):
        return (f"<p class='atlas-super'><b>⚠ Super expert</b>: largest activation inside it {act:.3g}, over "
                "10x the layer's clean extreme (massive activations that attention sinks may depend on: "
                "<code>Run.super_experts()</code> measures it)</p>")
    return f"<p class='atlas-act'>largest activation inside it {act:.3g} (not a super expert)</p>"


def card_html(row: dict | None) -> str:
    """One expert's card as HTML: every stored string escaped."""
    if row is None:
        return EMPTY
    head = (f"<h3>layer {int(row['layer'])}, expert {int(row['expert'])}: {row['load_share']:.1%} of the layer's "
            f"routed slots</h3><p class='atlas-label'><b>{_e(row['label'])}</b></p>"
            f"<p>{int(row['slots'])} slots in {int(row['runs'])} runs"
            + (f", mean gate weight {row['mean_weight']:.3f}" if row["mean_weight"] is not None else "") + "</p>"
            + _super(row))
    if not row["slots"]:
        return CARD_CSS + f"<div class='atlas-card'>{head}</div>"
    ctx = "".join(f"<div class='ctx'>{_e(c['before'])}<mark>{_e(c['token'])}</mark>{_e(c['after'])}</div>"
                  f"<small>weight {c['weight']:.3f} · {_e(c.get('class'))} · run {_e(c['run_id'])} "
                  f"pos {int(c['pos'])}</small>" for c in json.loads(row["contexts"] or "[]"))
    toks = ", ".join(f"<code>{_e(t)}</code> {w:.2f}" for t, w in zip(row["top_tokens"], row["token_weights"]))
    co = _bars(row["co_experts"], row["co_shares"], "expert ") or "none"
    return (CARD_CSS + f"<div class='atlas-card'>{head}<h4>Top contexts (highest gate weight)</h4>{ctx}"
            f"<h4>Token classes</h4>{_bars(row['top_classes'], row['class_shares'])}"
            f"<h4>Top tokens (summed gate weight)</h4><p>{toks}</p>"
            f"<h4>Chosen with (same token, same layer)</h4>{co}</div>")


def _atlas(app: AppContext, batch_id: str) -> pl.DataFrame:
    return Batch(app.store, batch_id).atlas()


def atlas_card(app: AppContext, batch_id: str | None, layer, expert) -> str:
    """The card of ``layer`` x ``expert`` in the batch's atlas (stored after the first look)."""
    if not batch_id or layer is None or expert is None:
        return EMPTY
    df = _atlas(app, batch_id).filter((pl.col("layer") == int(layer)) & (pl.col("expert") == int(expert)))
    return card_html(df.row(0, named=True) if df.height else None)


def atlas_views(app: AppContext, batch_id: str | None, layer=None, expert=None):
    """The batch's heat map, the layer and expert pickers (the busiest expert of the first layer by default) and
    its card, and a message."""
    none = gr.Dropdown(choices=[], value=None)
    if not batch_id:
        return None, none, none, EMPTY, "No batch yet: `workbench record --prompts FILE` records one."
    try:
        df = _atlas(app, batch_id)
    except query.RunNotFound as e:
        return None, none, none, EMPTY, md_plain(e)
    if not df.height:
        return None, none, none, EMPTY, f"Batch {md_plain(batch_id)} has no routing (a dense model)."
    layers = sorted(set(df["layer"].to_list()))
    layer = int(layer) if layer is not None and int(layer) in layers else layers[0]
    here = df.filter(pl.col("layer") == layer)
    experts = here["expert"].to_list()
    if expert is None or int(expert) not in experts:
        expert = int(here.sort(["load_share", "expert"], descending=[True, False])["expert"][0])
    row = here.filter(pl.col("expert") == int(expert)).row(0, named=True)
    n_runs = query.batch_runs(app.store, batch_id).filter(pl.col("status") == "complete").height
    return (grid_figure(df, batch_id), gr.Dropdown(choices=layers, value=layer),
            gr.Dropdown(choices=[(f"{e}: {lab}", e) for e, lab in zip(experts, here["label"].to_list())],
                        value=int(expert)),
            card_html(row), f"Atlas of batch {md_plain(batch_id)}: {n_runs} complete runs, {len(layers)} MoE layers.")


def build(session: Page) -> None:
    with gr.Tab("Atlas", id="atlas") as tab:
        with gr.Row():
            pick = gr.Dropdown(label="Batch (a prompt set: workbench record --prompts)", choices=[],
                               elem_id="atlas-batch", scale=4)
            btn = gr.Button("↻", scale=0, min_width=60)
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="atlas-msg")
        grid = gr.Plot(label="Load share per MoE layer x expert", elem_id="atlas-grid")
        with gr.Row():
            layer = gr.Dropdown(label="MoE layer", choices=[], elem_id="atlas-layer", scale=1)
            expert = gr.Dropdown(label="Expert", choices=[], elem_id="atlas-expert", scale=3)
        card = gr.HTML(EMPTY, elem_id="atlas-card")
    app = session.app
    views, choices, one = partial(atlas_views, app), partial(batch_choices, app), partial(atlas_card, app)
    out = [grid, layer, expert, card, msg]
    tab.select(choices, pick, pick, api_name=False, **READ).then(views, pick, out, api_name=False)
    btn.click(choices, pick, pick, api_name=False, **READ)
    pick.input(views, pick, out, api_name=False)
    layer.input(views, [pick, layer], out, api_name=False)
    expert.input(one, [pick, layer, expert], card, api_name=False)
