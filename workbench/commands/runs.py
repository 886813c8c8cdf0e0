"""workbench runs: list the runs in a database."""
from __future__ import annotations

import json


def main(args) -> int:
    from workbench.run import Workbench

    df = Workbench(args.db).runs()
    if args.json:
        print(json.dumps(df.with_columns(df["created_at"].cast(str)).to_dicts()))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"runs in {args.db or 'default database'}")
    for c in ("run_id", "created_at", "status", "n_tokens", "n_anomalies", "prompt"):
        t.add_column(c)
    for r in df.iter_rows(named=True):
        prompt = (r["prompt"] or "").replace("\n", "⏎")[:40]
        t.add_row(*(escape(str(v)) for v in (r["run_id"], str(r["created_at"])[:19], r["status"], r["n_tokens"],
                                             r["n_anomalies"], prompt)))
    Console().print(t)
    return 0
