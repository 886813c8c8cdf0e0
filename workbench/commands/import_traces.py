"""workbench import DIR: merge a folder of Parquet shards (export / record --out) into a database."""
from __future__ import annotations

from workbench.data.export import import_traces
from workbench.data.store import Store, TraceStore


def main(args) -> int:

    dest = Store(args.db)
    added, present = import_traces(TraceStore(args.traces), dest)
    print(f"{len(added)} runs imported from {args.traces} into {dest.path} ({len(present)} already there)")
    return 0
