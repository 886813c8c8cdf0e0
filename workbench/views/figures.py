"""Plotly figures of a run, shared by the Gradio app, the notebook (``Run.fig_*``) and the reports.

Every function is pure and takes frames: ``fig_<name>(<polars frames of the run>, <plain values>) -> go.Figure``.
No figure reads the store or loads a tokenizer: ``workbench.views.session.RunFrames`` reads a run's frames
once and offers each figure as ``frames.fig_<name>(...)`` with the arguments ``Run.fig_<name>`` always took.

Token text is untrusted (a model can emit ``<img src=x onerror=...>``) and plotly renders hover text,
labels and ticks as a subset of HTML, so every piece of token text goes through ``token_label``.

Views that follow the replay slider take ``step`` (and the run's ``tokens``): only what had been recorded by
the end of that generation step (0 = the prefill) is drawn.
"""
from __future__ import annotations

import html
from functools import lru_cache

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import polars as pl
from plotly.subplots import make_subplots

from workbench.analysis.codeview import code_view
from workbench.analysis.whatif import (
    PREDICTORS,
    SEED_HIT_RATES,
    SEED_LATENCY,
    decode_points,
    expert_cache_sweep,
    fit_latency,
    latency_model,
)
from workbench.data.summary import ModelSummary

CONFIDENCE_SCALE = "RdYlGn"  # red = unsure, green = confident; also used by the app's token strip
ENTROPY_SCALE = "Viridis"
WEIGHT_SCALE = "Blues"


# -- helpers -------------------------------------------------------------------------------------

def token_label(text: str | None, limit: int = 24) -> str:
    """Token text made safe and visible for plotly: HTML-escaped, whitespace shown, long text cut."""
    if text is None:
        return ""
    t = text.replace("\n", "\u21b5").replace("\t", "\u2192").replace("\r", "\u240d")
    if t.strip() == "":
        t = t.replace(" ", "\u00b7")  # a lone space would be an invisible tick
    if len(t) > limit:
        t = t[: limit - 1] + "\u2026"
    return html.escape(t, quote=False)  # quotes are harmless outside attributes; plotly shows &quot; raw


def empty_figure(title: str) -> go.Figure:
    """A figure without data whose title (and the note in its middle) says why."""
    fig = go.Figure()
    fig.update_layout(title=html.escape(title), xaxis={"visible": False}, yaxis={"visible": False},
                      annotations=[{"text": html.escape(title), "showarrow": False, "xref": "paper",
                                    "yref": "paper", "x": 0.5, "y": 0.5}], height=260)
    return fig


_empty = empty_figure


@lru_cache(maxsize=1)
def _template() -> go.layout.Template:
    return pio.templates["plotly_white"]


def _layout(fig: go.Figure, title: str, height: int = 380, **kw) -> go.Figure:
    # The registered template is valid already: assigned as plotly assigns its default template (without
    # validation). ``update_layout(template="plotly_white")`` validates and deep-copies it: ~13 ms a figure,
    # a third of a replay view's time.
    fig.layout._validate = False
    try:
        fig.layout.template = _template()
    finally:
        fig.layout._validate = fig._validate
    fig.update_layout(title=title, height=height, margin={"l": 60, "r": 20, "t": 50, "b": 50}, **kw)
    return fig


def no_routing_reason(summary: ModelSummary | None) -> str:
    """Why a run has (or may have) no routing rows, in words (never "dense" for a MoE model)."""
    if summary is not None and summary.unrouted_layers:
        return (f"routing not recorded: {summary.family} has MoE blocks in layers {summary.unrouted_layers} that "
                "no adapter recognises")
    if summary is not None and not summary.moe_layers:
        return f"no routing: {summary.family} is a dense model (no MoE layers)"
    return "no routing rows recorded for this run (the routing probe was off)"


def _n_experts(summary: ModelSummary | None, rows: pl.DataFrame, *cols: str) -> int:
    """Experts per MoE layer: the model summary's, else one more than the largest expert id in ``rows``."""
    if summary is not None and summary.n_routed_experts:
        return summary.n_routed_experts
    return int(max(rows[c].max() for c in cols or ("expert",))) + 1


def _max_pos_at(tokens: pl.DataFrame | None, step: int | None) -> int | None:
    """Last position recorded by the end of ``step`` (None: no limit)."""
    if step is None:
        return None
    if tokens is None:
        raise ValueError("a view at a replay step needs the run's tokens")
    t = tokens.filter(pl.col("step") <= step)
    return int(t["pos"].max()) if t.height else -1


def _max_fed_pos_at(tokens: pl.DataFrame | None, step: int | None) -> int | None:
    """Last position fed to the model by the end of ``step``: attention and routing rows exist up to it
    (the token a step produces is fed, and gets its rows, only at the next step)."""
    last = _max_pos_at(tokens, step)
    return None if last is None else last - 1


def _check_pos(tokens: pl.DataFrame, pos: int) -> dict:
    row = tokens.filter(pl.col("pos") == pos)
    if row.height == 0:
        n = tokens.height
        raise ValueError(f"no token at position {pos}; this run has positions 0..{n - 1}" if n else
                         "this run has no tokens recorded")
    return row.row(0, named=True)


def token_texts(ids: list[int], tokens: pl.DataFrame, tokenizer=None) -> list[str]:
    """Text of token ids: the ``tokenizer`` the caller passes, else texts the run's tokens table already holds
    for those ids, else ``#id``. Never loads a tokenizer."""
    if tokenizer is not None:
        return [tokenizer.decode([int(i)]) for i in ids]
    seen = dict(zip(tokens["token_id"].to_list(), tokens["text"].to_list()))
    return [seen.get(int(i), f"#{int(i)}") for i in ids]


def _texts_by_pos(tokens: pl.DataFrame | None) -> dict[int, str]:
    return {} if tokens is None else dict(zip(tokens["pos"].to_list(), tokens["text"].to_list()))


