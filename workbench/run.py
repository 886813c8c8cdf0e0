"""The user-facing facade: ``record``, ``Workbench`` (a database) and ``Run`` (one recorded generation).

All thin, and on top of everything else: reads go through ``workbench.data.query``, figures through
``workbench.views.figures``, analyses (anomalies, root cause, replay, diff) through their own modules, which
take a store and a run id and never import this one. A ``Run`` returned by ``record`` keeps the adapter
it was recorded with, so root cause runs on that same model.
"""
from __future__ import annotations

import dataclasses
import html
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from workbench.analysis import anomalies
from workbench.analysis import placement as expert_placement
from workbench.analysis.anomalies import detect
from workbench.analysis.atlas import atlas as expert_atlas
from workbench.analysis.atlas import super_experts as super_expert_flags
from workbench.analysis import contrast as _contrast
from workbench.analysis.codeview import code_view, run_compile_check, token_classes
from workbench.analysis.diff import diff_runs
from workbench.analysis.findings import findings
from workbench.analysis.whatif import expert_cache, fit_latency
from workbench.capture import interventions as _interventions
from workbench.capture.settings import RecordSettings
from workbench.data import query
from workbench.data.signals import PROBES, TABLES
from workbench.data.sqlsafe import readonly_sql
from workbench.data.store import Store, default_db
from workbench.data.summary import ModelSummary
from workbench.views import figures
from workbench.views.figures import precision_figure
from workbench.views.report import write_report
from workbench.views.session import RunFrames

if TYPE_CHECKING:  # the adapters import torch; reading a stored run does not need them
    from workbench.capture.adapters import Adapter


