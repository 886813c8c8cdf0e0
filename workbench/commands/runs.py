"""workbench runs: list the runs in a database."""
from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.run import Workbench


def main(args) -> int:

    df = Workbench(args.db).runs()
    if args.json:
        print(json.dumps(df.with_columns(df["created_at"].cast(str)).to_dicts()))
        return 0

    t = Table(title=escape(f"runs in {args.db or 'default database'}"))
    for c in ("run_id", "created_at", "status", "model", "dtype", "n_tokens", "n_anomalies", "prompt"):
        # ids and models whole: they are what the other commands take
        t.add_column(c, no_wrap=c in ("run_id", "created_at"), overflow="fold")
    for r in df.iter_rows(named=True):
        prompt = (r["prompt"] or "").replace("\n", "⏎")[:40]
        t.add_row(*(escape(str(v)) for v in (r["run_id"], str(r["created_at"])[:19], r["status"], r["model"],
                                             r["dtype"], r["n_tokens"], r["n_anomalies"], prompt)))
    Console(width=max(160, Console().width)).print(t)
    return 0