def _tick_axis(positions: list[int], texts: list[str], max_ticks: int = 60) -> dict:
    """Numeric axis ticked with token text (numeric, so repeated tokens stay separate)."""
    stride = max(1, -(-len(positions) // max_ticks))
    return {"tickmode": "array", "tickvals": positions[::stride],
            "ticktext": [f"{token_label(t, 10)}" for t in texts[::stride]], "tickangle": -60}


# -- tokens --------------------------------------------------------------------------------------

def fig_tokens(tokens: pl.DataFrame, step: int | None = None) -> go.Figure:
    """Confidence (max prob of the predicting distribution) per position; prompt tokens faded."""
    t = tokens
    if step is not None:
        t = t.filter(pl.col("step") <= step)
    t = t.filter(pl.col("pos") > 0)
    if t.height == 0:
        return _empty("no predicted tokens recorded yet")
    hover = [f"pos {p}: {token_label(x, 40)}<br>confidence {c:.3f}<br>prob {pr:.3f}, rank {r}"
             for p, x, c, pr, r in zip(t["pos"], t["text"], t["confidence"].fill_null(float("nan")),
                                       t["prob"].fill_null(float("nan")), t["rank"])]
    conf = t["confidence"].cast(pl.Float64).to_numpy()  # numpy: plotly takes an array whole (a list value by value)
    fig = go.Figure(go.Bar(
        x=t["pos"].to_numpy(), y=conf, hovertext=hover, hoverinfo="text",
        marker={"color": conf, "colorscale": CONFIDENCE_SCALE, "cmin": 0, "cmax": 1,
                "opacity": np.where(t["is_prompt"].to_numpy(), 0.45, 1.0),
                "colorbar": {"title": "confidence"}}, name="confidence (top probability)"))
    fig.add_trace(go.Scatter(x=t["pos"].to_numpy(), y=t["prob"].cast(pl.Float64).to_numpy(), mode="markers",
                             name="probability of the token that came", marker={"color": "black", "size": 4},
                             hoverinfo="skip"))
    _layout(fig, "Token confidence per position (faded: prompt)", yaxis={"range": [0, 1], "title": "probability"},
            xaxis={"title": "position", **_tick_axis(t["pos"].to_list(), t["text"].to_list())},
            legend={"orientation": "h", "y": -0.3})
    return fig


def fig_topk(tokens: pl.DataFrame, pos: int, tokenizer=None) -> go.Figure:
    """The top-k alternatives at ``pos`` (the distribution that produced its token), produced one marked.
    Their text: ``tokenizer`` if given, else the run's own texts of those ids, else ``#id`` (``token_texts``)."""
    row = _check_pos(tokens, pos)
    if row["topk_ids"] is None:
        return _empty(f"position {pos} has no prediction (the first token)")
    ids, probs = list(row["topk_ids"]), list(row["topk_probs"])
    texts = token_texts(ids, tokens, tokenizer)
    chosen = [i == row["token_id"] for i in ids]
    labels = [f"{k + 1}. {token_label(x, 20)}" for k, x in enumerate(texts)]
    fig = go.Figure(go.Bar(
        x=probs[::-1], y=labels[::-1], orientation="h",
        marker={"color": ["#2a9d8f" if c else "#9aa5b1" for c in chosen[::-1]]},
        hovertext=[f"{token_label(x, 60)} (id {i}): {p:.4f}" for x, i, p in zip(texts[::-1], ids[::-1], probs[::-1])],
        hoverinfo="text"))
    _layout(fig, f"Top-{len(ids)} at pos {pos}; produced {token_label(row['text'], 16)} "
                 f"(rank {row['rank']}, p={row['prob']:.3g})",
            height=300, xaxis={"title": "probability", "range": [0, max(probs + [1e-9]) * 1.1]})
    return fig


# -- attention -----------------------------------------------------------------------------------

def _heatmap(z: pl.DataFrame, row: str, col: str, val: str, n_rows: int | None = None,
             n_cols: int | None = None, fill: float | None = None) -> tuple[list, list, list]:
    """Dense (rows x cols) matrix of ``val`` from long rows, as lists; missing cells are ``fill`` (None: a gap)."""
    rows = list(range(n_rows)) if n_rows is not None else sorted(set(z[row].to_list()))
    cols = list(range(n_cols)) if n_cols is not None else sorted(set(z[col].to_list()))
    ri, ci = {r: i for i, r in enumerate(rows)}, {c: i for i, c in enumerate(cols)}
    m = np.full((len(rows), len(cols)), np.nan if fill is None else fill, dtype=float)
    for r, c, v in zip(z[row].to_list(), z[col].to_list(), z[val].to_list()):
        if r in ri and c in ci and v is not None:
            m[ri[r], ci[c]] = v
    # lists, not the numpy matrix: the page's plot then holds plain nested arrays (plotly would send a numpy
    # matrix base64-encoded), and a gap is None (null), not NaN
    return [[None if x != x else x for x in r] for r in m.tolist()], rows, cols


def fig_token_heads(attention: pl.DataFrame, pos: int) -> go.Figure:
    """Attention entropy (nats) per layer x head for the query at ``pos``."""
    h = attention.filter(pl.col("pos") == pos)
    if h.height == 0:
        return _empty(f"no attention rows at position {pos}")
    z, layers, heads = _heatmap(h, "layer", "head", "entropy")
    mw, _, _ = _heatmap(h, "layer", "head", "max_weight")
    fig = go.Figure(go.Heatmap(z=z, x=heads, y=layers, colorscale=ENTROPY_SCALE, colorbar={"title": "nats"},
                               customdata=mw, hovertemplate="layer %{y}, head %{x}<br>entropy %{z:.3f}"
                               "<br>max weight %{customdata:.3f}<extra></extra>"))
    _layout(fig, f"Attention entropy at pos {pos} (layer x head)", height=320,
            xaxis={"title": "head", "dtick": 1}, yaxis={"title": "layer", "dtick": 1, "autorange": "reversed"})
    return fig


def fig_head_entropy(attention: pl.DataFrame, step: int | None = None, tokens: pl.DataFrame | None = None
                     ) -> go.Figure:
    """Mean attention entropy per layer x head over the run's query positions (pos 0 excluded), or up to
    ``step`` (then ``tokens`` says which positions had been fed by then)."""
    a = attention.filter(pl.col("pos") > 0)
    last = _max_fed_pos_at(tokens, step)
    if last is not None:
        a = a.filter(pl.col("pos") <= last)
    h = a.group_by("layer", "head").agg(pl.col("entropy").mean()).sort("layer", "head")
    if h.height == 0:
        return _empty("no attention rows recorded")
    z, layers, heads = _heatmap(h, "layer", "head", "entropy")
    fig = go.Figure(go.Heatmap(z=z, x=heads, y=layers, colorscale=ENTROPY_SCALE, colorbar={"title": "nats"},
                               hovertemplate="layer %{y}, head %{x}<br>mean entropy %{z:.3f}<extra></extra>"))
    _layout(fig, "Mean attention entropy (layer x head)", height=320,
            xaxis={"title": "head", "dtick": 1}, yaxis={"title": "layer", "dtick": 1, "autorange": "reversed"})
    return fig


def fig_entropy_along(attention: pl.DataFrame, tokens: pl.DataFrame | None = None,
                      heads: list[tuple[int, int]] | None = None, normalised: bool = False,
                      step: int | None = None) -> go.Figure:
    """Attention entropy along positions for chosen ``(layer, head)`` pairs (default: the 4 most diffuse)."""
    a = attention
    last = _max_fed_pos_at(tokens, step)
    if last is not None:
        a = a.filter(pl.col("pos") <= last)
    if a.height == 0:
        return _empty("no attention rows recorded")
    if not heads:
        top = (a.filter(pl.col("pos") > 0).group_by("layer", "head").agg(pl.col("entropy").mean())
               .sort("entropy", "layer", "head", descending=[True, False, False]).head(4))
        heads = list(zip(top["layer"].to_list(), top["head"].to_list()))
    col = "norm_entropy" if normalised else "entropy"
    text = _texts_by_pos(tokens)
    fig = go.Figure()
    for layer, head in heads:
        s = a.filter((pl.col("layer") == layer) & (pl.col("head") == head)).sort("pos")
        if s.height == 0:
            raise ValueError(f"no attention rows for layer {layer}, head {head}")
        name = f"layer {layer}, head {head}"
        fig.add_trace(go.Scatter(
            x=s["pos"].to_numpy(), y=s[col].cast(pl.Float64).to_numpy(), mode="lines+markers", name=name,
            hovertext=[f"{name}, pos {p}: {token_label(text.get(p), 30)}<br>"
                       f"{'normalised entropy' if normalised else 'entropy'} {v:.3f}"
                       if v is not None else f"pos {p}" for p, v in zip(s["pos"], s[col])], hoverinfo="text"))
    _layout(fig, "Attention entropy along the run" + (" (normalised)" if normalised else ""),
            xaxis={"title": "position"}, yaxis={"title": "normalised entropy" if normalised else "nats"})
    return fig


# -- experts -------------------------------------------------------------------------------------

def fig_token_routing(routing: pl.DataFrame, pos: int, summary: ModelSummary | None = None) -> go.Figure:
    """Gate weight per MoE layer x expert for the token at ``pos`` (blank: not chosen)."""
    r = routing.filter(pl.col("pos") == pos)
    if r.height == 0:
        return _empty(f"no routing rows at position {pos}: " + no_routing_reason(summary))
    n_exp = _n_experts(summary, r)
    z, layers, experts = _heatmap(r, "layer", "expert", "weight", n_cols=n_exp)
    margins = dict(zip(r["layer"].to_list(), r["margin"].to_list()))
    fig = go.Figure(go.Heatmap(
        z=z, x=experts, y=[f"L{l}" for l in layers], colorscale=WEIGHT_SCALE, colorbar={"title": "weight"},
        hoverongaps=False, customdata=[[margins.get(l)] * len(experts) for l in layers],
        hovertemplate="%{y}, expert %{x}<br>weight %{z:.3f}<br>margin %{customdata:.3g}<extra></extra>"))
    _layout(fig, f"Routing at pos {pos} (layer x expert)", height=300,
            xaxis={"title": "expert", "dtick": 1}, yaxis={"title": "MoE layer", "autorange": "reversed"})
    return fig


def expert_load_frame(routing: pl.DataFrame) -> pl.DataFrame:
    """layer, expert, slots, share: each expert's share of its layer's routed slots (sums to 1 per layer)."""
    return (routing.group_by("layer", "expert").agg(pl.len().alias("slots"))
            .with_columns((pl.col("slots") / pl.col("slots").sum().over("layer")).alias("share"))
            .sort("layer", "expert"))


def fig_expert_load(routing: pl.DataFrame, summary: ModelSummary | None = None, step: int | None = None,
                    tokens: pl.DataFrame | None = None) -> go.Figure:
    """Share of routed slots per expert per MoE layer (each row sums to 1); uniform = 1/E."""
    last = _max_fed_pos_at(tokens, step)
    r = routing if last is None else routing.filter(pl.col("pos") <= last)
    load = expert_load_frame(r)
    if load.height == 0:
        return _empty(no_routing_reason(summary) if routing.height == 0 else "no routing rows by this step")
    n_exp = _n_experts(summary, load)
    return _load_heatmap(load, n_exp, f"Expert load (share of routed slots; uniform = {1 / n_exp:.3f})")


def _load_heatmap(load: pl.DataFrame, n_exp: int, title: str) -> go.Figure:
    """MoE layer x expert heat map of ``share`` (a frame with layer, expert, share)."""
    z, layers, experts = _heatmap(load, "layer", "expert", "share", n_cols=n_exp, fill=0.0)
    fig = go.Figure(go.Heatmap(z=z, x=experts, y=[f"L{l}" for l in layers], colorscale="YlOrRd",
                               colorbar={"title": "share"}, zmin=0,
                               hovertemplate="%{y}, expert %{x}<br>share %{z:.3f}<extra></extra>"))
    return _layout(fig, title, height=320, xaxis={"title": "expert", "dtick": 1},
                   yaxis={"title": "MoE layer", "autorange": "reversed"})


def _first_moe_layer(routing: pl.DataFrame) -> int | None:
    return int(routing["layer"].min()) if routing.height else None


def coactivation_frame(routing: pl.DataFrame, layer: int) -> pl.DataFrame:
    """a, b, count: how often experts a and b are chosen for the same token in ``layer`` (both orders)."""
    r = routing.filter(pl.col("layer") == layer).select("pos", "slot", "expert")
    pairs = r.join(r, on="pos", suffix="_b").filter(pl.col("slot") != pl.col("slot_b"))
    return (pairs.group_by(pl.col("expert").alias("a"), pl.col("expert_b").alias("b"))
            .agg(pl.len().alias("count")).sort("a", "b"))


def fig_coactivation(routing: pl.DataFrame, layer: int | None = None, summary: ModelSummary | None = None
                     ) -> go.Figure:
    """How often two experts are chosen for the same token in ``layer`` (default: the first MoE layer)."""
    layer = _first_moe_layer(routing) if layer is None else layer
    if layer is None:
        return _empty(no_routing_reason(summary))
    c = coactivation_frame(routing, layer)
    if c.height == 0:
        return _empty(f"no co-activations in layer {layer} (not a MoE layer, or top-1 routing)")
    n_exp = _n_experts(summary, c, "a", "b")
    z, rows, cols = _heatmap(c, "a", "b", "count", n_rows=n_exp, n_cols=n_exp, fill=0)
    fig = go.Figure(go.Heatmap(z=z, x=cols, y=rows, colorscale="Purples", colorbar={"title": "tokens"},
                               hovertemplate="experts %{y} & %{x}: %{z} tokens<extra></extra>"))
    _layout(fig, f"Expert co-activation, layer {layer}", height=420,
            xaxis={"title": "expert", "dtick": 1}, yaxis={"title": "expert", "dtick": 1, "autorange": "reversed"})
    return fig


def load_along_frame(routing: pl.DataFrame, layer: int, window: int = 16) -> pl.DataFrame:
    """window_start, expert, slots, share: each expert's share of slots in consecutive windows of positions."""
    return (routing.filter(pl.col("layer") == layer)
            .select((pl.col("pos") // window * window).alias("window_start"), "expert")
            .group_by("window_start", "expert").agg(pl.len().alias("slots"))
            .with_columns((pl.col("slots") / pl.col("slots").sum().over("window_start")).alias("share"))
            .sort("window_start", "expert"))


def fig_load_along(routing: pl.DataFrame, layer: int | None = None, window: int = 16,
                   summary: ModelSummary | None = None) -> go.Figure:
    """Each expert's share of slots in consecutive windows of ``window`` positions, in ``layer``; a window's
    cell spans its positions, so the axis starts at position 0."""
    layer = _first_moe_layer(routing) if layer is None else layer
    if layer is None:
        return _empty(no_routing_reason(summary))
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    d = load_along_frame(routing, layer, window)
    if d.height == 0:
        return _empty(f"no routing rows in layer {layer}")
    n_exp = _n_experts(summary, d)
    z, experts, starts = _heatmap(d, "expert", "window_start", "share", n_rows=n_exp, fill=0.0)
    end = max(starts) + window
    fig = go.Figure(go.Heatmap(z=z, x=[s + window / 2 for s in starts], y=experts, colorscale="YlOrRd", zmin=0,
                               colorbar={"title": "share"},
                               customdata=[[f"{s}-{s + window - 1}" for s in starts] for _ in experts],
                               hovertemplate="positions %{customdata}, expert %{y}<br>share %{z:.3f}<extra></extra>"))
    _layout(fig, f"Expert load along the run, layer {layer} (windows of {window} positions)", height=380,
            xaxis={"title": "position", "range": [0, end]}, yaxis={"title": "expert", "dtick": 1})
    return fig


# -- KV cache ------------------------------------------------------------------------------------

def fig_kv_bytes(kv: pl.DataFrame, step: int | None = None) -> go.Figure:
    """Bytes held in each layer's latent KV cache after every step (stacked: the total)."""
    if step is not None:
        kv = kv.filter(pl.col("step") <= step)
    if kv.height == 0:
        return _empty("no KV cache rows recorded")
    fig = go.Figure()
    for layer in sorted(set(kv["layer"].to_list())):
        s = kv.filter(pl.col("layer") == layer).sort("step")
        fig.add_trace(go.Scatter(x=s["step"].to_numpy(), y=s["bytes"].to_numpy(), name=f"layer {layer}",
                                 stackgroup="kv", mode="lines", customdata=s["cached_tokens"].to_numpy(),
                                 hovertemplate=f"layer {layer}" + ", step %{x}<br>%{y} bytes, "
                                 "%{customdata} tokens<extra></extra>"))
    _layout(fig, "KV cache bytes per layer over steps (stacked)", xaxis={"title": "step (0 = prefill)"},
            yaxis={"title": "bytes"})
    return fig


def fig_kv_received(kv_tokens: pl.DataFrame, tokens: pl.DataFrame | None = None, layer: int | None = None
                    ) -> go.Figure:
    """Attention each cached token has received (summed over heads and queries), at the last recorded step.

    ``layer`` None: a layer x position heat map; else one layer's bars.
    """
    kt = kv_tokens
    if kt.height == 0:
        return _empty("no per-token KV rows recorded")
    last = kt.filter(pl.col("step") == kt["step"].max())
    text = _texts_by_pos(tokens)
    if layer is not None:
        s = last.filter(pl.col("layer") == layer).sort("pos")
        if s.height == 0:
            raise ValueError(f"no KV rows for layer {layer}; layers: {sorted(set(last['layer'].to_list()))}")
        fig = go.Figure(go.Bar(x=s["pos"].to_list(), y=s["attn_received"].to_list(), hoverinfo="text",
                               hovertext=[f"pos {p}: {token_label(text.get(p), 30)}<br>received {v:.3f}"
                                          for p, v in zip(s["pos"], s["attn_received"])]))
        _layout(fig, f"Attention received per cached token, layer {layer} (step {last['step'][0]})",
                xaxis={"title": "cached position", **_tick_axis(s["pos"].to_list(), [text.get(p) for p in s["pos"]])},
                yaxis={"title": "attention received"})
        return fig
    z, layers, positions = _heatmap(last, "layer", "pos", "attn_received")
    hover = [[f"layer {l}, pos {p}: {token_label(text.get(p), 30)}" for p in positions] for l in layers]
    fig = go.Figure(go.Heatmap(z=z, x=positions, y=layers, colorscale="Magma", colorbar={"title": "received"},
                               customdata=hover, hovertemplate="%{customdata}<br>received %{z:.3f}<extra></extra>"))
    _layout(fig, f"Attention received per cached token (step {last['step'][0]})", height=360,
            xaxis={"title": "cached position", **_tick_axis(positions, [text.get(p) for p in positions])},
            yaxis={"title": "layer", "dtick": 1, "autorange": "reversed"})
    return fig


# -- root cause ----------------------------------------------------------------------------------

def _for_target(attributions: pl.DataFrame, pos: int) -> pl.DataFrame:
    if attributions.height and "target_pos" in attributions.columns:
        return attributions.filter(pl.col("target_pos") == pos)
    return attributions


def fig_attribution(attributions: pl.DataFrame, tokens: pl.DataFrame | None, pos: int) -> go.Figure:
    """Integrated-Gradients score of every earlier token for the token at ``pos`` (``attributions`` rows of
    the run: all targets, or those of ``pos``)."""
    a = _for_target(attributions, pos)
    tok = a.filter(pl.col("kind") == "token") if a.height else a
    if tok.height == 0:
        return _empty(f"no attribution stored for position {pos}: run root cause on it first")
    tok = tok.sort("source_pos")
    text = _texts_by_pos(tokens)
    xs, scores = tok["source_pos"].to_list(), tok["score"].to_list()
    lim = max((abs(s) for s in scores if s is not None), default=1.0) or 1.0
    method = tok["method"][0]
    hover = [[f"pos {p}: {token_label(text.get(p), 40)}<br>score {s:.4g}" for p, s in zip(xs, scores)]]
    fig = go.Figure(go.Heatmap(z=[scores], x=xs, y=[token_label(text.get(pos), 12)], colorscale="RdBu",
                               zmid=0, zmin=-lim, zmax=lim, customdata=hover,
                               colorbar={"title": "score", "thickness": 12, "nticks": 3},
                               hovertemplate="%{customdata}<extra></extra>"))
    delta = tok["delta"].drop_nulls()
    extra = f", delta {delta[0]:.2g}" if delta.len() else ""
    _layout(fig, f"Attribution over the context for pos {pos} ({html.escape(str(method))}{extra})", height=300,
            xaxis={"title": "source position", **_tick_axis(xs, [text.get(p) for p in xs])})
    return fig


def fig_components(attributions: pl.DataFrame, pos: int, top: int = 15) -> go.Figure:
    """The top-ranked heads and experts (ablation effects) for the token at ``pos``."""
    a = _for_target(attributions, pos)
    c = a.filter(pl.col("kind") != "token").sort("rank").head(top) if a.height else a
    if c.height == 0:
        return _empty(f"no component ranking stored for position {pos}")

    def name(r: dict) -> str:
        where = "" if r["layer"] is None else f"L{r['layer']} "
        if r["kind"] == "head":
            return f"{where}head {r['head']}"
        if r["kind"] == "expert":
            return f"{where}expert {r['expert']}"
        if r["source_pos"] is not None:
            return f"{where}{r['kind']} at pos {r['source_pos']}"
        return f"{where}{r['kind']}"
    rows = list(c.iter_rows(named=True))
    fig = go.Figure(go.Bar(x=[r["score"] for r in rows][::-1], y=[html.escape(name(r)) for r in rows][::-1],
                           orientation="h", marker={"color": "#e76f51"}))
    methods = ", ".join(sorted({m for m in c["method"].to_list() if m})) if "method" in c.columns else ""
    _layout(fig, f"Components ranked for pos {pos} ({html.escape(methods or 'score')}; nats of the token's logprob)",
            height=360, xaxis={"title": "score (nats)"}, yaxis={"dtick": 1, "automargin": True})
    return fig


# -- what-if: expert cache, latency against context, precision, code view ---------------------------
# ``*_figure(frame or fit)`` draw what ``workbench.analysis.whatif`` / ``workbench.analysis.codeview`` computed (several runs
# pooled, or a model re-run: the precision probe); ``fig_*(frames)`` compute it from one run's rows.

def expert_cache_figure(df: pl.DataFrame, title: str = "Expert cache: hit rate against cache size K") -> go.Figure:
    """Hit rate (all MoE layers together: the ``layer`` null rows) against K, one line per predictor
    (``workbench.analysis.whatif.expert_cache_sweep``; a frame without ``predictor`` is one line), with the seed
    documents' 82.4% (last 3 tokens) and 94.1% (next 5 positions) as reference lines."""

    tot = df.filter(pl.col("layer").is_null())
    if tot.height == 0:
        return _empty("no expert-cache rows (no routing recorded)")
    if "predictor" not in tot.columns:
        tot = tot.with_columns(pl.lit("none").alias("predictor"))
    names = {"none": "LRU only", "prev3": "LRU + prefetch: last 3 tokens' experts",
             "lookahead": "LRU + prefetch: next 5 positions (oracle)"}
    fig = go.Figure()
    for p in dict.fromkeys(tot["predictor"].to_list()):
        s = tot.filter(pl.col("predictor") == p).sort("slots")
        fig.add_trace(go.Scatter(
            x=s["slots"].to_list(), y=s["hit_rate"].to_list(), mode="lines+markers",
            name=html.escape(names.get(p, str(p))), customdata=list(zip(s["hits"].to_list(), s["lookups"].to_list())),
            hovertemplate="K=%{x}: hit rate %{y:.1%}<br>%{customdata[0]} of %{customdata[1]} lookups<extra></extra>"))
    for label, rate, dash in (("seeds, level 1 (last 3 tokens)", SEED_HIT_RATES["prev3"], "dot"),
                              ("seeds, level 2 (next 5 positions)", SEED_HIT_RATES["lookahead"], "dash")):
        fig.add_hline(y=rate, line={"dash": dash, "color": "#888"}, annotation_text=f"{label}: {rate:.1%}",
                      annotation_position="bottom right")
    _layout(fig, html.escape(title), xaxis={"title": "cache slots per MoE layer (K)", "dtick": 1},
            yaxis={"title": "hit rate", "range": [0, 1.02], "tickformat": ".0%"}, legend={"orientation": "h", "y": -0.25})
    return fig


def fig_expert_cache(routing: pl.DataFrame, summary: ModelSummary | None = None, n_prompt_tokens: int = 0,
                     slots=(1, 2, 3, 4, 6, 8, 12, 16), predictors=None, decode_only: bool = False) -> go.Figure:
    """The run's expert-cache hit rate against K for each predictor (``workbench.analysis.whatif``)."""
    if routing.height == 0:
        return _empty(no_routing_reason(summary))
    n_exp = _n_experts(summary, routing)
    ks = [k for k in slots if 1 <= k <= n_exp] or [n_exp]
    start = int(n_prompt_tokens or 0) if decode_only else 0
    df = expert_cache_sweep(routing, ks, predictors or PREDICTORS, start)
    return expert_cache_figure(df, f"Expert cache over the recorded routing ({n_exp} experts per layer)")


def latency_fit_figure(fit, reference: bool = True) -> go.Figure:
    """Decode-step wall time against context length with the fitted ``a (L/L0)^b + c`` (a
    ``workbench.analysis.whatif.LatencyFit``), the residuals below; ``reference``: the seeds' curve (a=12.4, b=1.38, c=8.2)."""


    r = fit.residuals
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3], vertical_spacing=0.06)
    fig.add_trace(go.Scatter(x=r["L"].to_list(), y=r["wall_ms"].to_list(), mode="markers", name="decode steps",
                             marker={"size": 5, "color": "#457b9d"},
                             hovertemplate="L=%{x}: %{y:.2f} ms<extra></extra>"), row=1, col=1)
    lo, hi = float(r["L"].min()), float(r["L"].max())
    xs = [lo + (hi - lo) * i / 200 for i in range(201)]
    fig.add_trace(go.Scatter(x=xs, y=fit.predict(xs).tolist(), mode="lines", name="fit", line={"color": "#e63946"}),
                  row=1, col=1)
    if reference:
        fig.add_trace(go.Scatter(x=xs, y=latency_model(xs, **SEED_LATENCY, L0=fit.L0).tolist(), mode="lines",
                                 name="seeds: 12.4 (L/L0)^1.38 + 8.2", line={"dash": "dash", "color": "#888"}),
                      row=1, col=1)
    fig.add_trace(go.Scatter(x=r["L"].to_list(), y=r["residual"].to_list(), mode="markers", name="residual",
                             marker={"size": 4, "color": "#6c757d"}, showlegend=False,
                             hovertemplate="L=%{x}: residual %{y:.2f} ms<extra></extra>"), row=2, col=1)
    fig.add_hline(y=0, line={"color": "#bbb"}, row=2, col=1)
    title = (f"Latency = a (L/{fit.L0})^b + c: a = {fit.a:.3g} ± {fit.a_se:.2g}, b = {fit.b:.3g} ± {fit.b_se:.2g}, "
             f"c = {fit.c:.3g} ± {fit.c_se:.2g} ms (n = {fit.n})")
    _layout(fig, title, height=460, legend={"orientation": "h", "y": -0.2})
    fig.update_yaxes(title_text="wall ms per step", row=1, col=1)
    fig.update_yaxes(title_text="residual ms", row=2, col=1)
    fig.update_xaxes(title_text="cached tokens L", row=2, col=1)
    return fig


def fig_latency_fit(steps: pl.DataFrame, n_prompt_tokens: int = 0, L0: int = 32768) -> go.Figure:
    """The run's decode-step latency against context with the fit (``workbench.analysis.whatif.fit_latency``)."""
    pts = decode_points(steps, int(n_prompt_tokens or 0))
    try:
        fit = fit_latency(pts, L0=L0)
    except (ValueError, RuntimeError) as e:
        return _empty(f"no latency fit: {e}")
    return latency_fit_figure(fit)


def precision_figure(df: pl.DataFrame, value: str = "delta_nll") -> go.Figure:
    """Heat map layer x format of a precision probe (``workbench.analysis.whatif.precision_probe``): ``value``
    ``delta_nll`` (nats, diverging around 0) or ``rel_l2``; the ``layer`` null row is "all layers"."""
    if df.height == 0:
        return _empty("no precision-probe rows")
    if value not in ("delta_nll", "rel_l2", "top1_agreement"):
        raise ValueError(f"value must be delta_nll, rel_l2 or top1_agreement, not {value!r}")
    formats = list(dict.fromkeys(df["format"].to_list()))
    layers = sorted({l for l in df["layer"].to_list() if l is not None})
    rows = layers + ([None] if df["layer"].null_count() else [])
    cell = {(r["layer"], r["format"]): r for r in df.iter_rows(named=True)}
    z = [[cell.get((l, f), {}).get(value) for f in formats] for l in rows]
    hover = [[(lambda c: f"{'all layers' if l is None else f'layer {l}'}, {html.escape(str(f))}<br>"
                         f"Δ NLL {c['delta_nll']:.4g} nats<br>rel. L2 {c['rel_l2']:.3g}<br>"
                         f"top-1 agreement {c['top1_agreement']:.1%}" if c else "")(cell.get((l, f)))
              for f in formats] for l in rows]
    scale = {"delta_nll": {"colorscale": "RdBu_r", "zmid": 0}, "rel_l2": {"colorscale": "Reds", "zmin": 0},
             "top1_agreement": {"colorscale": "Greens", "zmin": 0, "zmax": 1}}[value]
    fig = go.Figure(go.Heatmap(z=z, x=[html.escape(str(f)) for f in formats],
                               y=["all" if l is None else f"L{l}" for l in rows], customdata=hover,
                               hovertemplate="%{customdata}<extra></extra>",
                               colorbar={"title": "nats" if value == "delta_nll" else value}, **scale))
    what = {"delta_nll": "mean NLL change of the recorded tokens", "rel_l2": "relative L2 error of the logits",
            "top1_agreement": "top-1 agreement with the unquantized run"}[value]
    _layout(fig, f"Precision sensitivity: {what} (one layer quantized at a time)",
            height=max(280, 40 * len(rows) + 120), xaxis={"title": "format"},
            yaxis={"title": "quantized layer", "autorange": "reversed"})
    return fig


def code_view_figure(summary: pl.DataFrame, title: str = "Confidence by Python token class") -> go.Figure:
    """Mean confidence per token class (bars, token counts on them) and mean entropy (markers, right axis),
    from ``workbench.analysis.codeview.code_view``."""
    if summary.height == 0:
        return _empty("no classified tokens (no generated text?)")
    cls = summary["class"].to_list()
    fig = go.Figure(go.Bar(x=cls, y=summary["mean_confidence"].to_list(), name="mean confidence",
                           text=[str(n) for n in summary["tokens"].to_list()], textposition="outside",
                           marker={"color": summary["mean_confidence"].to_list(), "colorscale": CONFIDENCE_SCALE,
                                   "cmin": 0, "cmax": 1},
                           customdata=list(zip(summary["tokens"].to_list(), summary["low_confidence_share"].to_list())),
                           hovertemplate="%{x}: mean confidence %{y:.3f}<br>%{customdata[0]} tokens, "
                                         "%{customdata[1]:.0%} below 0.2<extra></extra>"))
    fig.add_trace(go.Scatter(x=cls, y=summary["mean_entropy"].to_list(), mode="markers", name="mean entropy (nats)",
                             yaxis="y2", marker={"color": "black", "size": 9, "symbol": "diamond"},
                             hovertemplate="%{x}: mean entropy %{y:.3f} nats<extra></extra>"))
    _layout(fig, html.escape(title), yaxis={"title": "mean confidence", "range": [0, 1.1]},
            yaxis2={"title": "mean entropy (nats)", "overlaying": "y", "side": "right", "rangemode": "tozero"},
            xaxis={"title": "token class (tokenize)"}, legend={"orientation": "h", "y": -0.25})
    return fig


def fig_code_view(tokens: pl.DataFrame, generated_only: bool = True) -> go.Figure:
    """The run's confidence and entropy by Python token class (``workbench.analysis.codeview``)."""
    if tokens.height == 0:
        return _empty("no tokens recorded")
    what = "generated tokens" if generated_only else "all tokens"
    return code_view_figure(code_view(tokens, generated_only), f"Confidence by Python token class ({what})")


# -- what-if: KV-cache policies (workbench.analysis.kv_policies) ------------------------------------------------

SEED_TOPK_INT8_KEPT = 0.53  # the seed documents: top-512 in FP16 + the rest INT8, "memory -47%"


def fig_kv_pareto(frame: pl.DataFrame | None) -> go.Figure:
    """Memory kept (``bytes_kept / bytes_full``) against ``delta_nll`` per KV-cache policy, the Pareto front
    (no other policy keeps less memory and loses less) as a line. ``frame``: ``Run.kv_whatif(...)``'s frame or
    the stored ``policy_results`` rows (rows of one policy are averaged, e.g. over several runs)."""
    if frame is None or frame.height == 0:
        return _empty("no KV what-if results yet (Run.kv_whatif / workbench kv-whatif)")
    df = (frame.with_columns((pl.col("bytes_kept") / pl.col("bytes_full").clip(1)).alias("kept"))
          .group_by("policy", maintain_order=True)
          .agg(pl.col("kept").mean(), pl.col("delta_nll").mean(), pl.col("top1_agreement").mean(),
               pl.col("events").mean(), pl.len().alias("n")))
    rows = df.to_dicts()
    front, best = [], float("inf")
    for r in sorted(rows, key=lambda r: (r["kept"], r["delta_nll"])):
        if r["delta_nll"] is not None and r["delta_nll"] < best:
            front.append(r)
            best = r["delta_nll"]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[r["kept"] for r in front], y=[r["delta_nll"] for r in front], mode="lines",
                             line={"shape": "hv", "color": "#bbb", "dash": "dot"}, name="Pareto front",
                             hoverinfo="skip"))
    for fam in dict.fromkeys(str(r["policy"]).split(":")[0] for r in rows):
        g = [r for r in rows if str(r["policy"]).split(":")[0] == fam]
        labels = [token_label(str(r["policy"]), 40) for r in g]
        fig.add_trace(go.Scatter(
            x=[r["kept"] for r in g], y=[r["delta_nll"] for r in g], mode="markers+text", name=token_label(fam, 40),
            text=labels, textposition="top center", textfont={"size": 9}, marker={"size": 10},
            customdata=[[lab, r["top1_agreement"], r["events"], r["n"]] for lab, r in zip(labels, g)],
            hovertemplate="%{customdata[0]}<br>memory kept %{x:.1%}<br>Δ NLL %{y:.4f} nats<br>"
                          "top-1 agreement %{customdata[1]:.1%}<br>events %{customdata[2]:.0f} "
                          "(%{customdata[3]} runs)<extra></extra>"))
    fig.add_vline(x=SEED_TOPK_INT8_KEPT, line={"dash": "dash", "color": "#888"},
                  annotation_text="seeds: topk_int8 memory -47%", annotation_position="top left")
    fig.add_hline(y=0, line={"color": "#ddd"})
    return _layout(fig, "KV-cache policies: memory kept vs Δ NLL (lower left is better)", height=440,
                   xaxis={"title": "memory kept (bytes_kept / bytes_full, end of run)", "tickformat": ".0%",
                          "range": [0, 1.08]},
                   yaxis={"title": "Δ NLL of the recorded tokens (nats per generated token)"},
                   legend={"orientation": "h", "y": -0.2})


