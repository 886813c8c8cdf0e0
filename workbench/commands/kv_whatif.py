"""workbench kv-whatif RUN_ID --policy SPEC ...: the run's tokens re-run with each KV-cache policy, vs full."""
from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.run import Workbench


def main(args) -> int:

    run = Workbench(args.db).run(args.run_id)
    df = run.kv_whatif(args.policy)
    if args.json:
        print(json.dumps({"run_id": run.run_id, "results": df.to_dicts()}))
        return 0

    t = Table(title=escape(f"KV-cache policies on run {run.run_id} (vs the full cache; delta_nll in nats per "
                            "generated token)"))
    for c in ("policy", "memory kept", "bytes_kept", "delta_nll", "top1_agreement", "first_divergence", "events"):
        t.add_column(c, overflow="fold", justify="left" if c == "policy" else "right")
    for r in df.iter_rows(named=True):
        kept = r["bytes_kept"] / r["bytes_full"] if r["bytes_full"] else float("nan")
        first = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        t.add_row(escape(r["policy"]), f"{kept:.1%}", str(r["bytes_kept"]), f"{r['delta_nll']:.4f}",
                  f"{r['top1_agreement']:.1%}", first, str(r["events"]))
    Console(width=max(120, Console().width)).print(t)
    return 0
