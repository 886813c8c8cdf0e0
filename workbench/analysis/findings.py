"""Findings: a run's anomaly rows grouped into one diagnosis per component or token span.

Rows (warning and critical) become findings by what they point at:

- ``non_finite`` rows: one finding at the first layer whose residual stream (else any signal) holds NaN/Inf;
- ``head_norm_outlier`` / ``entropy_spike`` / ``entropy_collapse`` / ``entropy_shift``: one finding per (layer, head);
- ``overloaded_expert`` / ``dead_expert`` / ``starved_expert``: one per (layer, expert); ``routing_collapse``: one per
  layer;
- ``resid_norm_outlier``: each flagged position is attributed to the first layer where its residual norm
  is out of range (later layers only carry the damage on); per such layer, if the flagged positions are
  concentrated on one routed expert of that layer (hypergeometric test against the run's routing), the
  finding names that expert; else it joins that layer's head finding if there is one; else it names the
  layer's feed-forward block (its shared experts, in an MoE layer);
- ``kv_norm_outlier``: one per layer of the KV cache; ``cache_mismatch`` (the recorded run against a forward of its
  tokens without the cache): one ``kv`` finding at the first layer whose residual stream differs, first after NaN/Inf;
- ``head_entropy_shift`` / ``head_norm_shift`` (run-level): with the head's rows; ``block_shift``: one ``layer`` finding
  per layer;
- ``low_confidence`` / ``high_surprise``: one per span of consecutive token positions;
- ``repetition``: one ``generation`` finding per loop, repeated span or copy (degenerate generation);
- ``component_outlier`` (a component's activations against the model's activation profile): one finding per
  component (its input norms, attention block, rotary part and what it adds to the stream: a ``layer`` finding).

Columns: rank, component (kind: head | expert | router | shared_expert | mlp | layer | kv | tokens |
generation | non_finite | embedding | unembedding), layer, head, expert, pos_start, pos_end, positions (the evidence), n_rows, kinds, severity,
score (the strongest row's -log10 q), explanation (one line).

Order: by severity (NaN/Inf first, then a recording unlike its model's own computation), then layer by layer, the
layer with the strongest finding first, and within a layer upstream first (a head, then the KV cache, the router,
routed experts, shared experts / the feed-forward block: what a head breaks, the router and experts of its layer
read), findings without a layer by their score.
"""
from __future__ import annotations

import math

import polars as pl
from scipy.stats import hypergeom

from workbench.analysis.anomalies import detect
from workbench.data import query

SCHEMA = {"rank": pl.Int32, "component": pl.Utf8, "layer": pl.Int32, "head": pl.Int32, "expert": pl.Int32,
          "pos_start": pl.Int32, "pos_end": pl.Int32, "positions": pl.List(pl.Int32), "n_rows": pl.Int32,
          "kinds": pl.List(pl.Utf8), "severity": pl.Utf8, "score": pl.Float64, "explanation": pl.Utf8}
HEAD_KINDS = ("head_norm_outlier", "entropy_spike", "entropy_collapse", "entropy_shift", "head_entropy_shift",
              "head_norm_shift")
EXPERT_KINDS = ("overloaded_expert", "dead_expert", "starved_expert")
SEVERITY = {"critical": 0, "warning": 1, "info": 2}
# a component_outlier row's component kind (workbench.analysis.activations) -> the finding's component
COMPONENT_OF = {"head": "head", "expert": "expert", "router": "router", "shared_expert": "shared_expert",
                "mlp_block": "mlp", "dense_mlp": "mlp", "kv_latent": "kv", "embed": "embedding",
                "unembed": "unembedding", "final_norm": "final_norm"}
UPSTREAM = {c: i for i, c in enumerate(("non_finite", "head", "kv", "router", "expert", "shared_expert", "mlp",
                                        "layer"))}


def _finding(component: str, rows: pl.DataFrame, explanation: str, layer=None, head=None, expert=None,
             positions: list[int] | None = None) -> dict:
    pos = sorted(set(positions if positions is not None else [p for p in rows["pos"].to_list() if p is not None]))
    sev = min(rows["severity"].to_list(), key=lambda s: SEVERITY[s])
    return {"component": component, "layer": layer, "head": head, "expert": expert,
            "pos_start": pos[0] if pos else None, "pos_end": pos[-1] if pos else None, "positions": pos,
            "n_rows": rows.height, "kinds": sorted(set(rows["kind"].to_list())), "severity": sev,
            "score": float(rows["score"].max()), "explanation": explanation}


def _where(pos: list[int]) -> str:
    if not pos:
        return ""
    return f" at {len(pos)} position{'s' if len(pos) > 1 else ''} ({pos[0]}" + (f"-{pos[-1]})" if len(pos) > 1 else ")")