__all__ = [n for n in dir() if n.startswith("fig_")] + ["token_label", "CONFIDENCE_SCALE"]


# -- batches (prompt sets): frames from workbench.data.query.batch_* ------------------------------------------

def batch_load_figure(load: pl.DataFrame, batch_id: str = "") -> go.Figure:
    """Share of routed slots per expert per MoE layer over a batch's runs (``query.batch_expert_load``)."""
    if load.height == 0:
        return _empty("no routing rows in this batch (dense models, or no complete runs)")
    n_exp = int(load["expert"].max()) + 1
    return _load_heatmap(load, n_exp, f"Expert load over batch {html.escape(batch_id)} (uniform = {1 / n_exp:.3f})")


def batch_entropy_figure(per_run: pl.DataFrame, batch_id: str = "", value: str = "norm_entropy") -> go.Figure:
    """One box per layer x head: the spread over a batch's runs of each run's mean entropy at that head
    (``query.batch_head_entropy``)."""
    if per_run.height == 0:
        return _empty("no attention rows in this batch")
    fig = go.Figure()
    for (layer,), grp in per_run.sort("layer", "head").group_by("layer", maintain_order=True):
        fig.add_trace(go.Box(x=[f"L{layer}H{h}" for h in grp["head"].to_list()], y=grp[value].to_list(),
                             name=f"layer {layer}", boxpoints="outliers",
                             text=[html.escape(r) for r in grp["run_id"].to_list()],
                             hovertemplate="%{x}: %{y:.3f}<br>run %{text}<extra></extra>"))
    _layout(fig, f"Per-head {'normalised ' if value == 'norm_entropy' else ''}entropy across the runs of batch "
                 f"{html.escape(batch_id)}", height=380,
            xaxis={"title": "layer / head"}, yaxis={"title": value})
    return fig


