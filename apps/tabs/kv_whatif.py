"""The KV what-if tab: the picked run's tokens re-run with KV-cache policies, against the full cache."""
from __future__ import annotations

import re
from functools import partial

import gradio as gr
import polars as pl

from workbench.apps.shared import READ, AppContext, Page, empty_table, fail, frames_of, table
from workbench.views.figures import fig_kv_pareto
from workbench.views.markup import defuse, md_plain
from workbench.views.recording import record_threads
from workbench.views.session import Session

KV_POLICY_CHOICES = ["full", "window:sink=4,recent=64", "window:sink=4,recent=16", "heavy_hitters:budget=32",
                     "entropy", "confidence:threshold=0.85", "confidence:shallow=0.80,deep=0.92", "topk_int8:k=512",
                     "topk_int8:k=16", "quant_tree", "recompute:delta=0.012,window=3"]
KV_POLICY_DEFAULT = ["full", "window:sink=4,recent=16", "heavy_hitters:budget=32", "topk_int8:k=16", "quant_tree"]
COLUMNS = ["policy", "memory_kept", "bytes_kept", "bytes_full", "delta_nll", "top1_agreement", "first_divergence",
           "events"]


def kv_shown(df: pl.DataFrame | None) -> pl.DataFrame:
    """A KV what-if frame for display: memory kept as a share, numbers rounded (the store keeps them whole)."""
    if df is None or df.height == 0:
        return empty_table(COLUMNS)
    return df.select(pl.col("policy").cast(pl.String),
                     (pl.col("bytes_kept") / pl.col("bytes_full").clip(1)).round(4).alias("memory_kept"),
                     "bytes_kept", "bytes_full", pl.col("delta_nll").round(5), pl.col("top1_agreement").round(4),
                     "first_divergence", "events")


def kv_whatif_stored(app: AppContext, s: Session, run_id: str | None):
    """The KV what-if rows stored for the run (``policy_results``) and their Pareto figure."""
    f = frames_of(s, run_id)
    if f is None:
        return "Choose a run.", empty_table(COLUMNS), None
    df = f.policy_results
    msg = (f"{df.height} stored polic{'ies' if df.height != 1 else 'y'} for {md_plain(run_id)}." if df.height else
           "No KV what-if results for this run yet: pick policies and press Run.")
    return msg, kv_shown(df), fig_kv_pareto(df)


def kv_whatif_run(app: AppContext, s: Session, run_id: str | None, picked: list[str] | None, extra: str,
                  progress=gr.Progress()):
    """Re-run the run's tokens with each chosen policy (``Run.kv_whatif``); the table and the figure."""
    if not run_id:
        return "Choose a run first.", empty_table(COLUMNS), None
    specs = list(picked or []) + [x.strip() for x in re.split(r"[;\n]", extra or "") if x.strip()]
    if not specs:
        return "Pick at least one policy (or type a spec).", empty_table(COLUMNS), None
    progress(0.05, desc=f"re-running the run's tokens with {len(specs)} KV policies")
    try:
        with record_threads():
            df = app.run(run_id).kv_whatif(specs)
    except gr.Error:
        raise
    except Exception as e:  # a bad spec, a model that is not here: say why, keep the app alive
        return defuse(fail("KV what-if", e)), empty_table(COLUMNS), None
    progress(1.0, desc="done")
    f = frames_of(s, run_id)
    if f is not None:
        f.forget("policy_results")
    return (f"{df.height} policies re-run on {md_plain(run_id)} (stored in policy_results).", kv_shown(df),
            fig_kv_pareto(df))


def build(session: Page) -> None:
    with gr.Tab("KV what-if", id="kvwhatif") as tab:
        gr.Markdown("Re-run the picked run's tokens teacher-forced with KV-cache policies acting on the cache, "
                    "against the full cache: Δ NLL (nats per generated token), top-1 agreement, memory kept at the "
                    "end (`workbench kv-whatif`; the specs: `workbench.analysis.kv_policies`).")
        with gr.Row():
            pick = gr.CheckboxGroup(label="Policies", choices=KV_POLICY_CHOICES, value=KV_POLICY_DEFAULT,
                                    elem_id="kvw-policies", scale=3)
            with gr.Column(scale=1):
                extra = gr.Textbox(label="More specs (one per line or ; separated)", lines=3,
                                   placeholder="window:sink=2,recent=32", elem_id="kvw-extra")
                btn = gr.Button("Run what-if", variant="primary", elem_id="kvw-run")
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="kvw-msg")
        df = table(COLUMNS, "Policies against the full cache", elem_id="kvw-table")
        plot = gr.Plot(label="Memory kept vs Δ NLL", elem_id="kvw-plot")
    app, state, run_pick = session.app, session.state, session.run_pick
    btn.click(partial(kv_whatif_run, app), [state, run_pick, pick, extra], [msg, df, plot], api_name="kv_whatif")
    tab.select(partial(kv_whatif_stored, app), [state, run_pick], [msg, df, plot], api_name=False, **READ)
