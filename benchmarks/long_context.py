"""Long-context prefill with attention-entropy capture: time and peak memory against a plain prefill.

    python benchmarks/long_context.py [--lengths 4096 16384 32768] [--timeout 300] [--write]
    python benchmarks/long_context.py --latency [--contexts 512 1024 ... 32768] [--steps 12] [--write]

Each (length, probes on/off) runs in a fresh subprocess, so its peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``; tracemalloc does not see torch) is its own. The model is
the demo model loaded with ``max_seq_len=32768`` (YaRN), one prefill of random tokens under
``inference_mode``. With probes, every layer's ``hook_attn_stats`` (the seam the recorder's attention and KV
probes listen to) gets each block of query rows (``MLA.attn_chunk`` = 1024) reduced by the model itself to
entropy / max / sink per row and head and the attention each key received, and the hook turns them into
the attention table's columns, so memory stays O(chunk x T); the table also shows what one materialised
[heads, T, T] fp32 pattern would need.
With ``--write`` the table goes into benchmarks/RESULTS.md under "## Long context".

``--latency`` measures decode-step latency against context length instead (a minute or two): the same
model with a latent cache already holding L tokens (random values: the cost does not depend on them),
``--steps`` one-token decode forwards at each L after 2 warm-up ones, plain (no probes), and fits
``wall_ms = a * (L / 32768)^b + c`` to them (``workbench.analysis.whatif.fit_latency``, scipy's curve_fit), beside
the seed documents' a = 12.4, b = 1.38, c = 8.2; with ``--write`` under "## Latency against context".
The same fit on a recorded run's own steps table (``run.latency_fit()``) is shown for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MAX_LEN = 32768


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def demo_model():
    """(model, what) with a MAX_LEN context: the trained demo checkpoint, else the demo preset's random weights."""
    from workbench.model import DEFAULT_CHECKPOINT, ModelArgs, Transformer, load_checkpoint

    if (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        return load_checkpoint(max_seq_len=MAX_LEN), "trained demo checkpoint"
    args = ModelArgs.preset("demo")
    args.max_seq_len = MAX_LEN
    return Transformer(args).init_weights(seed=0).eval(), "demo preset, random weights"


def one(length: int, probes: bool, threads: int) -> dict:
    """Run in the child: load, prefill once, report seconds and peak RSS."""
    import torch

    from workbench.probes import attach
    from workbench.probes.signals import reduced_stats

    torch.set_num_threads(threads)
    model, what = demo_model()
    tokens = torch.randint(0, model.args.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    rows = [0]

    def on_stats(st, name, q_start, received, **_):
        stats = reduced_stats(st[0], received.size(-1), q_start)  # [Tc, H] rows: nothing O(T^2) outlives a block
        rows[0] += stats["entropy"].size

    base = maxrss_mb()
    hooks = {"layers.*.attn.hook_attn_stats": on_stats} if probes else {}
    t = time.perf_counter()
    with torch.inference_mode(), attach(model, hooks):
        model(tokens)
    secs = time.perf_counter() - t
    return {"length": length, "probes": probes, "seconds": secs, "peak_mb": maxrss_mb(), "model_mb": base,
            "rows": rows[0], "model": what, "heads": model.args.n_heads, "layers": model.args.n_layers,
            "chunk": model.layers[0].attn.attn_chunk}


def decode_latency(contexts: list[int], steps: int, threads: int) -> tuple[list[dict], str]:
    """Wall ms of one-token decode forwards with ``L`` tokens already cached, for each L in ``contexts``."""
    import torch

    torch.set_num_threads(threads)
    model, what = demo_model()
    g = torch.Generator().manual_seed(0)
    token = torch.tensor([[1]])
    points = []
    with torch.inference_mode():
        for L in contexts:
            L = min(L, MAX_LEN - 1)
            model.setup_cache(batch=1, max_len=L + 1)
            for layer in model.layers:
                c = layer.attn.cache
                c.kv.normal_(generator=g)
                c.pe.normal_(generator=g)
                c.length = L
            for i in range(steps + 2):
                t = time.perf_counter()
                model(token, start_pos=L)  # attends over the L cached tokens and itself
                ms = (time.perf_counter() - t) * 1e3
                if i >= 2:
                    points.append({"L": L, "wall_ms": ms})
            print(json.dumps({"L": L, "median_ms": sorted(p["wall_ms"] for p in points if p["L"] == L)[steps // 2]}),
                  file=sys.stderr, flush=True)
    model.clear_cache()
    return points, what


def latency_main(args) -> int:
    import statistics

    import polars as pl

    from workbench import record
    from workbench.analysis.whatif import L0, SEED_LATENCY, fit_latency
    from workbench.data.store import Store

    t0 = time.perf_counter()
    # each in a fresh process: glibc reads its malloc settings at start. "default": as a user runs it;
    # "no mmap": allocations above glibc's mmap threshold (32 MB at most, dynamic) kept on the heap instead
    # of being mapped, page-faulted and unmapped on every step
    envs = {"default malloc": {}, "MALLOC_MMAP_THRESHOLD_=4G": {"MALLOC_MMAP_THRESHOLD_": str(2**32),
                                                                "MALLOC_TRIM_THRESHOLD_": str(2**32)}}
    measured: dict[str, list[dict]] = {}
    what = "?"
    for name, extra in envs.items():
        cmd = [sys.executable, __file__, "--latency-points", "--contexts", *map(str, args.contexts), "--steps",
               str(args.steps), "--threads", str(args.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT,
                           env={**os.environ, **extra})
        if r.returncode != 0:
            raise SystemExit(f"latency child ({name}) failed: {r.stderr.strip()[-2000:]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
        measured[name], what = got["points"], got["model"]
    fits = {name: fit_latency(pl.DataFrame(pts), L0=L0) for name, pts in measured.items()}
    points, fit = measured["default malloc"], fits["default malloc"]
    tuned = fits["MALLOC_MMAP_THRESHOLD_=4G"]
    # a recorded run's own steps table (short: its L spans only the prompt plus the new tokens)
    run = record("def fibonacci(n):\n", max_new_tokens=64, db=Store(Path(tempfile.mkdtemp()) / "lat.duckdb"),
                 detect=False)
    try:
        own = run.latency_fit()
    except (ValueError, RuntimeError) as e:
        own = e
    secs = time.perf_counter() - t0
    seed = SEED_LATENCY
    lines = [
        "## Latency against context",
        "",
        f"`python benchmarks/long_context.py --latency --contexts {' '.join(map(str, args.contexts))} --steps "
        f"{args.steps} --threads {args.threads}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {secs:.0f} s)",
        "",
        f"Model: {what}, loaded with max_seq_len {MAX_LEN} (YaRN), fp32, CPU ({platform.machine()}, torch threads "
        f"{args.threads}, 2 cores shared with other jobs). One-token decode forwards with L tokens already in the "
        f"latent cache, no probes, {args.steps} per L after 2 warm-up ones. Fit: `wall_ms = a * (L / {L0})^b + c` "
        "by `scipy.optimize.curve_fit` on every step (`workbench.analysis.whatif.fit_latency`; ± one standard error).",
        "",
        "| L (cached tokens) | median ms per step | min | max | fitted | median, MALLOC_MMAP_THRESHOLD_=4G | fitted |",
        "|---|---|---|---|---|---|---|",
    ]
    other = measured["MALLOC_MMAP_THRESHOLD_=4G"]
    for L in sorted({p["L"] for p in points}):
        ms = [p["wall_ms"] for p in points if p["L"] == L]
        ms2 = [p["wall_ms"] for p in other if p["L"] == L]
        lines.append(f"| {L:,} | {statistics.median(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} | "
                     f"{float(fit.predict([L])[0]):.2f} | {statistics.median(ms2):.2f} | "
                     f"{float(tuned.predict([L])[0]):.2f} |")
    lines += [
        "",
        "| | a (ms) | b | c (ms) | residual RMS (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, f in fits.items():
        lines.append(f"| demo model, this machine, {name} | {f.a:.3g} ± {f.a_se:.2g} | **{f.b:.3f} ± {f.b_se:.2g}** | "
                     f"{f.c:.3g} ± {f.c_se:.2g} | {f.rmse:.2f} |")
    lines.append(f"| seeds (A100, 32K -> 128K) | {seed['a']} | **{seed['b']}** | {seed['c']} | |")
    if isinstance(own, Exception):
        lines.append(f"| a recorded run's steps table | not fitted: {own} | | | |")
    else:
        lines.append(f"| a recorded run's steps table (`run.latency_fit()`, L {int(own.residuals['L'].min())}-"
                     f"{int(own.residuals['L'].max())}, probes on) | {own.a:.3g} ± {own.a_se:.2g} | {own.b:.3f} ± "
                     f"{own.b_se:.2g} | {own.c:.3g} ± {own.c_se:.2g} | {own.rmse:.2f} |")
    big = 32 * 2**20 // (4 * 80 * 4)  # L where heads x L x (C + R) fp32 crosses glibc's 32 MB mmap ceiling
    lines += [
        "",
        f"- b: a decode step reads each of the L cached latents once, so above the fixed cost c the step grows about "
        f"linearly: b = {tuned.b:.2f} ± {tuned.b_se:.2f} once the allocator artifact below is removed, against the "
        f"seeds' {seed['b']} (their system, their range 32K-128K; not reproduced here).",
        f"- With glibc's default malloc the step time jumps once L passes ~{big:,} instead of following a "
        f"power law (the default fit's b = {fit.b:.1f} only describes that jump): consistent with a per-layer buffer "
        f"of heads x L x (C + R) x 4 bytes (MLA's keys expanded over the heads for the fused decode) crossing glibc's "
        f"32 MB mmap ceiling there, so that from there every layer of every step maps, page-faults and "
        "unmaps it; with MALLOC_MMAP_THRESHOLD_ raised the jump goes. (Not fixed here: model/model.py.)",
        "- A recorded run's own steps (`run.latency_fit()`) span a few dozen lengths near the start: no curvature "
        "to fit there, so a and b are not identifiable (the huge standard errors say so); pool runs of different "
        "lengths (`workbench.analysis.whatif.fit_latency(run_a, run_b, ...)`) or measure as above.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        from results_md import write_section
        write_section(ROOT / "benchmarks" / "RESULTS.md", "## Latency against context", text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--latency", action="store_true", help="decode-step latency against context, and its fit")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 24576, 32767],
                    help="context lengths L for --latency")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per context length (--latency)")
    ap.add_argument("--latency-points", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("LENGTH", "PROBES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1] == "1", args.threads)))
        return 0
    if args.latency_points:
        points, what = decode_latency(args.contexts, args.steps, args.threads)
        print(json.dumps({"points": points, "model": what}))
        return 0
    if args.latency:
        return latency_main(args)
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
        from results_md import write_section
        write_section(ROOT / "benchmarks" / "RESULTS.md", "## Long context", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
