"""workbench export: runs as Hive-partitioned Parquet (<DIR>/<table>/run_id=<id>/data.parquet).

Every file is written under a temporary name and moved into place; ``<DIR>/_SUCCESS`` is written last,
so its presence says the export finished (see ``workbench.data.export``).
"""
from __future__ import annotations

from workbench.data.export import MARKER, export_parquet
from workbench.data.store import Store


def main(args) -> int:

    files = export_parquet(Store(args.db), args.parquet, args.run_id)
    print(f"{len(files)} Parquet files written under {args.parquet} (finished: {args.parquet}/{MARKER})")
    return 0
