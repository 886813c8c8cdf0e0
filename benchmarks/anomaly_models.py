"""The detectors on another model, profiled as a user would: false alarms on clean runs and faults named.

    python benchmarks/anomaly_models.py [--family qwen3_moe] [--calibration 40] [--write]

A tiny random transformers folder of ``--family`` (``workbench.capture.tiny.make_folder``, seed 0: any MoE family of the
installed transformers) is calibrated with
``workbench.profile`` on the first ``--calibration`` prompts of data/prompts/calibration.jsonl (a quarter of each
kind), cut to its context; then, as benchmarks/anomaly_eval.py does for the demo model:
- clean runs of every prompt of data/prompts/clean_kinds.jsonl, other_kinds.jsonl and held_out_kinds.jsonl (cut to
  the context, ``--new-tokens`` greedy tokens), detected with the model: warning/critical rows per 1,000 generated
  tokens per kind (``repetition`` rows apart: they are read off the text);
- injected faults of ``workbench.analysis.faults.KINDS`` (those the family has), up to ``--per-kind`` each with a
  symptom: the share where a finding names the faulted layer, and the faulted component.

A small calibration set is the point: a user profiles on what they have. With ``--write`` the section goes into
benchmarks/RESULTS.md as "## Anomaly detectors (calibrated): profiled tiny <family>".
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import polars as pl  # noqa: E402
from anomaly_eval import (CALIBRATION, CLEAN, HELD_OUT_KINDS, OTHER, clean_runs, fault_eval, record_set,  # noqa: E402
                          sampled_items, summary)
from results_md import write_section  # noqa: E402

import workbench  # noqa: E402
from workbench.capture.adapters import load_adapter  # noqa: E402
from workbench.capture.prompts import load_prompts  # noqa: E402
from workbench.capture.tiny import make_folder  # noqa: E402
from workbench.model import load_tokenizer  # noqa: E402


def cut(items: list[dict], tok, room: int) -> list[dict]:
    """Each prompt cut to its first ``room`` tokens (decoded back to text)."""
    return [{**it, "prompt": tok.decode(tok.encode(it["prompt"]).ids[:room])} for it in items]


def calibration_set(n: int) -> list[str]:
    """The first ``n // 4`` calibration prompts of each of its four kinds."""
    seen: dict[str, int] = {}
    out = []
    for it in load_prompts(CALIBRATION):
        kind = it["id"].split(":")[0]
        if seen.get(kind, 0) < n // 4:
            seen[kind] = seen.get(kind, 0) + 1
            out.append(it["prompt"])
    return out


