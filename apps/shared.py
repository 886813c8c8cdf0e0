"""What every tab shares: the app's context (store, model, runs recorded here), the page's shared components
and the presentation helpers (escaping, the token strip's buckets, empty tables).

Every string from the database (token text, prompts, statuses, errors, run ids) and every exception message is
untrusted: it reaches the page only through components that render text (HighlightedText, Dataframe with
``str`` columns, Code, Dropdown labels) or through ``md_text`` (escaped HTML and Markdown, no autolink, no math)
in Markdown and ``error_text`` in ``gr.Error`` / ``gr.Warning`` (whose message Gradio renders as HTML), never as markup.
"""
from __future__ import annotations

import functools
import html
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr
import polars as pl

from workbench.capture.resolve import run_tokenizer
from workbench.data import query
from workbench.data.store import DB_ERRORS, Store
from workbench.model import state_sha256
from workbench.run import Run
from workbench.views.markup import md_plain
from workbench.views.session import RunFrames, Session

# confidence buckets of the token strip (label -> colour); the legend explains them
BUCKETS = [("< 0.2", "#e63946", 0.2), ("0.2-0.5", "#f4a261", 0.5), ("0.5-0.8", "#e9c46a", 0.8),
           ("≥ 0.8", "#8ac926", 1.01)]
COLOR_MAP = {label: color for label, color, _ in BUCKETS} | {"no prediction": "#adb5bd"}
RECORD_COLOR_MAP = COLOR_MAP | {"recording": "#a2d2ff"}  # streamed, not yet committed

# Read handlers run two at a time per group: the run lists and /tokens share two slots, /sql has two. Their
# work is mostly Python (Gradio's request handling, frame conversion) holding the GIL; the Record tab records
# in a worker process (workbench.capture.background), so they no longer slow its steps, and with one slot a
# group's requests queued (8 clients: p95 0.56-0.62 s, two slots: 0.36-0.42 s; benchmarks/RESULTS.md "UI
# under load"). Requests beyond the slots wait in Gradio's queue.
READ = {"concurrency_id": "read", "concurrency_limit": 2}
SQL = {"concurrency_id": "sql", "concurrency_limit": 2}
# A step of the run-pick chain still running for the run picked before defers this run's (which then reads the
# picker anew) instead of dropping it (Gradio's default for a .then(), "once", left views on the old run).
LAST = {"api_name": False, "trigger_mode": "always_last"}


# -- presentation helpers --------------------------------------------------------------------------

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


def md_text(value) -> str:
    """``value`` as literal text inside Markdown, on one line: HTML escaped, Markdown's inline syntax
    backslash-escaped, and no autolink (bare URLs, ``www.``, e-mail addresses) and no ``$$`` math
    (``workbench.views.markup.md_plain``). Everything stored (token text, prompt, status, error, run id) or
    raised goes through it, or through ``md_plain`` itself."""
    return md_plain(value)


def error_text(value) -> str:
    """A message for ``gr.Error`` / ``gr.Warning`` (Gradio renders it as HTML): escaped."""
    return html.escape(str(value), quote=True)


def fail(where: str, e: BaseException) -> str:
    """A one-line, escaped message for a failed optional feature."""
    first = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, ImportError):
        return f"⚠️ {where} is not available in this installation yet ({md_text(e)})."
    return f"⚠️ {where} failed: {md_text(type(e).__name__)}: {md_text(first)}"