def group_findings(anomalies: pl.DataFrame, routing: pl.DataFrame | None = None,
                   shared_experts: bool = False) -> pl.DataFrame:
    """Findings from a run's anomaly rows (and its routing, to name the expert behind residual outliers)."""
    a = anomalies.filter(pl.col("severity") != "info")
    out: list[dict] = []
    nf = a.filter(pl.col("kind") == "non_finite")
    if nf.height:
        layered = nf.filter(pl.col("layer").is_not_null() & pl.col("explanation").str.contains("resid_norm"))
        first = int(layered["layer"].min()) if layered.height else (
            int(nf["layer"].min()) if nf["layer"].drop_nulls().len() else None)
        where = f"first in layer {first}" if first is not None else "in the recorded signals"
        out.append(_finding("non_finite", nf, f"NaN/Inf values {where}: {nf['explanation'][0]}", layer=first))
    heads: dict[tuple, pl.DataFrame] = {}
    for (layer, head), g in a.filter(pl.col("kind").is_in(HEAD_KINDS)).group_by("layer", "head", maintain_order=True):
        heads[(layer, head)] = g
    resid = a.filter(pl.col("kind") == "resid_norm_outlier")
    extra_head_rows: dict[tuple, list] = {}
    if resid.height:
        first_layer = resid.group_by("pos").agg(pl.col("layer").min().alias("first"))
        for (layer,), g in first_layer.group_by("first", maintain_order=True):
            pos = sorted(g["pos"].to_list())
            rows = resid.filter(pl.col("pos").is_in(pos) & (pl.col("layer") == layer))
            expert = _concentrated_expert(routing, int(layer), pos)
            head_here = [k for k in heads if k[0] == layer and heads[k]["kind"].str.contains("head_norm").any()]
            if expert is not None:
                e, k = expert
                out.append(_finding("expert", rows, f"layer {layer} expert {e}: the residual stream's norm jumps after "
                                    f"the block{_where(pos)}, {k} of them routed to expert {e}", layer=layer,
                                    expert=e, positions=pos))
            elif head_here:
                extra_head_rows.setdefault(head_here[0], []).append(rows)
            else:
                comp = "shared_expert" if shared_experts else "mlp"
                what = "its shared experts" if shared_experts else "its feed-forward block"
                move = "drops" if rows["explanation"].str.contains("unusually low").all() else "jumps"
                out.append(_finding(comp, rows, f"layer {layer}: the residual stream's norm {move} after the block"
                                    f"{_where(pos)}, with no single head or routed expert behind it (look at {what})",
                                    layer=layer, positions=pos))
    for (layer, head), g in heads.items():
        rows = pl.concat([g, *extra_head_rows.get((layer, head), [])], how="vertical_relaxed")
        pos = sorted(set(p for p in rows["pos"].to_list() if p is not None))
        what = _head_words(g)
        out.append(_finding("head", rows, f"layer {layer} head {head}: {what}{_where(pos)}", layer=layer, head=head))
    for (layer, expert), g in a.filter(pl.col("kind").is_in(EXPERT_KINDS)) \
            .group_by("layer", "expert", maintain_order=True):
        k = set(g["kind"].to_list())
        what = ("the router sends it far more tokens than usual" if "overloaded_expert" in k else
                "the router sends it no token" if "dead_expert" in k else
                "the router sends it far fewer tokens than the profile expects")
        out.append(_finding("expert", g, f"layer {layer} expert {expert}: {what} ({g['explanation'][0]})",
                            layer=layer, expert=expert))
    for (layer,), g in a.filter(pl.col("kind") == "block_shift").group_by("layer", maintain_order=True):
        way = "weaker" if g["explanation"].str.contains("unusually low").all() else "stronger"
        out.append(_finding("layer", g, f"layer {layer}: the block changes the residual stream {way} than on clean "
                            f"runs, all run long ({g['explanation'][0]})", layer=layer, positions=[]))
    for (layer,), g in a.filter(pl.col("kind") == "routing_collapse").group_by("layer", maintain_order=True):
        out.append(_finding("router", g, f"layer {layer}: the router's load is concentrated on few experts", layer=layer))
    for r in a.filter(pl.col("kind") == "cache_mismatch").iter_rows(named=True):
        one = a.filter(pl.col("kind") == "cache_mismatch")
        where = f"layer {r['layer']}: " if r["layer"] is not None else ""
        out.append(_finding("kv", one, f"{where}{r['explanation']}", layer=r["layer"], positions=[r["pos"]]))
    for (layer,), g in a.filter(pl.col("kind") == "kv_norm_outlier").group_by("layer", maintain_order=True):
        pos = sorted(g["pos"].to_list())
        out.append(_finding("kv", g, f"layer {layer}: cached KV entries out of their usual range{_where(pos)}",
                            layer=layer))
    for r in a.filter(pl.col("kind") == "component_outlier").iter_rows(named=True):
        one = a.filter((pl.col("kind") == "component_outlier") & (pl.col("explanation") == r["explanation"]))
        kind = r.get("component") or r["explanation"].rsplit(", ", 1)[-1].rstrip(")")  # older rows: from the text
        out.append(_finding(COMPONENT_OF.get(kind, "layer"), one, r["explanation"], layer=r["layer"],
                            head=r["head"], expert=r["expert"], positions=[] if r["pos"] is None else [r["pos"]]))
    tok = a.filter(pl.col("kind").is_in(["low_confidence", "high_surprise"])).sort("pos")
    if tok.height:
        span = (pl.col("pos").diff().fill_null(0) > 1).cum_sum()
        for _, g in tok.with_columns(span.alias("_span")).group_by("_span", maintain_order=True):
            pos = sorted(set(g["pos"].to_list()))
            out.append(_finding("tokens", g.drop("_span"), f"tokens {pos[0]}-{pos[-1]}: the model was unusually unsure "
                                f"or surprised ({len(pos)} token{'s' if len(pos) > 1 else ''})"))
    for r in a.filter(pl.col("kind") == "repetition").sort("pos").iter_rows(named=True):
        one = a.filter((pl.col("kind") == "repetition") & (pl.col("pos") == r["pos"])
                       & (pl.col("explanation") == r["explanation"]))
        n = int(r["score"] or 0)
        out.append(_finding("generation", one, f"degenerate generation: {r['explanation']}",
                            positions=list(range(r["pos"], r["pos"] + n)) if r["pos"] is not None else []))
    if not out:
        return pl.DataFrame(schema=SCHEMA)
    df = pl.DataFrame(out, schema={k: v for k, v in SCHEMA.items() if k != "rank"})
    sev = pl.col("severity").replace_strict(SEVERITY, return_dtype=pl.Int32)
    # NaN/Inf leads: everything after it is its consequence; then a recording unlike its model's own computation
    # (cache_mismatch): the other findings describe what the cached path computed, which root cause cannot replay
    first = pl.when(pl.col("component") == "non_finite").then(0).when(
        pl.col("kinds").list.contains("cache_mismatch")).then(1).otherwise(2)
    # one layer's findings stay together (ranked by the layer's strongest), upstream first: a head's output feeds
    # the router and the experts of its layer, so their findings there are likely its consequence
    group = pl.when(pl.col("layer").is_null()).then(-1 - pl.int_range(pl.len())).otherwise(pl.col("layer"))
    df = df.with_columns(group.alias("_g"), sev.alias("_sev")).with_columns(
        pl.col("score").max().over("_g", "_sev").alias("_gs"),
        pl.col("component").replace_strict(UPSTREAM, default=len(UPSTREAM), return_dtype=pl.Int32).alias("_up"))
    df = df.sort("_sev", first, "_gs", "_g", "_up", "score", descending=[False, False, True, False, False, True],
                 maintain_order=True).drop("_g", "_sev", "_gs", "_up")
    return df.with_columns(pl.arange(1, df.height + 1, dtype=pl.Int32).alias("rank")).select(list(SCHEMA))


