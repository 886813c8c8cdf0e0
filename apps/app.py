"""The Gradio workbench: layout and event wiring only.

Every number on screen comes from ``workbench.data.query`` frames, ``workbench.views.figures`` (plotly) or a
``workbench.Run``; this file holds no SQL and no analysis. Every string from the database (token
text, prompts, statuses, errors, run ids) and every exception message is untrusted: it reaches the
page only through components that render text (HighlightedText, Dataframe with ``str`` columns,
JSON, Code, Dropdown labels) or through ``md_text`` (escaped HTML and Markdown) in Markdown and
``gr.Error`` (whose message Gradio renders as HTML), never as markup.

Every run list (Runs table, run picker, reference and Compare pickers) is computed when a page
loads, on Refresh, when the Runs or Compare tab is opened and after a recording (which selects the
new run), never when the app is built.

    python -m workbench.apps.app --db data/workbench.duckdb      # or: workbench ui
"""
from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported
# Gradio's queue rebuilds a pandas frame of its last GRADIO_ANALYTICS_MAX_EVENTS (10,000) events after every
# event, for its /monitoring summary, which this app does not use: with 8 clients polling, 22% of the app's
# CPU (py-spy, benchmarks/ui_load.py), growing with uptime. Every 1,000 events over the last 1,000 instead.
os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", "1000")
os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "1000")

import contextlib
import html
import json
import queue
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

import gradio as gr
import polars as pl
import torch

from workbench.analysis.anomalies import detect as detect_anomalies
from workbench.analysis.anomalies import select as select_anomalies
from workbench.analysis.rootcause import ig_check
from workbench.capture import background
from workbench.data import query
from workbench.data.sqlsafe import SqlError, run_readonly
from workbench.data.store import Store
from workbench.model import load_checkpoint, state_sha256
from workbench.run import Batch, Run, record
from workbench.views.figures import batch_entropy_figure, batch_load_figure, fig_kv_pareto

# confidence buckets of the token strip (label -> colour); the legend explains them
BUCKETS = [("< 0.2", "#e63946", 0.2), ("0.2-0.5", "#f4a261", 0.5), ("0.5-0.8", "#e9c46a", 0.8),
           ("≥ 0.8", "#8ac926", 1.01)]
COLOR_MAP = {label: color for label, color, _ in BUCKETS} | {"no prediction": "#adb5bd"}
RECORD_COLOR_MAP = COLOR_MAP | {"recording": "#a2d2ff"}  # streamed, not yet committed
RUN_COLUMNS = ["run_id", "status", "created_at", "model", "prompt", "n_tokens", "n_anomalies"]
# the Runs table fits its box: fixed shares of its width, the prompt wraps in its own column
RUN_COLUMN_WIDTHS = ["13%", "9%", "15%", "12%", "35%", "8%", "8%"]
DEFAULT_SQL = "SELECT run_id, status, n_tokens, prompt FROM runs ORDER BY created_at DESC"

CSS = """
#token-strip .token { cursor: pointer; }
.wb-message { font-size: 0.95em; }
"""


# -- pure helpers (presentation only) ------------------------------------------------------------

def bucket(confidence: float | None) -> str:
    """Strip category of a confidence value."""
    if confidence is None or confidence != confidence:  # None or NaN
        return "no prediction"
    for label, _, upper in BUCKETS:
        if confidence < upper:
            return label
    return BUCKETS[-1][0]


def strip_value(tokens: pl.DataFrame) -> list[tuple[str, str]]:
    """HighlightedText value: one (text, confidence bucket) per token, in position order."""
    return [(t if t else "\u2205", bucket(c)) for t, c in zip(tokens["text"].to_list(), tokens["confidence"].to_list())]


def _short_model(path: str | None) -> str:
    return Path(path).name if path and ("/" in path or "\\" in path) else (path or "")


def runs_table_empty() -> pl.DataFrame:
    return pl.DataFrame({c: [] for c in RUN_COLUMNS}, schema={c: pl.String for c in RUN_COLUMNS})


def runs_table(store: Store) -> pl.DataFrame:
    """The Runs tab's table: selected columns of ``query.runs``, prompt shortened."""
    df = query.runs(store)
    if df.height == 0:
        return runs_table_empty()
    return df.select(
        "run_id", "status", pl.col("created_at").cast(pl.String).str.slice(0, 19),
        pl.col("model").map_elements(_short_model, return_dtype=pl.String),
        pl.col("prompt").str.replace_all("\n", " \u21b5 ").str.slice(0, 80), "n_tokens", "n_anomalies")


def run_choices(store: Store) -> list[tuple[str, str]]:
    """(label, run_id) for the run picker; the label is shown as plain text by the dropdown."""
    df = query.runs(store)
    return [(f"{r['run_id']} · {r['status']} · {r['n_tokens']} tok · {(r['prompt'] or '')[:40]!r}", r["run_id"])
            for r in df.iter_rows(named=True)]


# what can turn one line of text into markup: links and images ([..](..), ![..](..)), emphasis, code,
# strike-through, backslash escapes; < > & (HTML) are escaped as entities by html.escape
_MD_SPECIAL = re.compile(r"([\\`*_\[\]!~])")


def md_text(value) -> str:
    """``value`` as literal text inside Markdown: HTML escaped, Markdown's inline syntax
    backslash-escaped, on one line. Everything stored (token text, prompt, status, error) or raised
    goes through it."""
    one_line = " ".join(str(value).splitlines())
    return html.escape(_MD_SPECIAL.sub(r"\\\1", one_line), quote=True)


KV_POLICY_CHOICES = ["full", "window:sink=4,recent=64", "window:sink=4,recent=16", "heavy_hitters:budget=32",
                     "entropy", "confidence:threshold=0.85", "confidence:shallow=0.80,deep=0.92", "topk_int8:k=512",
                     "topk_int8:k=16", "quant_tree", "recompute:delta=0.012,window=3"]
KV_POLICY_DEFAULT = ["full", "window:sink=4,recent=16", "heavy_hitters:budget=32", "topk_int8:k=16", "quant_tree"]


def _kv_shown(df: pl.DataFrame | None) -> pl.DataFrame | None:
    """A KV what-if frame for display: memory kept as a share, numbers rounded (the store keeps them whole)."""
    if df is None or df.height == 0:
        return None
    return df.select(pl.col("policy").cast(pl.String),
                     (pl.col("bytes_kept") / pl.col("bytes_full").clip(1)).round(4).alias("memory_kept"),
                     "bytes_kept", "bytes_full", pl.col("delta_nll").round(5), pl.col("top1_agreement").round(4),
                     "first_divergence", "events")


