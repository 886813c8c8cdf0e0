"""Expert contrast: which (layer, expert) two sets of runs choose at different rates (SteerMoE's detection step,
arXiv 2509.09660), from the stored routing alone (no torch, no model).

For each run, layer and routed expert the *share* is the fraction of the run's routed tokens at that layer whose
chosen set holds the expert (over a layer, the shares of a run sum to top-k). ``share_a`` / ``share_b`` are the
means of the per-run shares over set A / set B, ``diff = share_a - share_b``.

Significance treats the **run as the unit**: tokens of one prompt route alike (neighbouring tokens, a repeated
identifier), so counting tokens as independent draws would call nearly any difference significant. ``p`` is
Welch's two-sided t-test of the per-run shares of A against B (unequal variances, Welch-Satterthwaite degrees of
freedom); both sets constant: p = 1 when equal, else 0; NULL when a set has fewer than two runs. It is a per-cell p
value, not corrected for the layers x experts tested (multiply by the number of rows for Bonferroni).

``rank`` orders the rows by |diff| (largest first), ties by p. ``workbench.Workbench.expert_contrast`` resolves batch
ids, run ids and prompt files to runs; ``Workbench.steer`` bans or boosts the top of a contrast and re-records set A.
"""
from __future__ import annotations

import numpy as np
import polars as pl
from scipy.stats import t as student_t

from workbench.data import query
from workbench.data.store import Store

COLUMNS = ["layer", "expert", "share_a", "share_b", "diff", "p", "rank", "n_a", "n_b"]


def _routed_experts(store: Store, run_ids: list[str]) -> tuple[list[int], int]:
    """(MoE layers, routed experts) shared by every run; a ValueError when the runs' models differ in them."""
    shapes = {}
    for rid in run_ids:
        s = query.model_summary(query.run_row(store, rid))
        shapes[rid] = (tuple(s.moe_layers), s.n_routed_experts)
    distinct = set(shapes.values())
    if len(distinct) > 1:
        raise ValueError("expert contrast needs runs of one model (the same MoE layers and experts); these differ: "
                         + "; ".join(f"{r}: layers {list(l)}, {e} experts" for r, (l, e) in list(shapes.items())[:4]))
    layers, n_exp = distinct.pop()
    if not layers or not n_exp:
        raise ValueError("expert contrast needs MoE runs with recorded routing; these runs have no routed layers")
    return list(layers), int(n_exp)


def run_shares(store: Store, run_ids: list[str], generated_only: bool = False) -> pl.DataFrame:
    """Per run x MoE layer x routed expert: ``share`` (fraction of the run's routed tokens at the layer that chose
    the expert; 0 where it chose none), ``tokens`` (the run's routed tokens at the layer)."""
    run_ids = list(dict.fromkeys(run_ids))
    layers, n_exp = _routed_experts(store, run_ids)
    ids = pl.DataFrame({"run_id": run_ids})
    where = ""
    if generated_only:
        where = "AND r.pos >= coalesce(x.n_prompt_tokens, 0) "
    counts = store.sql(f"""
        SELECT r.run_id, r.layer, r.expert, count(DISTINCT r.pos) AS n
        FROM routing r JOIN runs x USING (run_id)
        WHERE r.run_id IN (SELECT unnest($ids::VARCHAR[])) {where}
        GROUP BY ALL""", {"ids": run_ids})
    tokens = store.sql(f"""
        SELECT r.run_id, r.layer, count(DISTINCT r.pos) AS tokens
        FROM routing r JOIN runs x USING (run_id)
        WHERE r.run_id IN (SELECT unnest($ids::VARCHAR[])) {where}
        GROUP BY ALL""", {"ids": run_ids})
    grid = ids.join(pl.DataFrame({"layer": layers}, schema={"layer": pl.Int32}), how="cross").join(
        pl.DataFrame({"expert": list(range(n_exp))}, schema={"expert": pl.Int32}), how="cross")
    counts = counts.with_columns(pl.col("layer").cast(pl.Int32), pl.col("expert").cast(pl.Int32))
    tokens = tokens.with_columns(pl.col("layer").cast(pl.Int32))
    out = grid.join(counts, on=["run_id", "layer", "expert"], how="left").join(tokens, on=["run_id", "layer"],
                                                                               how="left")
    empty = out.filter(pl.col("tokens").is_null())["run_id"].unique().to_list()
    if empty:
        raise ValueError(f"run(s) {', '.join(sorted(empty)[:5])} have no routing rows"
                         + (" among their generated tokens" if generated_only else "")
                         + ": record them with the routing probe")
    return out.with_columns((pl.col("n").fill_null(0) / pl.col("tokens")).alias("share")).select(
        "run_id", "layer", "expert", "share", "tokens")


