"""The Run view: the picked run's header and token strip, the token at a position (top-k, heads, routing),
its root cause (Explain, against an optional reference run), the patch scan against the reference (a heat map
layer x part of what restores the token), the logit lens, and the Interventions panel (the
prompt re-run with an expert banned, boosted or forced or a head scaled, as a child run, and what changed)."""
from __future__ import annotations

import json
from functools import partial

import gradio as gr
import polars as pl

from workbench.analysis.diff import diff_runs
from workbench.analysis.rootcause import cache_note, ig_check
from workbench.apps.shared import (
    COLOR_MAP,
    LAST,
    AppContext,
    Page,
    empty_table,
    error_text,
    fail,
    frames_of,
    strip_value,
    table,
)
from workbench.apps.tabs.runs import reference_choices
from workbench.data import query
from workbench.interventions import ban_expert, boost_expert, force_expert, normalize, scale_head
from workbench.views.figures import logit_lens_figure, patch_scan_figure
from workbench.views.markup import defuse, md_plain
from workbench.views.session import RunFrames, Session

TOKEN_COLUMNS = ["pos", "token", "token_id", "prompt", "prob", "confidence", "entropy", "rank"]
CAUSE_COLUMNS = ["rank", "kind", "layer", "head", "expert", "source_pos", "score", "method"]
TITLE = "## MoE observability workbench"
IV_ACTIONS = ["ban expert", "boost expert", "force expert", "scale head", "only the specs typed"]
CHANGED_COLUMNS = ["pos", "text_a", "text_b", "confidence_a", "confidence_b", "d_logprob"]


def run_summary(f: RunFrames) -> dict:
    """The run's summary (``Run.summary``'s keys) from its frames."""
    t = f.tokens
    gen = t.filter(~pl.col("is_prompt"))
    return {"run_id": f.run_id, "status": f.info["status"], "model": f.info["model"],
            "architecture": f.summary.describe(), "dtype": f.info["dtype"],
            "prompt_tokens": int(t["is_prompt"].sum()) if t.height else 0, "generated_tokens": gen.height,
            "mean_confidence": float(gen["confidence"].mean()) if gen.height else None,
            "low_confidence_tokens": int((gen["confidence"] < 0.2).sum()) if gen.height else 0}


def run_header(f: RunFrames, s: dict) -> str:
    esc = md_plain  # stored strings reach the page as text (no markup, links or math)
    head = f"**{esc(s['run_id'])}** · {esc(s['status'])}"
    if s["mean_confidence"] is not None:
        head += (f" · {s['prompt_tokens']} prompt + {s['generated_tokens']} generated tokens · mean confidence "
                 f"{s['mean_confidence']:.3f}")
    head += f"  \n{esc(s['architecture'])}"
    if f.info.get("parent_run_id"):
        head += f"  \nchild of {esc(f.info['parent_run_id'])}"
    if f.info.get("notes"):
        head += f"  \n⚠️ {esc(f.info['notes'])}"
    if f.info.get("error"):
        head += f"  \n⚠️ error: {esc(f.info['error'])}"
    return head


def page_header(f: RunFrames | None, db_name: str = "", read_only: bool = False) -> str:
    """The page's title line: the picked run's model family (``ModelSummary.describe``); a read-only folder of
    shards says so whichever run is picked."""
    shards = " (a read-only folder of Parquet shards)" if read_only else ""
    if f is None:
        return f"{TITLE}\nRuns recorded into {md_plain(db_name)}{shards}: pick one (Runs tab or the run picker)."
    return (f"{TITLE}\n{md_plain(f.summary.family)} run **{md_plain(f.run_id)}**: {md_plain(f.summary.describe())}"
            f"{shards}")


def cleared(app: AppContext, s: Session):
    """Every output of ``load_run`` for no run: the views show nothing."""
    return (page_header(None, app.store.path.name, app.store.read_only), "Choose a run.", [], gr.Number(value=0),
            None, "",
            gr.Slider(maximum=1, value=0), gr.Dropdown(choices=reference_choices(s.runs, None), value=""))


