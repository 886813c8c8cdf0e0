"""Anomaly reports: one self-contained HTML file (works offline), or JSON / Markdown with the same facts.

A report holds the run's summary, its anomalies ranked by severity, for the top few the root-cause
ranking and attribution heat map, and the entropy / routing / KV figures. Integrated Gradients is
slow, so only ``explain`` positions (default 3) are explained, and attributions already stored are
reused. Each analysis is optional: if a module or the model is missing, the report says so in its
notes instead of failing.

Everything from the run is untrusted text (token text, prompts, model names, explanations, error
messages). The HTML page is a Jinja2 template (``templates/report.html.j2``, package data) rendered
with autoescape on, so the template engine escapes every value it prints; the only values passed as
``Markup`` are plotly's bundle and JSON embedded in ``<script>``, which has ``<``, ``>`` and ``&``
escaped as ``\\u003c`` etc. (``script_json``), so no ``</script>`` can break out. The HTML loads
nothing from the network: plotly's JS is inlined and a Content-Security-Policy forbids fetching
anything. The Markdown is a template too (``templates/report.md.j2``), whose environment passes every printed
value through ``_md`` (HTML-escaped, since Markdown passes HTML through; pipes and newlines neutralised).
"""
from __future__ import annotations

import hashlib
import html
import json
import math
import re
import time
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

import plotly.io as pio
import polars as pl
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup
from plotly.offline import get_plotlyjs

from workbench.analysis import atlas as expert_atlas
from workbench.analysis.anomalies import what_was_tested
from workbench.analysis.codeview import code_view, run_compile_check
from workbench.analysis.findings import group_findings
from workbench.data import query
from workbench.data.schema import SCHEMA_VERSION
from workbench.views.figures import logit_lens_figure
from workbench.views.session import RunFrames

FORMATS = ("html", "json", "md")
CAUSES_SHOWN = 10
FINDINGS_SHOWN = 10
EXPLAIN_BUDGET_S = 60.0  # root cause (IG + ablations) takes seconds to minutes per position on a CPU
LENS_POSITIONS = 40  # positions of a finding's logit-lens heat map
ANOMALIES_SHOWN = 30  # rows of the HTML table shown before the rest is folded away
KV_POLICY_COLUMNS = ["policy", "bytes_kept", "bytes_full", "delta_nll", "top1_agreement", "first_divergence", "events"]
CODE_COLUMNS = ["class", "tokens", "mean_confidence", "median_confidence", "mean_entropy", "low_confidence_share"]
ANOMALY_COLUMNS = ["rank", "severity", "kind", "pos", "token", "layer", "head", "expert", "score", "threshold",
                   "explanation"]


# -- collecting the facts ---------------------------------------------------------------------------


