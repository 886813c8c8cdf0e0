"""The Record tab: record a prompt (``workbench.views.recording.Recorder``: a worker process, else a thread) and
stream its tokens, coloured by confidence, as they are committed."""
from __future__ import annotations

import queue
import time
import uuid
from functools import partial
from pathlib import Path

import gradio as gr

from workbench.apps.shared import RECORD_COLOR_MAP, AppContext, Page, fail, strip_value
from workbench.data import query
from workbench.model import DEFAULT_CHECKPOINT, load_checkpoint
from workbench.run import Run
from workbench.views.markup import defuse, md_plain
from workbench.views.recording import Recorder

UPDATE_S = 0.1  # the streamed strip is refreshed at most this often

# The folders the checkpoint box may load from (each with everything under it), besides the bundled demo and the
# app's own model folder: served with --host 0.0.0.0, the box is anyone's on the network, so it loads no other
# folder of the server, and its one refusal is the same for a folder that is missing and one that is not allowed.
CHECKPOINT_ROOTS: list[Path] = []
NOT_ALLOWED = ("checkpoint folder {0} cannot be loaded here: give a folder under the app's checkpoint roots (the "
               "bundled demo, the app's model folder, or a folder the app was started with), or leave the box empty")


def set_checkpoint_roots(roots) -> None:
    """The folders (besides the bundled demo and the app's model folder) whose checkpoints the Record tab may load,
    e.g. the ones given on the command line."""
    CHECKPOINT_ROOTS[:] = [Path(r).expanduser().resolve() for r in roots]


def checkpoint_roots(app: AppContext) -> list[Path]:
    """The bundled demo, the app's model folder (when it is one) and ``CHECKPOINT_ROOTS``, resolved."""
    roots = [Path(DEFAULT_CHECKPOINT).resolve(), *CHECKPOINT_ROOTS]
    if isinstance(app.model, (str, Path)) and str(app.model):
        roots.append(Path(app.model).expanduser().resolve())
    return roots


def allowed_checkpoint(app: AppContext, text: str) -> str | None:
    """The folder the checkpoint box names, resolved ("" for the app's model); None when it is not a folder under a
    root, whether it exists or not (the refusal reveals nothing of the server's filesystem)."""
    text = (text or "").strip()
    if not text:
        return ""
    try:
        folder = Path(text).expanduser().resolve()  # symlinks and .. resolved: no way out of a root
        inside = any(folder == r or folder.is_relative_to(r) for r in checkpoint_roots(app))
        return str(folder) if inside and folder.is_dir() else None
    except (OSError, RuntimeError, ValueError):
        return None


def recorder(app: AppContext) -> Recorder:
    """The app's recorder, made on the first recording (the default model: the app's, else the bundled demo)."""
    if app.recorder is None:
        app.recorder = Recorder(app.store, app.model, app.tokenizer, default_model=load_checkpoint)
    return app.recorder


def _drain(events: queue.Queue, pending: list) -> BaseException | bool | None:
    """Wait for the next event, then take those that come within ``UPDATE_S`` (one strip update each time: each
    re-reads the run and sends the whole strip). Returns False while recording, else ``done``'s error (or None)."""
    kind, item = events.get()
    deadline = time.monotonic() + UPDATE_S
    while True:
        if kind == "done":
            return item
        pending.append(item)
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            kind, item = events.get(timeout=left)
        except queue.Empty:
            return False


def _exists(app: AppContext, run_id: str) -> bool:
    try:
        query.run_row(app.store, run_id)
    except query.RunNotFound:
        return False
    return True


def record_stream(app: AppContext, prompt: str, max_new_tokens: float, temperature: float, top_p: float,
                  seed: float, checkpoint: str, progress=gr.Progress()):
    """Record ``prompt``; yield (strip, status, run id) as tokens are committed, then the finished run."""
    if not prompt or not prompt.strip():
        raise gr.Error("empty prompt: type some text to record")
    folder = allowed_checkpoint(app, checkpoint)
    if folder is None:
        yield [], f"⚠️ Recording failed: {md_plain(NOT_ALLOWED.format(repr(checkpoint.strip())))}.", ""
        return
    rid = "r" + uuid.uuid4().hex[:11]  # as the recorder's ids: never all digits (Parquet/Hive read those as BIGINT)
    rec = recorder(app)
    events = rec.start(rid, prompt, folder, {"max_new_tokens": int(max_new_tokens),
                                             "temperature": float(temperature), "top_p": float(top_p),
                                             "seed": int(seed)})
    pending: list[tuple[int, str]] = []
    total = int(max_new_tokens)
    while True:
        done = _drain(events, pending)
        try:
            t = query.tokens(app.store, rid)
        except Exception:  # noqa: BLE001 - not written yet
            t = None
        committed = t.height if t is not None else 0
        shown = (strip_value(t) if committed else []) + [(x, "recording") for p, x in pending if p >= committed]
        progress(min(len(pending) / max(total, 1), 1.0), desc=f"recording {rid}")
        if done is not False:
            break
        if committed:  # wait for the prefill's rows so the strip always starts with the prompt
            yield shown, f"Recording **{md_plain(rid)}**: {len(pending)}/{total} tokens", rid
    if done is not None:
        yield shown, defuse(fail("Recording", done)), rid if _exists(app, rid) else ""
        return
    if rid in rec.recorded:  # recorded in a thread: root cause runs on the module it was recorded with
        adapter, tok = rec.recorded.pop(rid)
        app.live[rid] = Run(app.store, rid, model=adapter, tokenizer=tok)
    t = query.tokens(app.store, rid)
    yield (strip_value(t), f"Recorded **{md_plain(rid)}**: {t.height} tokens "
           f"({md_plain(query.run_row(app.store, rid)['status'])}).", rid)


def build(session: Page) -> None:
    with gr.Tab("Record", id="record"):
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", lines=6, value="def fibonacci(n):", elem_id="record-prompt")
                ckpt = gr.Textbox(label="Checkpoint folder (empty: the app's model; a folder under the bundled demo or "
                                        "the app's checkpoint roots)", value="")
            with gr.Column(scale=1):
                max_new = gr.Slider(1, 512, value=48, step=1, label="max new tokens")
                temp = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
                seed = gr.Number(value=0, precision=0, label="seed")
                btn = gr.Button("Record", variant="primary", elem_id="record-button")
        status = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="record-status")
        strip = gr.HighlightedText(label="Tokens (colour: confidence)", color_map=RECORD_COLOR_MAP, show_legend=True,
                                   show_inline_category=False, elem_id="record-strip")
        rid = gr.Textbox(label="Run id", interactive=False, elem_id="record-id")
    session.ui.update(record_button=btn, record_id=rid)
    session.ui["record_event"] = btn.click(partial(record_stream, session.app), [prompt, max_new, temp, top_p, seed, ckpt],
                                          [strip, status, rid], api_name="record")