def load_run(app: AppContext, s: Session, run_id: str | None):
    """Pick ``run_id`` (its frames read anew): page header, run header, token strip, position (the first
    generated token), confidence plot, summary, the replay slider's range, the reference picker without it.
    An unknown run id clears every view and says so in a warning."""
    if not run_id:
        s.clear()
        return cleared(app, s)
    try:
        f = s.pick(run_id)
    except query.RunNotFound as e:
        gr.Warning(error_text(e))  # a toast renders HTML: escaped
        return cleared(app, s)
    t = f.tokens
    n = t.height
    pos = min(f.n_prompt_tokens or 1, max(n - 1, 0))
    summary = run_summary(f)
    last = f.last_step
    ref = s.reference if s.reference != run_id else None
    return (page_header(f, read_only=app.store.read_only), run_header(f, summary), strip_value(t),
            gr.Number(value=pos),  # no maximum: Gradio refuses a value past it before any callback, and an event sent
            # before a quick re-pick of a shorter run carries the longer run's position (token_views says it)
            f.fig_tokens(), json.dumps(summary, indent=1),
            gr.Slider(minimum=0, maximum=max(last, 1), value=last, step=1),
            gr.Dropdown(choices=reference_choices(s.runs, run_id), value=ref or ""))


def token_views_moved(app: AppContext, s: Session, run_id: str | None, pos: float | None):
    """``token_views`` where the position moved by itself (a pick, a click on the strip): a position past this run's
    tokens is another run's, sent before the pick that replaced it landed; the views are left as they are (no
    error: the user typed nothing)."""
    f = frames_of(s, run_id)
    if f is not None and pos is not None and not 0 <= int(pos) < f.tokens.height:
        return tuple(gr.skip() for _ in range(8))
    return token_views(app, s, run_id, pos)


def stored_causes(f: RunFrames, pos: int) -> tuple[str, pl.DataFrame]:
    """The status line and the Ranked causes table of the root cause stored for ``pos`` of this run."""
    a = f.attributions_at(pos)
    if a.height == 0:
        return (f"No root cause stored for pos {pos} of {md_plain(f.run_id)}: press Explain.",
                empty_table(CAUSE_COLUMNS))
    methods = ", ".join(sorted(set(a["method"].drop_nulls().to_list())))
    return (f"Root cause of pos {pos} (stored): {a.height} ranked causes ({md_plain(methods)}).",
            a.select(CAUSE_COLUMNS).head(30))


def token_views(app: AppContext, s: Session, run_id: str | None, pos: float | None):
    """The token at ``pos``: its row, top-k, heads, routing, stored attribution and components, and the Ranked
    causes table with its status line, all of this run and this position."""
    f = frames_of(s, run_id)
    if f is None or pos is None:
        return empty_table(TOKEN_COLUMNS), None, None, None, None, None, "", empty_table(CAUSE_COLUMNS)
    pos = int(pos)
    t = f.tokens
    if not 0 <= pos < t.height:
        raise gr.Error(f"position {pos} is outside this run (0..{t.height - 1})")
    s.pos = pos
    row = t.row(pos, named=True)
    r4 = lambda x: None if x is None else round(x, 4)
    info = pl.DataFrame([{"pos": pos, "token": row["text"], "token_id": row["token_id"], "prompt": row["is_prompt"],
                          "prob": r4(row["prob"]), "confidence": r4(row["confidence"]),
                          "entropy": r4(row["entropy"]), "rank": row["rank"]}])
    msg, causes = stored_causes(f, pos)
    return (info, f.fig_topk(pos), f.fig_token_heads(pos), f.fig_token_routing(pos), f.fig_attribution(pos),
            f.fig_components(pos), msg, causes)


def reference_note(app: AppContext, s: Session, run_id: str | None, reference: str | None) -> str:
    """What the chosen reference means for this run: none, itself, identical weights, another prompt."""
    s.reference = reference or None
    if not reference or not run_id:
        return ""
    if reference == run_id:
        return "⚠️ A run is no reference for itself: choose another run."
    try:
        mine, ref = query.run_row(app.store, run_id), query.run_row(app.store, reference)
    except query.RunNotFound as e:
        return f"⚠️ {md_plain(e)}"
    notes = []
    if mine["checkpoint_sha256"] and mine["checkpoint_sha256"] == ref["checkpoint_sha256"]:
        notes.append("⚠️ The reference has identical weights: unless its dtype or tokens differ, every difference "
                     "is zero.")
    if mine["prompt"] != ref["prompt"]:
        notes.append("⚠️ The reference has a different prompt: its positions hold other tokens.")
    return "  \n".join(notes) or f"Reference {md_plain(reference)}: other weights, same prompt."


