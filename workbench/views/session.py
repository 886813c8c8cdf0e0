"""Where the views read: a run's frames read once (``RunFrames``) and the UI's per-user state (``Session``).

``workbench.views.figures`` draws from frames and never reads the store; this module is the one place the views
read a run. ``RunFrames`` reads each table of a run (tokens, attention, routing, kv, kv_tokens, steps,
attributions, policy_results) on first use and hands the same frame to every view after that, and offers every
figure as ``frames.fig_<name>(...)`` with the arguments ``Run.fig_<name>`` has always taken (``Run`` forwards
to it). ``Session`` is what one user of the app has picked: the run (one ``RunFrames`` per pick), the token
position and the reference run.

Token text for top-k ids comes from the run's own tokens table, or a tokenizer the caller passed in; nothing
here loads a tokenizer (or imports torch).
"""
from __future__ import annotations

import threading
from collections import Counter

import plotly.graph_objects as go
import polars as pl

from workbench.data import query
from workbench.data.store import Store
from workbench.data.summary import ModelSummary
from workbench.views import figures

#: the tables a ``RunFrames`` reads lazily: name -> how (a signal table in its order, or a query function)
READERS = {
    "tokens": lambda s, r: query.signal(s, "tokens", r),
    "attention": lambda s, r: query.signal(s, "attention", r),
    "routing": lambda s, r: query.signal(s, "routing", r),
    "kv": lambda s, r: query.signal(s, "kv", r),
    "kv_tokens": lambda s, r: query.signal(s, "kv_tokens", r),
    "steps": lambda s, r: query.signal(s, "steps", r),
    "attributions": lambda s, r: query.attributions(s, r),
    "policy_results": lambda s, r: query.policy_results(s, r),
}


class RunFrames:
    """One run's frames, each read from the store at most once (on first use) and shared by every view.

    ``info`` (the run's ``runs`` row) is read when it is made: an unknown run id raises ``query.RunNotFound``.
    ``reads`` counts the reads per table (the run row included), so tests and benchmarks can check that a
    view reuses what another read. ``forget(name)`` drops a frame that changed (attributions after a root
    cause, policy_results after a KV what-if); ``forget()`` drops them all.
    """

    def __init__(self, store: Store, run_id: str, tokenizer=None, info: dict | None = None):
        self.store = store
        self.run_id = run_id
        self.tokenizer = tokenizer
        self.reads: Counter = Counter()
        if info is None:
            info = query.run_row(store, run_id)
            self.reads["runs"] += 1
        self.info = info
        self._frames: dict[str, pl.DataFrame] = {}
        self._lock = threading.Lock()

    def frame(self, name: str) -> pl.DataFrame:
        """The run's rows of table ``name`` (see ``READERS``), read once."""
        got = self._frames.get(name)
        if got is not None:
            return got
        if name not in READERS:
            raise ValueError(f"no frame {name!r}; frames: {', '.join(READERS)}")
        with self._lock:  # two views asking at once read it once
            got = self._frames.get(name)
            if got is None:
                got = READERS[name](self.store, self.run_id)
                self.reads[name] += 1
                self._frames[name] = got
        return got

    def forget(self, name: str | None = None) -> None:
        with self._lock:
            if name is None:
                self._frames.clear()
            else:
                self._frames.pop(name, None)

    tokens = property(lambda self: self.frame("tokens"))
    attention = property(lambda self: self.frame("attention"))
    routing = property(lambda self: self.frame("routing"))
    kv = property(lambda self: self.frame("kv"))
    kv_tokens = property(lambda self: self.frame("kv_tokens"))
    steps = property(lambda self: self.frame("steps"))
    attributions = property(lambda self: self.frame("attributions"))
    policy_results = property(lambda self: self.frame("policy_results"))

    @property
    def summary(self) -> ModelSummary:
        """The run's neutral model summary (from its runs row: no read)."""
        return query.model_summary(self.info)

    @property
    def n_prompt_tokens(self) -> int:
        return int(self.info["n_prompt_tokens"] or 0)

    @property
    def last_step(self) -> int:
        """The last step any of the run's tokens, steps or KV rows recorded (0 when none)."""
        last = [int(f["step"].max()) for f in (self.tokens, self.steps, self.kv) if f.height]
        return max(last, default=0)

    def attributions_at(self, pos: int) -> pl.DataFrame:
        """The stored root-cause rows of the token at ``pos``, by rank."""
        a = self.attributions
        return a.filter(pl.col("target_pos") == pos).sort("rank") if a.height else a

    def expert_load(self) -> pl.DataFrame:
        return figures.expert_load_frame(self.routing)

    def moe_layers(self) -> list[int]:
        """The layers with routing rows."""
        return sorted(set(self.routing["layer"].to_list()))

    # -- figures: Run.fig_* names and arguments --------------------------------------------------
    def fig_tokens(self, step: int | None = None) -> go.Figure:
        return figures.fig_tokens(self.tokens, step)

    def fig_topk(self, pos: int, tokenizer=None) -> go.Figure:
        return figures.fig_topk(self.tokens, pos, tokenizer if tokenizer is not None else self.tokenizer)

    def fig_token_heads(self, pos: int) -> go.Figure:
        return figures.fig_token_heads(self.attention, pos)

    def fig_head_entropy(self, step: int | None = None) -> go.Figure:
        return figures.fig_head_entropy(self.attention, step, self.tokens if step is not None else None)

    def fig_entropy_along(self, heads: list[tuple[int, int]] | None = None, normalised: bool = False,
                          step: int | None = None) -> go.Figure:
        return figures.fig_entropy_along(self.attention, self.tokens, heads, normalised, step)

    def fig_token_routing(self, pos: int) -> go.Figure:
        return figures.fig_token_routing(self.routing, pos, self.summary)

    def fig_expert_load(self, step: int | None = None) -> go.Figure:
        return figures.fig_expert_load(self.routing, self.summary, step, self.tokens if step is not None else None)

    def fig_coactivation(self, layer: int | None = None) -> go.Figure:
        return figures.fig_coactivation(self.routing, layer, self.summary)

    def fig_load_along(self, layer: int | None = None, window: int = 16) -> go.Figure:
        return figures.fig_load_along(self.routing, layer, window, self.summary)

    def fig_kv_bytes(self, step: int | None = None) -> go.Figure:
        return figures.fig_kv_bytes(self.kv, step)

    def fig_kv_received(self, layer: int | None = None) -> go.Figure:
        return figures.fig_kv_received(self.kv_tokens, self.tokens, layer)

    def fig_attribution(self, pos: int) -> go.Figure:
        return figures.fig_attribution(self.attributions_at(pos), self.tokens, pos)

    def fig_components(self, pos: int, top: int = 15) -> go.Figure:
        return figures.fig_components(self.attributions_at(pos), pos, top)

    def fig_expert_cache(self, slots=(1, 2, 3, 4, 6, 8, 12, 16), predictors=None,
                         decode_only: bool = False) -> go.Figure:
        return figures.fig_expert_cache(self.routing, self.summary, self.n_prompt_tokens, slots, predictors,
                                        decode_only)

    def fig_latency_fit(self, L0: int = 32768) -> go.Figure:
        return figures.fig_latency_fit(self.steps, self.n_prompt_tokens, L0)

    def fig_code_view(self, generated_only: bool = True) -> go.Figure:
        return figures.fig_code_view(self.tokens, generated_only)

    def fig_kv_pareto(self) -> go.Figure:
        return figures.fig_kv_pareto(self.policy_results)

    def __repr__(self) -> str:
        return f"RunFrames({self.run_id}, read: {', '.join(sorted(self._frames)) or 'nothing yet'})"


