"""workbench findings RUN_ID: the run's diagnosis, one ranked finding per component or token span."""
from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape

from workbench.analysis.anomalies import what_was_tested
from workbench.run import Workbench


def main(args) -> int:

    run = Workbench(args.db).run(args.run_id)
    df = run.findings()
    tested = what_was_tested(run.store, run.run_id)
    if args.json:
        print(json.dumps({"run_id": run.run_id, "tested": tested, "findings": df.to_dicts()}))
        return 0

    con = Console()
    if df.height == 0:
        con.print(escape(f"run {run.run_id}: no findings: {tested}"))
        return 0
    colour = {"critical": "bold red", "warning": "yellow", "info": "dim"}
    for r in df.iter_rows(named=True):
        con.print(escape(f"{r['rank']:>2}. [{r['severity']}] {r['explanation']}"), style=colour.get(r["severity"], ""))
    con.print(escape(f"tested: {tested}"), style="dim")
    return 0
