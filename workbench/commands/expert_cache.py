"""workbench expert-cache RUN_ID --slots 2,4,8 [--predictor none|prev3|lookahead|all] [--json]: a run's routing
replayed through a per-layer LRU cache of K experts (workbench.analysis.whatif.expert_cache)."""
from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.analysis.whatif import PREDICTORS
from workbench.data.query import no_routing_reason
from workbench.run import Workbench


def parse_slots(text: str) -> list[int]:
    try:
        ks = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--slots takes comma-separated integers (e.g. 2,4,8), got {text!r}") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--slots needs cache sizes >= 1, got {text!r}")
    return ks


def main(args) -> int:

    run = Workbench(args.db).run(args.run_id)
    slots = parse_slots(args.slots)
    preds = list(PREDICTORS) if args.predictor == "all" else [args.predictor]
    if run.routing().height == 0:
        raise ValueError(f"run {run.run_id}: {no_routing_reason(run.store, run.run_id)}")
    frames = {p: run.expert_cache(slots, p, decode_only=args.decode_only) for p in preds}
    if args.json:
        rows = [{"predictor": p, **r} for p, df in frames.items() for r in df.to_dicts()]
        print(json.dumps({"run_id": run.run_id, "slots": slots, "decode_only": bool(args.decode_only),
                          "results": rows}))
        return 0

    s = run.model_summary
    where = "generated positions" if args.decode_only else "every position"
    t = Table(title=escape(f"Expert cache on run {run.run_id}: hit rate per MoE layer ({s.n_routed_experts} experts, "
                           f"top-{s.top_k}; LRU over {where})"))
    t.add_column("predictor")
    t.add_column("layer", justify="right")
    for k in slots:
        t.add_column(f"K={k}", justify="right")
    for p, df in frames.items():
        layers = list(dict.fromkeys(df["layer"].to_list()))
        for layer in layers:
            part = df.filter(df["layer"].is_null() if layer is None else df["layer"] == layer)
            rate = dict(zip(part["slots"].to_list(), part["hit_rate"].to_list()))
            t.add_row(p, "all" if layer is None else str(layer),
                      *("-" if rate.get(k) is None else f"{rate[k]:.1%}" for k in slots),
                      end_section=layer is None)
    Console(width=max(100, Console().width)).print(t)
    return 0