def explain(app: AppContext, s: Session, run_id: str | None, pos: float | None, steps: float,
            reference: str | None = None, progress=gr.Progress()):
    """Root cause of the token at ``pos`` (stored), against ``reference`` if chosen."""
    if not run_id or pos is None:
        return "Choose a run and a token first.", None, None, empty_table(CAUSE_COLUMNS)
    run = app.run(run_id)
    pos = int(pos)
    progress(0.05, desc=f"root cause of the token at {pos}: integrated gradients + ablations")
    try:
        ranked = run.root_cause(pos, steps=int(steps), reference=app.run(reference) if reference else None)
    except Exception as e:  # root cause is optional and model-dependent: say why, keep the app alive
        return defuse(fail("Root cause", e)), None, None, empty_table(CAUSE_COLUMNS)
    progress(1.0, desc="done")
    f = s.frames_for(run_id)
    f.forget("attributions")  # just stored
    methods = ", ".join(sorted(set(ranked["method"].drop_nulls().to_list()))) if ranked.height else ""
    warn = ig_check(ranked, int(steps))
    cached = cache_note(run.store, run_id)
    shown = ranked.select([c for c in CAUSE_COLUMNS if c in ranked.columns]).head(30)
    return (f"Root cause of pos {pos}: {ranked.height} ranked causes ({md_plain(methods)})."
            + (f"  \n⚠️ {md_plain(cached)}" if cached else "")
            + (f"  \n⚠️ {md_plain(warn)}" if warn else ""), f.fig_attribution(pos), f.fig_components(pos), shown)


def patch_scan(app: AppContext, s: Session, run_id: str | None, pos: float | None, reference: str | None,
               progress=gr.Progress()):
    """Activation patching of the token at ``pos`` against the picked reference run (``Run.root_cause`` with a
    reference: its default method, stored like Explain's): a status line and the heat map layer x part of the
    fraction of the gap each patch closes (``patch_scan_figure``)."""
    if not run_id or pos is None:
        return "Choose a run and a token first.", None
    if not reference:
        return "Pick a known-good reference run first (the picker beside Explain).", None
    if reference == run_id:
        return "⚠️ A run is no reference for itself: choose another run.", None
    pos = int(pos)
    run = app.run(run_id)
    progress(0.05, desc=f"patch scan of the token at {pos} against {reference}")
    try:
        ranked = run.root_cause(pos, reference=app.run(reference), method="patching")
    except Exception as e:  # the models may be unavailable or not fit each other: say why, keep the app alive
        return defuse(fail("Patch scan", e)), None
    progress(1.0, desc="done")
    f = frames_of(s, run_id)
    if f is not None:
        f.forget("attributions")  # just stored
    parts = ranked.filter(pl.col("kind") != "token")
    best = parts.filter(pl.col("restored").is_not_nan()).sort("restored", descending=True, nulls_last=True).head(1)
    top = ""
    if best.height:
        b = best.row(0, named=True)
        what = ", ".join(f"{k} {b[k]}" for k in ("layer", "head", "expert") if b[k] is not None)
        top = f"; the most restoring: {md_plain(b['kind'])}" + (f" ({what})" if what else "") + f", {b['restored']:.0%}"
    return (f"Patch scan of pos {pos} against {md_plain(reference)}: {parts.height} parts patched{top}.",
            patch_scan_figure(ranked))


def logit_lens(app: AppContext, s: Session, run_id: str | None, progress=gr.Progress()):
    """The picked run's logit lens (computed with the model on the first press, then read back): a status line and
    the heat map layer x position of the produced token's probability."""
    if not run_id:
        return "Choose a run first.", None
    run = app.run(run_id)
    progress(0.1, desc="logit lens: one forward of the run's tokens")
    try:
        lens = run.logit_lens()
    except Exception as e:  # the lens needs the run's model: say why it cannot run, keep the app alive
        return defuse(fail("Logit lens", e)), None
    f = frames_of(s, run_id)
    low = lens.filter(pl.col("layer") == lens["layer"].max()) if lens.height else lens
    return (f"Logit lens of {md_plain(run_id)}: {lens['pos'].n_unique()} positions x {lens['layer'].n_unique()} "
            f"layers; at the last layer the produced token is the top-1 at {int((low['rank'] == 1).sum())} of "
            f"{low.height} positions."), logit_lens_figure(lens, f.tokens if f is not None else None)