def readable_errors(fn):
    """``fn`` (a plain, synchronous event handler) raising a database failure (``StoreError``, e.g. a full disk
    that closed the connection, which reopens at the next action; or a DuckDB error) as ``gr.Error`` with its
    one-line message, escaped, instead of Gradio's bare "Error" badge. Generators and coroutines are returned
    as they are."""
    if (not callable(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
            or inspect.iscoroutinefunction(fn) or getattr(fn, "_readable_errors", False)):
        return fn

    @functools.wraps(fn)
    def handler(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DB_ERRORS as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise gr.Error(error_text(f"the database failed: {first}")) from None

    handler._readable_errors = True  # type: ignore[attr-defined]
    return handler


def empty_table(columns: list[str]) -> pl.DataFrame:
    """A table with its column names and no rows: what an empty Dataframe shows (never Gradio's "1 2 3")."""
    return pl.DataFrame(schema={c: pl.String for c in columns})


def table(columns: list[str], label: str, **kw) -> gr.Dataframe:
    """A read-only Dataframe that starts empty under its own column names."""
    return gr.Dataframe(value=empty_table(columns), headers=columns, interactive=False, type="polars", label=label,
                        wrap=True, **kw)


def short_model(path: str | None) -> str:
    return Path(path).name if path and ("/" in path or "\\" in path) else (path or "")


# -- the app's context and the page ----------------------------------------------------------------

class AppContext:
    """What the whole app shares: the store, the model the Record tab and root cause use, the runs recorded in
    this app (they keep their module), and the recording worker. Per-user state is a ``Session``."""

    def __init__(self, store: Store, model=None, tokenizer=None):
        self.store, self.model, self.tokenizer = store, model, tokenizer
        self.live: dict[str, Run] = {}  # runs recorded in this app keep their module, so root cause uses it
        self._model_sha: str | None = None
        self._tokenizers: dict[tuple[str, str], object] = {}  # (runs.model, runs.tokenizer) -> its tokenizer or None
        self.recorder = None  # the Record tab's worker (workbench.views.recording), made on the first recording

    def session(self) -> Session:
        """A new user's state over this app's store (top-k texts by ``tokenizer_for`` each run)."""
        return Session(self.store, tokenizer_for=self.tokenizer_for)

    def _same_model(self, info: dict) -> bool:
        if self.model is None or isinstance(self.model, (str, Path)):
            return False
        if self._model_sha is None:
            self._model_sha = state_sha256(self.model)
        return info["checkpoint_sha256"] == self._model_sha

    def tokenizer_for(self, info: dict):
        """The tokenizer for a run's top-k texts: the app's for a run of the app's model, else the tokenizer.json
        the run was recorded with (``runs.tokenizer``), else its checkpoint folder's (or the bundled one for a
        run that names no folder here; ``workbench.capture.resolve.run_tokenizer``), loaded once; None where
        none fits the run's vocabulary (the figures then show the run's own texts, else ``#id``)."""
        if self.tokenizer is not None and self._same_model(info):
            return self.tokenizer
        key = (str(info.get("model") or ""), str(info.get("tokenizer") or ""))
        if key not in self._tokenizers:
            try:
                tok = run_tokenizer(info)
                vocab = query.model_summary(info).vocab_size
                self._tokenizers[key] = tok if tok.get_vocab_size() >= vocab else None
            except Exception:  # noqa: BLE001 - no tokenizer here: the run's own texts instead
                self._tokenizers[key] = None
        return self._tokenizers[key]

    def run(self, run_id: str | None) -> Run:
        """The ``Run`` to analyse (root cause, anomalies, KV what-if): recorded here, or with the app's module
        when the checkpoint matches. ``gr.Error`` (escaped) for no run or an unknown one."""
        if not run_id:
            raise gr.Error("choose a run first (Runs tab or the run picker)")
        if run_id in self.live:
            return self.live[run_id]
        try:
            run = Run(self.store, run_id)
        except query.RunNotFound as e:
            raise gr.Error(error_text(e)) from None
        if self._same_model(run.info):
            run = Run(self.store, run_id, model=self.model, tokenizer=self.tokenizer)
        return run


def frames_of(s: Session, run_id: str | None) -> RunFrames | None:
    """The picked run's frames for a view (read once per pick); None for no run or an unknown one (the pick
    itself says so, and every view then shows nothing)."""
    if not run_id:
        return None
    try:
        return s.frames_for(run_id)
    except query.RunNotFound:
        return None


@dataclass
class Page:
    """What each tab's ``build(session)`` gets: the app's context, the per-user ``Session`` state, the
    components every tab may use (run picker, tabs) and those tabs share by name (``ui``), and the run-pick
    chain the tabs add their views to (``on_pick``: (fn, inputs, outputs), run in order after a pick)."""

    app: AppContext
    state: gr.State
    run_pick: gr.Dropdown
    tabs: gr.Tabs
    ui: dict = field(default_factory=dict)
    on_pick: list = field(default_factory=list)