def _plain(x: Any) -> Any:
    """A JSON-ready value: non-finite floats become None, dates ISO strings, containers recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (datetime, date)):
        return x.isoformat()
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):  # numpy scalars
        return _plain(x.item())
    return x


def _records(df: pl.DataFrame | None) -> list[dict]:
    return [] if df is None else [_plain(r) for r in df.iter_rows(named=True)]


@dataclass
class Report:
    """What a report says (``facts``, JSON-ready) and its figures ``(section, key, plotly figure)``."""

    facts: dict
    figures: list[tuple[str, str, Any]] = field(default_factory=list)
    run: Any = None  # the workbench.Run it describes
    frames: RunFrames | None = None  # its frames, read once for every figure

    @property
    def notes(self) -> list[str]:
        return self.facts["notes"]


def _figure(rep: Report, section: str, key: str, name: str, *args) -> None:
    """Add ``RunFrames.<name>(*args)`` (the run's frames read once for the whole report); a note instead if it
    cannot be drawn."""
    if rep.frames is None:
        rep.frames = RunFrames(rep.run.store, rep.run.run_id, info=rep.run.info)
    fn = getattr(rep.frames, name, None)
    if fn is None:
        rep.notes.append(f"figure {key} unavailable: no figure {name}")
        return
    try:
        rep.figures.append((section, key, fn(*args)))
    except Exception as e:  # a figure must never sink the whole report
        rep.notes.append(f"figure {key} failed: {type(e).__name__}: {e}")


def _anomalies(run, rep: Report) -> pl.DataFrame | None:
    try:
        df = run.anomalies()
    except ImportError as e:
        rep.notes.append(f"anomaly detection is not available in this installation ({e}); no anomalies listed")
        return None
    except Exception as e:
        rep.notes.append(f"anomaly detection failed: {type(e).__name__}: {e}")
        return None
    # most severe first, then the detector's own order (kept stable)
    sev = {"critical": 0, "warning": 1, "info": 2}
    df = df.with_row_index("_order").with_columns(
        pl.col("severity").replace_strict(sev, default=3, return_dtype=pl.Int32).alias("_sev"))
    return df.sort("_sev", "_order").drop("_sev", "_order").with_row_index("rank", offset=1)


def _explain(run, pos: int, rep: Report, root_cause_kw: dict) -> pl.DataFrame | None:
    """Stored attributions for ``pos``, else ``run.root_cause(pos)``; None (with a note) if impossible."""
    have = query.attributions(run.store, run.run_id, pos)
    if have.height:
        return have
    try:
        return run.root_cause(pos, **root_cause_kw)
    except ImportError as e:
        rep.notes.append(f"root cause is not available in this installation ({e})")
    except Exception as e:
        rep.notes.append(f"root cause of position {pos} not computed: {type(e).__name__}: {e}")
    return None


def _findings(run, anomalies, rep: Report):
    """The run's findings from its anomaly rows (None, with a note, if that fails)."""
    if anomalies is None:
        return None
    try:
        s = run.model_summary
        return group_findings(anomalies, run.routing(), shared_experts=bool(s.n_shared_experts))
    except Exception as e:  # noqa: BLE001 - a report still comes out
        rep.notes.append(f"findings could not be formed: {type(e).__name__}: {e}")
        return None


def _code_facts(rep: Report, toks: pl.DataFrame) -> None:
    """The text read as Python (workbench.analysis.codeview): the compile check and confidence by token class."""
    if toks.height == 0:
        return
    try:
        rep.facts["code"] = {"compile": _plain(run_compile_check(toks)), "classes": _records(code_view(toks))}
    except Exception as e:  # noqa: BLE001 - a report still comes out
        rep.notes.append(f"code view failed: {type(e).__name__}: {e}")
        return
    _figure(rep, "code", "code_view", "fig_code_view")


def _compile_line(chk: dict, text: dict) -> str:
    """The compile check in words (not escaped)."""
    if chk["ok"]:
        return f"The text parses as Python ({chk['lines']} lines)."
    what = "Incomplete (the text ends mid-statement)" if chk["status"] == "incomplete" else "Syntax error"
    tok = f", token {chk['pos']} {_show(text.get(chk['pos']))!r}" if chk.get("pos") is not None else ""
    return (f"{what}: {chk['message']} at line {chk['line']}, col {chk['col']}{tok}; the first {chk['ok_lines']} "
            f"of {chk['lines']} lines parse.")


def _atlas_cards(rep: Report, store, info: dict) -> None:
    """For each finding that names an expert: its card from the stored atlas of the run's batch
    (``Batch.atlas()``; the report never computes one)."""
    named = [fnd for fnd in rep.facts["findings"] if fnd.get("expert") is not None and fnd.get("layer") is not None]
    if not named or not info.get("batch_id"):
        return
    try:
        df, fp = expert_atlas.stored(store, expert_atlas.batch_scope(info["batch_id"]))
    except Exception as e:  # noqa: BLE001 - a report still comes out
        rep.notes.append(f"the batch's expert atlas could not be read: {type(e).__name__}: {e}")
        return
    cards = {(r["layer"], r["expert"]): r for r in df.iter_rows(named=True)} if fp else {}
    for fnd in named:
        row = cards.get((int(fnd["layer"]), int(fnd["expert"])))
        if row is not None:
            c = expert_atlas.card(row)
            fnd["atlas"] = _plain({
                "batch_id": info["batch_id"], "layer": c["layer"], "expert": c["expert"],
                "load_share": c["load_share"], "label": c["label"], "top_tokens": c["top_tokens"][:6],
                "classes": list(zip(c["top_classes"], c["class_shares"]))[:4],
                "co_experts": list(zip(c["co_experts"], c["co_shares"]))[:3], "contexts": c["contexts"][:3]})


def _lens_figures(rep: Report, store, run_id: str, toks: pl.DataFrame) -> None:
    """For each finding, the logit lens (layer x position) at its positions and the next ones, when the run's
    ``logit_lens`` rows are stored (``Run.logit_lens``); the report never runs the model for it."""
    try:
        lens = query.table(store, "logit_lens", run_id, "pos, layer",
                           cols=["pos", "layer", "token_id", "prob", "rank", "top_token_id", "top_prob", "top_text"])
    except Exception as e:  # noqa: BLE001 - a report still comes out
        rep.notes.append(f"logit lens rows could not be read: {type(e).__name__}: {e}")
        return
    if lens.height == 0:
        return
    for fnd in rep.facts["findings"]:
        near = sorted({p + d for p in fnd.get("positions") or [] for d in (0, 1)} & set(lens["pos"].to_list()))
        if not near:
            continue
        near = near[:LENS_POSITIONS]
        fnd["lens_positions"] = near
        rank = int(fnd["rank"])
        fig = logit_lens_figure(lens.filter(pl.col("pos").is_in(near)), toks,
                                f"Logit lens at the positions of finding {rank}: p of the produced token per layer")
        rep.figures.append((f"lens-{rank}", f"logit_lens_{rank}", fig))


def build_report(run, explain: int = 3, root_cause_kw: dict | None = None,
                 explain_budget_s: float | None = EXPLAIN_BUDGET_S) -> Report:
    """Collect a report's facts and figures for ``run`` (a ``workbench.Run``).

    Args:
        explain: how many of the top anomalous positions get a root-cause ranking (0: none).
        root_cause_kw: keyword arguments for ``Run.root_cause`` (e.g. ``{"steps": 16}``).
        explain_budget_s: once root cause has taken this long, further positions are listed in the
            notes instead of computed (the first is always explained; None: no limit).
    """
    if explain < 0:
        raise ValueError(f"explain must be >= 0, got {explain}")
    info = run.refresh().info
    params = json.loads(info["params"] or "{}")
    toks = run.tokens()
    rep = Report(facts={
        "report": {"kind": "moe-workbench anomaly report", "schema_version": SCHEMA_VERSION,
                   "created_at": datetime.now(timezone.utc).replace(microsecond=0).isoformat()},
        "run": _plain({k: v for k, v in info.items() if k not in ("config", "params", "pid", "summary")}),
        "model": _plain(run.model_summary.to_dict()),
        "params": _plain(params), "config": _plain(json.loads(info["config"] or "{}")),
        "summary": {}, "findings": [], "tokens": [], "anomalies": [], "explained": [], "signals": {}, "notes": [],
    }, run=run)
    facts = rep.facts
    facts["summary"] = _plain(run.summary())
    facts["tokens"] = _records(toks.select("pos", "token_id", "text", "is_prompt", "prob", "logprob", "confidence",
                                           "entropy", "rank")) if toks.height else []
    anomalies = _anomalies(run, rep)
    facts["anomalies"] = _records(anomalies)
    if anomalies is not None:
        facts["summary"]["anomalies"] = {s: int((anomalies["severity"] == s).sum())
                                         for s in ("critical", "warning", "info")}
        facts["summary"]["tested"] = what_was_tested(run.store, run.run_id)
    # the diagnosis: findings first; each of the top ones gets a root-cause ranking of the token it hurt most
    text = dict(zip(toks["pos"].to_list(), toks["text"].to_list())) if toks.height else {}
    found = _findings(run, anomalies, rep)
    facts["findings"] = _records(found.head(FINDINGS_SHOWN)) if found is not None else []
    logprob = dict(zip(toks["pos"].to_list(), toks["logprob"].to_list())) if toks.height else {}
    targets: list[int] = []
    for fnd in facts["findings"]:
        cands = {p + d for p in fnd["positions"] or [] for d in (0, 1) if 1 <= p + d < toks.height}
        cands = [c for c in cands if logprob.get(c) is not None and math.isfinite(logprob[c])]
        if cands:
            fnd["explained_pos"] = min(cands, key=lambda c: logprob[c])  # the token it hurt most
            if fnd["explained_pos"] not in targets and len(targets) < explain:
                targets.append(fnd["explained_pos"])
    started = time.perf_counter()
    for i, pos in enumerate(targets):
        if explain_budget_s is not None and i and time.perf_counter() - started > explain_budget_s:
            rest = ", ".join(str(p) for p in targets[i:])
            rep.notes.append(f"root cause of positions {rest} skipped: the {explain_budget_s:g} s budget for "
                             f"explaining is spent (run `workbench explain {run.run_id} POS`, then re-export)")
            break
        causes = _explain(run, pos, rep, dict(root_cause_kw or {}))
        if causes is None:
            continue
        from workbench.analysis.rootcause import (  # lazy: imports torch; reading a run needs none
            cache_note, ig_check, sampler_note)
        warn = ig_check(causes, (root_cause_kw or {}).get("steps", 32))
        if warn:
            rep.notes.append(f"position {pos}: {warn}")
        tok = causes.filter(pl.col("kind") == "token").sort("source_pos")
        facts["explained"].append({
            "pos": pos, "text": text.get(pos), "sampler_note": sampler_note(run.store, run.run_id, pos),
            "cache_note": cache_note(run.store, run.run_id),
            "anomaly_ids": [r["anomaly_id"] for r in anomalies.iter_rows(named=True) if r["pos"] == pos],
            "causes": _records(causes.sort("rank").head(CAUSES_SHOWN).select(
                [c for c in ("rank", "kind", "layer", "head", "expert", "source_pos", "score", "method", "delta")
                 if c in causes.columns])),
            "attribution": [{"source_pos": r["source_pos"], "text": text.get(r["source_pos"]),
                             "score": _plain(r["score"])} for r in tok.iter_rows(named=True)],
        })
        if rep.frames is not None:
            rep.frames.forget("attributions")  # root cause may just have stored this position's rows
        _figure(rep, f"explain-{pos}", f"attribution_{pos}", "fig_attribution", pos)
        _figure(rep, f"explain-{pos}", f"components_{pos}", "fig_components", pos)
    store, rid = run.store, run.run_id
    _atlas_cards(rep, store, info)
    _lens_figures(rep, store, rid, toks)
    facts["signals"] = {
        "head_entropy": _records(query.head_entropy(store, rid)),
        "expert_load": _records(query.expert_load(store, rid)),
        "kv": _records(query.kv(store, rid)),
        "steps": _records(query.steps(store, rid)),
    }
    _figure(rep, "signals", "confidence", "fig_tokens")
    _figure(rep, "signals", "head_entropy", "fig_head_entropy")
    _figure(rep, "signals", "entropy_along", "fig_entropy_along")
    _figure(rep, "signals", "expert_load", "fig_expert_load")
    _figure(rep, "signals", "kv_bytes", "fig_kv_bytes")
    _figure(rep, "signals", "kv_received", "fig_kv_received")
    _code_facts(rep, toks)
    # KV-cache policy what-if rows stored for the run (workbench kv-whatif); none: no section
    facts["kv_policies"] = _records(query.policy_results(store, rid))
    if facts["kv_policies"]:
        _figure(rep, "kv_whatif", "kv_pareto", "fig_kv_pareto")
    return rep


def report_facts(rep: Report) -> dict:
    """The JSON document of a report (without internals)."""
    return rep.facts | {"figures": [key for _, key, _ in rep.figures]}


# -- rendering --------------------------------------------------------------------------------------

_SCRIPT_SAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def script_json(text: str) -> str:
    """JSON text made safe inside ``<script>``: no ``</script>``, ``<!--`` or line separators survive."""
    return re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_SAFE[m.group(0)], text)