class Run:
    """One recorded run. Frames are polars; figures (``fig_*``) are plotly."""

    def __init__(self, store: Store, run_id: str, model=None, tokenizer=None):
        self.store = store
        self.run_id = run_id
        self.info = query.run_row(store, run_id)  # raises RunNotFound
        self._adapter: Adapter | None = None
        if model is not None:
            from workbench.capture.adapters import adapter_for  # lazy: imports torch; reading a run needs none
            self._adapter = adapter_for(model)
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
        """The model's own config (family-specific keys); consumers read ``model_summary`` instead."""
        return json.loads(self.info["config"] or "{}")

    @property
    def model_summary(self) -> ModelSummary:
        """The neutral model summary stored with the run (family, layers, heads, MoE layers, experts, top-k)."""
        return query.model_summary(self.info)

    @property
    def text(self) -> str:
        return "".join(self.tokens()["text"].to_list())

    @property
    def generated_text(self) -> str:
        t = self.tokens()
        return "".join(t.filter(~pl.col("is_prompt"))["text"].to_list())

    def adapter(self) -> Adapter:
        """The adapter to re-run this run with: the one it was recorded with, else its checkpoint (hash-checked)."""
        if self._adapter is None:
            from workbench.capture.resolve import load_for_run  # lazy: imports torch; reading a run needs none
            try:
                self._adapter = load_for_run(self.info)
            except ValueError as e:
                raise FileNotFoundError(f"{e}") from None
        return self._adapter

    def model(self):
        """The module this run ran (``adapter().module``)."""
        return self.adapter().module

    def tokenizer(self):
        """The run's tokenizer (``workbench.capture.resolve.run_tokenizer``): the tokenizer.json it was recorded
        with (``runs.tokenizer``, e.g. ``record --tokenizer PATH``) while it is there; else its model folder's,
        else the bundled demo's for a model that names no folder here."""
        if self._tokenizer is None:
            from workbench.capture.resolve import run_tokenizer  # lazy: imports torch; reading a run needs none
            self._tokenizer = run_tokenizer(self.info)
        return self._tokenizer

    # -- signals: one accessor per registry table (tokens, attention, routing, kv, kv_tokens, steps, ...) --
    def signal(self, table: str) -> pl.DataFrame:
        """All rows of one signal table for this run (see ``workbench.data.signals.REGISTRY``)."""
        return query.signal(self.store, table, self.run_id)

    def expert_load(self) -> pl.DataFrame:
        return query.expert_load(self.store, self.run_id)

    def maxvio(self, chunk: int = expert_placement.MAXVIO_CHUNK) -> pl.DataFrame:
        """Load imbalance per MoE layer, ``max_e load_e / mean_e load_e - 1`` (DeepSeek's MaxVio): ``layer,
        maxvio`` over the whole run, ``maxvio_chunk_mean`` / ``maxvio_chunk_max`` over chunks of ``chunk``
        positions (default 256), ``chunks``, ``slots`` (``workbench.analysis.placement``)."""
        n = self.model_summary.n_routed_experts
        if not n:
            raise ValueError(f"run {self.run_id}: {query.no_routing_reason(self.store, self.run_id)}")
        return expert_placement.maxvio(expert_placement.routing_loads(self.routing(), chunk), n)

    # -- analyses ---------------------------------------------------------------------------------
    def anomalies(self, recompute: bool = False, reference=None, **thresholds) -> pl.DataFrame:
        """Anomalies of this run (detected and stored on first call, or when ``recompute``)."""
        ref = getattr(reference, "run_id", reference)
        return detect(self.store, self.run_id, recompute=recompute, reference=ref, model=self._adapter, **thresholds)

    def findings(self, **thresholds) -> pl.DataFrame:
        """The run's anomalies grouped into ranked findings: one per component or token span (workbench.analysis.findings)."""
        return findings(self.store, self.run_id, **thresholds)

    def root_cause(self, pos: int, reference=None, **kw) -> pl.DataFrame:
        """Ranked causes of the token at ``pos``: layers, heads, experts, shared experts, routers, norms, the KV
        latent and rotary part, and source tokens (``workbench.analysis.rootcause``).

        ``reference``: a known-good ``Run`` or run id, module, adapter or checkpoint folder; with one, activation
        patching (each component's output taken from the reference: how much of the gap it closes, ``restored``)
        is the default (``method="attribution_diff"``: the difference of attributions instead). Without one:
        components ranked by how unusual they are against the baseline profile, with ablation and IG evidence."""
        from workbench.analysis.rootcause import root_cause  # lazy: imports torch; reading a run needs none
        if isinstance(reference, Run):  # its live adapter, unless the run id's checks (same weights) must speak
            same = reference.info["checkpoint_sha256"] == self.info["checkpoint_sha256"]
            reference = reference.run_id if same or reference._adapter is None else reference._adapter
        if "store" in kw:  # the older keyword
            kw["save"] = kw.pop("store")
        return root_cause(self.store, self.run_id, pos, adapter=self.adapter(), reference=reference, **kw)

    def suspects(self, pos: int, **kw) -> pl.DataFrame:
        """Components ranked by the findings and the root cause of the token at ``pos`` together."""
        from workbench.analysis.rootcause import suspects  # lazy: imports torch; reading a run needs none
        kw.setdefault("save", False)
        return suspects(self.root_cause(pos, **kw), self.findings())

    def at_step(self, t: int):
        """The state of the generation after step ``t``, from the database alone."""
        from workbench.analysis.replay import at_step  # lazy: imports torch; reading a run needs none
        return at_step(self.store, self.run_id, t)

    def replay(self, **kw) -> dict:
        """Re-run this run and compare it with the record (see ``workbench.analysis.replay.replay_run``)."""
        from workbench.analysis.replay import replay_run  # lazy: imports torch; reading a run needs none
        return replay_run(self.store, self.run_id, model=kw.pop("model", self._adapter), **kw)

    def interventions(self) -> pl.DataFrame:
        """The interventions this run was recorded under (``interventions`` table: idx, kind, layer, expert, head,
        path, value, spec); empty for a plain run. Its parent: ``info["parent_run_id"]``."""
        return _interventions.stored(self.store, self.run_id)

    def rerun(self, interventions=(), **kw) -> "Run":
        """This run's prompt (its token ids) recorded again with the same settings and model, under
        ``interventions`` (``workbench.interventions`` values or specs), as a child run (``parent_run_id`` this run).
        The child runs exactly the interventions given (not this run's own). ``kw``: ``record``'s keywords."""
        settings = RecordSettings.of_run(self.info)
        ids = json.loads(self.info["params"] or "{}").get("prompt_ids")
        if not ids:
            raise ValueError(f"run {self.run_id} has no recorded prompt_ids in its params; it cannot be re-run")
        kw.setdefault("tokenizer", self._tokenizer if self._tokenizer is not None else self.tokenizer())
        model = kw.pop("model", None)
        return record(list(ids), model=self.adapter() if model is None else model, db=self.store, settings=settings,
                      parent_run_id=self.run_id, interventions=interventions, **kw)

    def super_experts(self, experts=None) -> pl.DataFrame:
        """Super experts of this run (arXiv 2507.23279) and whether the attention sink depends on them: the run's
        flagged experts (``workbench.analysis.atlas.super_experts`` over its ``expert_extremes`` rows: largest
        activation over 10x the layer's median over experts), or the ``(layer, expert)`` pairs given. Columns
        layer, expert, max_act, clean_extreme, super, and ``sink_change``: the change in attention weight on
        position 0, averaged over the heads of the layers after the expert's and the prompt's positions 1..,
        when the expert is banned (``ban_expert``) against the same prompt without a ban (both prefilled, in a
        scratch database: the run's store gets no child runs). Needs the run's model; computed on demand."""
        flags = super_expert_flags(self.store, [self.run_id])
        if experts is None:
            pairs = [(r["layer"], r["expert"]) for r in flags.filter(pl.col("super")).iter_rows(named=True)]
        else:
            pairs = [(int(lay), int(e)) for lay, e in experts]
        change = self._sink_changes(pairs) if pairs else []
        out = pl.DataFrame({"layer": [p[0] for p in pairs], "expert": [p[1] for p in pairs], "sink_change": change},
                           schema={"layer": pl.Int32, "expert": pl.Int32, "sink_change": pl.Float64})
        return (out.join(flags.select("layer", "expert", "max_act", "clean_extreme", "super"),
                         on=["layer", "expert"], how="left")
                .with_columns(pl.col("super").fill_null(False))
                .select("layer", "expert", "max_act", "clean_extreme", "super", "sink_change"))

    def _sink_changes(self, pairs: list[tuple[int, int]]) -> list[float | None]:
        ids = json.loads(self.info["params"] or "{}").get("prompt_ids")
        if not ids:
            raise ValueError(f"run {self.run_id} has no recorded prompt_ids in its params; it cannot be re-run")
        settings = dataclasses.replace(RecordSettings.of_run(self.info), max_new_tokens=1, probes=("attention",))
        tok = self._tokenizer if self._tokenizer is not None else self.tokenizer()
        with tempfile.TemporaryDirectory(prefix="workbench_sink_") as tmp:
            scratch = Store(Path(tmp) / "sink.duckdb")

            def sink(interventions) -> pl.DataFrame:
                r = record(list(ids), model=self.adapter(), tokenizer=tok, db=scratch, settings=settings,
                           detect=False, interventions=interventions)
                return (r.attention().filter((pl.col("pos") >= 1) & (pl.col("pos") < len(ids)))
                        .select("layer", "head", "pos", "sink_weight"))
            try:
                base = sink(None)
                change = []
                for layer, e in pairs:
                    got = sink([_interventions.ban_expert(layer, e)]).join(base, on=["layer", "head", "pos"],
                                                                           suffix="_base")
                    got = got.filter(pl.col("layer") > layer)
                    change.append(float((got["sink_weight"] - got["sink_weight_base"]).mean())
                                  if got.height else None)
            finally:
                scratch.close()
        return change

    def report(self, out: str | Path | None = None, format: str = "html") -> Path | str:
        return write_report(self, out, format)

    # -- what-if on the record (workbench.analysis.whatif, workbench.analysis.codeview) -------------------------------
    def expert_cache(self, slots=(2, 4, 8), predictor: str = "none", decode_only: bool = False) -> pl.DataFrame:
        """Hit rates of a per-layer LRU cache of K expert ``slots`` replayed over this run's routing
        (``predictor``: "none", "prev3" or "lookahead"; ``decode_only``: count generated positions only)."""
        start = int(self.info["n_prompt_tokens"] or 0) if decode_only else 0
        return expert_cache(self.routing(), slots, predictor, count_from=start)

    def latency_fit(self, L0: int = 32768):
        """``wall_ms = a * (L / L0)^b + c`` fitted to this run's decode steps (``workbench.analysis.whatif.LatencyFit``)."""
        return fit_latency(self, L0=L0)

    def precision_probe(self, formats=("fp8_e4m3", "int8", "bf16"), layers=None,
                        parts=("weights", "activations", "kv"), all_layers: bool = True) -> pl.DataFrame:
        """The recorded tokens re-run teacher-forced with one layer at a time fake-quantized to each format:
        ``layer, format, rel_l2, delta_nll, top1_agreement`` (``workbench.analysis.precision.precision_probe``)."""
        from workbench.analysis.precision import precision_probe  # lazy: imports torch; reading a run needs none
        return precision_probe(self.adapter(), self.tokens()["token_id"].to_list(), formats, layers, parts,
                               all_layers)

    def logit_lens(self, pos=None, recompute: bool = False) -> pl.DataFrame:
        """Where in depth each token was decided: per produced position (``tokens.pos``) x layer, the residual
        stream after the layer through the final norm and unembedding: ``pos, layer, token_id, prob, rank,
        top_token_id, top_prob, top_text, text`` (``workbench.analysis.lens``). ``pos``: a position, several, or
        None (all). Computed with the model on the first call and stored (``logit_lens``); read back afterwards."""
        from workbench.analysis.lens import logit_lens  # lazy: imports torch; reading a run needs none
        return logit_lens(self.store, self.run_id, pos, adapter=self.adapter, tokenizer=self.tokenizer,
                          recompute=recompute)

    def fig_logit_lens(self, pos=None, recompute: bool = False):
        """Heat map layer x position of ``logit_lens``: the produced token's probability, the top-1 on hover."""
        return figures.logit_lens_figure(self.logit_lens(pos, recompute))

    def code_view(self, generated_only: bool = True, per_token: bool = False) -> pl.DataFrame:
        """Confidence and entropy by Python token class (``workbench.analysis.codeview``); ``per_token``: each token's class."""
        return token_classes(self.tokens()) if per_token else code_view(self.tokens(), generated_only)

    def compile_check(self) -> dict:
        """``ast.parse`` of the run's text: status, the first syntax error's line, col and token ``pos``."""
        tokens = self.tokens()
        if tokens.height == 0:
            raise ValueError(f"run {self.run_id} has no tokens rows (recorded without the tokens probe): no text to "
                             "check")
        return run_compile_check(tokens)

    def fig_precision(self, formats=("fp8_e4m3", "int8", "bf16"), value: str = "delta_nll", **kw):
        """Heat map (layer x format) of ``precision_probe``."""
        return precision_figure(self.precision_probe(formats, **kw), value=value)

    def kv_whatif(self, policies, save: bool = True) -> pl.DataFrame:
        """The recorded tokens re-run teacher-forced with each KV-cache policy acting on the cache (spec strings
        such as ``"window:sink=4,recent=64"``): ``policy, bytes_kept, bytes_full, delta_nll, top1_agreement,
        first_divergence, events`` against the full cache (``workbench.analysis.kv_policies``); stored in ``policy_results``."""
        from workbench.analysis.kv_policies import kv_whatif  # lazy: imports torch; reading a run needs none
        return kv_whatif(self.store, self.run_id, policies, adapter=self.adapter(), save=save)

    def policy_results(self) -> pl.DataFrame:
        """This run's stored KV what-if rows (``policy_results``), one per policy."""
        return query.policy_results(self.store, self.run_id)

    # -- figures ----------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name in TABLES:
            return lambda: self.signal(name)
        if name.startswith("fig_") and callable(getattr(RunFrames, name, None)):
            # the run's frames read now, for this figure (a live run keeps growing); the tokenizer only if loaded
            return lambda *a, **k: getattr(self.frames(), name)(*a, **k)
        raise AttributeError(name)

    def frames(self) -> RunFrames:
        """The run's frames (``workbench.views.session.RunFrames``): each table read once, on first use."""
        return RunFrames(self.store, self.run_id, tokenizer=self._tokenizer, info=self.info)

    # -- display ----------------------------------------------------------------------------------
    def summary(self) -> dict:
        t = self.tokens()
        gen = t.filter(~pl.col("is_prompt"))
        return {
            "run_id": self.run_id, "status": self.info["status"], "model": self.info["model"],
            "architecture": self.model_summary.describe(), "dtype": self.info["dtype"], "prompt_tokens": int(t["is_prompt"].sum()) if t.height else 0,
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
        return diff_runs(self.store, a, b)

    def intervene(self, run_id: str, interventions, **kw) -> Run:
        """Run ``run_id``'s prompt again under ``interventions``, as its child run (``Run.rerun``)."""
        return self.run(run_id).rerun(interventions, **kw)

    def run_set(self, runs, **record_kw) -> list[str]:
        """Run ids from: a list of run ids and / or batch ids, a ``Batch``, a string of comma-separated ids, or a
        prompt file (``.txt`` / ``.jsonl``, recorded first as a batch, by default with the bundled model:
        ``record_kw`` are ``record_many``'s keywords). A batch gives its complete runs."""
        if isinstance(runs, Batch):
            runs = [runs.batch_id]
        if isinstance(runs, Path) or (isinstance(runs, str) and Path(runs).is_file()):
            record_kw.setdefault("detect", False)
            runs = [record_many(str(runs), db=self.store, progress=False, **record_kw).batch_id]
        elif isinstance(runs, str):
            runs = [r.strip() for r in runs.split(",") if r.strip()]
        out: list[str] = []
        for r in runs:
            r = getattr(r, "run_id", r)
            b = query.batch_runs(self.store, r)
            if b.height:
                out += b.filter(pl.col("status") == "complete")["run_id"].to_list()
            else:
                out.append(query.run_row(self.store, r)["run_id"])  # RunNotFound names a typo
        if not out:
            raise ValueError(f"no complete runs in {runs!r}")
        return out

    def expert_contrast(self, runs_a, runs_b, generated_only: bool = False, **record_kw) -> pl.DataFrame:
        """(layer, expert) ranked by how much more often set A's runs choose it than set B's: layer, expert,
        share_a, share_b, diff, p, rank, n_a, n_b (``workbench.analysis.contrast``: per-run shares, Welch's t over
        runs). ``runs_a`` / ``runs_b``: run ids, batch ids or prompt files (``run_set``)."""
        a, b = self.run_set(runs_a, **record_kw), self.run_set(runs_b, **record_kw)
        return _contrast.expert_contrast(self.store, a, b, generated_only)

    def steer(self, runs_a, contrast: pl.DataFrame, top: int = 3, action: str = "ban", side: str | None = None,
              delta: float = 1.0, **kw) -> list[Run]:
        """Ban (or boost by ``delta``) the ``top`` experts of ``contrast`` and re-record every run of set A under
        it, each as a child of its run (``Run.rerun``); returns the child runs. ``side`` (whose experts): "a"
        (chosen more by A; the default for ban) or "b" (by B; the default for boost: pushes A toward B)."""
        specs = _contrast.steer_targets(contrast, top, action, side, delta)
        if not specs:
            whose = (side or ("a" if action == "ban" else "b")).upper()
            raise ValueError(f"the contrast has no expert chosen more by set {whose}")
        return [self.intervene(r, specs, **kw) for r in self.run_set(runs_a)]

    def sql(self, query_text: str, **kw) -> pl.DataFrame:
        """Read-only SQL over the store (row and time limits; see ``workbench.data.sqlsafe``)."""
        return readonly_sql(self.store, query_text, **kw)

    def record(self, prompt, **kw) -> Run:
        return record(prompt, db=self.store, **kw)

    def record_many(self, prompts, **kw):
        """Record a prompt set into this database (``workbench.record_many``); returns the ``Batch``."""
        return record_many(prompts, db=self.store, **kw)

    def batches(self) -> pl.DataFrame:
        """Every batch (prompt-set recording): batch_id, runs, complete, failed, started, finished."""
        return query.batches(self.store)

    def batch(self, batch_id: str):
        """One batch: its runs, and expert load, head entropy and low-confidence tokens over all of them."""
        if not query.batch_runs(self.store, batch_id).height:
            raise query.RunNotFound(f"no batch {batch_id!r} in {self.store.path}")
        return Batch(self.store, batch_id)

    def atlas(self, run_ids, recompute: bool = False) -> pl.DataFrame:
        """The expert atlas over a list of runs of one model (``workbench.analysis.atlas``; columns as
        ``Batch.atlas()``): stored in the ``atlas`` table under ``runs:<hash of the sorted ids>``, computed once."""
        return expert_atlas(self.store, [getattr(r, "run_id", r) for r in run_ids], recompute=recompute)

    def search(self, text: str, **kw) -> pl.DataFrame:
        """Runs and positions whose decoded text contains ``text`` (run_id, pos, end_pos, offset, match,
        context; ``workbench.data.query.search``)."""
        return query.search(self.store, text, **kw)

    def __repr__(self) -> str:
        return f"Workbench({self.store.path}, {self.runs().height} runs)"


def record(prompt: str | list[int], *, model=None, tokenizer=None, max_new_tokens: int = 64,
           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, db=None, dtype: str | None = None,
           probes=PROBES, topk: int = 5, progress: bool = False, on_token=None, parent_run_id: str | None = None,
           run_id: str | None = None, detect: bool = True, backend: str = "auto", run_fields: dict | None = None,
           device_map=None, settings: RecordSettings | None = None, interventions=None) -> Run:
    """Generate from ``prompt`` with probes attached and store every signal; returns the ``Run``.

    Args:
        prompt: text (encoded with ``tokenizer``) or token ids.
        model: None (bundled demo), a checkpoint folder (ours, or any ``transformers`` causal LM), a loaded
            module (our ``Transformer`` or a ``transformers`` model) or an adapter.
        tokenizer: a ``tokenizers.Tokenizer`` or a path; None: the checkpoint folder's (an error if it has
            none), the bundled one for the bundled model.
        db: database path or ``Store`` (default ``$WORKBENCH_DB`` or ``data/workbench.duckdb``).
        dtype: "float32" / "bfloat16" / "float16" to run the model in that dtype.
        probes: signals to record (``workbench.data.signals.PROBES``: all of them by default).
        on_token: called as ``on_token(pos, text)`` for each generated token (live streaming).
        detect: run the anomaly detectors once the run completes (``Run.anomalies()`` recomputes on demand).
        backend: "auto" | "native" | "transformers": how a DeepseekV3 folder is run.
        run_fields: more ``runs`` columns for the run's first row (``record_many`` sets ``batch_id`` so).
        device_map: a transformers folder too large for one device, placed by accelerate ("auto", or
            {module path: device}); recorded through the same adapter and probes.
        settings: every generation / recording setting at once (``workbench.capture.settings.RecordSettings``),
            instead of the keywords max_new_tokens ... device_map (give one or the other).
        interventions: edits of the model's computation to record under (``workbench.interventions``: values
            such as ``ban_expert(1, 5)`` or specs such as ``"scale_head:L0H1=0"``); stored with the run
            (``Run.interventions()``); ``parent_run_id`` names the run it varies.
    """
    from workbench.capture.recorder import record_run  # lazy: imports torch; reading a run needs none

    given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
             "dtype": dtype, "probes": probes, "topk": topk, "backend": backend, "device_map": device_map}
    if settings is None:
        settings = RecordSettings(**given)
    else:
        default = RecordSettings()
        changed = sorted(k for k, v in given.items() if v is not getattr(default, k) and v != getattr(default, k))
        if changed:
            raise TypeError(f"give settings= or the keywords {changed}, not both")
    rid, store, adapter, tok = record_run(
        prompt, settings, model=model, tokenizer=tokenizer, db=db, progress=progress, on_token=on_token,
        parent_run_id=parent_run_id, run_id=run_id, run_fields=run_fields,
        after_run=anomalies.detect if detect else None,  # the runs table shows anomaly counts
        interventions=interventions)
    return Run(store, rid, model=adapter, tokenizer=tok)


