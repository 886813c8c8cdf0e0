"""Comparison of two recorded runs, aligned by position: tokens, confidence, head entropy, routing.

Made for the same prompt under fp32 vs bf16, an edited prompt, and a replay against its original.
Positions are compared where both runs have them; after the first differing token the two runs see
different contexts, so later deltas say how far apart they drifted, not why.
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
import polars as pl

from workbench.capture.interventions import stored as stored_interventions
from workbench.data import query
from workbench.data.signals import TABLES as SIGNAL_TABLES
from workbench.data.store import Store


def _f(x) -> float | None:
    """A plain float for summaries (None for NULL / NaN / inf, so the summary is valid JSON)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _abs_stats(s: pl.Series) -> tuple[float | None, float | None]:
    s = s.cast(pl.Float64).fill_nan(None).drop_nulls().abs()
    return (_f(s.mean()), _f(s.max())) if s.len() else (None, None)


@dataclass
class RunDiff:
    """Two runs compared. ``summary`` is a JSON-ready dict; the frames are polars.

    Attributes:
        tokens: per position: both tokens, ``same_token``, confidence / logprob / entropy of each
            and their change (b - a).
        heads: per layer x head: mean entropy of each run over shared positions and the change,
            plus the largest per-position change.
        routing: per MoE layer: slots compared, share whose expert differs (slot by slot) and share
            whose expert is not in the other run's selection for that token at all.
    """

    a: str
    b: str
    summary: dict
    tokens: pl.DataFrame
    heads: pl.DataFrame
    routing: pl.DataFrame

    def figures(self) -> dict:
        """Plotly figures: ``confidence`` (both runs along positions), ``delta`` (change in logprob and
        confidence), ``heads`` (layer x head change in mean entropy), ``routing`` (share changed per layer)."""

        t = self.tokens
        first = self.summary.get("first_divergence_pos")
        # plotly reads a subset of HTML in hover text, legend names and titles: escape token text and run ids so
        # they show literally (a run id ``<a href=...>`` is no live link)
        ha = [html.escape(x or "") for x in t["text_a"].fill_null("").to_list()]
        hb = [html.escape(x or "") for x in t["text_b"].fill_null("").to_list()]
        name_a, name_b = (html.escape(str(r), quote=False) for r in (self.a, self.b))
        # numeric columns as numpy arrays (NULL -> NaN, a gap as None was): plotly checks a list element by element
        conf = go.Figure([
            go.Scatter(x=t["pos"].to_numpy(), y=t["confidence_a"].to_numpy(), name=f"A {name_a}", mode="lines+markers",
                       text=ha, hovertemplate="pos %{x}<br>%{text}<br>confidence %{y:.3f}<extra>A</extra>"),
            go.Scatter(x=t["pos"].to_numpy(), y=t["confidence_b"].to_numpy(), name=f"B {name_b}", mode="lines+markers",
                       text=hb, hovertemplate="pos %{x}<br>%{text}<br>confidence %{y:.3f}<extra>B</extra>"),
        ])
        if first is not None:
            conf.add_vline(x=first, line_dash="dash", line_color="red", annotation_text="first divergence")
        conf.update_layout(title="Confidence along the sequence", xaxis_title="position", yaxis_title="confidence")
        delta = go.Figure([
            go.Bar(x=t["pos"].to_numpy(), y=t["d_logprob"].to_numpy(), name="Δ logprob (B - A)"),
            go.Bar(x=t["pos"].to_numpy(), y=t["d_confidence"].to_numpy(), name="Δ confidence (B - A)"),
        ])
        delta.update_layout(title="Per-position change", xaxis_title="position", barmode="group")
        h = self.heads
        layers = sorted(set(h["layer"].to_list()))
        heads = sorted(set(h["head"].to_list()))
        grid = {(r["layer"], r["head"]): r["d_entropy"] for r in h.iter_rows(named=True)}
        z = [[grid.get((l, hd)) for hd in heads] for l in layers]
        lim = max([abs(v) for row in z for v in row if v is not None] + [1e-12])
        heat = go.Figure(go.Heatmap(z=z, x=heads, y=layers, colorscale="RdBu_r", zmin=-lim, zmax=lim,
                                    colorbar={"title": "Δ entropy"},
                                    hovertemplate="layer %{y} head %{x}<br>Δ entropy %{z:.4f}<extra></extra>"))
        heat.update_layout(title="Change in mean attention entropy (B - A)", xaxis_title="head", yaxis_title="layer")
        r = self.routing
        rout = go.Figure([go.Bar(x=r["layer"].to_list(), y=r["changed_share"].to_list(), name="slot differs"),
                          go.Bar(x=r["layer"].to_list(), y=r["set_changed_share"].to_list(), name="not in B's set")])
        rout.update_layout(title="Routing changes per MoE layer", xaxis_title="layer", yaxis_title="share of slots",
                           yaxis_range=[0, 1], barmode="group")
        return {"confidence": conf, "delta": delta, "heads": heat, "routing": rout}

    def to_json(self) -> str:
        return json.dumps(self.summary)

    def __repr__(self) -> str:
        s = self.summary
        under = f", b under {', '.join(s['interventions'])}" if s.get("interventions") else ""
        return (f"RunDiff({self.a} vs {self.b}: first divergence at {s['first_divergence_pos']}, "
                f"{s['token_diff_share']:.1%} tokens differ{under})")


