"""workbench explain RUN_ID POS: root cause of one token (source tokens by IG, heads and experts by ablation and
against the baseline profile; with --reference, every component kind by activation patching).

``--model FOLDER`` and ``--tokenizer PATH`` (read with ``getattr``: declared in workbench/cli.py) replace the
run's recorded model folder (its weights must hash to the recorded ones) and tokenizer.

Progress (loading the model, then each phase's forwards: IG points, ablated components, the evidence, patching)
goes to stderr as a bar while stderr is a terminal; piped or redirected, or with ``--quiet`` where the parser
declares it, nothing is drawn."""
from __future__ import annotations

import contextlib
import json
import math
import sys
from typing import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from workbench.analysis.rootcause import cache_note, ig_check, sampler_note
from workbench.capture.resolve import load_for_run, run_tokenizer
from workbench.run import Run, Workbench


def _num(v):
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


def main(args) -> int:

    run = Workbench(args.db).run(args.run_id)
    model, tok = getattr(args, "model", None), getattr(args, "tokenizer", None)
    if model is not None or tok is not None:  # overrides of the recorded model folder / tokenizer
        run = Run(run.store, run.run_id, model=load_for_run(run.info, model) if model is not None else None,
                  tokenizer=run_tokenizer(run.info, model, tok))
    kw = {"method": args.method} if getattr(args, "method", None) else {}
    with _progress(_stderr_tty() and not getattr(args, "quiet", False)) as report:
        if report is not None:
            report("loading the model", 0, None)
            run.adapter()  # loads (and hash-checks) the model once; root_cause reuses it
            report("loading the model", 1, 1)
        df = run.root_cause(args.pos, steps=args.steps, mode=args.mode, reference=args.reference,
                            progress=report, **kw)
    tokens = run.tokens()
    texts = dict(zip(tokens["pos"].to_list(), tokens["text"].to_list()))
    target = tokens.filter(tokens["pos"] == args.pos).row(0, named=True)
    ig = df.filter(df["kind"] == "token")
    method = ig["method"][0] if ig.height else None
    delta = ig["delta"][0] if ig.height else None
    warning = ig_check(df, args.steps)
    drawn = sampler_note(run.store, run.run_id, args.pos)
    cached = cache_note(run.store, run.run_id)
    if args.json:
        rows = [{k: _num(v) for k, v in r.items()} | ({"source_text": texts.get(r["source_pos"])}
                                                      if r["source_pos"] is not None else {})
                for r in df.iter_rows(named=True)]
        print(json.dumps({"run_id": run.run_id, "pos": args.pos, "reference": args.reference, "token": target["text"],
                          "logprob": _num(target["logprob"]), "method": method, "delta": _num(delta),
                          "ig_warning": warning, "sampler_note": drawn, "cache_note": cached,
                          "ig_total": _num(float(ig["score"].sum())) if ig.height else None, "causes": rows}))
        return 0

    lp = target["logprob"]
    title = (f"why {target['text']!r} at {args.pos} (logprob {lp:.3f})" if lp is not None
             else f"why {target['text']!r} at {args.pos}")
    if args.reference is not None:
        title += f", against reference {args.reference}"
    t = Table(title=escape(title))
    patching = "patching" in set(df["method"])
    for c in ("rank", "kind", "where", "score (nats)") + (("restored",) if patching else ()) + ("method",):
        t.add_column(c)
    for r in df.head(15).iter_rows(named=True):
        score = "nan" if r["score"] is None or not math.isfinite(r["score"]) else f"{r['score']:+.4f}"
        cells = [r["rank"], r["kind"], _where(r, texts), score]
        if patching:
            rest = r.get("restored")
            cells.append("-" if rest is None or not math.isfinite(rest) else f"{rest:.0%}")
        t.add_row(*(escape(str(v)) for v in cells + [r["method"]]))
    con = Console()
    for note in (cached, drawn):
        if note:
            con.print(escape(f"note: {note}"), style="bold")
    con.print(t)
    if ig.height and delta is not None:
        con.print(escape(f"token attributions: {method}, {args.steps} steps, sum {ig['score'].sum():+.4f} nats, "
                         f"convergence delta {delta:+.2e}"))
    if warning:
        con.print(escape(f"warning: {warning}"), style="bold yellow")
    return 0


def _stderr_tty() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator:
    """``report(phase, done, total)`` drawing one bar per phase on stderr (removed when done), or None."""
    if not enabled:
        yield None
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True, force_terminal=True), transient=True)
    tasks: dict[str, int] = {}

    def report(phase: str, done: int, total: int | None) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total)
        bar.update(tasks[phase], completed=done, total=total)

    with bar:
        yield report


WHAT = {"router": "router", "shared_expert": "shared experts", "attn_block": "attention block",
        "mlp_block": "MoE block", "dense_mlp": "dense MLP", "resid": "residual stream after the block",
        "attn_norm": "attention input norm", "mlp_norm": "MLP input norm", "kv_latent": "KV latent",
        "rotary": "rotary part"}


def _where(r: dict, texts: dict) -> str:
    kind = r["kind"]
    if kind == "token":
        return f"pos {r['source_pos']} {texts.get(r['source_pos'], '')!r}"
    if kind == "head":
        return f"layer {r['layer']} head {r['head']}"
    if kind == "expert":
        return f"layer {r['layer']} expert {r['expert']}"
    if kind == "embed":
        return "input embedding"
    if kind == "unembed":
        return "output projection"
    if kind == "final_norm":
        return "final norm"
    if kind == "router" and r.get("expert") is not None:  # a row about one expert's routing (its rate or bias)
        return f"layer {r['layer']} router, expert {r['expert']}"
    return f"layer {r['layer']} {WHAT.get(kind, kind)}"
