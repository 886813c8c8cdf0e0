"""What recording costs: recorded generation time over plain generation time, per probe and all together.

    python benchmarks/probe_overhead.py [--new-tokens 256] [--reps 5] [--write]
    python benchmarks/probe_overhead.py --model peers [--only "all probes, detectors off"]   # the 89M folder

``--model peers``: decode on benchmarks/peers.py's random 89M-parameter DeepseekV3 folder (made in a temporary
folder, loaded natively; needs transformers), ``--model FOLDER``: a folder our loader reads; the table then goes
under "## Probe overhead" too, as its own dated part only when written by hand (``--write`` writes the demo's).

Same process, same model, same prompt, greedy. Each repetition runs plain ``generate`` and then every
recorded configuration, so slow drifts of a shared machine hit all of them alike; each configuration's
ratio is the median over repetitions of (its time / the same repetition's plain time). Two clocks:
process CPU time (all threads, the writer thread included; robust on a machine shared with other
jobs, the headline) and wall time (what a user waits; noisy when the machine is busy). A recorded run
is the whole ``workbench.record`` call: model hashing, the runs row, every step's reductions, and
waiting for the writer thread to commit the last step, then the anomaly detectors over the finished run
(``detect=True``, the default; "detectors off" is the same recording with ``detect=False``; "all probes but
expert_extremes" leaves out the super-expert signal; "... by running the experts again" computes it the earlier
way, the chosen experts run again at each flush, instead of read inside the model's own expert calls). With
``--write`` the table goes into benchmarks/RESULTS.md under "## Probe overhead".
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench import PROBES, record  # noqa: E402
from workbench.capture.adapters.native import NativeAdapter  # noqa: E402
from workbench.data.store import Store  # noqa: E402
from workbench.model import DEFAULT_CHECKPOINT, ModelArgs, Transformer, generate, load_checkpoint, load_tokenizer  # noqa: E402
from results_md import write_section  # noqa: E402

PROMPT = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
'''
# the super-expert signal runs the chosen experts again: its cost, as "all probes" with and without it
WITHOUT = "expert_extremes"
# the same recording with the super-expert signal computed the earlier way (the chosen experts run again on their
# input rows, instead of read inside the model's own expert calls): a same-process A/B of that change
RERUN = f"all probes, detectors off, {WITHOUT} by running the experts again"
CONFIGS = {"all probes": PROBES, "all probes, detectors off": PROBES, RERUN: PROBES,
           f"all probes but {WITHOUT}": tuple(p for p in PROBES if p != WITHOUT),
           **{f"{p} only": (p,) for p in PROBES}}


def load_demo() -> tuple[Transformer, str]:
    if (DEFAULT_CHECKPOINT / "model.safetensors").exists():
        return load_checkpoint(), f"trained demo checkpoint ({DEFAULT_CHECKPOINT.relative_to(ROOT)})"
    model = Transformer(ModelArgs.preset("demo")).init_weights(seed=0).eval()
    return model, "demo preset with RANDOM weights (data/demo/model.safetensors not there yet)"


def load_folder(spec: str, tmp: Path, context: int):
    """(model, tokenizer, description) of ``--model``: 'peers' (benchmarks/peers.py's folder) or a folder."""
    if spec == "peers":
        from peers import CONFIG, make_folder  # optional: needs transformers (only --model peers does)
        folder = make_folder(tmp / "peers", context)
        what = (f"benchmarks/peers.py's random DeepseekV3 folder (hidden {CONFIG['hidden_size']}, "
                f"{CONFIG['num_hidden_layers']} layers, {CONFIG['n_routed_experts']} routed experts top-"
                f"{CONFIG['num_experts_per_tok']}), loaded natively")
    else:
        folder, what = Path(spec), spec
    model = load_checkpoint(folder)
    n = sum(p.numel() for p in model.parameters())
    return model, load_tokenizer(folder / "tokenizer.json"), f"{what}, {n / 1e6:.0f}M parameters"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--only", nargs="*", default=None, help="configurations to run (default: all)")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    ap.add_argument("--model", help="'peers' (benchmarks/peers.py's 89M folder) or a model folder; default the demo")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="probe_overhead_"))
    if args.model:
        model, tok, what = load_folder(args.model, tmp, 1024)
        if args.write:
            raise SystemExit("--write writes the demo model's table; paste another model's into RESULTS.md by hand")
    else:
        model, what = load_demo()
        tok = load_tokenizer()
    ids = tok.encode(PROMPT).ids
    eos = tok.token_to_id("<|endoftext|>")
    configs = {k: v for k, v in CONFIGS.items() if args.only is None or k in args.only}
    store = Store(tmp / "bench.duckdb")

    def timed(fn) -> tuple[float, float]:
        c, w = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - c, time.perf_counter() - w

    def plain() -> tuple[float, float]:
        return timed(lambda: generate(model, ids, args.new_tokens, eos_id=eos))

    def recorded(name) -> tuple[float, float]:
        try:
            NativeAdapter.expert_out_seam = name != RERUN
            return timed(lambda: record(ids, model=model, tokenizer=tok, max_new_tokens=args.new_tokens, db=store,
                                        probes=CONFIGS[name], detect="detectors off" not in name))
        finally:
            NativeAdapter.expert_out_seam = True

    n_new = len(generate(model, ids, args.new_tokens, eos_id=eos))
    plain(), recorded("all probes")  # warm-up: allocator, polars/duckdb/scipy first-call costs
    cpu: dict[str, list[float]] = {"plain": [], **{k: [] for k in configs}}
    wall: dict[str, list[float]] = {"plain": [], **{k: [] for k in configs}}
    r_cpu: dict[str, list[float]] = {k: [] for k in configs}
    r_wall: dict[str, list[float]] = {k: [] for k in configs}
    for rep in range(args.reps):
        b1 = plain()
        order = list(configs)[rep % len(configs):] + list(configs)[: rep % len(configs)]  # rotate: no order bias
        got = {name: recorded(name) for name in order}
        b2 = plain()  # plain before and after, averaged, to cancel drift within a repetition
        for i, clock in enumerate((cpu, wall)):
            clock["plain"] += [b1[i], b2[i]]
            for name in configs:
                clock[name].append(got[name][i])
        for name in configs:
            r_cpu[name].append(got[name][0] / ((b1[0] + b2[0]) / 2))
            r_wall[name].append(got[name][1] / ((b1[1] + b2[1]) / 2))
        print(f"rep {rep + 1}/{args.reps}: plain cpu {b1[0]:.2f}s/{b2[0]:.2f}s  " +
              "  ".join(f"{k} {r_cpu[k][-1]:.3f}x" for k in configs), file=sys.stderr, flush=True)
    med = statistics.median
    rows = [("plain generate", med(cpu["plain"]), 1.0, med(wall["plain"]), 1.0)]
    rows += [(k, med(cpu[k]), med(r_cpu[k]), med(wall[k]), med(r_wall[k])) for k in configs]
    lines = [
        "## Probe overhead",
        "",
        f"`python benchmarks/probe_overhead.py --new-tokens {args.new_tokens} --reps {args.reps}"
        f"{' --model ' + args.model if args.model else ''}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Model: {what}; prompt {len(ids)} tokens, {n_new} new tokens (greedy), fp32, CPU "
        f"({platform.machine()}, torch threads {torch.get_num_threads()}, 2 cores shared with other jobs). "
        "Ratio: median over repetitions of recorded / plain, plain measured before and after each "
        "repetition's recorded runs. CPU = process CPU time, all threads (the writer thread included); "
        "wall = elapsed time, noisy on the shared machine.",
        "",
        "| configuration | CPU (s) | CPU ratio | wall (s) | wall ratio |",
        "|---|---|---|---|---|",
        *[f"| {name} | {c:.2f} | {rc:.3f}x | {w:.2f} | {rw:.3f}x |" for name, c, rc, w, rw in rows],
        "",
    ]
    publish(lines, args.write)
    return 0


def publish(lines: list[str], write: bool) -> None:
    """Print a benchmark's section (its first line is the ``## `` heading); with ``write``, put it into
    benchmarks/RESULTS.md in place of the old one."""
    text = "\n".join(lines)
    print(text)
    if write:
        write_section(ROOT / "benchmarks" / "RESULTS.md", lines[0], text)


if __name__ == "__main__":
    sys.exit(main())