class Batch:
    """The runs of one prompt-set recording: their list, views over all of them (polars frames, plotly figures),
    and each of them as a ``Run``.

    ``recorded``: the rows (run_id, key, status, n_tokens, error) of the prompts recorded by the call that
    returned it; ``skipped``: the keys it skipped as already complete."""

    def __init__(self, store: Store | None, batch_id: str):
        self.store = store
        self.batch_id = batch_id
        self.recorded: list[dict] = []
        self.skipped: list[str] = []

    def runs(self) -> pl.DataFrame:
        """run_id, batch_item, status, prompt, n_prompt_tokens, n_tokens, error, created_at (in the set's order
        of recording)."""
        return query.batch_runs(self.store, self.batch_id)

    @property
    def run_ids(self) -> list[str]:
        return self.runs()["run_id"].to_list()

    def status(self) -> dict[str, int]:
        """Runs per status."""
        return dict(self.runs().group_by("status").len().sort("status").iter_rows())

    def expert_load(self) -> pl.DataFrame:
        """Routed slots per layer x expert summed over the batch's runs, and the share of the layer's slots."""
        return query.batch_expert_load(self.store, self.batch_id)

    def _loads(self, chunk: int = expert_placement.MAXVIO_CHUNK) -> tuple[pl.DataFrame, int]:
        """The complete runs' routed slots per chunk x layer x expert, and the model's routed experts E."""
        runs = self.runs().filter(pl.col("status") == "complete")
        n = query.model_summary(query.run_row(self.store, runs["run_id"][0])).n_routed_experts if runs.height else 0
        if not n:
            raise ValueError(f"batch {self.batch_id}: no complete runs with routed experts")
        return expert_placement.store_loads(self.store, runs["run_id"].to_list(), chunk), n

    def maxvio(self, chunk: int = expert_placement.MAXVIO_CHUNK) -> pl.DataFrame:
        """Load imbalance per MoE layer over the complete runs (DeepSeek's MaxVio, ``max / mean - 1``): ``layer,
        maxvio`` over the whole batch, ``maxvio_chunk_mean`` / ``maxvio_chunk_max`` over chunks of ``chunk`` tokens
        (default 256; the runs one after the other), ``chunks``, ``slots`` (``workbench.analysis.placement``)."""
        return expert_placement.maxvio(*self._loads(chunk))

    def placement(self, devices: int, redundant: int = 0, policy="contiguous") -> pl.DataFrame:
        """Expert-parallel placement what-if over the batch's routing: ``policy, layer, device, slots`` (routed
        slots the device processes), ``replicas``, ``experts``. ``policy``: "contiguous", "eplb", a user's placement
        (a dict or JSON file ``{layer or "*": [[experts of device 0], ...]}``) or a list of them
        (``workbench.analysis.placement``)."""
        loads = expert_placement.layer_loads(*self._loads())
        pols = policy if isinstance(policy, (list, tuple)) else [policy]
        return pl.concat([expert_placement.placement(loads, devices, redundant, p) for p in pols])

    def placement_summary(self, devices: int, redundant: int = 0, policies=expert_placement.POLICIES) -> pl.DataFrame:
        """Per policy and layer: ``max_load``, ``mean_load``, ``imbalance`` (max / mean) of the device loads and the
        all-to-all traffic ``offdevice_slots`` / ``offdevice_share`` (sources spread evenly over the devices)."""
        loads = expert_placement.layer_loads(*self._loads())
        pols = policies if isinstance(policies, (list, tuple)) else [policies]
        return pl.concat([expert_placement.summary(expert_placement.placement(loads, devices, redundant, p), loads,
                                                   redundant) for p in pols])

    def fig_placement(self, devices: int, redundant: int = 0, policies=expert_placement.POLICIES):
        return figures.placement_figure(self.placement_summary(devices, redundant, policies))

    def head_entropy(self) -> pl.DataFrame:
        """Each run's mean entropy per layer x head (run_id, layer, head, entropy, norm_entropy): the
        distribution of a head's entropy across the batch."""
        return query.batch_head_entropy(self.store, self.batch_id)

    def head_entropy_summary(self) -> pl.DataFrame:
        """Per layer x head over the batch's runs: runs, mean, std, min, p10, median, p90, max of norm_entropy."""
        return query.batch_head_entropy_summary(self.store, self.batch_id)

    def low_confidence(self, n: int = 20) -> pl.DataFrame:
        """The ``n`` least confident generated tokens across the batch: run_id, pos, text, confidence, prob, rank."""
        return query.batch_low_confidence(self.store, self.batch_id, n)

    def atlas(self, recompute: bool = False) -> pl.DataFrame:
        """The expert atlas of the batch's complete runs (``workbench.analysis.atlas``): per MoE layer x expert
        layer, expert, slots, load_share, runs, mean_weight, label, top_tokens, token_weights, key_tokens,
        key_scores, top_classes, class_shares, co_experts, co_shares, contexts (JSON). Computed once and stored
        in the ``atlas`` table; recomputed when the batch's complete runs changed, or with ``recompute``."""
        return expert_atlas(self.store, batch_id=self.batch_id, recompute=recompute)

    def search(self, text: str, **kw) -> pl.DataFrame:
        """``workbench.data.query.search`` within this batch's runs."""
        return query.search(self.store, text, batch_id=self.batch_id, **kw)

    def fig_expert_load(self):
        return figures.batch_load_figure(self.expert_load(), self.batch_id)

    def fig_head_entropy(self):
        return figures.batch_entropy_figure(self.head_entropy(), self.batch_id)

    def fig_low_confidence(self, n: int = 20):
        return figures.batch_confidence_figure(self.low_confidence(n), self.batch_id)

    def __repr__(self) -> str:
        st = ", ".join(f"{n} {s}" for s, n in self.status().items()) if self.store is not None else "not opened"
        return f"Batch({self.batch_id}, {st})"

    def run(self, run_id: str) -> Run:
        if run_id not in self.run_ids:
            raise query.RunNotFound(f"run {run_id!r} is not in batch {self.batch_id}")
        return Run(self.store, run_id)