CODE_COLOR_MAP = {"keyword": "#c77dff", "name": "#a2d2ff", "number": "#ffb703", "string": "#95d5b2",
                  "operator": "#dee2e6", "comment": "#adb5bd", "newline": "#f8f9fa", "indent": "#f8f9fa",
                  "whitespace": "#f8f9fa", "error": "#e63946", "syntax error here": "#e63946"}


def code_strip(classes: pl.DataFrame, error_pos: int | None = None) -> list[tuple[str, str | None]]:
    """HighlightedText value of the Code tab: one (text, Python token class) per model token; the token of
    the first syntax error is marked instead."""
    return [(t if t else "\u2205", "syntax error here" if p == error_pos else c)
            for p, t, c in zip(classes["pos"].to_list(), classes["text"].to_list(), classes["class"].to_list())]


def compile_message(check: dict, text: str | None = None) -> str:
    """The compile check in one escaped line of Markdown."""
    if check["ok"]:
        return f"✅ The run's text parses as Python ({check['lines']} lines)."
    what = "Incomplete (the text ends mid-statement)" if check["status"] == "incomplete" else "❌ Syntax error"
    where = f"line {check['line']}, col {check['col']}"
    if check.get("pos") is not None:
        where += f", token pos {check['pos']}" + (f" “{md_text(text)}”" if text else "")
    return (f"{'⚠️ ' if check['status'] == 'incomplete' else ''}{what}: {md_text(check['message'])} at {where}; "
            f"the first {check['ok_lines']} of {check['lines']} lines parse.")


def error_text(value) -> str:
    """A message for ``gr.Error`` (Gradio renders it as HTML): escaped."""
    return html.escape(str(value), quote=True)


def _fail(where: str, e: BaseException) -> str:
    """A one-line, escaped message for a failed optional feature."""
    first = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, ImportError):
        return f"⚠️ {where} is not available in this installation yet ({md_text(e)})."
    return f"⚠️ {where} failed: {md_text(type(e).__name__)}: {md_text(first)}"


# -- serving: how the app shares the CPU with a recording ----------------------------------------

UPDATE_S = 0.1  # the Record tab's streamed strip is refreshed at most this often
# Read handlers run two at a time per group: the run lists and /tokens share two slots, /sql has two. Their
# work is mostly Python (Gradio's request handling, frame conversion) holding the GIL; the Record tab records
# in a worker process (workbench.capture.background), so they no longer slow its steps, and with one slot a group's
# requests queued (8 clients: p95 0.56-0.62 s, two slots: 0.36-0.42 s; benchmarks/RESULTS.md "UI under
# load"). Requests beyond the slots wait in Gradio's queue.
READ = {"concurrency_id": "read", "concurrency_limit": 2}
SQL = {"concurrency_id": "sql", "concurrency_limit": 2}


