"""Prompt-set throughput: a set recorded in batched generations against the same set recorded one at a time.

    python benchmarks/batch_throughput.py [--prompts 32] [--new-tokens 32] [--reps 3] [--write]
    python benchmarks/batch_throughput.py --tiny mixtral [--sizes 8] [--write]    # a transformers model
    python benchmarks/batch_throughput.py --model FOLDER ...                      # a transformers or our folder

Same process, same model (the demo; ``--tiny FAMILY``: a tiny random transformers folder of that family,
``workbench.capture.tiny.make_folder``; ``--model``: a folder), same prompt set, greedy, every probe. The set:
the first ``--prompts`` function headers of the standard library's ``textwrap``, ``json/encoder``, ``argparse``
and ``csv`` modules (a ``def`` line and up to three more lines, so 3 to ~60 tokens; cut to the model's context).
Each repetition times, in a rotating order: plain generation one prompt at a time (the adapter's ``stream``),
plain batched generation (its ``stream_batch``, no probes), and ``workbench.record_many`` with ``batch_size`` 1
(one at a time) and each batch size of ``--sizes`` (detectors off: they cost the same per run either way).
Reported: new tokens per second of wall time (median over repetitions) and the speed-up against recording one
at a time in the same repetition. With ``--write`` the table goes into benchmarks/RESULTS.md under
"## Batched recording", as the model's own ``### `` part (the other models' parts are kept).
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

from probe_overhead import load_demo, write_section  # noqa: E402

from workbench import record_many  # noqa: E402
from workbench.capture.adapters import adapter_for, load_adapter  # noqa: E402
from workbench.capture.recorder import eos_of  # noqa: E402
from workbench.capture.resolve import tokenizer_for  # noqa: E402
from workbench.data.store import Store  # noqa: E402

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


def fit(prompts: list[str], tok, room: int) -> list[str]:
    """Each prompt cut (by whole lines, then characters) to at most ``room`` tokens of ``tok``."""
    out = []
    for p in prompts:
        while len(tok.encode(p).ids) > room:
            p = "\n".join(p.splitlines()[:-1]) + "\n" if p.count("\n") > 1 else p[: max(1, len(p) * 3 // 4)]
        out.append(p)
    return out


def load(args, tmp: Path):
    """(adapter, tokenizer, description) of the benchmark's model."""
    if args.tiny:
        from workbench.capture.tiny import make_folder  # optional: needs transformers (only --tiny does)

        folder = make_folder(args.tiny, tmp / f"tiny_{args.tiny}")
        adapter = load_adapter(str(folder))
        s = adapter.summary
        return adapter, tokenizer_for(adapter), (
            f"tiny random transformers {args.tiny} folder (`python -m workbench.capture.tiny {args.tiny}`: "
            f"{s.n_layers} layers, {s.n_routed_experts} experts top-{s.top_k}, eager attention, vocab "
            f"{s.vocab_size}, context {s.max_seq_len})")
    if args.model:
        adapter = load_adapter(args.model)
        return adapter, tokenizer_for(adapter), f"{args.model} ({adapter.summary.describe()})"
    model, what = load_demo()
    adapter = adapter_for(model)
    return adapter, tokenizer_for(adapter), what