def _num(x: Any) -> str:
    """A table cell's text (not escaped: the template does that): floats to 4 significant digits, None empty."""
    if isinstance(x, float):
        return f"{x:.4g}"
    return "" if x is None else str(x)


def _show(text: str | None) -> str:
    """Token text with newlines and tabs made visible (not yet escaped)."""
    return (text or "").replace("\n", "\u21b5\n").replace("\t", "\u2192")


def _confidence_colour(c: float | None) -> str:
    if c is None:
        return "#eeeeee"
    return f"hsl({120 * max(0.0, min(1.0, c)):.0f}, 70%, 82%)"


@lru_cache(maxsize=1)
def templates() -> Environment:
    """The report's Jinja2 environment: templates from the package (workbench/views/templates), autoescape on.

    Autoescape escapes every value a template prints unless it is ``Markup``; the only Markup passed in is
    built in ``render_html`` (plotly's bundle, JSON made script-safe by ``script_json``).
    """
    env = Environment(loader=PackageLoader("workbench.views", "templates"),
                      autoescape=select_autoescape(enabled_extensions=("html", "htm", "html.j2"), default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(num=_num, visible=_show, colour=_confidence_colour, span_list=_span_list)
    return env


def render_html(rep: Report) -> str:
    """One self-contained HTML page (templates/report.html.j2): plotly's JS inline, figures and facts as
    script-safe JSON."""
    f = rep.facts
    run, summary = f["run"], f["summary"]
    keys = ["status", "model", "checkpoint_sha256", "dtype", "device", "seed", "parent_run_id", "created_at",
            "n_prompt_tokens", "n_tokens", "error"]
    rows = [(k, run.get(k)) for k in keys] + [(k, v) for k, v in summary.items() if k != "run_id" and k not in keys]
    rows += [(k, f["params"].get(k)) for k in ("max_new_tokens", "temperature", "top_p")]
    summary_rows = [(k, json.dumps(v) if isinstance(v, dict) else v) for k, v in rows]
    text = {t["pos"]: t["text"] for t in f["tokens"]}
    groups = []
    if f["anomalies"]:
        rows = [dict(a, token=_show(text.get(a["pos"])) if a.get("pos") is not None else "")
                for a in f["anomalies"]]
        groups = [{"kind": kind, "rows": [r for r in rows if r["kind"] == kind]}
                  for kind in sorted({r["kind"] for r in rows})]
    # figures numbered in the order the page shows them; a section the page leaves out shows none
    by_section: dict[str, list] = {}
    for section, key, fig in rep.figures:
        by_section.setdefault(section, []).append((key, fig))
    shown = [f"lens-{int(fnd['rank'])}" for fnd in f["findings"] if fnd.get("lens_positions")]
    shown += [f"explain-{ex['pos']}" for ex in f["explained"]] + ["signals"]
    shown += ["kv_whatif"] if f.get("kv_policies") else []
    shown += ["code"] if f.get("code") else []
    figs, figs_by_section = [], {}
    for section in shown:
        for key, fig in by_section.get(section, []):
            d = {"id": f"fig-{len(figs)}", "key": key,
                 "json": Markup(script_json(pio.to_json(fig, validate=False)))}  # script-safe: no < > &
            figs.append(d)
            figs_by_section.setdefault(section, []).append(d)
    js = get_plotlyjs()
    if "</script" in js.lower():  # never true for plotly 5-7, but the page must stay well formed
        js = re.sub(r"(?i)</script", r"<\\/script", js)
    return templates().get_template("report.html.j2").render(
        f=f, run=run, summary=summary, summary_rows=summary_rows,
        explained={ex["pos"]: ex for ex in f["explained"]},
        anomalous={a["pos"] for a in f["anomalies"] if a.get("pos") is not None},
        anomaly_groups=groups, anomalies_failed=any("anomal" in n for n in f["notes"]),
        anomalies_shown=ANOMALIES_SHOWN, anomaly_columns=ANOMALY_COLUMNS,
        kv_policy_columns=KV_POLICY_COLUMNS, code_columns=CODE_COLUMNS,
        compile_line=_compile_line(f["code"]["compile"], text) if f.get("code") else "",
        figs=figs, figs_by_section=figs_by_section,
        facts_json=Markup(script_json(json.dumps(report_facts(rep), allow_nan=False, default=str))),
        plotly_js=Markup(js))


def _md(x: Any) -> str:
    """A Markdown table cell: HTML-escaped (Markdown passes HTML through), pipes and newlines neutralised."""
    if isinstance(x, float):
        x = f"{x:.4g}"
    s = html.escape("" if x is None else str(x), quote=True)
    return s.replace("|", "\\|").replace("`", "&#96;").replace("\n", "\u21b5").replace("\r", "")


def _span_list(pos: list[int] | None, most: int = 12) -> str:
    pos = pos or []
    return ", ".join(str(p) for p in pos[:most]) + (f", ... ({len(pos)} in all)" if len(pos) > most else "")


def _md_value(x: Any) -> Any:
    """What the Markdown template prints for ``{{ x }}``: ``_md(x)``, unless it is Markup (already escaped)."""
    return x if isinstance(x, Markup) else _md(x)


@lru_cache(maxsize=1)
def md_templates() -> Environment:
    """The Markdown report's environment: the same package templates; every printed value passes ``_md``."""
    env = Environment(loader=PackageLoader("workbench.views", "templates"), autoescape=False, finalize=_md_value,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    return env


def render_md(rep: Report) -> str:
    """The report in Markdown (templates/report.md.j2): the same facts, no figures."""
    f = rep.facts
    run = f["run"]
    text = {t["pos"]: t["text"] for t in f["tokens"]}
    keys = ("status", "model", "checkpoint_sha256", "dtype", "seed", "parent_run_id", "created_at")
    rows = [{"field": k, "value": run.get(k)} for k in keys]
    rows += [{"field": k, "value": json.dumps(v) if isinstance(v, dict) else v} for k, v in f["summary"].items()
             if k != "run_id" and k not in keys]
    return md_templates().get_template("report.md.j2").render(
        f=f, summary_rows=rows, anomaly_rows=[dict(a, token=text.get(a.get("pos"))) for a in f["anomalies"]],
        text=Markup(html.escape("".join(t["text"] or "" for t in f["tokens"]))),  # escaped here, for <pre>
        compile_line=_compile_line(f["code"]["compile"], text) if f.get("code") else "",
        kv_policy_columns=KV_POLICY_COLUMNS, code_columns=CODE_COLUMNS)


def report_name(run_id: str, format: str = "html") -> str:
    """A report's file name for ``run_id``: ``report_<id>.<format>`` with every character but letters, digits,
    ``_``, ``.`` and ``-`` as ``_`` (a ``/``, ``..`` or a NUL in a run id makes no path), no leading dot, and a
    long id shortened with a hash of the whole id (file names stay under 255 bytes, distinct ids distinct names)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(run_id)).strip(".") or "_"
    if len(safe) > 80 or safe != str(run_id):
        safe = f"{safe[:80]}_{hashlib.sha256(str(run_id).encode()).hexdigest()[:10]}"
    return f"report_{safe}.{format}"


def write_report(run, out: str | Path | None = None, format: str = "html", *, explain: int = 3,
                 root_cause_kw: dict | None = None, explain_budget_s: float | None = EXPLAIN_BUDGET_S) -> Path:
    """Write ``run``'s anomaly report and return its path.

    Args:
        run: a ``workbench.Run``.
        out: file to write, or a folder (default: ``report_<run_id>.<format>`` in the current folder).
        format: "html" (one self-contained file, works offline), "json" (the same facts) or "md".
        explain: number of top anomalous positions explained with root cause (IG is slow).
        root_cause_kw: passed to ``Run.root_cause`` (e.g. ``{"steps": 16}``).
        explain_budget_s: seconds of root cause after which further positions are skipped (with a note).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown report format {format!r}; choose from {', '.join(FORMATS)}")
    name = report_name(run.run_id, format)
    path = Path(out) if out is not None else Path.cwd() / name
    if path.is_dir():
        path = path / name
    if not path.parent.exists():
        raise FileNotFoundError(f"cannot write the report to {path}: folder {path.parent} does not exist")
    rep = build_report(run, explain=explain, root_cause_kw=root_cause_kw, explain_budget_s=explain_budget_s)
    if format == "html":
        body = render_html(rep)
    elif format == "json":
        body = json.dumps(report_facts(rep), indent=1, allow_nan=False, default=str) + "\n"
    else:
        body = render_md(rep)
    path.write_text(body, encoding="utf-8")
    return path
