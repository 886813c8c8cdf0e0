"""The Replay tab: the run as it stood after each generation step (0 = the prefill), by slider or played."""
from __future__ import annotations

from functools import partial

import gradio as gr
import polars as pl

from workbench.analysis.replay import at_step
from workbench.apps.shared import COLOR_MAP, AppContext, Page, fail, frames_of, strip_value
from workbench.views.markup import defuse
from workbench.views.session import Session

PLAY, PAUSE = "▶ Play", "❚❚ Pause"  # U+275A: in every font the page may fall back to (U+23F8 is not)


def replay(app: AppContext, s: Session, run_id: str | None, step: float):
    """The tokens so far, the state line, and confidence, head entropy, expert load, KV bytes up to ``step``."""
    f = frames_of(s, run_id)
    if f is None:
        return [], "", None, None, None, None
    t = int(step)
    try:
        st = at_step(app.store, f.run_id, t)
        toks = st.tokens
        info = (f"step {st.step}/{st.last_step} ({st.kind}) · newest fed pos {st.newest_pos} · produced pos "
                f"{st.produced_pos} · KV {st.cached_tokens} tokens, {st.kv_bytes} bytes"
                + (f" · {st.wall_ms:.1f} ms" if st.wall_ms is not None else ""))
    except Exception as e:
        toks = f.tokens.filter(pl.col("step") <= t)
        info = defuse(fail("Replay state", e))
    return (strip_value(toks), info, f.fig_tokens(step=t), f.fig_head_entropy(step=t), f.fig_expert_load(step=t),
            f.fig_kv_bytes(step=t))


def replay_picked(app: AppContext, s: Session, run_id: str | None):
    """``replay`` of a run just picked, at its last step (where the pick puts the slider). The slider is no input: a
    step the page sent with it could be the run picked before's, past the new run's range, which Gradio refuses
    with an error toast ("Value 5 is greater than maximum value 1.", seen when runs were picked quickly)."""
    return replay(app, s, run_id, last_step(s, run_id))


def last_step(s: Session, run_id: str | None) -> int:
    f = frames_of(s, run_id)
    return f.last_step if f is not None else 0


def replay_play(app: AppContext, s: Session, run_id: str | None, step: float):
    """Start playing; from the beginning if the slider is at the last step."""
    at_end = int(step) >= last_step(s, run_id)
    return gr.Slider(value=0) if at_end else gr.Slider(), gr.Timer(active=bool(run_id))


def replay_tick(app: AppContext, s: Session, run_id: str | None, step: float):
    """One step on, or stop at the last."""
    nxt = int(step) + 1
    if nxt > last_step(s, run_id):
        return gr.Slider(), gr.Timer(active=False)
    return gr.Slider(value=nxt), gr.Timer()


def build(session: Page) -> None:
    with gr.Tab("Replay", id="replay"):
        with gr.Row():
            step = gr.Slider(0, 1, value=0, step=1, label="Step (0 = prefill)", elem_id="replay-step", scale=4)
            play = gr.Button(PLAY, scale=0, min_width=90, elem_id="replay-play")
            pause = gr.Button(PAUSE, scale=0, min_width=90, elem_id="replay-pause")
        timer = gr.Timer(0.8, active=False)
        info = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="replay-info")
        strip = gr.HighlightedText(label="Tokens so far", color_map=COLOR_MAP, show_legend=True,
                                   show_inline_category=False, elem_id="replay-strip")
        with gr.Row():
            conf = gr.Plot(label="Token confidence so far", elem_id="replay-confidence")
            heads = gr.Plot(label="Mean attention entropy so far", elem_id="replay-heads")
        with gr.Row():
            load = gr.Plot(label="Expert load so far", elem_id="replay-load")
            kv = gr.Plot(label="KV cache bytes so far", elem_id="replay-kv")
    session.ui["step"] = step
    app, state, pick = session.app, session.state, session.run_pick
    fn = partial(replay, app)
    inputs, outputs = [state, pick, step], [strip, info, conf, heads, load, kv]
    # redrawn by whatever moves it: a new run (even when its last step equals the slider's value, so the slider
    # does not change), the user's slider, Play and the timer; never by the slider's .change (load_run moves the
    # slider too, and that replay of the run picked before could land after the new run's)
    session.on_pick.append((partial(replay_picked, app), [state, pick], outputs))
    step.input(fn, inputs, outputs, api_name=False, trigger_mode="always_last")
    play.click(partial(replay_play, app), inputs, [step, timer], api_name=False).then(fn, inputs, outputs,
                                                                                      api_name=False)
    pause.click(lambda: gr.Timer(active=False), None, timer, api_name=False)
    timer.tick(partial(replay_tick, app), inputs, [step, timer], api_name=False).then(fn, inputs, outputs,
                                                                                      api_name=False)
