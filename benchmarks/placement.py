"""Expert load imbalance (MaxVio) and the expert-parallel placement what-if on a recorded prompt set.

    python benchmarks/placement.py [--db /tmp/placement_bench.duckdb] [--prompts data/prompts/clean_kinds.jsonl]
                                   [--new-tokens 32] [--chunk 256] [--write]

Records the prompt set (64 prompts by default) with the bundled demo model (greedy, ``--new-tokens`` each, no
anomaly detection) into ``--db`` as one batch, or resumes / reads it when that database holds it already (the
batch id hashes the set and the settings: ``workbench record --prompts FILE --max-new-tokens N --db DB`` makes the
same batch). Then, from the store alone (``workbench.analysis.placement``):

- MaxVio per MoE layer over the whole batch and over chunks of ``--chunk`` tokens (``Batch.maxvio``);
- contiguous against EPLB placement at 4 and 16 devices, with 0 redundant experts and with E / 4 (4 devices) or
  16 (16 devices: G must divide E + R, so one redundant slot per device) redundant ones
  (``Batch.placement_summary``): the busiest device's load over the mean and the share of routed slots sent off
  their source device.

With ``--write`` the tables go into benchmarks/RESULTS.md under "## Expert load and placement" (replaced if there,
else appended at the end).
"""
from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import workbench  # noqa: E402
from workbench.analysis.placement import MAXVIO_CHUNK  # noqa: E402
from workbench.data.store import Store  # noqa: E402

HEADER = "## Expert load and placement"


def get_batch(db: Path, prompts: Path, new_tokens: int):
    t0 = time.perf_counter()
    batch = workbench.record_many(str(prompts), db=Store(db), max_new_tokens=new_tokens, detect=False, progress=True)
    recorded = len(batch.recorded)
    return workbench.open(db).batch(batch.batch_id), recorded, time.perf_counter() - t0


def maxvio_table(vio: pl.DataFrame, chunk: int) -> str:
    rows = ["| MoE layer | MaxVio (whole batch) | mean MaxVio over chunks | max MaxVio over chunks | chunks "
            "| routed slots |", "|---|---|---|---|---|---|"]
    for r in vio.iter_rows(named=True):
        rows.append(f"| {r['layer']} | {r['maxvio']:.3f} | {r['maxvio_chunk_mean']:.3f} | {r['maxvio_chunk_max']:.3f} "
                    f"| {r['chunks']} | {r['slots']} |")
    return "\n".join(rows) + f"\n\nChunks: {chunk} consecutive tokens (the runs one after the other)."


def placement_table(batch, settings: list[tuple[int, int]]) -> str:
    rows = ["| devices | redundant | policy | max / mean device load, per MoE layer | mean over layers | "
            "off-device slots (mean over layers) |", "|---|---|---|---|---|---|"]
    for g, r in settings:
        s = batch.placement_summary(g, r)
        for name in ("contiguous", "eplb"):
            p = s.filter(pl.col("policy") == name).sort("layer")
            per = ", ".join(f"L{la} {v:.3f}" for la, v in zip(p["layer"].to_list(), p["imbalance"].to_list()))
            rows.append(f"| {g} | {r} | {name} | {per} | {p['imbalance'].mean():.3f} | "
                        f"{p['offdevice_share'].mean():.1%} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="/tmp/placement_bench.duckdb")
    ap.add_argument("--prompts", default=str(ROOT / "data" / "prompts" / "clean_kinds.jsonl"))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=MAXVIO_CHUNK)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    batch, recorded, rec_s = get_batch(Path(args.db), Path(args.prompts), args.new_tokens)
    runs = batch.runs().filter(pl.col("status") == "complete")
    n_tok = int(runs["n_tokens"].sum())
    summary = batch.run(runs["run_id"][0]).model_summary
    E = summary.n_routed_experts
    t0 = time.perf_counter()
    vio = batch.maxvio(chunk=args.chunk)
    settings = [(4, 0), (4, E // 4), (16, 0), (16, 16)]
    place = placement_table(batch, settings)
    took = time.perf_counter() - t0
    prompts = Path(args.prompts).resolve()
    shown = prompts.relative_to(ROOT) if prompts.is_relative_to(ROOT) else prompts
    text = "\n".join([
        HEADER, "",
        f"{dt.date.today().isoformat()}, `python benchmarks/placement.py --write` (Python {platform.python_version()},"
        f" CPU). The bundled demo model ({E} routed experts, top-{summary.top_k}, MoE layers "
        f"{', '.join(map(str, summary.moe_layers))}) on {shown}: "
        f"{runs.height} prompts, greedy, {args.new_tokens} new tokens each, {n_tok} tokens in all (prompt + generated: "
        f"every position is routed), batch `{batch.batch_id}`. "
        f"MaxVio and the placement tables from the store: {took:.1f} s"
        + (f"; recording {rec_s:.0f} s." if recorded else " (the batch was recorded before)."), "",
        "### MaxVio per MoE layer (`Batch.maxvio()`)", "",
        maxvio_table(vio, args.chunk), "",
        "MaxVio = max_e load_e / mean_e load_e - 1 (DeepSeek, arXiv 2408.15664): 0 is perfect balance, the largest "
        f"possible value here is E / k - 1 = {E / max(summary.top_k, 1) - 1:.0f}. Over the whole batch the busiest "
        f"expert of a layer gets {1 + vio['maxvio'].min():.2f}-{1 + vio['maxvio'].max():.2f}x its fair share; within "
        f"a chunk of {args.chunk} tokens (mostly one prompt, one kind of code) it gets "
        f"{1 + vio['maxvio_chunk_mean'].min():.2f}-{1 + vio['maxvio_chunk_mean'].max():.2f}x on average: a small "
        "batch is far less balanced than the whole set.", "",
        "### Contiguous against EPLB placement (`Batch.placement_summary()`, `workbench placement`)", "",
        place, "",
        "Device load: routed slots a device processes, each replica taking an equal share of its expert's slots; "
        "max / mean = 1 is perfectly balanced (the busiest device sets the MoE layer's step time). Off-device: "
        "the share of routed slots whose expert has no replica on the token's source device, sources spread evenly "
        "over the devices (sum_e load_e (1 - D_e / G) / slots, D_e the devices holding e). Contiguous: expert e on "
        "device e // ((E + R) / G), replicas in the last slots; EPLB: the R hottest experts replicated greedily, "
        "then balanced packing ((E + R) / G replicas per device). With one expert per device (16 devices, R = 0) "
        "no placement can balance: both are the batch's MaxVio + 1. Replicas without balancing (contiguous, R > 0) "
        "land on the last devices, not beside the hot experts' first copies, so they help little or hurt. "
        "Off-device traffic depends only on how many distinct devices hold each expert: 1 - 1 / G without "
        "replicas whatever the placement; a replica on another device keeps that device's share of the expert's "
        "tokens local.",
    ])
    print(text)
    if args.write:
        path = ROOT / "benchmarks" / "RESULTS.md"
        old = path.read_text()
        if HEADER + "\n" in old:
            start = old.index(HEADER + "\n")
            nxt = old.find("\n## ", start + len(HEADER))
            new = old[:start] + text + "\n" + (old[nxt:] if nxt >= 0 else "")
        else:
            new = old.rstrip("\n") + "\n\n" + text + "\n"
        path.write_text(new)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
