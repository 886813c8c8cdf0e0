"""The Contrast tab: which experts two batches choose at different rates (``Workbench.expert_contrast``: per-run
shares, Welch's t over runs; SteerMoE's detection step), as a ranked table and a layer x expert heat map of the
difference, and "Steer set A": ban or boost the top N experts and re-record every run of batch A under it
(``Workbench.steer``), each as a child run.

Stored strings (batch and run ids, error messages) reach the page through ``md_plain`` (Markdown), Dropdown labels
or ``str`` table columns; the figure's hover holds numbers only."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.apps.shared import READ, AppContext, Page, empty_table, fail, table
from workbench.apps.tabs.batches import batch_choices
from workbench.data import query
from workbench.run import Workbench
from workbench.views.figures import contrast_figure
from workbench.views.markup import defuse, md_plain

RANK_COLUMNS = ["layer", "expert", "share_a", "share_b", "diff", "p", "rank"]
CHILD_COLUMNS = ["run_id", "parent_run_id", "status", "interventions"]
STEER_ACTIONS = ["ban", "boost"]


def contrast_choices(app: AppContext, a: str | None, b: str | None):
    """Both pickers, read now: A keeps its batch (else the newest), B its own (else the next one after A)."""
    ids = query.batches(app.store)["batch_id"].to_list()
    a = a if a in ids else (ids[0] if ids else None)
    b = b if b in ids and b != a else next((i for i in ids if i != a), None)
    return batch_choices(app, a), batch_choices(app, b) if b else gr.Dropdown(choices=[], value=None)


def _contrast(app: AppContext, batch_a: str, batch_b: str, generated_only: bool) -> pl.DataFrame:
    return Workbench(app.store).expert_contrast(batch_a, batch_b, generated_only=bool(generated_only))


def contrast_views(app: AppContext, batch_a: str | None, batch_b: str | None, generated_only: bool = False):
    """The ranked table (layer, expert, share_a, share_b, diff, p, rank), the heat map and a status line."""
    none = empty_table(RANK_COLUMNS)
    if not batch_a or not batch_b:
        return none, None, "Pick two batches (prompt sets: `workbench record --prompts FILE`)."
    if batch_a == batch_b:
        return none, None, "⚠️ Pick two different batches: a batch contrasted with itself differs nowhere."
    try:
        df = _contrast(app, batch_a, batch_b, generated_only)
    except (ValueError, query.RunNotFound) as e:
        return none, None, f"⚠️ {md_plain(str(e).splitlines()[0] if str(e) else type(e).__name__)}"
    shown = df.select(RANK_COLUMNS).with_columns(pl.col("share_a", "share_b", "diff").round(4),
                                                  pl.col("p").round(6))
    n_a, n_b = (int(df["n_a"][0]), int(df["n_b"][0])) if df.height else (0, 0)
    top = df.head(1).row(0, named=True) if df.height else None
    lead = (f" Largest: layer {top['layer']} expert {top['expert']} ({top['diff']:+.3f}"
            + (f", p {top['p']:.3g}" if top["p"] is not None else "") + ").") if top else ""
    return (shown, contrast_figure(df, f"Expert contrast: {batch_a} (A) minus {batch_b} (B)"),
            f"Expert contrast of batch {md_plain(batch_a)} (A, {n_a} runs) against {md_plain(batch_b)} (B, {n_b} "
            f"runs): {df.height} layer x expert rows, ranked by |diff|; p: Welch over runs, uncorrected.{lead}")


def _steer_model(app: AppContext, run_ids: list[str]):
    """The adapter every run of set A re-runs on when they all ran one checkpoint (the app's own module where it
    matches, else the checkpoint loaded once, hash-checked); None when they ran several (each loads its own)."""
    shas = {query.run_row(app.store, r)["checkpoint_sha256"] for r in run_ids}
    return app.run(run_ids[0]).adapter() if len(shas) == 1 else None


def steer(app: AppContext, batch_a: str | None, batch_b: str | None, action: str | None, top, delta,
          generated_only: bool = False, progress=gr.Progress()):
    """Ban (or boost by ``delta``) the ``top`` experts of the contrast and re-record every run of batch A under
    it (``Workbench.steer``): a status line naming the child runs, and their table."""
    nothing = empty_table(CHILD_COLUMNS)
    if not batch_a or not batch_b or batch_a == batch_b:
        return "Pick two different batches first.", nothing
    action = action or "ban"
    wb = Workbench(app.store)
    try:
        contrast = _contrast(app, batch_a, batch_b, generated_only)
        runs_a = wb.run_set(batch_a)
    except (ValueError, query.RunNotFound) as e:
        return f"⚠️ {md_plain(str(e).splitlines()[0] if str(e) else type(e).__name__)}", nothing
    try:
        model = _steer_model(app, runs_a)
    except Exception as e:  # no model for these runs (a module recorded elsewhere, a missing folder): one line
        return defuse(fail("Steering (it re-runs batch A on its runs' model)", e)), nothing
    kw = {} if model is None else {"model": model}
    progress(0.05, desc=f"re-recording {len(runs_a)} runs of {batch_a} with the top {top} experts {action}ned")
    try:
        children = wb.steer(batch_a, contrast, top=int(top or 1), action=action, delta=float(delta or 0.0), **kw)
    except Exception as e:  # a contrast with nothing on that side, a model that does not fit: say why
        return defuse(fail("Steering", e)), nothing
    for c in children:
        app.live[c.run_id] = c  # keeps its module: root cause of a child runs on it
    rows = pl.DataFrame({
        "run_id": [c.run_id for c in children],
        "parent_run_id": [str(c.info.get("parent_run_id") or "") for c in children],
        "status": [str(c.refresh().info["status"]) for c in children],
        "interventions": [", ".join(c.interventions()["spec"].to_list()) for c in children]},
        schema={c: pl.String for c in CHILD_COLUMNS})
    specs = rows["interventions"][0] if rows.height else ""
    return (f"Steered set A ({md_plain(batch_a)}) under {md_plain(specs)}: {len(children)} child runs "
            f"{md_plain(', '.join(rows['run_id'].to_list()))}; they are in the Runs tab.", rows)


def build(session: Page) -> None:
    with gr.Tab("Contrast", id="contrast") as tab:
        with gr.Row():
            pick_a = gr.Dropdown(label="Batch A", choices=[], elem_id="contrast-a", scale=3)
            pick_b = gr.Dropdown(label="Batch B", choices=[], elem_id="contrast-b", scale=3)
            gen_only = gr.Checkbox(value=False, label="generated tokens only", scale=1)
            btn = gr.Button("Contrast", scale=0, min_width=100, elem_id="contrast-button")
            again = gr.Button("↻", scale=0, min_width=60)
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="contrast-msg")
        with gr.Row():
            ranked = table(RANK_COLUMNS, "Experts ranked by |share A - share B|", elem_id="contrast-table")
            fig = gr.Plot(label="diff per MoE layer x expert", elem_id="contrast-plot")
        with gr.Accordion("Steer set A: ban or boost the top experts and re-record batch A", open=True):
            with gr.Row():
                action = gr.Radio(STEER_ACTIONS, value="ban", label="Action (ban: A's top experts; boost: B's)",
                                  elem_id="steer-action")
                top = gr.Number(value=3, precision=0, minimum=1, label="Top N", elem_id="steer-top")
                delta = gr.Number(value=1.0, label="Boost delta", elem_id="steer-delta")
                steer_btn = gr.Button("Steer set A", elem_id="steer-button")
            steer_msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="steer-msg")
            children = table(CHILD_COLUMNS, "Child runs", elem_id="steer-children", datatype="str")
    app = session.app
    choices, views = partial(contrast_choices, app), partial(contrast_views, app)
    pickers, out = [pick_a, pick_b], [ranked, fig, msg]
    tab.select(choices, pickers, pickers, api_name=False, **READ).then(views, [*pickers, gen_only], out,
                                                                       api_name=False)
    again.click(choices, pickers, pickers, api_name=False, **READ)
    for c in (pick_a, pick_b):
        c.input(views, [*pickers, gen_only], out, api_name=False)
    btn.click(views, [*pickers, gen_only], out, api_name="expert_contrast")
    steer_btn.click(partial(steer, app), [*pickers, action, top, delta, gen_only], [steer_msg, children],
                    api_name="steer")