def tiny_folder(family: str, folder: Path) -> Path:
    """A tiny random folder of ``family`` (``make_folder``: any MoE family of the installed transformers), seed 0."""
    try:
        return make_folder(family, folder, seed=0)
    except ValueError as e:
        raise SystemExit(f"anomaly_models: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--calibration", type=int, default=40, help="calibration prompts (a quarter of each kind)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--max-draws", type=int, default=8)
    ap.add_argument("--fault-tokens", type=int, default=24)
    ap.add_argument("--fault-temperature", type=float, default=0.0, help="sample the faulty runs (0: greedy)")
    ap.add_argument("--min-effect", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    args.kinds = ""  # fault_eval: faults.KINDS and the two extra kinds
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        folder = tiny_folder(args.family, tmp / args.family)
        tok = load_tokenizer(folder / "tokenizer.json")
        model = load_adapter(str(folder))
        room = model.summary.max_seq_len - args.new_tokens - 1
        store = workbench.Store(tmp / "eval.duckdb")
        cal = [it["prompt"] for it in cut([{"prompt": p} for p in calibration_set(args.calibration)], tok, room)]
        res = workbench.profile(cal, model=model, db=store, max_new_tokens=args.new_tokens)
        print(f"profile: {len(res['runs'])} runs, {res['cells']} cells", flush=True)
        clean_items, other_items = cut(load_prompts(CLEAN), tok, room), cut(load_prompts(OTHER), tok, room)
        items = (clean_items + other_items
                 + [{**it, "id": f"held-out {it['id']}"} for it in cut(load_prompts(HELD_OUT_KINDS), tok, room)]
                 + sampled_items(clean_items, other_items))
        run_ids, kinds = record_set(items, model, store, args.new_tokens)
        clean = clean_runs(store, run_ids, kinds, model)
        prompts = [ids for ids in (tok.encode(it["prompt"]).ids[:60] for it in load_prompts(CLEAN)) if len(ids) >= 24]
        results = fault_eval(model, store, prompts[1::3][:12], args)
        store.close()
    seconds = time.perf_counter() - t0
    text = markdown(args, model, len(res["runs"]), clean, results, seconds)
    print(text)
    if args.write:
        write_section(ROOT / "benchmarks" / "RESULTS.md", f"## Anomaly detectors (calibrated): profiled tiny {args.family}",
                      text)
    return 0


def markdown(args, model, n_cal: int, clean: list[dict], results: list[dict], seconds: float) -> str:
    groups = {"code (clean_kinds.jsonl)": [r for r in clean if r["kind"] in ("library", "script", "test", "docs")],
              "other kinds (other_kinds.jsonl)": [r for r in clean if r["kind"] in
                                                  ("prose", "data", "sql", "markdown", "numbers", "multilingual")],
              "held-out kinds (held_out_kinds.jsonl)": [r for r in clean if r["kind"].startswith("held-out")],
              "sampled (every third clean prompt at temperature 1.0, the other kinds at 0.7)":
                  [r for r in clean if r["kind"] in ("sampled", "sampled-other")]}
    s = model.summary
    lines = [f"## Anomaly detectors (calibrated): profiled tiny {args.family}", "",
             f"`python benchmarks/anomaly_models.py --family {args.family} --calibration {args.calibration}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds:.0f} s, {platform.machine()} "
             f"{os.cpu_count()} CPU cores, 1 torch thread). A tiny random {args.family} folder ({s.n_layers} layers, "
             f"{len(s.moe_layers)} MoE, {s.n_routed_experts} experts; workbench/capture/tiny.py, seed 0) profiled with "
             f"`workbench.profile` on {n_cal} calibration prompts (a quarter of each kind of "
             f"data/prompts/calibration.jsonl, cut to its {s.max_seq_len}-token context), as a user with a small set "
             f"would; clean runs of {args.new_tokens} greedy tokens.", "",
             "| clean prompts | runs | generated tokens | warning/critical rows | per 1,000 tokens |", "|---|---|---|---|---|"]
    for name, runs in groups.items():
        c = summary(runs)
        lines.append(f"| {name} | {c['runs']} | {c['tokens']} | {c['alarms']} | {c['per_1000']:.2f} |")
    by: dict[str, int] = {}
    for r in clean:
        for k in r["alarms"]:
            by[k] = by.get(k, 0) + 1
    lines += ["", "Rows by detector: " + (", ".join(f"`{k}` {v}" for k, v in sorted(by.items())) or "none") + ".", ""]
    if results:
        n = len(results)
        layer = sum(r["layer_named"] for r in results)
        comp = sum(r["component_named"] for r in results)
        lines += [f"**Injected faults with a symptom** ({n} faults, up to {args.per_kind} per kind of `faults.KINDS` "
                  f"the family has plus NaN and a scaled KV entry, {args.fault_tokens} generated tokens): a finding "
                  f"names the faulted layer in **{100 * layer / n:.0f}%**, the faulted component in "
                  f"{100 * comp / n:.0f}%.", "",
                  "| fault kind | faults | layer named | component named |", "|---|---|---|---|"]
        kinds: dict[str, list[dict]] = {}
        for r in results:
            kinds.setdefault(r["kind"], []).append(r)
        for k, rs in kinds.items():
            lines.append(f"| {k} | {len(rs)} | {sum(r['layer_named'] for r in rs)}/{len(rs)} | "
                         f"{sum(r['component_named'] for r in rs)}/{len(rs)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
