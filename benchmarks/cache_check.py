"""The cache check across every MoE family of the installed transformers: clean runs agree, a corrupted cache is named.

    python benchmarks/cache_check.py [--families F ...] [--kinds kv_cache decode_attn] [--tokens 16] [--write]
    python benchmarks/cache_check.py --dtype bfloat16 --tokens 32 [--write]   # half precision's own rule

Per family (a tiny random model, ``workbench.capture.tiny.make_folder``): one clean recording, then one per layer
and cache-only fault kind (``faults.HELD_OUT["kv_cache"]``: each channel of what the layer writes into the
generation's KV cache multiplied by its own random factor; ``"decode_attn"``: a fixed direction added to the layer's
attention output, 3x its RMS, in decode steps only; a forward without the cache unchanged by either), each judged by
the detectors after the recording (``anomalies.cache_rows``: the recorded token logprobs against one forward of the
run's tokens without the cache). Columns: clean ``cache_mismatch`` rows (false alarms), then of the faulted layers:
where the fault moved some recorded token's logprob by >= 0.05 nats (the check's fp32 threshold) against the clean
run ("moved"), how many raised a ``cache_mismatch`` row ("found") and how many of those named the faulted layer. A
layer the fault does not reach (a linear-attention layer, a family whose cache is its own) moves no token.

With ``--write`` the table goes into benchmarks/RESULTS.md under "## Cache check" (``--dtype`` other than float32:
"## Cache check (DTYPE)"; half precision is judged by the generated tokens as a whole, ``CACHE_MEDIAN_HALF``).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import polars as pl
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import workbench  # noqa: E402
from results_md import write_section  # noqa: E402
from workbench.analysis import faults  # noqa: E402
from workbench.analysis.anomalies import CACHE_NATS  # noqa: E402
from workbench.capture.adapters import load_adapter  # noqa: E402
from workbench.capture.tiny import make_folder, moe_families  # noqa: E402
from workbench.data.store import Store  # noqa: E402

PROMPT = "def add(a, b):\n    return a"


def _logprobs(run) -> dict[int, float]:
    t = run.tokens().filter(pl.col("logprob").is_not_null())
    return dict(zip(t["pos"].to_list(), t["logprob"].to_list()))


def family(name: str, tmp: Path, store: Store, tokens: int, kinds: list[str], dtype: torch.dtype | None = None) -> dict:
    a = load_adapter(make_folder(name, tmp / name), dtype=dtype)
    if not a.cache_exact:
        return {"family": name, "note": "not compared: its attention selects its keys"}
    clean = workbench.record(PROMPT, model=a, max_new_tokens=tokens, db=store)
    base = _logprobs(clean)
    out = {"family": name, "clean": clean.anomalies().filter(pl.col("kind") == "cache_mismatch").height,
           "layers": a.summary.n_layers}
    for kind in kinds:
        k = out[kind] = {"acted": 0, "rows": 0, "named": 0, "misnamed": []}
        for layer in range(a.summary.n_layers):
            try:
                made = faults.HELD_OUT[kind](a, layer)
                with made:
                    bad = workbench.record(PROMPT, model=a, max_new_tokens=tokens, db=store)
            except ValueError:  # a layer without the part (no attention at a linear-attention layer)
                continue
            got = _logprobs(bad)
            moved = max((abs(got[p] - base[p]) for p in got.keys() & base.keys()), default=0.0)
            if moved < CACHE_NATS["float32"]:
                continue
            k["acted"] += 1
            rows = bad.anomalies().filter(pl.col("kind") == "cache_mismatch")
            k["rows"] += rows.height > 0
            if rows.height and rows["layer"][0] == layer:
                k["named"] += 1
            elif rows.height:
                k["misnamed"].append(f"{layer} -> {rows['layer'][0]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=None, help="default: every MoE family of transformers")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--kinds", nargs="*", default=["kv_cache", "decode_attn"], help="cache-only fault kinds")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="cache_check_"))
    store = Store(tmp / "c.duckdb")
    res = []
    for name in args.families or moe_families():
        try:
            r = family(name, tmp, store, args.tokens, args.kinds, dtype)
        except Exception as e:  # noqa: BLE001 - a family that cannot be built here: said, the others go on
            r = {"family": name, "note": f"failed: {type(e).__name__}: {str(e)[:80]}"}
        print(r, file=sys.stderr, flush=True)
        res.append(r)
    import transformers

    done = [r for r in res if "note" not in r]
    opts = "" if args.dtype == "float32" else f" --dtype {args.dtype} --tokens {args.tokens}"
    if args.families:
        opts += " --families " + " ".join(args.families)
    lines = ["## Cache check" + ("" if args.dtype == "float32" else f" ({args.dtype})"), "",
             f"`python benchmarks/cache_check.py{opts}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{time.perf_counter() - t0:.0f} s, transformers {transformers.__version__}, 1 torch thread). " +
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             f"Compared: {len(done)} families; clean `cache_mismatch` rows: **{sum(r['clean'] for r in done)}**."]
    for kind in args.kinds:
        acted = sum(r[kind]["acted"] for r in done)
        lines.append(f"`{kind}` ({faults.HELD_OUT[kind].doc}): faulted layers that moved a token {acted}; a "
                     f"`cache_mismatch` row **{sum(r[kind]['rows'] for r in done)} of {acted}**; at the faulted "
                     f"layer **{sum(r[kind]['named'] for r in done)}**.")
    head = " | ".join(f"{k}: moved / found / at its layer | {k}: named elsewhere" for k in args.kinds)
    lines += ["", f"| family | clean rows | layers | {head} |", "|---|---|---|" + "---|---|" * len(args.kinds)]
    for r in res:
        if "note" in r:
            lines.append(f"| {r['family']} | {r['note']} |" + " |" * (2 + 2 * len(args.kinds)))
            continue
        cells = " | ".join(f"{r[k]['acted']} / {r[k]['rows']} / {r[k]['named']} | {', '.join(r[k]['misnamed'])}"
                           for k in args.kinds)
        lines.append(f"| {r['family']} | {r['clean']} | {r['layers']} | {cells} |")
    text = "\n".join(lines + [""])
    print(text)
    if args.write:
        write_section(ROOT / "benchmarks" / "RESULTS.md", lines[0], text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
