"""Detectors measured like signals: false alarms on clean runs, and findings that name injected faults.

On the demo model with its bundled baseline profile (data/demo/profile.parquet, calibrated on
data/prompts/calibration.jsonl: function openings from the demo's training split):

- clean: every prompt of data/prompts/clean_eval.jsonl (openings from the held-out validation packages:
  code the model never saw, no file in common with the calibration set), greedy; warning/critical anomaly rows per 1,000 generated tokens
  (target <= 5) and findings per run;
- faults: heads, routed experts and shared experts scaled x30, router selection biases of +``--amount``
  toward one expert, NaN in one layer's residual stream at one position, one cached KV latent scaled x30;
  drawn with a fixed seed (as in root_cause_eval.py) until each kind has ``--per-kind`` faults with a
  symptom (some token's logprob moved by >= 1 nat, teacher-forced); the share where a finding names the
  culprit (target >= 95%), and per detector: false alarms per 1,000 clean tokens, and on faulty runs the
  share of its rows that point at the culprit (precision) and the share of faults it names (recall).

    .venv/bin/python benchmarks/anomaly_eval.py            # writes its section of RESULTS.md
    .venv/bin/python benchmarks/anomaly_eval.py --make-profile   # rebuild data/demo/profile.parquet first
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import polars as pl  # noqa: E402
import torch  # noqa: E402
from root_cause_eval import teacher_forced_logprobs, write_section  # noqa: E402

import workbench  # noqa: E402
from workbench.analysis import faults  # noqa: E402
from workbench.analysis.baseline import BUNDLED, export_profile, profile  # noqa: E402
from workbench.capture.adapters import load_adapter  # noqa: E402
from workbench.capture.prompts import load_prompts  # noqa: E402

SECTION = "## Anomaly detectors (calibrated)"
CALIBRATION = ROOT / "data" / "prompts" / "calibration.jsonl"
KINDS = ("head", "expert", "shared_expert", "router", "non_finite", "kv")


def names_culprit(kind: str, culprit: dict, f: dict) -> bool:
    """Does one finding (a row of ``Run.findings()``) name the injected fault?"""
    if f["layer"] != culprit["layer"] and kind != "non_finite":
        return False
    if kind == "head":
        return f["component"] == "head" and f["head"] == culprit["index"]
    if kind in ("expert", "router"):
        return f["component"] == "expert" and f["expert"] == culprit["index"]
    if kind == "shared_expert":
        return f["component"] == "shared_expert"
    if kind == "non_finite":
        return f["component"] == "non_finite" and f["layer"] == culprit["layer"]
    return f["component"] == "kv" and culprit["index"] in (f["positions"] or [])


def row_points_at(kind: str, culprit: dict, r: dict) -> bool:
    """Does one anomaly row point at the culprit (its layer and, where it has one, its head / expert / pos)?"""
    if kind == "non_finite":
        return r["kind"] == "non_finite"
    if r["layer"] != culprit["layer"]:
        return False
    if kind == "head":
        return r["head"] == culprit["index"]
    if kind in ("expert", "router"):
        return r["expert"] == culprit["index"]
    if kind == "kv":
        return r["pos"] == culprit["index"]
    return r["head"] is None and r["expert"] is None  # shared expert: layer-level rows


def fault(kind: str, model, c: dict, args):
    if kind == "head":
        return faults.break_head(model, c["layer"], c["index"], scale=args.scale)
    if kind == "expert":
        return faults.break_expert(model, c["layer"], c["index"], scale=args.scale)
    if kind == "shared_expert":
        return faults.break_shared(model, c["layer"], scale=args.scale)
    if kind == "router":
        return faults.bias_router(model, c["layer"], c["index"], amount=args.amount)
    if kind == "non_finite":
        return faults.inject_nan(model, c["layer"], c["index"])
    return faults.corrupt_kv(model, c["layer"], c["index"], scale=args.scale)


def draw(kind: str, k: int, rng: random.Random, s, n_prompt: int) -> dict:
    if kind == "head":
        return {"layer": rng.randrange(s.n_layers), "index": rng.randrange(s.n_heads)}
    if kind in ("expert", "router"):
        return {"layer": rng.choice(s.moe_layers), "index": rng.randrange(s.n_routed_experts)}
    if kind == "shared_expert":
        return {"layer": rng.choice(s.moe_layers), "index": None}
    # non-finite and KV faults at a prompt position (their damage then reaches the generated tokens)
    return {"layer": rng.randrange(s.n_layers), "index": rng.randrange(1, n_prompt)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=5)
    ap.add_argument("--max-draws", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--scale", type=float, default=30.0)
    ap.add_argument("--amount", type=float, default=1.0)
    ap.add_argument("--min-effect", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--make-profile", action="store_true", help="rebuild the bundled profile first")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model = load_adapter(None)
    clean_prompts = load_prompts(ROOT / "data" / "prompts" / "clean_eval.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        db = workbench.Store(Path(tmp) / "eval.duckdb")
        if args.make_profile or not BUNDLED.exists():
            res = profile(CALIBRATION, model=model, db=db,
                          max_new_tokens=args.max_new_tokens, progress=True)
            export_profile(db, res["sha"], BUNDLED)
            print(f"wrote {BUNDLED} ({res['cells']} cells from {len(res['runs'])} runs)", flush=True)
        # clean runs: false alarms
        n_tok, rows_by_kind, n_findings, clean = 0, {}, [], []
        for it in clean_prompts:
            run = workbench.record(it["prompt"], model=model, db=db, max_new_tokens=args.max_new_tokens)
            a = run.anomalies().filter(pl.col("severity") != "info")
            n_tok += run.tokens().filter(~pl.col("is_prompt")).height
            for k in a["kind"]:
                rows_by_kind[k] = rows_by_kind.get(k, 0) + 1
            n_findings.append(run.findings().height)
            clean.append(run)
        warnings = sum(rows_by_kind.values())
        basis = json.loads(clean[0].refresh().info["detection"] or "{}").get("profile")
        print(f"clean: {len(clean)} runs, {n_tok} tokens, {warnings} warning/critical rows "
              f"({1000 * warnings / max(n_tok, 1):.2f} per 1,000 tokens), findings per run {n_findings}", flush=True)
        # faults
        results = []
        s = model.summary
        for n_kind, kind in enumerate(KINDS):
            rng = random.Random(args.seed * 1000 + n_kind)
            found = 0
            for k in range(args.max_draws):
                if found == args.per_kind:
                    break
                p = k % len(clean)
                ids = clean[p].tokens().filter(pl.col("is_prompt"))["token_id"].to_list()
                c = draw(kind, k, rng, s, len(ids))
                with fault(kind, model, c, args):
                    run = workbench.record(ids, model=model, db=db, max_new_tokens=args.max_new_tokens, detect=False)
                    seq = run.tokens()["token_id"].to_list()
                    bad = teacher_forced_logprobs(model, seq)
                good = teacher_forced_logprobs(model, seq)
                effect = float((bad - good).abs().nan_to_num(nan=float("inf")).max())
                if effect < args.min_effect:
                    continue
                found += 1
                a = run.anomalies().filter(pl.col("severity") != "info")
                fs = run.findings()
                named = [f["rank"] for f in fs.iter_rows(named=True) if names_culprit(kind, c, f)]
                results.append({"kind": kind, "layer": c["layer"], "index": c["index"], "prompt": p,
                                "effect": effect, "named": bool(named), "rank": min(named) if named else None,
                                "n_findings": fs.height, "top": fs["explanation"][0] if fs.height else "",
                                "rows": {kk: [row_points_at(kind, c, r) for r in a.filter(pl.col("kind") == kk)
                                              .iter_rows(named=True)] for kk in set(a["kind"])}})
                r = results[-1]
                print(f"{kind:<14} L{c['layer']} {c['index']!s:<4} prompt {p:>2} Δ {min(effect, 99):5.2f}  named "
                      f"{r['named']!s:<5} rank {r['rank']}  findings {fs.height}", flush=True)
        db.close()
    seconds = time.perf_counter() - t0
    text = markdown(results, rows_by_kind, n_tok, n_findings, len(clean), basis, args, seconds)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "clean_rows": rows_by_kind, "tokens": n_tok}))
    if not args.no_write:
        write_section(ROOT / "benchmarks" / "RESULTS.md", text, SECTION)
        print("wrote the anomaly section of benchmarks/RESULTS.md")
    return 0


def markdown(results, clean_rows, n_tok, n_findings, n_runs, basis, args, seconds) -> str:
    warnings = sum(clean_rows.values())
    per_1000 = 1000 * warnings / max(n_tok, 1)
    named = sum(r["named"] for r in results) / max(len(results), 1)
    lines = [SECTION, "",
             f"`benchmarks/anomaly_eval.py` on the demo model ({time.strftime('%Y-%m-%d')}, {seconds:.0f} s, "
             f"{torch.get_num_threads()} CPU threads), baseline: {basis or '?'} (data/demo/profile.parquet, "
             f"calibrated on data/prompts/calibration.jsonl: {len(load_prompts(CALIBRATION))} function openings from "
             "the demo model's training split: the standard library and the installed packages). Alarms: "
             "Benjamini-Hochberg over every test of a run at alpha 0.01.", "",
             f"**Clean runs** (data/prompts/clean_eval.jsonl: {n_runs} openings from the held-out packages the "
             f"model never saw, none used for calibration; at most {args.max_new_tokens} greedy tokens each, "
             f"a run ends early at <|endoftext|>; {n_tok} generated tokens): "
             f"{warnings} warning/critical rows, **{per_1000:.2f} per 1,000 generated tokens** (target <= 5: "
             f"{'met' if per_1000 <= 5 else 'missed'}); findings per run: mean {sum(n_findings) / max(n_runs, 1):.2f}, "
             f"max {max(n_findings) if n_findings else 0}.", "",
             f"**Injected faults with a symptom** ({args.per_kind} per kind, >= {args.min_effect:g} nat on some token): "
             f"a finding names the culprit in **{named:.0%}** (target >= 95%: {'met' if named >= 0.95 else 'missed'}).",
             "", "| fault kind | faults | a finding names the culprit | its rank among the run's findings (median) |",
             "|---|---|---|---|"]
    for kind in KINDS:
        rs = [r for r in results if r["kind"] == kind]
        if rs:
            ranks = sorted(r["rank"] for r in rs if r["rank"] is not None)
            lines.append(f"| {kind} | {len(rs)} | {sum(r['named'] for r in rs) / len(rs):.0%} | "
                         f"{ranks[len(ranks) // 2] if ranks else '-'} |")
    lines += ["", "Per detector: false alarms on the clean runs, and on the faulty runs precision (share of its "
              "rows that point at the culprit: its layer, and its head / expert / position where it names one) and "
              "recall (share of faults where one of its rows points at the culprit).", "",
              "| detector | clean rows per 1,000 tokens | rows on faulty runs | precision | recall |", "|---|---|---|---|---|"]
    kinds = sorted(set(clean_rows) | {k for r in results for k in r["rows"]})
    for k in kinds:
        hits = [h for r in results for h in r["rows"].get(k, [])]
        rec = sum(any(r["rows"].get(k, [])) for r in results) / max(len(results), 1)
        lines.append(f"| {k} | {1000 * clean_rows.get(k, 0) / max(n_tok, 1):.2f} | {len(hits)} | "
                     f"{(sum(hits) / len(hits)) if hits else float('nan'):.0%} | {rec:.0%} |")
    lines += ["", "| fault | prompt | Δ logprob | named (rank) | findings | top finding |", "|---|---|---|---|---|---|"]
    for r in results:
        top = r["top"].replace("|", "\\|")[:140]
        lines.append(f"| {r['kind']} L{r['layer']} {'' if r['index'] is None else r['index']} | {r['prompt']} | "
                     f"{min(r['effect'], 99):.2f} | {'yes (' + str(r['rank']) + ')' if r['named'] else 'no'} | "
                     f"{r['n_findings']} | {top} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
