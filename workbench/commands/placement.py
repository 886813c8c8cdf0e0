"""workbench placement BATCH --devices G [--redundant R] [--policy contiguous|eplb|FILE.json ...] [--json]: a
batch's recorded routing replayed over an expert-parallel placement (workbench.analysis.placement): per policy
and MoE layer the busiest device's load against the mean and the slots sent off their source device."""
from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.analysis.placement import POLICIES, to_json
from workbench.run import Workbench


def main(args) -> int:
    batch = Workbench(args.db).batch(args.batch_id)
    policies = args.policy or list(POLICIES)
    per_device = batch.placement(args.devices, args.redundant, policies)
    summ = batch.placement_summary(args.devices, args.redundant, policies)
    if args.json:
        layouts = {name: to_json(per_device.filter(per_device["policy"] == name))
                   for name in dict.fromkeys(per_device["policy"].to_list())}
        print(json.dumps({"batch_id": batch.batch_id, "devices": args.devices, "redundant": args.redundant,
                          "summary": summ.to_dicts(), "placements": layouts}))
        return 0
    t = Table(title=escape(f"Placement of batch {batch.batch_id} on {args.devices} devices, {args.redundant} redundant "
                           f"expert slots: routed slots per device (max / mean = 1 is balanced; off-device: "
                           f"sources spread evenly over the devices)"))
    for c in ("policy", "layer", "max", "mean", "max / mean", "off-device slots", "off-device"):
        t.add_column(c, justify="left" if c == "policy" else "right")
    names = list(dict.fromkeys(summ["policy"].to_list()))
    for i, name in enumerate(names):
        part = summ.filter(summ["policy"] == name)
        for j, r in enumerate(part.iter_rows(named=True)):
            t.add_row(escape(name), str(r["layer"]), f"{r['max_load']:.1f}", f"{r['mean_load']:.1f}",
                      f"{r['imbalance']:.3f}", f"{r['offdevice_slots']:.1f}", f"{r['offdevice_share']:.1%}",
                      end_section=j == part.height - 1 and i < len(names) - 1)
    Console(width=max(100, Console().width)).print(t)
    return 0
