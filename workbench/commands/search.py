"""workbench search TEXT: runs and positions whose decoded text contains TEXT."""
from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.data.query import search
from workbench.data.store import Store


def main(args) -> int:

    df = search(Store(args.db), args.text, batch_id=args.batch, ignore_case=args.ignore_case, limit=args.limit)
    if args.json:
        print(json.dumps(df.to_dicts()))
        return 0

    t = Table(title=escape(f"{df.height} matches of {args.text!r}"))
    for c in ("run_id", "pos", "end_pos", "context"):
        t.add_column(c, no_wrap=c != "context", overflow="fold")
    for r in df.iter_rows(named=True):
        t.add_row(escape(r["run_id"]), str(r["pos"]), str(r["end_pos"]), escape(r["context"].replace("\n", "⏎")))
    Console(width=max(120, Console().width)).print(t)
    return 0