def intervention_list(action: str | None, layer, expert, head, value, specs: str | None) -> list:
    """The panel's picks as interventions: the action on (layer, expert / head, value), then the specs typed
    (``;``-separated, e.g. ``ban:L1E3; scale_head:L0H1=0``). ValueError (one line) for a bad one."""
    out = []

    def n(x, what: str) -> int:
        if x is None:
            raise ValueError(f"{action}: pick a {what}")
        return int(x)
    if action == "ban expert":
        out.append(ban_expert(n(layer, "layer"), n(expert, "expert")))
    elif action == "boost expert":
        out.append(boost_expert(n(layer, "layer"), n(expert, "expert"), float(value or 0.0)))
    elif action == "force expert":
        out.append(force_expert(n(layer, "layer"), n(expert, "expert")))
    elif action == "scale head":
        out.append(scale_head(n(layer, "layer"), n(head, "head"), float(value or 0.0)))
    return out + normalize([x.strip() for x in (specs or "").split(";") if x.strip()])


def intervene(app: AppContext, s: Session, run_id: str | None, action: str | None, layer, expert, head, value,
              specs: str | None, progress=gr.Progress()):
    """Re-run the picked run's prompt under the chosen interventions as its child run (``Run.rerun``); the
    status line, the tokens that changed and the two runs' confidence along the sequence."""
    nothing = empty_table(CHANGED_COLUMNS)
    if not run_id:
        return "Choose a run first.", nothing, None
    try:
        ivs = intervention_list(action, layer, expert, head, value, specs)
    except ValueError as e:
        return f"⚠️ {md_plain(e)}", nothing, None
    if not ivs:
        return "Pick an action (or type a spec) first.", nothing, None
    run = app.run(run_id)
    progress(0.1, desc=f"re-running {run_id} under {', '.join(i.spec for i in ivs)}")
    try:
        child = run.rerun(ivs)
    except Exception as e:  # the model may be unavailable, or the intervention not fit it: say why
        return defuse(fail("Intervention", e)), nothing, None
    app.live[child.run_id] = child  # keeps its module: root cause of the child runs on it
    d = diff_runs(app.store, run_id, child.run_id)
    changed = d.tokens.filter(~pl.col("same_token")).select(CHANGED_COLUMNS)
    sm = d.summary
    first = sm["first_divergence_pos"]
    where = "the same tokens" if first is None else (f"first divergence at pos {first}, "
                                                      f"{sm['token_diff_share']:.0%} of the tokens differ")
    return (f"Child run **{md_plain(child.run_id)}** of {md_plain(run_id)} under "
            f"{md_plain(', '.join(sm['interventions']))}: {where}; it is in the Runs tab.",
            changed.head(100), d.figures()["confidence"])


def pick_token(evt: gr.SelectData):
    return evt.index if isinstance(evt.index, int) else evt.index[0]