def _token_frame(store: Store, a: str, b: str) -> pl.DataFrame:
    cols = ["pos", "token_id", "text", "is_prompt", "confidence", "logprob", "entropy"]
    ta, tb = (query.table(store, "tokens", r, "pos", cols=cols) for r in (a, b))
    j = ta.join(tb, on="pos", how="full", coalesce=True, suffix="_b")
    j = j.rename({c: f"{c}_a" for c in ("token_id", "text", "is_prompt", "confidence", "logprob", "entropy")})
    return j.sort("pos").with_columns(
        (pl.col("token_id_a") == pl.col("token_id_b")).fill_null(False).alias("same_token"),
        (pl.col("confidence_b") - pl.col("confidence_a")).alias("d_confidence"),
        (pl.col("logprob_b") - pl.col("logprob_a")).alias("d_logprob"),
        (pl.col("entropy_b") - pl.col("entropy_a")).alias("d_entropy"),
    ).select("pos", "token_id_a", "token_id_b", "text_a", "text_b", "same_token", "is_prompt_a", "is_prompt_b",
             "confidence_a", "confidence_b", "d_confidence", "logprob_a", "logprob_b", "d_logprob",
             "entropy_a", "entropy_b", "d_entropy")


def diff_runs(store: Store, a: str, b: str, tol: float = 1e-4) -> RunDiff:
    """Compare run ``b`` against run ``a``, aligned by position.

    Args:
        tol: tolerance for ``first_signal_divergence`` (the earliest signal, token or not, that differs).
    Returns: a ``RunDiff``; ``summary["first_divergence_pos"]`` is the first position whose token
        differs (or that only one run has), None when the token sequences are identical.
    Raises:
        RunNotFound: either id unknown.
    """
    ia, ib = query.run_row(store, a), query.run_row(store, b)
    tokens = _token_frame(store, a, b)
    both = tokens.filter(pl.col("token_id_a").is_not_null() & pl.col("token_id_b").is_not_null())
    differ = tokens.filter(~pl.col("same_token"))
    first = int(differ["pos"][0]) if differ.height else None
    heads = query.head_shift(store, a, b)
    routing = query.routing_agreement(store, a, b)
    d_conf = _abs_stats(both["d_confidence"])
    d_lp = _abs_stats(both["d_logprob"])
    d_h = _abs_stats(heads["d_entropy"]) if heads.height else (None, None)
    pa = json.loads(ia["params"] or "{}").get("prompt_ids")
    pb = json.loads(ib["params"] or "{}").get("prompt_ids")
    n_slots = int(routing["slots"].sum()) if routing.height else 0
    row = differ.row(0, named=True) if differ.height else None
    iv_a, iv_b = (stored_interventions(store, r)["spec"].to_list() for r in (a, b))
    # the weights each ran with: a fault or an in-place edit changes them under the same checkpoint hash (compared
    # at the same dtype: a cast is the same checkpoint); NULL (offloaded weights) compares as unknown
    wa, wb = ia.get("weights_sha256"), ib.get("weights_sha256")
    same_weights = None if wa is None or wb is None or ia["dtype"] != ib["dtype"] else wa == wb
    summary = {
        "run_a": a, "run_b": b, "dtype_a": ia["dtype"], "dtype_b": ib["dtype"],
        "same_checkpoint": ia["checkpoint_sha256"] == ib["checkpoint_sha256"] and same_weights is not False,
        "same_weights": same_weights,
        "interventions_a": iv_a, "interventions_b": iv_b,
        # what b ran under that a did not, and the reverse (b a child of a: its interventions)
        "interventions": [x for x in iv_b if x not in iv_a],
        "interventions_removed": [x for x in iv_a if x not in iv_b],
        "b_is_child_of_a": ib.get("parent_run_id") == a,
        "same_prompt": pa == pb if pa is not None and pb is not None else ia["prompt"] == ib["prompt"],
        "n_tokens_a": int(tokens["token_id_a"].is_not_null().sum()),
        "n_tokens_b": int(tokens["token_id_b"].is_not_null().sum()),
        "n_compared": both.height,
        "first_divergence_pos": first,
        "first_divergence_tokens": None if row is None else {"a": row["text_a"], "b": row["text_b"],
                                                            "token_id_a": row["token_id_a"],
                                                            "token_id_b": row["token_id_b"]},
        "token_diff_share": (int((~both["same_token"]).sum()) / both.height) if both.height else 0.0,
        "mean_abs_d_confidence": d_conf[0], "max_abs_d_confidence": d_conf[1],
        "mean_abs_d_logprob": d_lp[0], "max_abs_d_logprob": d_lp[1],
        "mean_abs_d_head_entropy": d_h[0], "max_abs_d_head_entropy": _f(heads["max_abs_d_entropy"].max())
        if heads.height else None,
        "routing_change_share": {str(r["layer"]): _f(r["changed_share"]) for r in routing.iter_rows(named=True)},
        "routing_set_change_share": {str(r["layer"]): _f(r["set_changed_share"])
                                     for r in routing.iter_rows(named=True)},
        "routing_change_share_all": (int(routing["changed_slots"].sum()) / n_slots) if n_slots else 0.0,
        "first_signal_divergence": first_divergence(store, a, b, tol),
    }
    return RunDiff(a, b, summary, tokens, heads, routing)


