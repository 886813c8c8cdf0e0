"""workbench export: runs as Hive-partitioned Parquet (<DIR>/<table>/run_id=<id>/data.parquet)."""
from __future__ import annotations


def main(args) -> int:
    from workbench.export import export_parquet
    from workbench.store import Store

    files = export_parquet(Store(args.db), args.parquet, args.run_id)
    print(f"{len(files)} Parquet files written under {args.parquet}")
    return 0