def batch_confidence_figure(low: pl.DataFrame, batch_id: str = "") -> go.Figure:
    """The batch's least confident generated tokens (``query.batch_low_confidence``), one bar each."""
    if low.height == 0:
        return _empty("no generated tokens in this batch")
    labels = [f"{html.escape(r)}@{p}" for r, p in zip(low["run_id"].to_list(), low["pos"].to_list())]
    fig = go.Figure(go.Bar(x=labels, y=low["confidence"].to_list(), marker={"color": low["confidence"].to_list(),
                           "colorscale": CONFIDENCE_SCALE, "cmin": 0, "cmax": 1},
                           text=[token_label(t) for t in low["text"].to_list()], textposition="outside",
                           hovertemplate="%{x}<br>token %{text}<br>confidence %{y:.3f}<extra></extra>"))
    _layout(fig, f"Least confident tokens of batch {html.escape(batch_id)}", height=360,
            xaxis={"title": "run @ pos", "tickangle": -45}, yaxis={"title": "confidence", "range": [0, 1.05]})
    return fig


def placement_figure(summary: pl.DataFrame, title: str = "Expert-parallel placement: device load against policy"
                     ) -> go.Figure:
    """Per MoE layer, one bar per policy: the busiest device's load over the mean device load (1 = balanced), and
    the share of routed slots sent off their source device (``workbench.analysis.placement.summary``)."""
    if summary.height == 0:
        return _empty("no routing rows to place (dense models, or no complete runs)")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("max / mean device load", "slots sent off their device"))
    colors = ("#636efa", "#ef553b", "#00cc96", "#ab63fa")
    for i, ((name,), grp) in enumerate(summary.sort("layer").group_by("policy", maintain_order=True)):
        g = grp.sort("layer")
        x = [f"L{v}" for v in g["layer"].to_list()]
        for col, value, fmt in ((1, "imbalance", ".3f"), (2, "offdevice_share", ".1%")):
            fig.add_trace(go.Bar(x=x, y=g[value].to_list(), name=html.escape(str(name)), legendgroup=str(name),
                                 showlegend=col == 1, marker={"color": colors[i % len(colors)]},
                                 hovertemplate=f"%{{x}}: %{{y:{fmt}}}<extra>{html.escape(str(name))}</extra>"),
                          row=1, col=col)
    g0 = summary.row(0, named=True)
    _layout(fig, f"{html.escape(title)} ({g0['devices']} devices, {g0['redundant']} redundant)", height=360,
            barmode="group")
    fig.update_yaxes(title_text="max / mean", row=1, col=1)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return fig


