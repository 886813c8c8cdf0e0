"""GPU: the fused attention + entropy kernel against scaled_dot_product_attention at long-context prefill.

    python benchmarks/gpu.py [--lengths 8192 16384 32768] [--heads 32] [--kv-heads 1] [--dim 128] [--dv D]
                             [--model-lengths 8192]
                             [--dtype bf16|fp16] [--reps 10] [--no-tune] [--write]

One causal prefill of ``--lengths`` tokens (queries = keys, ``q_start`` 0), batch ``--batch``: q [B, H, L, dim],
k [B, Hk, L, dim], v [B, Hk, L, dv]. ``probes.triton_attention.attention_with_stats`` (output, entropy, max
weight, sink weight and lse of every row) is timed against ``torch.nn.functional.scaled_dot_product_attention``
(output only; torch's own backend dispatch unless ``--backend``; for MQA/GQA k and v are expanded to H heads
beforehand, outside the timing). Each repetition runs both, alternating, after warm-up; times are medians of
``torch.cuda.synchronize``-bracketed wall times. Ratio = SDPA time / kernel time (the kernel's throughput
as a fraction of SDPA's; the target is >= 0.8x with the entropy captured). Unless ``--no-tune``, a few
block configurations are timed at the first length and the fastest is used for all. Checks per length:
max |o - SDPA|, and the row statistics against a float64 materialised reference (``reference``) on three
64-row chunks (start, middle, end). Exit status 1 if a check is out of tolerance. With ``--write`` the table
goes into benchmarks/RESULTS.md under "## GPU attention + entropy kernel". Without a CUDA device (or
without Triton) it prints why and exits 0. ``--device cpu`` with ``TRITON_INTERPRET=1`` runs the same
script on tiny sizes, to check it without a GPU (timings meaningless). With ``--dv`` != ``--dim`` SDPA
cannot use its flash kernel, so compare at equal dims.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

SECTION = "## GPU attention + entropy kernel"
# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried at the first length
CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)]
STATS = ("entropy", "max_weight", "sink_weight", "lse")


def load_kernel():
    """probes/triton_attention.py by path (no need to import the rest of the workbench for the timing)."""
    spec = importlib.util.spec_from_file_location("triton_attention", ROOT / "probes" / "triton_attention.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def timed(fns: list, reps: int, warmup: int, sync) -> list[float]:
    """Median seconds of each zero-argument callable, run alternately ``reps`` times after ``warmup``."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            sync()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def tune(ta, q, k, v, scale, reps: int, sync) -> tuple[tuple[int, int, int, int], list[str]]:
    block_d = max(triton_pow2(q.shape[-1]), triton_pow2(v.shape[-1]))
    notes, best = [], None
    for cfg in CONFIGS:
        bm, bn, warps, stages = cfg
        if block_d > 128 and bm * bn > 64 * 64:
            continue
        kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            (t,) = timed([lambda: ta.attention_with_stats(q, k, v, scale, **kw)], reps, 1, sync)
        except Exception as e:  # e.g. out of shared memory for this config
            notes.append(f"{cfg}: failed ({type(e).__name__})")
            continue
        notes.append(f"{cfg}: {t * 1e3:.2f} ms")
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        raise RuntimeError("no block configuration ran: " + "; ".join(notes))
    return best[1], notes


