"""Long-context prefill with attention-entropy capture: time and peak memory against a plain prefill.

    python benchmarks/long_context.py [--lengths 4096 16384 32768] [--timeout 300] [--write]

Each (length, probes on/off) runs in a fresh subprocess, so its peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``; tracemalloc does not see torch) is its own. The model is
the demo model loaded with ``max_seq_len=32768`` (YaRN), one prefill of random tokens under
``inference_mode``. With probes, every layer's ``hook_attn_probs`` reduces each block of query rows
(``MLA.attn_chunk`` = 1024) to entropy / norm_entropy / max / sink per row and head, so memory stays
O(chunk x T); the table also shows what one materialised [heads, T, T] fp32 pattern would need.
With ``--write`` the table goes into benchmarks/RESULTS.md under "## Long context".
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MAX_LEN = 32768


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one(length: int, probes: bool, threads: int) -> dict:
    """Run in the child: load, prefill once, report seconds and peak RSS."""
    import torch

    from workbench.model import DEFAULT_CHECKPOINT, ModelArgs, Transformer, load_checkpoint
    from workbench.probes import attach
    from workbench.probes.signals import attention_stats

    torch.set_num_threads(threads)
    if (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        model, what = load_checkpoint(max_seq_len=MAX_LEN), "trained demo checkpoint"
    else:
        args = ModelArgs.preset("demo")
        args.max_seq_len = MAX_LEN
        model, what = Transformer(args).init_weights(seed=0).eval(), "demo preset, random weights"
    tokens = torch.randint(0, model.args.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    rows = [0]

    def on_probs(p, name, q_start, **_):
        stats = attention_stats(p[0], q_start)  # reduced inside the hook: nothing O(T^2) outlives a block
        rows[0] += stats["entropy"].size

    base = maxrss_mb()
    hooks = {"layers.*.attn.hook_attn_probs": on_probs} if probes else {}
    t = time.perf_counter()
    with torch.inference_mode(), attach(model, hooks):
        model(tokens)
    secs = time.perf_counter() - t
    return {"length": length, "probes": probes, "seconds": secs, "peak_mb": maxrss_mb(), "model_mb": base,
            "rows": rows[0], "model": what, "heads": model.args.n_heads, "layers": model.args.n_layers,
            "chunk": model.layers[0].attn.attn_chunk}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("LENGTH", "PROBES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1] == "1", args.threads)))
        return 0
    results = []
    for length in args.lengths:
        for probes in (False, True):
            cmd = [sys.executable, __file__, "--one", str(length), "1" if probes else "0", "--threads",
                   str(args.threads)]
            t = time.perf_counter()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
                res = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                    {"length": length, "probes": probes, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
            except subprocess.TimeoutExpired:
                res = {"length": length, "probes": probes, "error": f"over the {args.timeout}s limit"}
            res["total_s"] = time.perf_counter() - t
            print(json.dumps(res), file=sys.stderr, flush=True)
            results.append(res)
    ok = [r for r in results if "error" not in r]
    what = ok[0]["model"] if ok else "?"
    heads = ok[0]["heads"] if ok else 4
    layers = ok[0]["layers"] if ok else 6
    chunk = ok[0]["chunk"] if ok else 1024
    lines = [
        "## Long context",
        "",
        f"`python benchmarks/long_context.py --lengths {' '.join(map(str, args.lengths))}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Model: {what}, loaded with max_seq_len {MAX_LEN} (YaRN); one prefill of random tokens, fp32, CPU "
        f"({platform.machine()}, torch threads {args.threads}, 2 cores shared with other jobs). Peak RSS of a "
        "fresh process per row (model and runtime included); 'prefill memory' = peak minus the RSS after "
        f"loading. Entropy capture reduces each block of {chunk} query rows inside the hook.",
        "",
        "| tokens | probes | prefill time (s) | time ratio | peak RSS (MB) | prefill memory (MB) | "
        "memory ratio | one [heads,T,T] fp32 pattern (MB) | all layers (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for length in args.lengths:
        plain = next((r for r in ok if r["length"] == length and not r["probes"]), None)
        for r in [x for x in results if x["length"] == length]:
            pattern = heads * length * length * 4 / 2**20
            label = "attention entropy" if r["probes"] else "none"
            if "error" in r:
                lines.append(f"| {length} | {label} | not measured: {r['error']} | | | | | {pattern:,.0f} | "
                             f"{pattern * layers:,.0f} |")
                continue
            extra = r["peak_mb"] - r["model_mb"]
            tr = f"{r['seconds'] / plain['seconds']:.2f}x" if plain else ""
            mr = f"{r['peak_mb'] / plain['peak_mb']:.2f}x" if plain else ""
            lines.append(f"| {length} | {label} | {r['seconds']:.1f} | {tr} | {r['peak_mb']:,.0f} | {extra:,.0f} | "
                         f"{mr} | {pattern:,.0f} | {pattern * layers:,.0f} |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.write:
        from probe_overhead import write_section
        write_section(ROOT / "benchmarks" / "RESULTS.md", "## Long context", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