# -- the logit lens --------------------------------------------------------------------------------

def logit_lens_figure(lens: pl.DataFrame, tokens: pl.DataFrame | None = None, title: str | None = None) -> go.Figure:
    """Heat map layer x position of a logit lens (``Run.logit_lens``): the probability each layer gives the token
    the run produced there ("where was this token decided"); hover: its rank and the layer's top-1 token. Texts
    from the frame's ``text`` / ``top_text`` columns, else the run's ``tokens``, else ``#id``."""
    if lens.height == 0:
        return _empty("no logit-lens rows: compute them with the model (Run.logit_lens)")
    texts = _texts_by_pos(tokens)
    if "text" in lens.columns:
        texts |= {p: t for p, t in zip(lens["pos"].to_list(), lens["text"].to_list()) if t is not None}
    seen = dict(zip(tokens["token_id"].to_list(), tokens["text"].to_list())) if tokens is not None else {}
    positions = sorted(set(lens["pos"].to_list()))
    layers = sorted(set(lens["layer"].to_list()))
    col, row = {p: i for i, p in enumerate(positions)}, {l: i for i, l in enumerate(layers)}
    z = [[None] * len(positions) for _ in layers]
    hover = [[""] * len(positions) for _ in layers]
    top_texts = lens["top_text"].to_list() if "top_text" in lens.columns else [None] * lens.height
    for r, top in zip(lens.iter_rows(named=True), top_texts):
        i, j = row[r["layer"]], col[r["pos"]]
        z[i][j] = r["prob"]
        tok = token_label(texts.get(r["pos"], seen.get(r["token_id"], f"#{r['token_id']}")), 20)
        top = token_label(top if top is not None else seen.get(r["top_token_id"], f"#{r['top_token_id']}"), 20)
        p, tp = r["prob"], r["top_prob"]
        hover[i][j] = (f"pos {r['pos']} «{tok}», layer {r['layer']}<br>p = {'' if p is None else f'{p:.3g}'}, "
                       f"rank {r['rank']}<br>top-1 «{top}» ({'' if tp is None else f'{tp:.3g}'})")
    fig = go.Figure(go.Heatmap(z=z, x=list(range(len(positions))), y=layers, customdata=hover, zmin=0, zmax=1,
                               colorscale=CONFIDENCE_SCALE, colorbar={"title": "p(token)"},
                               hovertemplate="%{customdata}<extra></extra>"))
    ticks = _tick_axis(list(range(len(positions))), [texts.get(p, "") for p in positions], max_ticks=40)
    ticks["ticktext"] = [f"{positions[v]} {t}" for v, t in zip(ticks["tickvals"], ticks["ticktext"])]
    _layout(fig, html.escape(title or "Logit lens: where was each token decided (p of the produced token per layer)"),
            height=max(260, 28 * len(layers) + 160), xaxis={"title": "position", **ticks},
            yaxis={"title": "layer (residual stream after it)", "dtick": 1})
    return fig