def triton_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def check_rows(ta, q, ke, ve, scale, stats, rows: int = 64) -> dict[str, float]:
    """Max abs difference of each row statistic against the float64 reference on three chunks of rows.

    ``ke``/``ve``: keys and values expanded to q's heads; a few heads at a time ([B, 8, rows, L] float64).
    """
    L = q.shape[2]
    err = dict.fromkeys(STATS, 0.0)
    for a in sorted({0, max(0, L // 2 - rows // 2), max(0, L - rows)}):
        b = min(L, a + rows)
        for h in range(0, q.shape[1], 8):
            hs = slice(h, h + 8)
            _, ref = ta.reference(q[:, hs, a:b], ke[:, hs], ve[:, hs], scale, q_start=a)
            for name in STATS:
                err[name] = max(err[name], (stats[name][:, hs, a:b] - ref[name]).abs().max().item())
    return err


def model_rows(lengths: list[int], dev: torch.device, dtype: torch.dtype, sync, reps: int) -> list[str]:
    """Recorded / plain prefill on benchmarks/peers.py's random DeepseekV3 folder loaded into our own model on
    ``dev`` in ``dtype`` (on CUDA a stats listener runs the Triton kernel: ``MLA.stats_kernel``): plain = ``generate``
    of one token, recorded = ``workbench.record(max_new_tokens=1)`` with the tokens, attention and routing probes into
    a temporary DuckDB file; alternating, ``reps`` pairs, medians of synchronised wall times."""
    import shutil
    import tempfile

    import workbench
    from peers import make_folder
    from workbench.data.store import Store
    from workbench.model import load_checkpoint, load_tokenizer
    from workbench.model.generate import generate

    tmp = Path(tempfile.mkdtemp(prefix="gpu_model_"))
    out = ["Recorded / plain prefill, benchmarks/peers.py's random DeepseekV3 folder (hidden 512, 8 layers, 16 heads, "
           f"MLA, 32 routed experts top-4) in our model on this device in {dtype}: plain = `generate` of one token, "
           "recorded = `workbench.record(max_new_tokens=1, probes=tokens, attention, routing)`, alternating, "
           f"median of {reps} pairs after a warm-up (target <= 1.10x at 8K).", "",
           "| tokens | plain (s) | recorded (s) | recorded / plain | kernel used |", "|---|---|---|---|---|"]
    try:
        folder = make_folder(tmp / "deepseek_v3", max(lengths))
        module = load_checkpoint(folder, dtype=dtype, device=dev)
        tok = load_tokenizer(folder / "tokenizer.json")
        store = Store(tmp / "wb.duckdb")
        for n in lengths:
            ids = torch.randint(5, tok.get_vocab_size(), (n,), generator=torch.Generator().manual_seed(n)).tolist()
            used = []
            probe = module.layers[0].attn.hook_attn_stats.register_forward_hook(
                lambda m, *_: used.append(module.layers[0].attn.stats_kernel is not None))

            def plain():
                generate(module, ids, 1)

            def rec():
                workbench.record(ids, model=module, tokenizer=tok, max_new_tokens=1, db=store, detect=False,
                                 probes=("tokens", "attention", "routing"))
            plain(), rec()  # warm-up
            t_plain, t_rec = [], []
            for _ in range(reps):
                for fn, acc in ((plain, t_plain), (rec, t_rec)):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    acc.append(time.perf_counter() - t0)
            probe.remove()
            p, r = statistics.median(t_plain), statistics.median(t_rec)
            kernel = "Triton" if any(used) else "no (CPU tiles)"
            out.append(f"| {n} | {p:.3f} | {r:.3f} | **{r / p:.2f}x** | {kernel} |")
            print(out[-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=1, help="key/value heads (1: MQA, the MLA latent case)")
    ap.add_argument("--dim", type=int, default=128, help="q/k head dim")
    ap.add_argument("--dv", type=int, default=None, help="v head dim (default: --dim)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-tune", action="store_true", help="use the kernel's default block configuration")
    ap.add_argument("--backend", choices=["default", "flash", "cudnn", "efficient"], default="default",
                    help="SDPA backend (default: torch's own dispatch)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a dry run)")
    ap.add_argument("--model-lengths", type=int, nargs="*", default=[8192],
                    help="also: recorded / plain prefill of benchmarks/peers.py's DeepseekV3 folder (89M parameters) "
                         "in our model at these lengths, in --dtype (none: skip)")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device, skipped")
        return 0
    ta = load_kernel()
    if not ta.available():
        print("benchmarks/gpu.py: triton is not installed, skipped")
        return 0
    if args.write:
        from results_md import write_section  # noqa: E402  (fails here, before any timing, if it cannot)
    if args.heads % args.kv_heads:
        ap.error("--kv-heads must divide --heads")

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    B, H, Hk, D = args.batch, args.heads, args.kv_heads, args.dim
    Dv = args.dv or D
    scale = 1 / math.sqrt(D)
    group = H // Hk
    tol_o = (1e-2, 2e-2) if dtype == torch.bfloat16 else (1e-3, 4e-3)  # (atol, rtol): a couple of ulps
    tol_stat = 1e-3
    gen = torch.Generator(device=dev).manual_seed(0)
    backend = contextlib.nullcontext
    if args.backend != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.backend]
        backend = lambda: sdpa_kernel([chosen])  # noqa: E731

    cfg, notes, rows, ok = None, [], [], True
    for L in args.lengths:
        q = torch.randn(B, H, L, D, generator=gen, device=dev).to(dtype)
        k = torch.randn(B, Hk, L, D, generator=gen, device=dev).to(dtype)
        v = torch.randn(B, Hk, L, Dv, generator=gen, device=dev).to(dtype)
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        if cfg is None:
            if on_gpu and not args.no_tune:
                cfg, notes = tune(ta, q, k, v, scale, max(3, args.reps // 2), sync)
                print("tuning at", L, "tokens:", "; ".join(notes))
            else:
                cfg = ()
        kw = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg))

        def ours():
            return ta.attention_with_stats(q, k, v, scale, **kw)

        def sdpa():
            with backend():
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True, scale=scale)

        t_ours, t_sdpa = timed([ours, sdpa], args.reps, args.warmup, sync)
        o, stats = ours()
        ref_o = sdpa().float()
        diff = (o.float() - ref_o).abs()
        o_err, o_ok = diff.max().item(), bool((diff <= tol_o[0] + tol_o[1] * ref_o.abs()).all())
        del ref_o, diff
        s_err = check_rows(ta, q, ke, ve, scale, stats)
        flops = B * H * L * L * (D + Dv)  # causal: half of 2 * L^2 * (D + Dv) per head
        good = o_ok and max(s_err.values()) <= tol_stat
        ok &= good
        rows.append((L, t_ours, t_sdpa, flops, o_err, s_err, good))
        print(f"{L} tokens: kernel {t_ours * 1e3:.2f} ms, SDPA {t_sdpa * 1e3:.2f} ms, ratio {t_sdpa / t_ours:.3f}x, "
              f"|o - SDPA| {o_err:.2e}, |entropy - ref| {s_err['entropy']:.2e}"
              + ("" if good else "  OUT OF TOLERANCE"))
        del q, k, v, ke, ve, o, stats
        if on_gpu:
            torch.cuda.empty_cache()

    import triton
    name = torch.cuda.get_device_name(dev) if on_gpu else f"CPU ({platform.machine()}, TRITON_INTERPRET=1)"
    cfg_text = (f"BLOCK_M={cfg[0]}, BLOCK_N={cfg[1]}, num_warps={cfg[2]}, num_stages={cfg[3]}"
                + (" (fastest of the tuned set at the first length)" if notes else "")) if cfg else "kernel defaults"
    lines = [SECTION, "",
             f"`python benchmarks/gpu.py {' '.join(sys.argv[1:] if argv is None else argv)}` "
             f"({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"Device: {name}; torch {torch.__version__}, triton {triton.__version__}. Causal prefill, batch {B}, "
             f"{H} query heads, {Hk} key/value heads, head dims q/k {D}, v {Dv}, {args.dtype}. Kernel: "
             f"`attention_with_stats` (output + entropy, max weight, sink weight, lse per row), {cfg_text}. "
             f"SDPA: `scaled_dot_product_attention(is_causal=True)`, {args.backend} backend"
             f"{' (torch dispatch)' if args.backend == 'default' else ''}, k/v expanded to {H} heads "
             f"outside the timing. Median of {args.reps} alternating repetitions after {args.warmup} warm-up. "
             f"Ratio = SDPA time / kernel time (target >= 0.8x). Errors: max |o - SDPA| over all rows; statistics "
             f"against a float64 materialised reference on three 64-row chunks (tolerance o: atol {tol_o[0]:g} "
             f"+ rtol {tol_o[1]:g} of |SDPA|; statistics {tol_stat:g}).", "",
             "| tokens | kernel (ms) | SDPA (ms) | kernel TFLOP/s | SDPA TFLOP/s | ratio | max abs o - SDPA "
             "| entropy err (nats) | lse err | max-weight err | sink err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for L, t_o, t_s, flops, o_err, s_err, good in rows:
        lines.append(f"| {L} | {t_o * 1e3:.2f} | {t_s * 1e3:.2f} | {flops / t_o / 1e12:.1f} | {flops / t_s / 1e12:.1f} "
                     f"| {t_s / t_o:.3f}x | {o_err:.1e}{'' if good else ' (!)'} | {s_err['entropy']:.1e} "
                     f"| {s_err['lse']:.1e} | {s_err['max_weight']:.1e} | {s_err['sink_weight']:.1e} |")
    if args.model_lengths:
        lines += ["", *model_rows(args.model_lengths, dev, dtype, sync, max(1, args.reps // 3))]
    met = [L for L, t_o, t_s, *_ in rows if t_s / t_o >= 0.8]
    lines += ["", f"Target >= 0.8x SDPA throughput with entropy captured: "
              + ("**met** at every length" if len(met) == len(rows) else
                 f"**not met** at {', '.join(str(r[0]) for r in rows if r[0] not in met)} tokens")
              + ("" if ok else "; **accuracy check failed** (marked (!))") + "."]
    if notes:
        lines += ["", "Tuning (first length): " + "; ".join(notes) + "."]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if args.write:
        write_section(args.results, SECTION, text)
        print(f"written to {args.results}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