class Session:
    """One app user's state: the picked run, the token position, the reference run.

    ``pick(run_id)`` reads the run anew (a new ``RunFrames``); ``frames_for(run_id)`` returns the picked run's
    frames when ``run_id`` is the picked run (every view of one pick shares one read), else picks it. An
    unknown run id clears the state (no view keeps showing the run picked before) and raises
    ``query.RunNotFound``. A deep copy (what ``gr.State`` makes for each browser session) is a fresh session
    over the same store.
    """

    def __init__(self, store: Store, tokenizer=None, tokenizer_for=None):
        self.store = store
        self.tokenizer = tokenizer  # for every run's top-k texts; or per run: ``tokenizer_for(info)`` (None: none)
        self.tokenizer_for = tokenizer_for
        self.frames: RunFrames | None = None
        self.pos: int | None = None
        self.reference: str | None = None
        self.runs: list[tuple[str, str]] = []  # the run lists as last read for this user: (label, run_id)
        self._previous: RunFrames | None = None  # the pick before: a view of it still running finds it here

    @property
    def run_id(self) -> str | None:
        return self.frames.run_id if self.frames is not None else None

    def clear(self) -> None:
        self.frames = self._previous = None
        self.pos = self.reference = None

    def pick(self, run_id: str) -> RunFrames:
        """Pick ``run_id``: its frames read anew (lazily). Unknown: the session is cleared, ``RunNotFound``."""
        try:
            fresh = RunFrames(self.store, run_id, self.tokenizer)
        except query.RunNotFound:
            self.clear()
            raise
        if self.tokenizer_for is not None:
            fresh.tokenizer = self.tokenizer_for(fresh.info)
        if self.frames is not None and self.frames.run_id != run_id:
            self._previous = self.frames
            self.reference = None if self.reference == run_id else self.reference
        self.frames, self.pos = fresh, None
        return fresh

    def frames_for(self, run_id: str) -> RunFrames:
        """The frames of ``run_id``: the picked run's (no read), the previous pick's, or a new pick."""
        for f in (self.frames, self._previous):
            if f is not None and f.run_id == run_id:
                return f
        return self.pick(run_id)

    def __deepcopy__(self, memo) -> Session:
        return Session(self.store, self.tokenizer, self.tokenizer_for)

    def __repr__(self) -> str:
        return f"Session(run={self.run_id}, pos={self.pos}, reference={self.reference})"
