"""workbench expert-contrast A B: (layer, expert) ranked by how much more often set A's runs choose it than set B's."""
from __future__ import annotations

import json
from pathlib import Path

from workbench.data.store import default_db
from workbench.run import Workbench


def main(args) -> int:
    files = [x for x in (args.a, args.b) if Path(x).is_file()]
    db = Path(args.db) if args.db else default_db()
    if not files and not db.exists():  # ids only: a missing database is a typo (prompt files make one)
        raise FileNotFoundError(f"no database at {db} (nothing was created); give --db an existing file, or prompt "
                                "files to record")
    if args.top < 0:
        raise ValueError(f"--top must be >= 0, got {args.top}")
    wb = Workbench(args.db)
    kw = {"model": args.model, "max_new_tokens": args.max_new_tokens} if files else {}
    a, b = wb.run_set(args.a, **kw), wb.run_set(args.b, **kw)
    table = wb.expert_contrast(a, b, generated_only=args.generated_only)
    shown = table.head(args.top) if args.top else table
    if args.json:
        print(json.dumps({"runs_a": a, "runs_b": b, "rows": shown.to_dicts()}))
        return 0
    print(f"A: {len(a)} runs, B: {len(b)} runs; share = fraction of a run's tokens that chose the expert "
          "(mean over the set's runs); p: Welch's t over runs")
    print(f"{'rank':>4} {'layer':>5} {'expert':>6} {'share_a':>8} {'share_b':>8} {'diff':>8} {'p':>9}")
    for r in shown.iter_rows(named=True):
        p = "n/a" if r["p"] is None else f"{r['p']:.2e}"
        print(f"{r['rank']:>4} {r['layer']:>5} {r['expert']:>6} {r['share_a']:>8.3f} {r['share_b']:>8.3f} "
              f"{r['diff']:>+8.3f} {p:>9}")
    return 0
