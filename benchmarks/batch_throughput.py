"""Prompt-set throughput: a set recorded in batched generations against the same set recorded one at a time.

    python benchmarks/batch_throughput.py [--prompts 32] [--new-tokens 32] [--reps 3] [--write]

Same process, same demo model, same prompt set, greedy, every probe. The set: the first ``--prompts``
function headers of the standard library's ``textwrap``, ``json/encoder``, ``argparse`` and ``csv``
modules (a ``def`` line and up to three more lines, so 3 to ~60 tokens). Each repetition times, in a
rotating order: plain generation one prompt at a time (``model.generate``), plain batched generation
(``model.generate.stream_batch``, no probes), and ``workbench.record_many`` with ``batch_size`` 1 (one at a
time) and each batch size of ``--sizes`` (detectors off: they cost the same per run either way). Reported:
new tokens per second of wall time (median over repetitions) and the speed-up against recording one at a
time in the same repetition. With ``--write`` the table goes into benchmarks/RESULTS.md under
"## Batched recording".
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from probe_overhead import load_demo, publish  # noqa: E402

from workbench import record_many  # noqa: E402
from workbench.data.store import Store  # noqa: E402
from workbench.model import generate, load_tokenizer  # noqa: E402
from workbench.model.generate import stream_batch  # noqa: E402

MODULES = ("textwrap", "json/encoder", "argparse", "csv")


def prompt_set(n: int) -> list[str]:
    """The first ``n`` function headers (a ``def`` line and up to three more) of a few stdlib modules."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for name in MODULES:
        lines = (lib / f"{name}.py").read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and len(out) < n:
                out.append("\n".join(lines[i:i + 1 + len(out) % 4]).lstrip() + "\n")
    return out[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: leave as is)")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, what = load_demo()
    tok = load_tokenizer()
    prompts = prompt_set(args.prompts)
    ids = [tok.encode(p).ids for p in prompts]
    eos = tok.token_to_id("<|endoftext|>")
    n_new = args.new_tokens
    tmp = Path(tempfile.mkdtemp(prefix="batch_throughput_"))

    def plain_single() -> int:
        return sum(len(generate(model, x, n_new, eos_id=eos)) for x in ids)

    def plain_batched(size: int) -> int:
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        got = 0
        for g in range(0, len(order), size):
            rows = [ids[i] for i in order[g:g + size]]
            k = len(rows)
            for step in stream_batch(model, rows, [n_new] * k, [0.0] * k, [1.0] * k, [0] * k, eos):
                got += sum(s is not None for s in step.steps)
        return got

    def recorded(size: int, rep: int) -> int:
        store = Store(tmp / f"b{size}_{rep}.duckdb")
        b = record_many(prompts, model=model, tokenizer=tok, db=store, max_new_tokens=n_new, batch_size=size,
                        detect=False, progress=False, batch_id=f"b{size}r{rep}")
        runs = b.runs()
        assert set(runs["status"]) == {"complete"}, runs
        return int((runs["n_tokens"] - runs["n_prompt_tokens"]).sum())

    configs = {"plain, one at a time": plain_single,
               **{f"plain, batched x{s}": (lambda s=s: plain_batched(s)) for s in args.sizes}}
    configs.update({"recorded, one at a time": lambda rep: recorded(1, rep),
                    **{f"recorded, batched x{s}": (lambda rep, s=s: recorded(s, rep)) for s in args.sizes}})
    takes_rep = {k for k in configs if k.startswith("recorded")}
    recorded(max(args.sizes), -1), plain_single()  # warm-up
    tps: dict[str, list[float]] = {k: [] for k in configs}
    speedup: dict[str, list[float]] = {k: [] for k in configs}
    tokens: dict[str, int] = {}
    for rep in range(args.reps):
        names = list(configs)
        order = names[rep % len(names):] + names[: rep % len(names)]
        secs = {}
        for name in order:
            t = time.perf_counter()
            tokens[name] = configs[name](rep) if name in takes_rep else configs[name]()
            secs[name] = time.perf_counter() - t
        for name in names:
            tps[name].append(tokens[name] / secs[name])
            speedup[name].append(secs["recorded, one at a time"] / secs[name])
        print(f"rep {rep + 1}/{args.reps}: " + "  ".join(f"{k} {tps[k][-1]:.0f} tok/s" for k in names),
              file=sys.stderr, flush=True)
    med = statistics.median
    n_tok = [len(x) for x in ids]
    lines = [
        "## Batched recording",
        "",
        f"`python benchmarks/batch_throughput.py --prompts {args.prompts} --new-tokens {n_new} --reps {args.reps}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Model: {what}; {len(prompts)} prompts of {min(n_tok)}-{max(n_tok)} tokens (stdlib function headers), "
        f"{n_new} new tokens each (greedy, stopping at end-of-text), every probe, detectors off, fp32, CPU "
        f"({platform.machine()}, torch threads {torch.get_num_threads()}). New tokens per second of wall time, "
        "median over repetitions; speed-up: recording one at a time / this, same repetition. Batched rows are "
        "grouped by prompt length (`workbench.capture.prompt_sets.groups`); each batched run equals its single recording "
        "(tests/test_batch.py).",
        "",
        "| configuration | new tokens | tokens/s | speed-up vs recorded one at a time |",
        "|---|---|---|---|",
        *[f"| {k} | {tokens[k]} | {med(tps[k]):.0f} | {med(speedup[k]):.2f}x |" for k in configs],
        "",
    ]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