# -- comparing two runs signal by signal ------------------------------------------------------------

# compared signals per table, from the registry: (key columns, exact columns, columns within a tolerance)
COMPARED: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    name: (t.names("key"), t.names("exact"), t.names("tol")) for name, t in SIGNAL_TABLES.items() if t.names("key")
    and (t.names("exact") or t.names("tol"))}
# order among signals of the same step and position: the registry's (the token fed there first, then
# what it caused)
_TABLE_ORDER = {name: i for i, name in enumerate(COMPARED)}


def _signal_frames(store: Store, table: str, a: str, b: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    keys, exact, tol = COMPARED[table]
    return query.table_pair(store, table, a, b, ", ".join(keys), cols=[*keys, *exact, *tol])


def _differs(a: Any, b: Any, tol: float) -> tuple[bool, float | None]:
    """(differs, magnitude) for two values; NULL equals NULL and NaN equals NaN (both recorded the same)."""
    if a is None or b is None:
        return (a is None) != (b is None), None
    if isinstance(a, float) or isinstance(b, float):
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) != math.isnan(fb), None
        if math.isinf(fa) or math.isinf(fb):
            return fa != fb, None
        d = abs(fa - fb)
        return d > tol, d
    return a != b, float(abs(a - b)) if isinstance(a, (int, float)) else None