def record_many(prompts, *, ray: str | bool | None = None, workers: int = 1, **kw) -> Batch:
    """Record every prompt of a set as its own run, all sharing one ``batch_id``; returns a ``Batch``
    (``workbench.capture.prompt_sets.record_many``: resumable, a failing prompt becomes a failed run, ``out=`` for shards).

    ``ray``: run the set on a Ray Data actor pool instead: True / "auto" (a local cluster, or the one
    ``$RAY_ADDRESS`` names) or a cluster address; needs ``out`` and ``pip install 'moe-workbench[ray]'``;
    ``workers``: actors of the pool (one model each)."""

    from workbench.capture import prompt_sets  # lazy: recording imports torch, reading a run does not

    kw["after_run"] = anomalies.detect if kw.pop("detect", True) else None  # capture never imports the analyses
    if ray:
        from workbench.capture.ray_actors import record_many_ray  # lazy: imports torch; reading a run needs none
        if kw.get("out") is None:
            raise ValueError("--ray writes Parquet shards: give --out DIR")
        prep = {k: kw[k] for k in ("model", "batch_id", "settings", *RecordSettings.names()) if k in kw}
        items, settings, batch_id = prompt_sets.prepare(prompts, **prep)
        rows = record_many_ray(items, out=kw["out"], batch_id=batch_id, model=kw.get("model"),
                               tokenizer=kw.get("tokenizer"), settings=settings, after_run=kw["after_run"],
                               progress=kw.get("progress", True), address=None if ray in (True, "auto") else str(ray),
                               workers=workers, batch_size=kw.get("batch_size", prompt_sets.BATCH_SIZE))
        out = Batch(Store(kw["out"]), batch_id)
        out.recorded = rows
        return out
    if kw["after_run"] is not None:  # the set's weights do not change between its runs: known answers computed once
        from workbench.analysis.activations import fixed_weights  # lazy: imports torch
        with fixed_weights():
            res = prompt_sets.record_many(prompts, **kw)
    else:
        res = prompt_sets.record_many(prompts, **kw)
    out = Batch(res.store, res.batch_id)
    out.recorded, out.skipped = res.recorded, res.skipped
    return out


def open(db: str | Path | Store | None = None, create: bool = False) -> Workbench:  # noqa: A001 - the documented name
    """Open a workbench database (default ``$WORKBENCH_DB`` or ``data/workbench.duckdb``); a folder of Parquet
    shards (``workbench export``, ``workbench record --prompts ... --out DIR``) opens read-only
    (``workbench.data.store.TraceStore``). A path that does not exist is a FileNotFoundError naming it, and
    nothing is created (a typo makes no empty database and no folders); ``create=True`` makes a new database
    there (at its first query)."""
    if not isinstance(db, Store) and not create:
        path = Path(db) if db else default_db()
        if not path.exists():
            raise FileNotFoundError(f"no workbench database at {path} (nothing was created); "
                                    "workbench.open(path, create=True) makes a new one")
    return Workbench(db)
