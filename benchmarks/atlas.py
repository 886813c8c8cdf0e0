"""The expert atlas of a recorded prompt set: the cards of the experts with the highest load share.

    python benchmarks/atlas.py [--prompts data/prompts/clean_kinds.jsonl] [--new-tokens 32] [--db /tmp/atlas.duckdb]
                               [--top 8]

Records the set with the bundled demo model (greedy, every probe, detectors off; a batch already in ``--db``
is resumed, not recorded again), then computes ``Batch.atlas()`` (timed: computed and stored, then read back)
and prints, as Markdown for benchmarks/RESULTS.md, the ``--top`` experts by load share: layer, expert, load
share, label (its key tokens and top class), its top tokens by summed gate weight, token classes, the experts
chosen with it and its highest-weight context; then the ``--top // 2`` most specialised experts (the largest
share of one token class).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

import workbench  # noqa: E402
from workbench.analysis.atlas import shown  # noqa: E402
from workbench.data.store import Store  # noqa: E402


def cell(text: str) -> str:
    """Token text inside a Markdown table cell: visible line breaks, no pipes, no HTML, no backticks."""
    t = text.replace("\\", "\\\\").replace("\n", "⏎").replace("\t", "⇥").replace("|", "¦").replace("`", "ˋ")
    return t.replace("<", "&lt;").replace(">", "&gt;")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(ROOT / "data" / "prompts" / "clean_kinds.jsonl"))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--db", default="/tmp/atlas_bench.duckdb")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args(argv)

    store = Store(a.db)
    t0 = time.perf_counter()
    batch = workbench.record_many(a.prompts, db=store, max_new_tokens=a.new_tokens, detect=False, progress=False)
    rec_s = time.perf_counter() - t0
    recorded = (f"{len(batch.recorded)} recorded in {rec_s:.0f} s" if batch.recorded
                else f"already in {Path(a.db).name}: nothing recorded")
    runs = batch.runs().filter(pl.col("status") == "complete")
    t0 = time.perf_counter()
    df = batch.atlas(recompute=True)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch.atlas()
    read_s = time.perf_counter() - t0
    layers = sorted(set(df["layer"].to_list()))
    top = df.sort(["load_share", "layer", "expert"], descending=[True, False, False]).head(a.top)
    never = df.filter(pl.col("slots") == 0)

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"`benchmarks/atlas.py` ({when}, {platform.machine()}, shared CPU): `{Path(a.prompts).name}`, "
          f"{runs.height} prompts recorded with the demo model (greedy, {a.new_tokens} new tokens, batch "
          f"`{batch.batch_id}`, {recorded}), {int(runs['n_tokens'].sum())} tokens, "
          f"{len(layers)} MoE layers x {df.height // max(len(layers), 1)} experts. `Batch.atlas()`: computed and "
          f"stored in {first_s:.2f} s, read back in {read_s * 1000:.0f} ms. Experts never routed: {never.height}. "
          f"Load share per layer: min {df['load_share'].min():.1%}, max {df['load_share'].max():.1%} "
          f"(uniform: {1 / max(df.height // max(len(layers), 1), 1):.1%}).")
    print()
    print(f"The {a.top} experts of highest load share (over all layers):")
    print()
    table(top)
    routed = df.filter(pl.col("slots") > 0).with_columns(pl.col("class_shares").list.first().alias("_top"))
    special = routed.sort(["_top", "layer", "expert"], descending=[True, False, False]).head(a.top // 2).drop("_top")
    print()
    print(f"The {a.top // 2} most specialised experts (largest share of one token class):")
    print()
    table(special)
    return 0


def table(rows: pl.DataFrame) -> None:
    print("| layer | expert | load share | label (key tokens, top class) | top tokens by summed weight | classes | "
          "chosen with | highest-weight context (token in [[ ]]) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows.iter_rows(named=True):
        classes = ", ".join(f"{k} {v:.0%}" for k, v in list(zip(r["top_classes"], r["class_shares"]))[:3])
        co = ", ".join(f"e{e} {s:.0%}" for e, s in list(zip(r["co_experts"], r["co_shares"]))[:3])
        ctx = json.loads(r["contexts"])[0]
        text = cell(ctx["before"][-30:]) + "[[" + cell(ctx["token"]) + "]]" + cell(ctx["after"][:30])
        label = ", ".join(list(dict.fromkeys(cell(shown(t)) for t in r["key_tokens"]))[:3])  # as the label
        heavy = ", ".join(list(dict.fromkeys(cell(shown(t)) for t in r["top_tokens"]))[:3])
        print(f"| {r['layer']} | {r['expert']} | {r['load_share']:.1%} | {label} ({r['top_classes'][0]} "
              f"{r['class_shares'][0]:.0%}) | {heavy} | {classes} | {co} | {text} (w {ctx['weight']:.2f}) |")


if __name__ == "__main__":
    raise SystemExit(main())
