"""``Workbench`` (a database) and ``Run`` (one recorded generation): the objects people use.

Both are thin: reads go through ``workbench.query``, figures through ``workbench.figures``, analyses
through their own modules. A ``Run`` returned by ``record`` keeps the module it was recorded with, so
root cause runs on that same model.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

import polars as pl

from . import query
from .store import Store


class Run:
    """One recorded run. Frames are polars; figures (``fig_*``) are plotly."""

    def __init__(self, store: Store, run_id: str, model=None, tokenizer=None):
        self.store = store
        self.run_id = run_id
        self.info = query.run_row(store, run_id)  # raises RunNotFound
        self._model = model
        self._tokenizer = tokenizer

    # -- metadata ---------------------------------------------------------------------------------
    def refresh(self) -> "Run":
        self.info = query.run_row(self.store, self.run_id)
        return self

    @property
    def status(self) -> str:
        return self.refresh().info["status"]

    @property
    def prompt(self) -> str:
        return self.info["prompt"]

    @property
    def params(self) -> dict:
        return json.loads(self.info["params"] or "{}")

    @property
    def config(self) -> dict:
        return json.loads(self.info["config"] or "{}")

    @property
    def text(self) -> str:
        return "".join(self.tokens()["text"].to_list())

    @property
    def generated_text(self) -> str:
        t = self.tokens()
        return "".join(t.filter(~pl.col("is_prompt"))["text"].to_list())

    def model(self):
        """The module to re-run this run with: the in-memory one it was recorded with, else its checkpoint."""
        if self._model is None:
            from workbench.model import load_checkpoint
            path = self.info["model"]
            if not Path(path).exists():
                raise FileNotFoundError(f"run {self.run_id} was recorded from {path!r}, which is not a checkpoint "
                                        "folder here; pass the module to workbench.record to analyse it")
            dtype = {"bfloat16": __import__("torch").bfloat16}.get(self.info["dtype"])
            self._model = load_checkpoint(path, **({"dtype": dtype} if dtype else {}))
        return self._model

    def tokenizer(self):
        if self._tokenizer is None:
            from workbench.model import load_tokenizer
            path = Path(self.info["model"]) / "tokenizer.json"
            self._tokenizer = load_tokenizer(path if path.exists() else None)
        return self._tokenizer

    # -- signals ----------------------------------------------------------------------------------
    def tokens(self) -> pl.DataFrame:
        return query.tokens(self.store, self.run_id)

    def attention(self) -> pl.DataFrame:
        return query.attention(self.store, self.run_id)

    def routing(self) -> pl.DataFrame:
        return query.routing(self.store, self.run_id)

    def kv(self) -> pl.DataFrame:
        return query.kv(self.store, self.run_id)

    def kv_tokens(self) -> pl.DataFrame:
        return query.kv_tokens(self.store, self.run_id)

    def steps(self) -> pl.DataFrame:
        return query.steps(self.store, self.run_id)

    def expert_load(self) -> pl.DataFrame:
        return query.expert_load(self.store, self.run_id)

    # -- analyses ---------------------------------------------------------------------------------
    def anomalies(self, recompute: bool = False, **thresholds) -> pl.DataFrame:
        """Anomalies of this run (detected and stored on first call, or when ``recompute``)."""
        from .anomalies import detect
        return detect(self, recompute=recompute, **thresholds)

    def root_cause(self, pos: int, **kw) -> pl.DataFrame:
        """Ranked causes of the token at ``pos``: source tokens (IG), heads and experts (ablation)."""
        from .rootcause import root_cause
        return root_cause(self, pos, **kw)

    def at_step(self, t: int):
        """The state of the generation after step ``t``, from the database alone."""
        from .replay import at_step
        return at_step(self.store, self.run_id, t)

    def report(self, out: str | Path | None = None, format: str = "html") -> Path | str:
        from .report import write_report
        return write_report(self, out, format)

    # -- figures ----------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name.startswith("fig_"):
            from . import figures
            fn = getattr(figures, name, None)
            if fn is not None:
                return lambda *a, **k: fn(self.store, self.run_id, *a, **k)
        raise AttributeError(name)

    # -- display ----------------------------------------------------------------------------------
    def summary(self) -> dict:
        t = self.tokens()
        gen = t.filter(~pl.col("is_prompt"))
        return {
            "run_id": self.run_id, "status": self.info["status"], "model": self.info["model"],
            "dtype": self.info["dtype"], "prompt_tokens": int(t["is_prompt"].sum()) if t.height else 0,
            "generated_tokens": gen.height,
            "mean_confidence": float(gen["confidence"].mean()) if gen.height else None,
            "low_confidence_tokens": int((gen["confidence"] < 0.2).sum()) if gen.height else 0,
        }

    def __repr__(self) -> str:
        s = self.summary()
        return f"Run({s['run_id']}, {s['status']}, {s['prompt_tokens']}+{s['generated_tokens']} tokens)"

    def _repr_html_(self) -> str:
        s = self.summary()
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in s.items())
        text = html.escape(self.text[:2000])
        return (f"<div><b>workbench run {html.escape(self.run_id)}</b><table>{rows}</table>"
                f"<pre style='white-space:pre-wrap'>{text}</pre></div>")


class Workbench:
    """A workbench database: list runs, open one, compare two."""

    def __init__(self, db: str | Path | Store | None = None):
        self.store = db if isinstance(db, Store) else Store(db)

    @property
    def path(self) -> Path:
        return self.store.path

    def runs(self) -> pl.DataFrame:
        return query.runs(self.store)

    def run(self, run_id: str) -> Run:
        return Run(self.store, run_id)

    def latest(self) -> Run:
        r = self.runs()
        if r.height == 0:
            raise query.RunNotFound(f"no runs in {self.store.path} yet")
        return self.run(r["run_id"][0])

    def diff(self, a: str, b: str):
        from .diff import diff_runs
        return diff_runs(self.store, a, b)

    def sql(self, query_text: str, **kw) -> pl.DataFrame:
        """Read-only SQL over the store (row and time limits; see ``workbench.sqlsafe``)."""
        from .sqlsafe import readonly_sql
        return readonly_sql(self.store, query_text, **kw)

    def record(self, prompt, **kw) -> Run:
        from .recorder import record
        return record(prompt, db=self.store, **kw)

    def __repr__(self) -> str:
        return f"Workbench({self.store.path}, {self.runs().height} runs)"


def open(db: str | Path | None = None) -> Workbench:  # noqa: A001 - the documented name
    """Open (or create) a workbench database."""
    return Workbench(db)
