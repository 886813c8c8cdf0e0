"""workbench anomalies RUN_ID: detect (or read the stored) anomalies of a run and list them, filtered."""
from __future__ import annotations

import json
import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.analysis.anomalies import select, what_was_tested
from workbench.run import Workbench


def _num(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def main(args) -> int:

    run = Workbench(args.db).run(args.run_id)
    df = run.anomalies(recompute=args.recompute)
    total = df.height
    df = select(df, args.kind, args.severity, args.layer)
    if args.json:
        rows = [{k: _num(v) for k, v in r.items()} for r in df.iter_rows(named=True)]
        print(json.dumps({"run_id": run.run_id, "total": total, "tested": what_was_tested(run.store, run.run_id),
                          "anomalies": rows}))
        return 0

    colour = {"critical": "bold red", "warning": "yellow", "info": "dim"}
    t = Table(title=escape(f"anomalies of run {run.run_id}: {df.height} shown of {total}"))
    for c in ("severity", "kind", "pos", "layer", "head", "expert", "score", "explanation"):
        t.add_column(c)
    for r in df.iter_rows(named=True):
        cells = [escape("" if r[c] is None else (f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c])))
                 for c in ("severity", "kind", "pos", "layer", "head", "expert", "score", "explanation")]
        t.add_row(*cells, style=colour.get(r["severity"], ""))
    con = Console()
    con.print(t)
    con.print(escape(f"tested: {what_was_tested(run.store, run.run_id)}"), style="dim")
    return 0