def _head_words(g: pl.DataFrame) -> str:
    """What a head's rows say, in words (the strongest kind first)."""
    kinds = set(g["kind"].to_list())
    low = g["explanation"].str.contains("unusually low")
    for kind in ("head_norm_outlier", "head_norm_shift"):
        if kind in kinds:
            norm_low = low.filter(g["kind"] == kind)
            return "its output is unusually small" if norm_low.all() else "its output is unusually large"
    if "entropy_collapse" in kinds:
        return "its attention collapsed onto a few keys"
    if "entropy_spike" in kinds:
        return "its attention is unusually diffuse"
    if "head_entropy_shift" in kinds:
        shift_low = low.filter(g["kind"] == "head_entropy_shift")
        return ("its attention is sharper than on clean runs, all run long" if shift_low.all() else
                "its attention is flatter than on clean runs, all run long")
    return "its attention moved from the reference's"


def _concentrated_expert(routing: pl.DataFrame | None, layer: int, positions: list[int]) -> tuple[int, int] | None:
    """(expert, count) if the positions are routed to one expert of ``layer`` far more than the run's other
    positions are (hypergeometric p < 1e-3 and at least 80% of them), else None."""

    if routing is None or routing.height == 0 or len(positions) < 2:
        return None
    r = routing.filter(pl.col("layer") == layer).unique(["pos", "expert"])
    if r.height == 0:
        return None
    n_pos = r["pos"].n_unique()
    flagged = r.filter(pl.col("pos").is_in(positions))
    n_flag = flagged["pos"].n_unique()
    best = None
    for (e,), g in flagged.group_by("expert"):
        k = g.height
        total = r.filter(pl.col("expert") == e).height
        p = float(hypergeom.sf(k - 1, n_pos, total, n_flag))
        if k >= math.ceil(0.8 * n_flag) and p < 1e-3 and (best is None or p < best[2]):
            best = (int(e), k, p)
    return None if best is None else best[:2]


def findings(store, run_id: str, **thresholds) -> pl.DataFrame:
    """The run's findings, ranked (detecting its anomalies first if that never ran)."""

    rows = detect(store, run_id, **thresholds)
    s = query.run_summary(store, run_id)
    return group_findings(rows, query.routing(store, run_id), shared_experts=bool(s.n_shared_experts))