# -- patch scan and expert contrast -----------------------------------------------------------------------

PATCH_PARTS = ["attn_block", "mlp_block / dense_mlp", "resid", "attn_norm", "mlp_norm", "kv_latent", "rotary",
               "shared_expert", "router"]  # then "head h", "expert e"; a row "embed / unembed" for the model's ends


def _patch_column(kind: str, head, expert) -> str:
    if kind in ("mlp_block", "dense_mlp"):
        return "mlp_block / dense_mlp"
    if kind == "head":
        return f"head {head}"
    if kind == "expert":
        return f"expert {expert}"
    return kind


def patch_scan_figure(frame: pl.DataFrame, title: str | None = None) -> go.Figure:
    """Heat map "what restores the token" of a patching root cause (``Run.root_cause(pos, reference=...)``):
    layer (rows) x part (columns: attn_block, mlp_block / dense_mlp, resid, the norms, kv_latent, rotary,
    shared_expert, router, then each head and routed expert patched inside the descended layers), coloured by
    ``restored`` (the fraction of the gap to the reference the patch closes; 1: the token given back). A cell
    that was not patched is blank (NULL), never 0; embed / unembed form a row of their own; source tokens are
    left out (they are the Ranked causes table's). Hover: kind, layer, head / expert, score in nats, restored."""
    rows = frame.filter(pl.col("method") == "patching") if "method" in frame.columns else frame
    rows = rows.filter(pl.col("kind") != "token")
    if rows.height == 0:
        return _empty("no patching rows: explain the token against a reference run (activation patching)")
    present = {_patch_column(r["kind"], r["head"], r["expert"]) for r in rows.iter_rows(named=True)}
    heads = sorted({h for h in rows["head"].to_list() if h is not None})
    experts = sorted({e for e in rows["expert"].to_list() if e is not None})
    cols = ([c for c in PATCH_PARTS if c in present] + [f"head {h}" for h in heads]
            + [f"expert {e}" for e in experts] + [c for c in ("embed", "unembed") if c in present])
    layers = sorted({lay for lay in rows["layer"].to_list() if lay is not None})
    ylab = [f"layer {lay}" for lay in layers] + (["embed / unembed"] if rows["layer"].null_count() else [])
    yi = {lay: i for i, lay in enumerate(layers)}
    xi = {c: j for j, c in enumerate(cols)}
    z = [[None] * len(cols) for _ in ylab]
    hover = [[""] * len(cols) for _ in ylab]
    for r in rows.iter_rows(named=True):
        i = yi[r["layer"]] if r["layer"] is not None else len(layers)
        j = xi[_patch_column(r["kind"], r["head"], r["expert"])]
        rest = r["restored"]
        rest = None if rest is None or rest != rest else float(rest)  # NaN: a gap too small to divide by
        z[i][j] = rest
        where = "" if r["layer"] is None else f", layer {r['layer']}"
        what = (f", head {r['head']}" if r["head"] is not None else "") + (
            f", expert {r['expert']}" if r["expert"] is not None else "")
        score = "" if r["score"] is None else f"{r['score']:+.4g} nats"
        hover[i][j] = (f"{html.escape(str(r['kind']))}{where}{what}<br>score {score}<br>restored "
                       + ("n/a (no gap)" if rest is None else f"{rest:.1%}") + f"<br>rank {r['rank']}")
    fig = go.Figure(go.Heatmap(z=z, x=cols, y=ylab, customdata=hover, zmid=0, colorscale="RdBu",
                               colorbar={"title": "restored"}, hoverongaps=False, xgap=1, ygap=1,
                               hovertemplate="%{customdata}<extra></extra>"))
    _layout(fig, html.escape(title or "Patch scan: what restores the token (fraction of the gap to the reference "
                                      "closed by patching each part)"),
            height=max(380, 36 * len(ylab) + 260), xaxis={"title": "part", "type": "category", "tickangle": -45},
            yaxis={"title": "", "autorange": "reversed", "type": "category"})
    return fig