def _plain(x: Any) -> Any:
    """JSON-safe value: non-finite floats become the strings "nan" / "inf" / "-inf"."""
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def first_divergence(store: Store, a: str, b: str, tol: float = 1e-4,
                     n_prompt: int | None = None) -> dict | None:
    """The earliest (by step, then position) signal on which run ``b`` departs from run ``a``.

    Discrete signals (token ids, ranks, experts, cache sizes) must be equal; real-valued ones within
    ``tol`` (absolute). Returns None when everything matches, else ``{"step", "pos", "signal",
    "magnitude", "a", "b", ...}``; ``signal`` is ``table.column`` and ``magnitude`` the absolute
    difference (None for a missing row or a NULL/NaN mismatch).
    """
    if n_prompt is None:
        n_prompt = int(query.run_row(store, a)["n_prompt_tokens"] or 0)
    best: tuple | None = None
    for table, (keys, exact, tolerant) in COMPARED.items():
        fa, fb = _signal_frames(store, table, a, b)
        if fa.height == 0 and fb.height == 0:
            continue
        # a full join leaves the absent side's columns NULL; the marker columns tell absent from NULL
        fa = fa.with_columns(pl.lit(True).alias("_a"))
        fb = fb.with_columns(pl.lit(True).alias("_b"))
        j = fa.join(fb, on=list(keys), how="full", suffix="_b", coalesce=True, nulls_equal=True) \
            .with_columns(pl.col("_a").fill_null(False), pl.col("_b").fill_null(False))
        if "step" in keys:
            j = j.with_columns(pl.col("step").alias("_step"))
        elif table == "tokens":  # produced at step pos - n_prompt; the prompt comes with the prefill
            j = j.with_columns(pl.max_horizontal(pl.col("pos") - n_prompt, pl.lit(0)).alias("_step"))
        else:  # attention / routing rows belong to the step that fed the position
            j = j.with_columns(pl.max_horizontal(pl.col("pos") - n_prompt + 1, pl.lit(0)).alias("_step"))
        if "step" in keys:  # per-step snapshots are ordered at the step's newest fed position
            j = j.with_columns(pl.when(pl.col("step") == 0).then(n_prompt - 1)
                               .otherwise(n_prompt + pl.col("step") - 1).alias("_pos"))
        else:
            j = j.with_columns(pl.col("pos").alias("_pos"))
        bad = [~pl.col("_a") | ~pl.col("_b")]
        for c in exact:
            bad.append(pl.col(c).is_null() != pl.col(f"{c}_b").is_null())
            bad.append((pl.col(c) != pl.col(f"{c}_b")).fill_null(False))
        for c in tolerant:
            a_, b_ = pl.col(c).cast(pl.Float64), pl.col(f"{c}_b").cast(pl.Float64)
            bad.append(a_.is_null() != b_.is_null())
            bad.append((a_.is_nan() != b_.is_nan()).fill_null(False))
            bad.append(((a_ - b_).abs() > tol).fill_null(False))
        hits = j.filter(pl.any_horizontal(bad)).sort(["_step", "_pos", *keys])
        if hits.height == 0:
            continue
        row = hits.row(0, named=True)
        order = (row["_step"], row["_pos"], _TABLE_ORDER[table])
        if best is not None and order >= best[0]:
            continue
        if not row["_a"] or not row["_b"]:
            hit = {"signal": f"{table}.missing", "magnitude": None,
                   "a": "present" if row["_a"] else "absent", "b": "present" if row["_b"] else "absent"}
        else:
            hit = {}
            for c in (*exact, *tolerant):
                differs, mag = _differs(row[c], row[f"{c}_b"], 0.0 if c in exact else tol)
                if differs:
                    hit = {"signal": f"{table}.{c}", "magnitude": mag, "a": _plain(row[c]), "b": _plain(row[f"{c}_b"])}
                    break
        where = {("cached_pos" if k == "pos" else k): row[k] for k in keys
                 if k != "step" and not (k == "pos" and table != "kv_tokens")}
        best = (order, {"step": int(row["_step"]), "pos": int(row["_pos"]), **hit, **where})
    return best[1] if best else None