def write_part(heading: str, part: list[str]) -> None:
    """Put ``part`` (its first line a ``### `` heading) into RESULTS.md's section ``heading`` in place of the same
    model's old part; the other models' parts stay (a section without parts is the demo model's)."""
    path = ROOT / "benchmarks" / "RESULTS.md"
    lines = path.read_text().splitlines() if path.exists() else []
    start = next((i for i, ln in enumerate(lines) if ln.strip() == heading), None)
    parts: list[list[str]] = []
    if start is not None:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        body = lines[start + 1:end]
        if any(ln.strip() for ln in body) and not any(ln.startswith("### ") for ln in body):
            body = ["### Demo model", ""] + body  # written before the section had one part per model
        for ln in body:
            if ln.startswith("### "):
                parts.append([])
            if parts:
                parts[-1].append(ln)
    parts = [p for p in parts if p[0].strip() != part[0].strip()] + [part]
    text = [heading, ""] + [ln for p in parts for ln in [*"\n".join(p).strip("\n").splitlines(), ""]]
    write_section(path, heading, "\n".join(text).rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: leave as is)")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    ap.add_argument("--tiny", metavar="FAMILY", help="a tiny random transformers folder of this family instead")
    ap.add_argument("--model", metavar="FOLDER", help="this model folder instead (transformers or ours)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="batch_throughput_"))
    adapter, tok, what = load(args, tmp)
    n_new = args.new_tokens
    prompts = fit(prompt_set(args.prompts), tok, adapter.summary.max_seq_len - n_new + 1)
    ids = [tok.encode(p).ids for p in prompts]
    eos = eos_of(tok, adapter)
    if not adapter.supports_batch:
        print(f"{adapter.summary.family}: records one prompt at a time (no exact batched generation): the batched "
              "configurations measure that", file=sys.stderr)

    def plain_single() -> int:
        return sum(1 for x in ids for _ in adapter.stream(x, n_new, 0.0, 1.0, 0, eos))

    def plain_batched(size: int) -> int:
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        got = 0
        for g in range(0, len(order), size):
            rows = [ids[i] for i in order[g:g + size]]
            k = len(rows)
            for step in adapter.stream_batch(rows, [n_new] * k, [0.0] * k, [1.0] * k, [0] * k, eos):
                got += sum(s is not None for s in step.steps)
        return got

    def recorded(size: int, rep: int) -> int:
        store = Store(tmp / f"b{size}_{rep}.duckdb")
        b = record_many(prompts, model=adapter, tokenizer=tok, db=store, max_new_tokens=n_new, batch_size=size,
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
    cpu_ratio: dict[str, list[float]] = {k: [] for k in configs}
    for rep in range(args.reps):
        names = list(configs)
        order = names[rep % len(names):] + names[: rep % len(names)]
        secs, cpu = {}, {}
        for name in order:
            t, c = time.perf_counter(), time.process_time()
            tokens[name] = configs[name](rep) if name in takes_rep else configs[name]()
            secs[name], cpu[name] = time.perf_counter() - t, time.process_time() - c
        for name in names:
            tps[name].append(tokens[name] / secs[name])
            speedup[name].append(secs["recorded, one at a time"] / secs[name])
            # recorded / plain CPU time of the same way of generating (one at a time, or the same batch size)
            plain = name.replace("recorded", "plain")
            if name.startswith("recorded") and plain in cpu:
                cpu_ratio[name].append(cpu[name] / cpu[plain])
        print(f"rep {rep + 1}/{args.reps}: " + "  ".join(f"{k} {tps[k][-1]:.0f} tok/s" for k in names),
              file=sys.stderr, flush=True)
    med = statistics.median
    n_tok = [len(x) for x in ids]
    flags = f" --tiny {args.tiny}" if args.tiny else f" --model {args.model}" if args.model else ""
    lines = [
        f"### {args.tiny and f'Tiny {args.tiny} (transformers)' or args.model or 'Demo model'}",
        "",
        f"`python benchmarks/batch_throughput.py{flags} --prompts {args.prompts} --new-tokens {n_new} --reps "
        f"{args.reps} --sizes {' '.join(map(str, args.sizes))} --threads {args.threads}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f", transformers {getattr(sys.modules.get('transformers'), '__version__', 'not loaded')})",
        "",
        f"Model: {what}; {len(prompts)} prompts of {min(n_tok)}-{max(n_tok)} tokens (stdlib function headers), "
        f"{n_new} new tokens each (greedy, stopping at end-of-text), every probe, detectors off, fp32, CPU "
        f"({platform.machine()}, torch threads {torch.get_num_threads()}). New tokens per second of wall time, "
        "median over repetitions; speed-up: recording one at a time / this, same repetition. Batched rows are "
        "grouped by prompt length (`workbench.capture.prompt_sets.groups`); each batched run equals its single recording "
        "(tests/test_batch.py, tests/test_hf_batch.py).",
        "",
        "CPU ratio: process CPU time (all threads) of a recorded configuration over the plain one generating the same "
        "way (one at a time, or batched at the same size), median over repetitions of the same repetition's ratio.",
        "",
        "| configuration | new tokens | tokens/s | speed-up vs recorded one at a time | CPU vs plain |",
        "|---|---|---|---|---|",
        *[f"| {k} | {tokens[k]} | {med(tps[k]):.0f} | {med(speedup[k]):.2f}x | "
          f"{f'{med(cpu_ratio[k]):.2f}x' if cpu_ratio[k] else ''} |" for k in configs],
        "",
        "CPU vs plain per repetition: " + "; ".join(f"{k}: {', '.join(f'{x:.2f}' for x in v)}"
                                                   for k, v in cpu_ratio.items() if v) + ".",
        "",
    ]
    print("\n".join(lines))
    if args.write:
        write_part("## Batched recording", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