def record_thread_count() -> int:
    return int(os.environ.get("WORKBENCH_RECORD_THREADS", max(1, (os.cpu_count() or 2) // 2)))


@contextlib.contextmanager
def record_threads():
    """torch's intra-op threads while the Record tab records: half the CPUs, at least one.

    A parallel region waits for its slowest thread, and with one thread per core while the app (or
    anything else) keeps the cores busy, a preempted thread stalls every op: 64 demo-model tokens took
    22-29 s with torch's 2 threads on 2 busy CPUs, 0.9-1.1 s with 1. The recording runs in its own
    thread; torch also makes the number the default of threads started meanwhile, and it is put back
    afterwards. ``$WORKBENCH_RECORD_THREADS`` sets the number (0: leave torch's setting).
    """

    n = record_thread_count()
    before = torch.get_num_threads()
    if n <= 0 or n >= before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the app -------------------------------------------------------------------------------------

def build_app(db: str | Path | Store | None = None, model=None, tokenizer=None) -> gr.Blocks:
    """The workbench as a ``gr.Blocks`` app over the database ``db``.

    Args:
        db: database path or ``Store`` (default ``$WORKBENCH_DB`` or ``data/workbench.duckdb``).
        model: a module (or checkpoint folder) the Record tab uses by default; None: the bundled demo.
        tokenizer: its tokenizer (None: the checkpoint's or the bundled one).
    """
    store = db if isinstance(db, Store) else Store(db)
    live: dict[str, Run] = {}  # runs recorded in this app keep their module, so root cause uses it
    model_sha: list[str] = []

    def get_run(run_id: str) -> Run:
        if not run_id:
            raise gr.Error("choose a run first (Runs tab or the run picker)")
        if run_id in live:
            return live[run_id]
        try:
            run = Run(store, run_id)
        except query.RunNotFound as e:
            raise gr.Error(error_text(e)) from None
        if model is not None and not isinstance(model, (str, Path)):
            if not model_sha:
                model_sha.append(state_sha256(model))
            if run.info["checkpoint_sha256"] == model_sha[0]:
                run = Run(store, run_id, model=model, tokenizer=tokenizer)
        return run

    loaded: list = []

    def default_model():
        """The app's model: the one given, else the bundled demo checkpoint, loaded once."""
        if model is not None:
            return model
        if not loaded:
            loaded.append(load_checkpoint())  # FileNotFoundError if not bundled: shown by the Record tab
        return loaded[0]

    # -- callbacks: each returns component values; data come from query / figures / Run --------------

    def refresh_runs(current: str | None, ref: str | None = None, a: str | None = None, b: str | None = None,
                     select: str | None = None):
        """Every run list, read now: the Runs table, the run picker (on ``select`` if it is a run, else
        ``current`` if it still exists, else the newest), the reference and the two Compare pickers."""
        choices = run_choices(store)
        ids = [v for _, v in choices]
        keep = lambda v: v if v in ids else None  # noqa: E731
        value = keep(select) or keep(current) or (ids[0] if ids else None)
        return (runs_table(store), gr.Dropdown(choices=choices, value=value),
                gr.Dropdown(choices=[("none", "")] + choices, value=keep(ref) or ""),
                gr.Dropdown(choices=choices, value=keep(a)), gr.Dropdown(choices=choices, value=keep(b)))

    def after_record(rid: str | None, current: str | None, ref: str | None, a: str | None, b: str | None):
        """Every run list after a recording: the new run is listed and becomes the picked one."""
        return refresh_runs(current, ref, a, b, select=rid or None)

    def pick_from_table(evt: gr.SelectData, table: pl.DataFrame | None):
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        rid = evt.row_value[0] if getattr(evt, "row_value", None) else None
        if rid is None and table is not None:
            rid = table["run_id"][row]
        return gr.Dropdown(value=rid), gr.Tabs(selected="runview")

    def load_run(run_id: str | None):
        """Everything in the Run view that depends on the run only."""
        if not run_id:
            return [], gr.Number(value=0), "Choose a run.", None, None, gr.Slider(maximum=1, value=0)
        run = get_run(run_id)
        t = run.tokens()
        n = t.height
        pos = min(int(run.info["n_prompt_tokens"] or 1), max(n - 1, 0))
        s = run.summary()
        esc = md_text  # stored strings reach the page as text
        head = (f"**{esc(s['run_id'])}** · {esc(s['status'])} · {s['prompt_tokens']} prompt + {s['generated_tokens']} "
                f"generated tokens · mean confidence "
                f"{s['mean_confidence']:.3f}" if s["mean_confidence"] is not None else
                f"**{esc(s['run_id'])}** · {esc(s['status'])}")
        head += f"  \n{esc(s['architecture'])}"
        if run.info.get("notes"):
            head += f"  \n⚠️ {esc(run.info['notes'])}"
        if run.info.get("error"):
            head += f"  \n⚠️ error: {esc(run.info['error'])}"
        try:
            from workbench.analysis.replay import step_range
            last_step = step_range(store, run_id)[1]
        except Exception:
            last_step = int(t["step"].max()) if n else 0
        return (strip_value(t), gr.Number(value=pos, maximum=max(n - 1, 0)), head,
                run.fig_tokens(), json.dumps(s, indent=1),
                gr.Slider(minimum=0, maximum=max(last_step, 1), value=last_step, step=1))

    def token_views(run_id: str | None, pos: float | None):
        if not run_id or pos is None:
            return "", None, None, None, None, None
        run = get_run(run_id)
        pos = int(pos)
        t = run.tokens()
        if not 0 <= pos < t.height:
            raise gr.Error(f"position {pos} is outside this run (0..{t.height - 1})")
        row = t.row(pos, named=True)
        r4 = lambda x: None if x is None else round(x, 4)  # noqa: E731 - display rounding only
        info = [{"pos": pos, "token": row["text"], "token_id": row["token_id"], "prompt": row["is_prompt"],
                 "prob": r4(row["prob"]), "confidence": r4(row["confidence"]), "entropy": r4(row["entropy"]),
                 "rank": row["rank"]}]
        return (pl.DataFrame(info), run.fig_topk(pos), run.fig_token_heads(pos), run.fig_token_routing(pos),
                run.fig_attribution(pos), run.fig_components(pos))

    def pick_token(evt: gr.SelectData):
        return evt.index if isinstance(evt.index, int) else evt.index[0]

    def explain(run_id: str | None, pos: float | None, steps: float, reference: str | None = None,
                progress=gr.Progress()):
        if not run_id or pos is None:
            return "Choose a run and a token first.", None, None, None
        run = get_run(run_id)
        pos = int(pos)
        progress(0.05, desc=f"root cause of the token at {pos}: integrated gradients + ablations")
        try:
            ranked = run.root_cause(pos, steps=int(steps), reference=get_run(reference) if reference else None)
        except Exception as e:  # root cause is optional and model-dependent: say why, keep the app alive
            return _fail("Root cause", e), None, None, None
        progress(1.0, desc="done")
        methods = ", ".join(sorted(set(ranked["method"].drop_nulls().to_list()))) if ranked.height else ""
        warn = ig_check(ranked, int(steps))
        return (f"Root cause of pos {pos}: {ranked.height} ranked causes ({md_text(methods)})."
                + (f"  \n⚠️ {md_text(warn)}" if warn else ""), run.fig_attribution(pos),
                run.fig_components(pos), ranked.head(30))

    def attention_views(run_id: str | None, heads: list[str] | None, normalised: bool):
        if not run_id:
            return None, None, gr.CheckboxGroup(choices=[])
        run = get_run(run_id)
        ms = run.model_summary
        choices = [f"L{l}H{h}" for l in range(ms.n_layers) for h in range(ms.n_heads)]
        chosen = [c for c in (heads or []) if c in choices]
        pairs = [tuple(int(x) for x in c[1:].split("H")) for c in chosen]
        return (run.fig_head_entropy(), run.fig_entropy_along(heads=pairs or None, normalised=normalised),
                gr.CheckboxGroup(choices=choices, value=chosen))

    def expert_views(run_id: str | None, layer: int | None, window: float):
        if not run_id:
            return None, None, None, gr.Dropdown(choices=[])
        run = get_run(run_id)
        layers = sorted(set(run.expert_load()["layer"].to_list()))
        layer = layer if layer in layers else (layers[0] if layers else None)
        return (run.fig_expert_load(), run.fig_coactivation(layer), run.fig_load_along(layer, int(window)),
                gr.Dropdown(choices=layers, value=layer))

    def kv_views(run_id: str | None, layer: str):
        if not run_id:
            return None, None
        run = get_run(run_id)
        return run.fig_kv_bytes(), run.fig_kv_received(None if layer in (None, "", "all") else int(layer))

    def anomaly_table(run_id: str | None, recompute: bool = False, severity: str = "warning",
                      kinds: list[str] | None = None, layers: str = ""):
        """The findings (the diagnosis) and the anomaly rows under the filters."""
        if not run_id:
            return None, None, "Choose a run.", gr.Dropdown()
        try:
            run = get_run(run_id)
            df = run.anomalies(recompute=recompute)
            found = run.findings()
            wanted = [int(x) for x in str(layers or "").replace(",", " ").split()]
            rows = select_anomalies(df, kinds or None, None if severity in (None, "", "all") else severity, wanted)
        except ValueError as e:
            return None, None, _fail("Filter", e), gr.Dropdown()
        except Exception as e:
            return None, None, _fail("Anomaly detection", e), gr.Dropdown()
        shown = rows.with_columns(pl.col(pl.Float64).round(4))  # display only; the store keeps full precision
        fshown = found.select("rank", "severity", "explanation", "component", "layer", "head", "expert",
                              "pos_start", "pos_end", pl.col("score").round(2))
        msg = (f"{found.height} finding{'s' if found.height != 1 else ''}; {rows.height} of {df.height} anomaly rows "
               "shown (click a row to jump to its token).")
        return fshown, shown, msg, gr.Dropdown(choices=sorted(set(df["kind"].to_list())), value=kinds or [])

    def pick_anomaly(evt: gr.SelectData, df: pl.DataFrame | None):
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        col = "pos" if df is not None and "pos" in df.columns else "pos_start"
        if df is None or col not in df.columns or row >= df.height or df[col][row] is None:
            return gr.Number(), gr.Tabs()
        return gr.Number(value=int(df[col][row])), gr.Tabs(selected="runview")

    def compare(a: str | None, b: str | None):
        if not a or not b:
            return None, "Choose two runs.", None, None, None, None
        try:
            from workbench.analysis.diff import diff_runs
            d = diff_runs(store, a, b)
        except Exception as e:
            return None, _fail("Comparison", e), None, None, None, None
        figs = d.figures() if hasattr(d, "figures") else {}
        f = list(figs.values()) + [None] * 4
        return d.summary, "", f[0], f[1], f[2], f[3]

    def replay(run_id: str | None, step: float):
        if not run_id:
            return [], "", None, None, None, None
        run = get_run(run_id)
        t = int(step)
        try:
            st = run.at_step(t)
            toks = st.tokens
            info = (f"step {st.step}/{st.last_step} ({st.kind}) · newest fed pos {st.newest_pos} · produced pos "
                    f"{st.produced_pos} · KV {st.cached_tokens} tokens, {st.kv_bytes} bytes"
                    + (f" · {st.wall_ms:.1f} ms" if st.wall_ms is not None else ""))
        except Exception as e:
            toks = run.tokens().filter(pl.col("step") <= t)
            info = _fail("Replay state", e)
        return (strip_value(toks), info, run.fig_tokens(step=t), run.fig_head_entropy(step=t),
                run.fig_expert_load(step=t), run.fig_kv_bytes(step=t))

    def _last_step(run_id: str | None) -> int:
        if not run_id:
            return 0
        t = query.tokens(store, run_id)
        return int(t["step"].max()) if t.height else 0

    def replay_play(run_id: str | None, step: float):
        """Start playing; from the beginning if the slider is at the last step."""
        at_end = int(step) >= _last_step(run_id)
        return gr.Slider(value=0) if at_end else gr.Slider(), gr.Timer(active=bool(run_id))

    def replay_tick(run_id: str | None, step: float, maximum_hint: float):
        nxt = int(step) + 1
        if nxt > int(maximum_hint):
            return gr.Slider(), gr.Timer(active=False)
        return gr.Slider(value=nxt), gr.Timer()

    def sql(text: str):
        try:
            r = run_readonly(store, text)
        except SqlError as e:  # DuckDB's message quotes the data (a token's text, say): text only
            return None, f"⚠️ {md_text(e)}"
        note = " (cut at the row limit)" if r.truncated else ""
        return r.frame, f"{r.frame.height} rows in {r.elapsed_ms:.0f} ms{note}"

    def kv_whatif_stored(run_id: str | None):
        """The KV what-if rows stored for the run (``policy_results``) and their Pareto figure."""
        if not run_id:
            return "Choose a run.", None, None
        df = query.policy_results(store, run_id)
        msg = (f"{df.height} stored polic{'ies' if df.height != 1 else 'y'} for {md_text(run_id)}." if df.height else
               "No KV what-if results for this run yet: pick policies and press Run.")
        return msg, _kv_shown(df), fig_kv_pareto(df)

    def kv_whatif_run(run_id: str | None, picked: list[str] | None, extra: str, progress=gr.Progress()):
        """Re-run the run's tokens with each chosen policy (``Run.kv_whatif``); the table and the figure."""
        if not run_id:
            return "Choose a run first.", None, None
        specs = list(picked or []) + [x.strip() for x in re.split(r"[;\n]", extra or "") if x.strip()]
        if not specs:
            return "Pick at least one policy (or type a spec).", None, None
        progress(0.05, desc=f"re-running the run's tokens with {len(specs)} KV policies")
        try:
            with record_threads():
                df = get_run(run_id).kv_whatif(specs)
        except Exception as e:  # a bad spec, a model that is not here: say why, keep the app alive
            return _fail("KV what-if", e), None, None
        progress(1.0, desc="done")
        return (f"{df.height} policies re-run on {md_text(run_id)} (stored in policy_results).",
                _kv_shown(df), fig_kv_pareto(df))

    def code_views(run_id: str | None, generated_only: bool = True):
        """The Code tab: compile check, each token's Python class, confidence by class (workbench.analysis.codeview)."""
        if not run_id:
            return "Choose a run.", [], None, None
        run = get_run(run_id)
        try:
            classes = run.code_view(per_token=True)
            check = run.compile_check()
            by_class = run.code_view(generated_only=bool(generated_only))
        except Exception as e:
            return _fail("Code view", e), [], None, None
        text = None
        if check.get("pos") is not None:
            row = classes.filter(pl.col("pos") == check["pos"])
            text = row["text"][0] if row.height else None
        shown = by_class.with_columns(pl.col(pl.Float64).round(4))  # display only
        return (compile_message(check, text), code_strip(classes, check.get("pos")), shown,
                run.fig_code_view(generated_only=bool(generated_only)))

    def export_report(run_id: str | None):
        if not run_id:
            return gr.File(visible=False), "Choose a run first."
        out = Path(tempfile.mkdtemp(prefix="workbench-report-")) / f"report-{run_id}.html"
        try:
            path = get_run(run_id).report(out, "html")
        except Exception as e:
            return gr.File(visible=False), _fail("Report export", e)
        return gr.File(value=str(path), visible=True), f"Report written: {md_text(Path(path).name)}"

    worker: list = []  # the recording process (workbench.capture.background), started by the first recording

    def start_recording(rid: str, prompt: str, checkpoint: str, settings: dict) -> queue.Queue:
        """Record in the worker process (or, where it cannot run, in a thread); returns the events queue:
        ``("token", (pos, text))`` per token, then ``("done", error or None)``."""
        if background.enabled() and not store.read_only and not worker:
            worker.append(background.RecordingProcess(store, model, tokenizer, threads=record_thread_count()))
        if worker and worker[0] is not None:
            try:
                return worker[0].record(rid, prompt, checkpoint.strip() or None, after_run=detect_anomalies, **settings)
            except Exception as e:  # e.g. a model that cannot be pickled: record in a thread from now on
                import warnings
                warnings.warn(f"recording in a worker process failed to start ({e}); recording in a thread")
                worker[0] = None
        events: queue.Queue = queue.Queue()

        def work() -> None:
            error = None
            try:
                with record_threads():
                    chosen = checkpoint.strip() or default_model()
                    live[rid] = record(prompt, model=chosen, tokenizer=None if checkpoint.strip() else tokenizer,
                                       db=store, run_id=rid, on_token=lambda pos, text: events.put(("token", (pos, text))),
                                       **settings)
            except BaseException as e:  # shown to the user
                error = e
            finally:
                events.put(("done", error))

        threading.Thread(target=work, name=f"record-{rid}", daemon=True).start()
        return events

    def record_stream(prompt: str, max_new_tokens: float, temperature: float, top_p: float, seed: float,
                      checkpoint: str, progress=gr.Progress()):
        """Record in the worker process; yield the tokens committed so far, coloured by confidence, as they land."""
        if not prompt or not prompt.strip():
            raise gr.Error("empty prompt: type some text to record")
        rid = "r" + uuid.uuid4().hex[:11]  # as the recorder's ids: never all digits (Parquet/Hive read those as BIGINT)
        events = start_recording(rid, prompt, checkpoint, {
            "max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": float(top_p),
            "seed": int(seed)})
        result: dict = {}
        pending: list[tuple[int, str]] = []
        total = int(max_new_tokens)
        while True:
            kind, item = events.get()
            done = kind == "done"
            if done:
                result["error"] = item
            else:
                pending.append(item)
                # one update per UPDATE_S at most: each re-reads the run and sends the whole strip, work
                # that would otherwise compete with the recording itself for the CPU and the GIL
                deadline = time.monotonic() + UPDATE_S
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        kind, nxt = events.get(timeout=left)
                    except queue.Empty:
                        break
                    if kind == "done":
                        done, result["error"] = True, nxt
                        break
                    pending.append(nxt)
            try:
                t = query.tokens(store, rid)
            except Exception:
                t = None
            shown = strip_value(t) if t is not None and t.height else []
            committed = t.height if t is not None else 0
            shown += [(text, "recording") for pos, text in pending if pos >= committed]
            progress(min(len(pending) / max(total, 1), 1.0), desc=f"recording {rid}")
            status = f"Recording **{md_text(rid)}**: {len(pending)}/{total} tokens"
            if done:
                break
            if committed:  # wait for the prefill's rows so the strip always starts with the prompt
                yield shown, status, rid
        if result.get("error") is not None:
            yield shown, _fail("Recording", result["error"]), rid if _exists(rid) else ""
            return
        t = query.tokens(store, rid)
        yield (strip_value(t), f"Recorded **{md_text(rid)}**: {t.height} tokens "
               f"({md_text(query.run_row(store, rid)['status'])}).", rid)

    def batch_choices(current: str | None):
        """The Batches tab's picker, read now: (label, batch_id), newest first."""
        df = query.batches(store)
        choices = [(f"{r['batch_id']} · {r['complete']}/{r['runs']} complete · {str(r['started'])[:19]}", r["batch_id"])
                   for r in df.iter_rows(named=True)]
        ids = [c[1] for c in choices]
        return gr.Dropdown(choices=choices, value=current if current in ids else (ids[0] if ids else None))

    def batch_views(batch_id: str | None):
        """A batch's runs, its least confident tokens, expert load and per-head entropy over all its runs."""
        if not batch_id:
            return None, None, None, None, "No batch yet: `workbench record --prompts FILE` records one."
        b = Batch(store, batch_id)
        runs = b.runs()
        low = b.low_confidence(20)
        st = ", ".join(f"{n} {md_text(k)}" for k, n in b.status().items())
        return (runs.select("run_id", "batch_item", "status", pl.col("prompt").str.slice(0, 80), "n_tokens", "error"),
                low.select("run_id", "batch_item", "pos", "text", pl.col("confidence").round(4), "rank"),
                batch_load_figure(b.expert_load(), batch_id), batch_entropy_figure(b.head_entropy(), batch_id),
                f"Batch {md_text(batch_id)}: {st}. Views over its complete runs.")

    def search_runs(text: str, ignore_case: bool):
        """Runs and positions whose decoded text contains ``text``."""
        if not text:
            return None, "Type some text to look for."
        df = query.search(store, text, ignore_case=bool(ignore_case), limit=200)
        shown = df.select("run_id", "pos", "end_pos", pl.col("context").str.replace_all("\n", " \u21b5 "))
        return shown, f"{df.height} match{'es' if df.height != 1 else ''} of “{md_text(text)}” (click one to open its run)."

    def pick_run_row(evt: gr.SelectData, df: pl.DataFrame | None):
        """A row of a table with a run_id column: open that run."""
        if df is None or evt.index is None or "run_id" not in df.columns:
            return gr.Dropdown(), gr.Tabs()
        return gr.Dropdown(value=str(df["run_id"][evt.index[0]])), gr.Tabs(selected="runview")

    def _exists(run_id: str) -> bool:
        try:
            query.run_row(store, run_id)
        except query.RunNotFound:
            return False
        return True

    def read_tokens(run_id: str):
        """API: a run's tokens (pos, text, confidence, ...) as a table. Reads the store only (no ``Run``,
        no model): the cheapest read there is, for clients that poll."""
        if not run_id:
            raise gr.Error("choose a run first (Runs tab or the run picker)")
        try:
            query.run_row(store, run_id)
        except query.RunNotFound as e:
            raise gr.Error(error_text(e)) from None
        return query.tokens(store, run_id).select("pos", "token_id", "text", "is_prompt", "prob", "confidence",
                                                  "entropy", "rank")

    # -- layout ------------------------------------------------------------------------------------

    with gr.Blocks(title="MoE workbench", analytics_enabled=False) as app:
        gr.Markdown("## MoE observability workbench\nDeepSeek-V3-style MoE runs recorded into "
                    f"{md_text(store.path.name)}{' (a read-only folder of Parquet shards)' if store.read_only else ''}: "
                    "confidence, attention entropy, routing, KV cache, root cause.")
        with gr.Row():
            run_pick = gr.Dropdown(label="Run", choices=[], value=None, scale=4,  # choices: at page load
                                   elem_id="run-picker", allow_custom_value=True)
            refresh_btn = gr.Button("↻ Refresh", scale=0, min_width=100)
            report_btn = gr.Button("Export report", scale=0, min_width=140, elem_id="export-report")
            report_file = gr.File(label="Report", scale=2, visible=False, interactive=False, height=80)
        report_msg = gr.Markdown(elem_classes=["wb-message"])

        with gr.Tabs(selected="runs") as tabs:
            with gr.Tab("Runs", id="runs") as runs_tab:
                runs_df = gr.Dataframe(value=runs_table_empty(), interactive=False, type="polars",
                                       label="Recorded runs (click a row to open it)", elem_id="runs-table", wrap=True,
                                       column_widths=RUN_COLUMN_WIDTHS, datatype="str")

            with gr.Tab("Record", id="record"):
                with gr.Row():
                    with gr.Column(scale=2):
                        rec_prompt = gr.Textbox(label="Prompt", lines=6, value="def fibonacci(n):\n",
                                                elem_id="record-prompt")
                        rec_ckpt = gr.Textbox(label="Checkpoint folder (empty: the app's model)", value="")
                    with gr.Column(scale=1):
                        rec_max = gr.Slider(1, 512, value=48, step=1, label="max new tokens")
                        rec_temp = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
                        rec_top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
                        rec_seed = gr.Number(value=0, precision=0, label="seed")
                        rec_btn = gr.Button("Record", variant="primary", elem_id="record-button")
                rec_status = gr.Markdown(elem_classes=["wb-message"], elem_id="record-status")
                rec_strip = gr.HighlightedText(label="Tokens (colour: confidence)", color_map=RECORD_COLOR_MAP,
                                               show_legend=True, show_inline_category=False, elem_id="record-strip")
                rec_id = gr.Textbox(label="Run id", interactive=False, elem_id="record-id")

            with gr.Tab("Run view", id="runview"):
                run_head = gr.Markdown(elem_id="run-head")
                strip = gr.HighlightedText(label="Tokens: colour = confidence of the prediction; click one",
                                           color_map=COLOR_MAP, show_legend=True, show_inline_category=False,
                                           elem_id="token-strip", interactive=False)
                pos = gr.Number(value=0, precision=0, minimum=0, label="Token position (or click a token above)",
                                elem_id="token-pos")
                tok_info = gr.Dataframe(label="Token", interactive=False, elem_id="token-info")
                with gr.Row():
                    topk_plot = gr.Plot(label="Top-k alternatives", elem_id="topk-plot")
                    heads_plot = gr.Plot(label="Attention entropy, layer x head", elem_id="heads-plot")
                with gr.Row():
                    route_plot = gr.Plot(label="Routing, layer x expert", elem_id="routing-plot")
                    attr_plot = gr.Plot(label="Attribution over the context", elem_id="attr-plot")
                with gr.Row():
                    rc_steps = gr.Slider(4, 64, value=16, step=4, label="IG steps")
                    rc_ref = gr.Dropdown(label="Against a known-good run (optional: rank what differs from it)",
                                         choices=[("none", "")], value="", allow_custom_value=True,
                                         elem_id="reference-picker")
                    rc_btn = gr.Button("Explain this token (root cause)", elem_id="explain-button")
                rc_msg = gr.Markdown(elem_classes=["wb-message"], elem_id="rc-msg")
                with gr.Row():
                    comp_plot = gr.Plot(label="Components", elem_id="comp-plot")
                    rc_table = gr.Dataframe(label="Ranked causes", interactive=False)
                with gr.Accordion("Run overview", open=False):
                    conf_plot = gr.Plot(label="Confidence along the run")
                    summary_json = gr.Code(label="Summary", language="json")

            with gr.Tab("Attention", id="attention"):
                head_plot = gr.Plot(label="Mean entropy, layer x head")
                heads_pick = gr.CheckboxGroup(label="Heads to follow along the run (none: the 4 most diffuse)")
                norm_box = gr.Checkbox(label="normalised entropy (/ log keys)", value=False)
                along_plot = gr.Plot(label="Entropy along positions")

            with gr.Tab("Experts", id="experts"):
                load_plot = gr.Plot(label="Load per expert per layer", elem_id="load-plot")
                with gr.Row():
                    exp_layer = gr.Dropdown(label="MoE layer", choices=[])
                    exp_window = gr.Slider(2, 128, value=16, step=2, label="window (positions)")
                with gr.Row():
                    coact_plot = gr.Plot(label="Co-activation")
                    along_load_plot = gr.Plot(label="Load along the run")

            with gr.Tab("KV cache", id="kv"):
                kv_plot = gr.Plot(label="Bytes per layer over steps")
                kv_layer = gr.Textbox(label="Layer for attention received (empty: all layers)", value="")
                kv_recv_plot = gr.Plot(label="Attention received per cached token")

            with gr.Tab("KV what-if", id="kvwhatif") as kvw_tab:
                gr.Markdown("Re-run the picked run's tokens teacher-forced with KV-cache policies acting on the "
                            "cache, against the full cache: Δ NLL (nats per generated token), top-1 agreement, "
                            "memory kept at the end (`workbench kv-whatif`; the specs: `workbench.analysis.kv_policies`).")
                with gr.Row():
                    kvw_pick = gr.CheckboxGroup(label="Policies", choices=KV_POLICY_CHOICES,
                                                value=KV_POLICY_DEFAULT, elem_id="kvw-policies", scale=3)
                    with gr.Column(scale=1):
                        kvw_extra = gr.Textbox(label="More specs (one per line or ; separated)", lines=3,
                                               placeholder="window:sink=2,recent=32", elem_id="kvw-extra")
                        kvw_btn = gr.Button("Run what-if", variant="primary", elem_id="kvw-run")
                kvw_msg = gr.Markdown(elem_classes=["wb-message"], elem_id="kvw-msg")
                kvw_df = gr.Dataframe(interactive=False, type="polars", label="Policies against the full cache",
                                      wrap=True, elem_id="kvw-table")
                kvw_plot = gr.Plot(label="Memory kept vs Δ NLL", elem_id="kvw-plot")

            with gr.Tab("Code", id="code") as code_tab:
                code_msg = gr.Markdown(elem_classes=["wb-message"], elem_id="code-msg")
                code_tokens = gr.HighlightedText(label="Tokens by Python token class (tokenize); red: the first "
                                                       "syntax error", color_map=CODE_COLOR_MAP, show_legend=True,
                                                 show_inline_category=False, elem_id="code-strip")
                code_gen = gr.Checkbox(label="generated tokens only", value=True, elem_id="code-generated")
                with gr.Row():
                    code_df = gr.Dataframe(interactive=False, type="polars", label="Confidence by token class",
                                           wrap=True, elem_id="code-table")
                    code_plot = gr.Plot(label="Confidence and entropy by class", elem_id="code-plot")

            with gr.Tab("Anomalies", id="anomalies") as anom_tab:
                with gr.Row():
                    anom_btn = gr.Button("Detect / refresh")
                    anom_re = gr.Checkbox(label="recompute", value=False)
                with gr.Row():
                    anom_sev = gr.Dropdown(label="severity at least", choices=["all", "warning", "critical"],
                                           value="warning", elem_id="anom-severity")
                    anom_kinds = gr.Dropdown(label="kinds", choices=[], multiselect=True, elem_id="anom-kinds")
                    anom_layers = gr.Textbox(label="layers (e.g. 2 3; empty: all)", value="", elem_id="anom-layers")
                anom_msg = gr.Markdown(elem_classes=["wb-message"], elem_id="anom-msg")
                find_df = gr.Dataframe(interactive=False, type="polars", elem_id="findings-table", wrap=True,
                                       label="Findings: the diagnosis, one per component or token span")
                anom_df = gr.Dataframe(interactive=False, type="polars", label="Anomalies (click to jump to the token)", wrap=True)

            with gr.Tab("Compare", id="compare") as cmp_tab:
                with gr.Row():
                    cmp_a = gr.Dropdown(label="Run A", choices=[], elem_id="compare-a")
                    cmp_b = gr.Dropdown(label="Run B", choices=[], elem_id="compare-b")
                    cmp_btn = gr.Button("Compare")
                cmp_msg = gr.Markdown(elem_classes=["wb-message"])
                cmp_json = gr.JSON(label="Summary")
                with gr.Row():
                    cmp_f1, cmp_f2 = gr.Plot(), gr.Plot()
                with gr.Row():
                    cmp_f3, cmp_f4 = gr.Plot(), gr.Plot()

            with gr.Tab("Replay", id="replay"):
                with gr.Row():
                    step = gr.Slider(0, 1, value=0, step=1, label="Step (0 = prefill)", elem_id="replay-step",
                                     scale=4)
                    play = gr.Button("▶ Play", scale=0, min_width=90)
                    pause = gr.Button("⏸ Pause", scale=0, min_width=90)
                timer = gr.Timer(0.8, active=False)
                rep_info = gr.Markdown(elem_classes=["wb-message"], elem_id="replay-info")
                rep_strip = gr.HighlightedText(label="Tokens so far", color_map=COLOR_MAP, show_legend=True,
                                               show_inline_category=False, elem_id="replay-strip")
                with gr.Row():
                    rep_conf, rep_heads = gr.Plot(), gr.Plot()
                with gr.Row():
                    rep_load, rep_kv = gr.Plot(), gr.Plot()

            with gr.Tab("SQL", id="sql"):
                gr.Markdown("Read-only SQL over the store: one SELECT over the workbench tables; no writes, "
                            "no file or network access; 1000 rows and 5 s at most.")
                sql_text = gr.Code(value=DEFAULT_SQL, language="sql", label="Query", interactive=True,
                                   elem_id="sql-text")
                sql_btn = gr.Button("Run query", elem_id="sql-run")
                sql_msg = gr.Markdown(elem_classes=["wb-message"], elem_id="sql-msg")
                sql_out = gr.Dataframe(interactive=False, label="Rows", wrap=True, elem_id="sql-rows", datatype="str")

            with gr.Tab("Batches", id="batches") as batch_tab:
                with gr.Row():
                    batch_pick = gr.Dropdown(label="Batch (a prompt set: workbench record --prompts)", choices=[],
                                             elem_id="batch-picker", scale=4)
                    batch_btn = gr.Button("↻", scale=0, min_width=60)
                batch_msg = gr.Markdown(elem_classes=["wb-message"], elem_id="batch-msg")
                batch_runs = gr.Dataframe(interactive=False, type="polars", label="Runs (click one to open it)",
                                          wrap=True, elem_id="batch-runs", datatype="str")
                with gr.Row():
                    batch_load = gr.Plot(label="Expert load over the batch", elem_id="batch-load")
                    batch_ent = gr.Plot(label="Per-head entropy across runs", elem_id="batch-entropy")
                batch_low = gr.Dataframe(interactive=False, type="polars", label="Least confident tokens of the batch "
                                         "(click one to open its run)", wrap=True, elem_id="batch-low", datatype="str")

            with gr.Tab("Search", id="search"):
                with gr.Row():
                    search_text = gr.Textbox(label="Text in the runs' decoded text (may span tokens)", scale=4,
                                             elem_id="search-text")
                    search_case = gr.Checkbox(label="ignore case", value=False, scale=0, min_width=120)
                    search_btn = gr.Button("Search", scale=0, min_width=100, elem_id="search-button")
                search_msg = gr.Markdown(elem_classes=["wb-message"], elem_id="search-msg")
                search_df = gr.Dataframe(interactive=False, type="polars", label="Matches", wrap=True,
                                         elem_id="search-results", datatype="str")

        # -- wiring ----------------------------------------------------------------------------------
        run_lists = [runs_df, run_pick, rc_ref, cmp_a, cmp_b]
        list_inputs = [run_pick, rc_ref, cmp_a, cmp_b]
        refresh_btn.click(refresh_runs, list_inputs, run_lists, api_name=False, **READ)
        runs_tab.select(refresh_runs, list_inputs, run_lists, api_name=False, **READ)
        cmp_tab.select(refresh_runs, list_inputs, run_lists, api_name=False, **READ)
        app.load(refresh_runs, list_inputs, run_lists, api_name=False, **READ)
        runs_df.select(pick_from_table, runs_df, [run_pick, tabs], api_name=False)
        run_outputs = [strip, pos, run_head, conf_plot, summary_json, step]
        tok_outputs = [tok_info, topk_plot, heads_plot, route_plot, attr_plot, comp_plot]
        rep_outputs = [rep_strip, rep_info, rep_conf, rep_heads, rep_load, rep_kv]
        code_outputs = [code_msg, code_tokens, code_df, code_plot]
        # the Replay tab is redrawn by whatever moves it: a new run (even when its last step equals the
        # slider's value, so the slider does not change), the user's slider, Play and the timer. Never by
        # the slider's .change: load_run moves the slider too, and that replay of the run picked before
        # could land after the new run's.
        # Every step of the chain is "always_last": a step still running for the run picked before
        # defers this run's (which then reads the picker anew) instead of dropping it, Gradio's default
        # for a .then() ("once"), which left views on the old run when runs were picked in quick succession.
        last = {"api_name": False, "trigger_mode": "always_last"}
        (run_pick.change(load_run, run_pick, run_outputs, **last)
         .then(replay, [run_pick, step], rep_outputs, **last)
         .then(token_views, [run_pick, pos], tok_outputs, **last)
         .then(attention_views, [run_pick, heads_pick, norm_box], [head_plot, along_plot, heads_pick], **last)
         .then(expert_views, [run_pick, exp_layer, exp_window], [load_plot, coact_plot, along_load_plot, exp_layer],
               **last)
         .then(kv_views, [run_pick, kv_layer], [kv_plot, kv_recv_plot], **last)
         .then(code_views, [run_pick, code_gen], code_outputs, **last)
         .then(lambda r: r, run_pick, cmp_a, **last))
        pos.change(token_views, [run_pick, pos], tok_outputs, api_name=False, trigger_mode="always_last")
        strip.select(pick_token, None, pos, api_name=False)
        rc_btn.click(explain, [run_pick, pos, rc_steps, rc_ref], [rc_msg, attr_plot, comp_plot, rc_table], api_name="explain")
        heads_pick.input(attention_views, [run_pick, heads_pick, norm_box], [head_plot, along_plot, heads_pick],
                         api_name=False)
        norm_box.change(attention_views, [run_pick, heads_pick, norm_box], [head_plot, along_plot, heads_pick],
                        api_name=False)
        for c in (exp_layer, exp_window):
            c.input(expert_views, [run_pick, exp_layer, exp_window], [load_plot, coact_plot, along_load_plot, exp_layer],
                    api_name=False)
        kv_layer.submit(kv_views, [run_pick, kv_layer], [kv_plot, kv_recv_plot], api_name=False)
        anom_in = [run_pick, anom_re, anom_sev, anom_kinds, anom_layers]
        anom_out = [find_df, anom_df, anom_msg, anom_kinds]
        anom_btn.click(anomaly_table, anom_in, anom_out, api_name=False)
        anom_tab.select(anomaly_table, anom_in, anom_out, api_name=False)
        for f in (anom_sev.input, anom_kinds.input, anom_layers.submit):  # user edits only: no loop
            f(anomaly_table, anom_in, anom_out, api_name=False)
        anom_df.select(pick_anomaly, anom_df, [pos, tabs], api_name=False)
        find_df.select(pick_anomaly, find_df, [pos, tabs], api_name=False)
        cmp_btn.click(compare, [cmp_a, cmp_b], [cmp_json, cmp_msg, cmp_f1, cmp_f2, cmp_f3, cmp_f4], api_name=False)
        step.input(replay, [run_pick, step], rep_outputs, api_name=False, trigger_mode="always_last")
        (play.click(replay_play, [run_pick, step], [step, timer], api_name=False)
         .then(replay, [run_pick, step], rep_outputs, api_name=False))
        pause.click(lambda: gr.Timer(active=False), None, timer, api_name=False)
        (timer.tick(lambda r, s: replay_tick(r, s, _last_step(r)), [run_pick, step], [step, timer], api_name=False)
         .then(replay, [run_pick, step], rep_outputs, api_name=False))
        kvw_btn.click(kv_whatif_run, [run_pick, kvw_pick, kvw_extra], [kvw_msg, kvw_df, kvw_plot], api_name="kv_whatif")
        kvw_tab.select(kv_whatif_stored, run_pick, [kvw_msg, kvw_df, kvw_plot], api_name=False, **READ)
        code_tab.select(code_views, [run_pick, code_gen], code_outputs, api_name=False, **READ)
        code_gen.input(code_views, [run_pick, code_gen], code_outputs, api_name=False)
        sql_btn.click(sql, sql_text, [sql_out, sql_msg], api_name="sql", **SQL)
        batch_out = [batch_runs, batch_low, batch_load, batch_ent, batch_msg]
        (batch_tab.select(batch_choices, batch_pick, batch_pick, api_name=False, **READ)
         .then(batch_views, batch_pick, batch_out, api_name=False))
        batch_btn.click(batch_choices, batch_pick, batch_pick, api_name=False, **READ)
        batch_pick.input(batch_views, batch_pick, batch_out, api_name=False)
        for t in (batch_runs, batch_low):
            t.select(pick_run_row, t, [run_pick, tabs], api_name=False)
        for f in (search_btn.click, search_text.submit):
            f(search_runs, [search_text, search_case], [search_df, search_msg], api_name=False, **READ)
        search_df.select(pick_run_row, search_df, [run_pick, tabs], api_name=False)
        report_btn.click(export_report, run_pick, [report_file, report_msg], api_name=False)
        (rec_btn.click(record_stream, [rec_prompt, rec_max, rec_temp, rec_top_p, rec_seed, rec_ckpt],
                       [rec_strip, rec_status, rec_id], api_name="record")
         .then(after_record, [rec_id] + list_inputs, run_lists, api_name=False))
        # API only: read a run back (gradio_client)
        api_run = gr.Textbox(visible=False)
        api_tokens = gr.Dataframe(visible=False)
        api_run.submit(read_tokens, api_run, api_tokens, api_name="tokens", **READ)

    return app


def launch(db: str | Path | Store | None = None, host: str = "127.0.0.1", port: int | None = 7860,
           auth: str | None = None, **kw) -> None:
    """Serve the app (blocking). ``auth`` is ``USER:PASS``."""
    creds = None
    if auth:
        user, sep, password = auth.partition(":")
        if not sep or not user or not password:
            raise ValueError("--auth must be USER:PASS (both non-empty)")
        creds = (user, password)
    app = build_app(db)
    app.queue(default_concurrency_limit=2).launch(server_name=host, server_port=port, auth=creds, css=CSS,
                                                  footer_links=["api"], **kw)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="MoE workbench UI")
    ap.add_argument("--db", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--auth", default=None)
    a = ap.parse_args()
    launch(a.db, a.host, a.port, a.auth)