def build(session: Page) -> None:
    with gr.Tab("Run view", id="runview"):
        run_head = gr.Markdown(latex_delimiters=[], elem_id="run-head")
        strip = gr.HighlightedText(label="Tokens: colour = confidence of the prediction; click one",
                                   color_map=COLOR_MAP, show_legend=True, show_inline_category=False,
                                   elem_id="token-strip", interactive=False)
        pos = gr.Number(value=0, precision=0, minimum=0, label="Token position (or click a token above)",
                        elem_id="token-pos")
        tok_info = table(TOKEN_COLUMNS, "Token", elem_id="token-info")
        with gr.Row():
            topk_plot = gr.Plot(label="Top-k alternatives", elem_id="topk-plot")
            heads_plot = gr.Plot(label="Attention entropy, layer x head", elem_id="heads-plot")
        with gr.Row():
            route_plot = gr.Plot(label="Routing, layer x expert", elem_id="routing-plot")
            attr_plot = gr.Plot(label="Attribution over the context", elem_id="attr-plot")
        with gr.Row():
            rc_steps = gr.Slider(4, 64, value=16, step=4, label="IG steps")
            rc_ref = gr.Dropdown(label="Against a known-good run (optional: rank what differs from it)",
                                 choices=[("none", "")], value="", allow_custom_value=True, elem_id="reference-picker")
            rc_btn = gr.Button("Explain this token (root cause)", elem_id="explain-button")
        ref_msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="reference-msg")
        rc_msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="rc-msg")
        with gr.Row():
            comp_plot = gr.Plot(label="Components", elem_id="comp-plot")
            rc_table = table(CAUSE_COLUMNS, "Ranked causes", elem_id="rc-table")
        with gr.Row():
            scan_btn = gr.Button("Patch scan against the reference", elem_id="patch-scan-button")
            scan_msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="patch-scan-msg")
        scan_plot = gr.Plot(label="Patch scan: what restores the token (layer x part)", elem_id="patch-scan-plot")
        with gr.Row():
            lens_btn = gr.Button("Logit lens", elem_id="logit-lens-button")
            lens_msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="logit-lens-msg")
        lens_plot = gr.Plot(label="Logit lens: where was each token decided (layer x position)",
                            elem_id="logit-lens-plot")
        with gr.Accordion("Interventions: re-run this prompt with an expert or head changed", open=True):
            with gr.Row():
                iv_action = gr.Dropdown(IV_ACTIONS, value="ban expert", label="Action", elem_id="iv-action")
                iv_layer = gr.Number(value=0, precision=0, minimum=0, label="Layer", elem_id="iv-layer")
                iv_expert = gr.Number(value=0, precision=0, minimum=0, label="Expert", elem_id="iv-expert")
                iv_head = gr.Number(value=0, precision=0, minimum=0, label="Head", elem_id="iv-head")
                iv_value = gr.Number(value=0.0, label="Boost delta / head factor", elem_id="iv-value")
            iv_specs = gr.Textbox(label="More interventions (specs, ';'-separated: ban:L1E3; scale_head:L0H1=0; "
                                        "scale:layers.1.ffn=0.5; router_bias:L1=[...])", elem_id="iv-specs")
            iv_btn = gr.Button("Re-run with the intervention", elem_id="iv-button")
            iv_msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="iv-msg")
            with gr.Row():
                iv_changed = table(CHANGED_COLUMNS, "Tokens that changed (A: this run, B: the child)",
                                   elem_id="iv-changed")
                iv_plot = gr.Plot(label="Confidence: this run vs the child", elem_id="iv-plot")
        with gr.Accordion("Run overview", open=False):
            conf_plot = gr.Plot(label="Confidence along the run", elem_id="conf-plot")
            summary_json = gr.Code(label="Summary", language="json")
    ui = session.ui
    ui.update(pos=pos, rc_ref=rc_ref, run_head=run_head)
    app, state, pick = session.app, session.state, session.run_pick
    session.on_pick.append((partial(load_run, app), [state, pick],
                            [ui["page_head"], run_head, strip, pos, conf_plot, summary_json, "step", rc_ref]))
    tok_outputs = [tok_info, topk_plot, heads_plot, route_plot, attr_plot, comp_plot, rc_msg, rc_table]
    session.on_pick.append((partial(token_views_moved, app), [state, pick, pos], tok_outputs))
    pos.change(partial(token_views_moved, app), [state, pick, pos], tok_outputs, api_name=False,
               trigger_mode="always_last")
    pos.submit(partial(token_views, app), [state, pick, pos], tok_outputs, api_name=False)  # typed: says a bad one
    strip.select(pick_token, None, pos, api_name=False)
    rc_ref.change(partial(reference_note, app), [state, pick, rc_ref], ref_msg, **LAST)
    rc_btn.click(partial(explain, app), [state, pick, pos, rc_steps, rc_ref], [rc_msg, attr_plot, comp_plot, rc_table],
                 api_name="explain")
    scan_btn.click(partial(patch_scan, app), [state, pick, pos, rc_ref], [scan_msg, scan_plot], api_name="patch_scan"
                   ).then(partial(token_views, app), [state, pick, pos], tok_outputs, **LAST)  # its stored ranking
    lens_btn.click(partial(logit_lens, app), [state, pick], [lens_msg, lens_plot], api_name="logit_lens")
    iv_btn.click(partial(intervene, app), [state, pick, iv_action, iv_layer, iv_expert, iv_head, iv_value, iv_specs],
                 [iv_msg, iv_changed, iv_plot], api_name="intervene")