def welch_p(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two-sided Welch t-test p values, row by row: ``a`` [C, n_a] and ``b`` [C, n_b] (NaN: a set under 2 runs)."""
    na, nb = a.shape[1], b.shape[1]
    if na < 2 or nb < 2:
        return np.full(a.shape[0], np.nan)
    ma, mb = a.mean(1), b.mean(1)
    va, vb = a.var(1, ddof=1) / na, b.var(1, ddof=1) / nb
    se2 = va + vb
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (ma - mb) / np.sqrt(se2)
        df = se2 ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1))
        p = 2 * student_t.sf(np.abs(t), df)
    constant = se2 <= 0
    p[constant] = np.where(np.isclose(ma[constant], mb[constant], rtol=0, atol=1e-12), 1.0, 0.0)
    return p


def expert_contrast(store: Store, runs_a: list[str], runs_b: list[str], generated_only: bool = False) -> pl.DataFrame:
    """Rank (layer, expert) by how much more often set A's runs choose it than set B's.

    Returns one row per MoE layer x routed expert: layer, expert, share_a, share_b, diff (= share_a - share_b),
    p (Welch over runs; see the module doc), rank (1 = largest |diff|), n_a, n_b (runs in each set).
    ``generated_only``: count generated tokens only (the prompt's tokens left out).
    """
    runs_a, runs_b = list(dict.fromkeys(runs_a)), list(dict.fromkeys(runs_b))
    if not runs_a or not runs_b:
        raise ValueError("expert contrast needs at least one run in each set")
    both = set(runs_a) & set(runs_b)
    if both:
        raise ValueError(f"run(s) {', '.join(sorted(both)[:5])} are in both sets")
    shares = run_shares(store, runs_a + runs_b, generated_only)
    wide = shares.pivot(on="run_id", index=["layer", "expert"], values="share").sort("layer", "expert")
    a = wide.select(runs_a).to_numpy().astype(np.float64)
    b = wide.select(runs_b).to_numpy().astype(np.float64)
    sa, sb = a.mean(1), b.mean(1)
    p = welch_p(a, b)
    out = wide.select("layer", "expert").with_columns(
        pl.Series("share_a", sa), pl.Series("share_b", sb), pl.Series("diff", sa - sb),
        pl.Series("p", p).fill_nan(None), pl.lit(len(runs_a), pl.Int32).alias("n_a"),
        pl.lit(len(runs_b), pl.Int32).alias("n_b"))
    out = out.sort([pl.col("diff").abs(), pl.col("p")], descending=[True, False], nulls_last=True, maintain_order=True)
    return out.with_columns(pl.arange(1, out.height + 1, dtype=pl.Int32).alias("rank")).select(COLUMNS)


def steer_targets(contrast: pl.DataFrame, top: int = 3, action: str = "ban", side: str | None = None,
                  delta: float = 1.0) -> list[str]:
    """The intervention specs that "ban" or "boost" the ``top`` experts of a contrast (its ``rank`` order).

    ``side``: whose experts: "a" (diff > 0, chosen more by set A) or "b" (diff < 0); default "a" for ban (take
    away what sets A apart) and "b" for boost (push A toward B). Boost adds ``delta`` to their selection score."""
    if action not in ("ban", "boost"):
        raise ValueError(f"action must be 'ban' or 'boost', got {action!r}")
    side = side or ("a" if action == "ban" else "b")
    if side not in ("a", "b"):
        raise ValueError(f"side must be 'a' or 'b', got {side!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an integer >= 1, got {top!r}")
    rows = contrast.filter(pl.col("diff") > 0 if side == "a" else pl.col("diff") < 0).sort("rank").head(top)
    if action == "ban":
        return [f"ban:L{r['layer']}E{r['expert']}" for r in rows.iter_rows(named=True)]
    value = repr(float(delta)).removesuffix(".0")
    return [f"boost:L{r['layer']}E{r['expert']}={value}" for r in rows.iter_rows(named=True)]

