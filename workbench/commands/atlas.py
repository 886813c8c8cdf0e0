"""workbench atlas BATCH: the expert atlas of a batch, one card per expert (workbench.analysis.atlas)."""
from __future__ import annotations

import json

import polars as pl
from rich.console import Console
from rich.markup import escape

from workbench.analysis.atlas import card, cards_text
from workbench.run import Workbench


def main(args) -> int:
    df = Workbench(args.db).batch(args.batch_id).atlas(recompute=args.recompute)
    if args.layer is not None:
        layers = sorted(set(df["layer"].to_list()))
        if args.layer not in layers:
            raise ValueError(f"batch {args.batch_id} has no MoE layer {args.layer}; its MoE layers: {layers}")
        df = df.filter(pl.col("layer") == args.layer)
    if args.top is not None:
        df = df.sort(["load_share", "layer", "expert"], descending=[True, False, False]).head(max(args.top, 0))
    if args.json:
        print(json.dumps({"batch_id": args.batch_id, "experts": [card(r) for r in df.iter_rows(named=True)]}))
        return 0
    con = Console(highlight=False, soft_wrap=True)
    if df.height == 0:
        con.print(escape(f"batch {args.batch_id}: no routed experts (a dense model records no routing)"))
        return 0
    con.print(escape(f"batch {args.batch_id}: {df.height} experts"), style="bold")
    con.print(escape(cards_text(df)))
    return 0