def contrast_figure(contrast: pl.DataFrame, title: str | None = None) -> go.Figure:
    """Heat map MoE layer x expert of an expert contrast (``Workbench.expert_contrast``): ``diff`` = share_a -
    share_b (red: chosen more by set A, blue: by set B); hover: both shares, p and rank."""
    if contrast.height == 0:
        return _empty("no expert contrast rows")
    layers = sorted(set(contrast["layer"].to_list()))
    experts = sorted(set(contrast["expert"].to_list()))
    yi, xi = {lay: i for i, lay in enumerate(layers)}, {e: j for j, e in enumerate(experts)}
    z = [[None] * len(experts) for _ in layers]
    hover = [[""] * len(experts) for _ in layers]
    for r in contrast.iter_rows(named=True):
        i, j = yi[r["layer"]], xi[r["expert"]]
        z[i][j] = r["diff"]
        p = "n/a" if r["p"] is None or r["p"] != r["p"] else f"{r['p']:.3g}"
        hover[i][j] = (f"layer {r['layer']}, expert {r['expert']}<br>share A {r['share_a']:.3f}, share B "
                       f"{r['share_b']:.3f}<br>diff {r['diff']:+.3f}, p {p}<br>rank {r['rank']}")
    m = max((abs(v) for row in z for v in row if v is not None), default=0.0) or 1.0
    fig = go.Figure(go.Heatmap(z=z, x=[str(e) for e in experts], y=[f"layer {lay}" for lay in layers],
                               customdata=hover, zmin=-m, zmax=m, colorscale="RdBu_r", colorbar={"title": "diff"},
                               hovertemplate="%{customdata}<extra></extra>"))
    _layout(fig, html.escape(title or "Expert contrast: share of set A minus share of set B per layer x expert"),
            height=max(260, 40 * len(layers) + 160), xaxis={"title": "expert", "type": "category"},
            yaxis={"autorange": "reversed", "type": "category"})
    return fig
