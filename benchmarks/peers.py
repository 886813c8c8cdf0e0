"""Peers: what capturing attention entropy per head, routing selection and token confidence costs with nnsight,
TransformerLens, transformers' materialised ``output_attentions=True`` and ``workbench.record``, side by side.

    python benchmarks/peers.py [--lengths 512 2048 4096] [--reps 2] [--budget-s 300] [--write]

One random ``transformers`` DeepseekV3 folder (hidden 512, 8 layers, 16 heads, 32 routed experts top-4 + 1 shared,
MLA, first layer dense; random weights, nothing downloaded, the bundled tokenizer), one random prompt per length,
one forward over it (``workbench.record`` with ``max_new_tokens=1``: the prefill, the first new token and its rows
written to DuckDB). Each tool runs in a process of its own (TransformerLens rewires the module in place; peak RSS is
that process's), torch with one thread:

* ``transformers plain``: ``model(ids)``, default (SDPA) attention, nothing captured: the denominator.
* ``transformers output_attentions``: eager attention, ``output_attentions=True`` (every layer's [H, T, T]
  probabilities materialised), forward hooks on the routers for the selection; entropies from the returned maps.
* ``nnsight``: ``NNsight(model).trace(ids)``, eager attention; entropy computed inside the trace per layer from
  ``self_attn.output[1]`` (only [H, T] saved), ``mlp.gate.output[2]`` (the selection) and the logits saved.
* ``TransformerLens``: ``TransformerBridge`` over the same module (``build_bridge_from_module``),
  ``run_with_hooks``: entropy computed in ``blocks.i.attn.hook_pattern`` hooks, selection from
  ``blocks.i.mlp.gate.hook_out``.
* ``workbench.record (transformers)``: our recorder on the same ``transformers`` module (``backend`` transformers,
  probes tokens, attention, routing), rows stored in a temporary DuckDB file.
* ``workbench.record (native)``: the same folder loaded into our own model (``load_checkpoint``), same probes.

Reported per length: seconds (median over ``--reps``), the ratio to the plain forward, and the peak RSS increase
over the process's RSS after loading and a warm-up. A tool that is not installed, fails or runs past the time
budget is listed as such. Peers are optional: ``pip install -e '.[peers]'``; without nnsight and TransformerLens
the script says so and exits 0. With ``--write`` the table goes into benchmarks/RESULTS.md under "## Peers".
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTION = "## Peers"
OURS_SECTION = "## Recording speed (prefill)"  # --write with only plain / our tools: the recording-speed table alone
PEER_TOOLS = {"output_attentions", "nnsight", "transformer_lens"}
TOOLS = ["plain", "output_attentions", "nnsight", "transformer_lens", "workbench_hf", "native_plain", "workbench_native"]
LABELS = {"plain": "transformers plain forward", "output_attentions": "transformers output_attentions=True",
          "nnsight": "nnsight", "transformer_lens": "TransformerLens (TransformerBridge)",
          "workbench_hf": "workbench.record (transformers)", "native_plain": "our plain forward (native generate, 1 token)",
          "workbench_native": "workbench.record (native)"}
NEEDS = {"nnsight": "nnsight", "transformer_lens": "transformer_lens"}
CONFIG = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
              n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=256,
              intermediate_size=1024, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=16, qk_nope_head_dim=32,
              v_head_dim=32, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=2.5)


def make_folder(folder: Path, context: int, seed: int = 0) -> Path:
    """A random transformers DeepseekV3 folder (weights scaled like ``workbench.capture.tiny``) with the bundled tokenizer."""
    import torch
    import transformers

    from workbench.model.tokenizer import DEFAULT_TOKENIZER

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEFAULT_TOKENIZER, folder / "tokenizer.json")
    vocab = json.loads(Path(DEFAULT_TOKENIZER).read_text())["model"]["vocab"]
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(vocab_size=len(vocab), max_position_embeddings=context, **CONFIG)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.05 if p.ndim > 1 else 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) * 0.2)
    hf.save_pretrained(folder)
    return folder


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _entropy(p):
    import torch
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [.., H, T]


def child(tool: str, folder: str, length: int, reps: int) -> dict:
    """Run ``tool`` over a random prompt of ``length`` tokens ``reps`` times in this process; timings and peak RSS."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(length)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    cfg = hf.config
    ids = torch.randint(5, cfg.vocab_size, (1, length), generator=g)
    moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    sig: dict = {}

    def confidence(logits):
        p = torch.softmax(logits[0].float(), -1)
        return p.max(-1).values

    if tool == "plain":
        def run():
            with torch.no_grad():
                sig["confidence"] = confidence(hf(ids).logits)
    elif tool == "output_attentions":
        hf.set_attn_implementation("eager")
        picks: dict = {}
        for i in moe:
            hf.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out, i=i: picks.__setitem__(i, out[2]))

        def run():
            with torch.no_grad():
                out = hf(ids, output_attentions=True)
                sig["entropy"] = [_entropy(a[0]) for a in out.attentions]
                sig["routing"] = dict(picks)
                sig["confidence"] = confidence(out.logits)
    elif tool == "nnsight":
        from nnsight import NNsight

        hf.set_attn_implementation("eager")
        nm = NNsight(hf)

        def run():
            ents, routes = [], {}
            with torch.no_grad(), nm.trace(ids):
                for i in range(cfg.num_hidden_layers):  # in execution order, as nnsight requires
                    layer = nm.model.layers[i]
                    ents.append(_entropy(layer.self_attn.output[1][0]).save())
                    if i in moe:
                        routes[i] = layer.mlp.gate.output[2].save()
                logits = nm.output.logits.save()
            sig["entropy"], sig["routing"], sig["confidence"] = ents, routes, confidence(logits)
    elif tool == "transformer_lens":
        from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

        bridge = build_bridge_from_module(hf, type(hf).__name__, hf_config=cfg)
        ents: dict = {}
        routes: dict = {}

        def pattern(t, hook):
            ents[hook.name] = _entropy(t[0]).detach()

        def gate(t, hook):
            routes[hook.name] = (t[2] if isinstance(t, tuple) else t).detach()

        hooks = [(f"blocks.{i}.attn.hook_pattern", pattern) for i in range(cfg.num_hidden_layers)]
        hooks += [(f"blocks.{i}.mlp.gate.hook_out", gate) for i in moe]

        def run():
            with torch.no_grad():
                logits = bridge.run_with_hooks(ids, fwd_hooks=hooks)
            sig["entropy"], sig["routing"], sig["confidence"] = dict(ents), dict(routes), confidence(logits)
    elif tool == "native_plain":
        from workbench.model import load_checkpoint
        from workbench.model.generate import generate

        module = load_checkpoint(folder)

        def run():  # what workbench.record(max_new_tokens=1) runs, without probes or a store
            sig["tokens"] = generate(module, ids[0].tolist(), 1)

        def theirs():  # transformers' plain forward of the same weights, for the side-by-side pairs below
            with torch.no_grad():
                hf(ids)
    elif tool in ("workbench_hf", "workbench_native"):
        import workbench
        from workbench.data.store import Store
        from workbench.model import load_checkpoint, load_tokenizer

        tok = load_tokenizer(Path(folder) / "tokenizer.json")
        if tool == "workbench_hf":
            hf.set_attn_implementation("eager")  # as workbench's own loader does: SDPA returns no probabilities
            module = hf
        else:
            del hf
            module = load_checkpoint(folder)
        tmp = Path(tempfile.mkdtemp(prefix="peers_wb_"))
        store = Store(tmp / "wb.duckdb")
        if tool == "workbench_native":
            from workbench.model.generate import generate

            def plain_pair():  # our plain forward, in this process: what record(max_new_tokens=1) runs, bare
                generate(module, ids[0].tolist(), 1)

        def run():
            r = workbench.record(ids[0].tolist(), model=module, tokenizer=tok, max_new_tokens=1, db=store, detect=False,
                                 probes=("tokens", "attention", "routing"), backend="auto")
            sig["rows"] = {t: int(store.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [r.run_id])[0][0])
                           for t in ("tokens", "attention", "routing")}
            sig["backend"] = r.model_summary.backend
    else:
        raise ValueError(tool)

    # warm-up on a short prompt (first-call costs), then the peak counted from here
    full = ids
    ids = full[:, :32]
    run()
    ids = full
    sig.clear()
    reset = _reset_peak()
    base = _rss_kb("VmRSS")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    peak = _rss_kb("VmHWM") if reset else _rss_kb("VmHWM")
    out = {"tool": tool, "length": length, "s": times, "peak_mb": (peak - base) / 1024, "peak_reset": reset}
    if "entropy" in sig:
        e = sig["entropy"]
        e = list(e.values()) if isinstance(e, dict) else e
        out["entropy_shape"] = list(e[0].shape)
        out["routing_shape"] = list(next(iter(sig["routing"].values())).shape)
    if "rows" in sig:
        out["rows"] = sig["rows"]
        out["backend"] = sig["backend"]
    if tool == "native_plain":  # our plain / transformers' plain, side by side in one process, interleaved
        ids = full[:, :32]
        theirs()  # its warm-up
        ids = full
        pair = {"ours_s": [], "hf_s": [], "ours_cpu": [], "hf_cpu": []}
        for _ in range(max(reps, 9 if length < 1024 else 2 if length < 4096 else 1)):
            for key, fn in (("hf", theirs), ("ours", run)):
                t, c = time.perf_counter(), time.process_time()
                fn()
                pair[key + "_s"].append(time.perf_counter() - t)
                pair[key + "_cpu"].append(time.process_time() - c)
        out["pair"] = pair
    if tool == "workbench_native":  # recorded / our plain, measured side by side in one process, interleaved
        ids = full[:, :32]
        plain_pair()
        ids = full
        peaks = []
        for fn in (plain_pair, run):  # each peak from its own reset: the high-water mark of that call alone
            _reset_peak()
            b = _rss_kb("VmRSS")
            fn()
            peaks.append((_rss_kb("VmHWM") - b) / 1024)
        pair: dict = {"plain_s": [], "rec_s": [], "plain_cpu": [], "rec_cpu": [], "plain_peak_mb": peaks[0],
                      "rec_peak_mb": peaks[1]}
        for _ in range(max(reps, 9 if length < 1024 else 2 if length < 4096 else 1)):  # short runs: noisy
            for key, fn in (("plain", plain_pair), ("rec", run)):
                t, c = time.perf_counter(), time.process_time()
                fn()
                pair[key + "_s"].append(time.perf_counter() - t)
                pair[key + "_cpu"].append(time.process_time() - c)
        out["pair"] = pair
    return out


def run_child(tool: str, folder: Path, length: int, reps: int, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", tool, "--folder", str(folder),
           "--lengths", str(length), "--reps", str(reps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 5), env=env)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "length": length, "error": "over the time budget"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return {"tool": tool, "length": length, "error": tail[:200]}
    return json.loads(lines[-1])


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--reps", type=int, default=2, help="repetitions per tool and length (4096 and over: 1)")
    ap.add_argument("--budget-s", type=float, default=300, help="stop starting tools after this many seconds")
    ap.add_argument("--tools", nargs="+", default=TOOLS, choices=TOOLS)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.lengths[0], args.reps)))
        return 0
    if importlib.util.find_spec("transformers") is None:
        print("peers: transformers is not installed (pip install -e '.[test]'); skipped")
        return 0
    missing = [m for m in ("nnsight", "transformer_lens") if importlib.util.find_spec(m) is None]
    if len(missing) == 2 and not set(args.tools) - set(NEEDS):
        print("peers: neither nnsight nor TransformerLens is installed (pip install -e '.[peers]'); skipped")
        return 0
    versions = {}
    for m in ("torch", "transformers", "nnsight", "transformer_lens"):
        try:
            from importlib.metadata import version
            versions[m] = version(m.replace("_", "-") if m == "transformer_lens" else m)
        except Exception:  # noqa: BLE001
            versions[m] = "not installed"
    tmp = Path(tempfile.mkdtemp(prefix="peers_"))
    start = time.monotonic()
    load0 = load()
    results: dict[tuple[str, int], dict] = {}
    try:
        folder = make_folder(tmp / "deepseek_v3", max(args.lengths))
        for length in args.lengths:
            reps = 1 if length >= 2048 else args.reps
            for tool in args.tools:
                if tool in NEEDS and NEEDS[tool] in missing:
                    results[(tool, length)] = {"error": "not installed"}
                    continue
                left = args.budget_s - (time.monotonic() - start)
                if left <= 0:
                    results[(tool, length)] = {"error": "skipped: time budget spent"}
                    continue
                r = run_child(tool, folder, length, reps, left)
                results[(tool, length)] = r
                print(f"  {length} {tool}: " + (f"{statistics.median(r['s']):.2f} s, peak +{r['peak_mb']:.0f} MB"
                                                 if "s" in r else r["error"]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, results, versions, missing, (load0, load()), time.monotonic() - start)
    print(text)
    if args.write:
        from results_md import write_section
        write_section(ROOT / "benchmarks" / "RESULTS.md", _section(args), text)
    return 0


def _section(args) -> str:
    return SECTION if PEER_TOOLS & set(args.tools) else OURS_SECTION


def _ratio(pair: dict, num: str, den: str, unit: str) -> float:
    """Median over the interleaved pairs of num / den (unit ``_cpu``: process CPU time; ``_s``: wall)."""
    if num + unit not in pair:  # a result from before CPU times were kept
        unit = "_s"
    return statistics.median([a / b for a, b in zip(pair[num + unit], pair[den + unit])])


def report(args, results, versions, missing, loads, total_s) -> str:
    tools = "" if args.tools == TOOLS else " --tools " + " ".join(args.tools)
    lines = [_section(args), "",
             f"`python benchmarks/peers.py --lengths {' '.join(map(str, args.lengths))} --reps {args.reps}{tools}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {os.cpu_count()} cores "
             f"shared with other jobs, torch threads 1, load average {loads[0]} before, {loads[1]} after, "
             f"{total_s:.0f} s in all; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ").", "",
             "Random transformers DeepseekV3 folder: hidden 512, 8 layers (first dense), 16 heads (MLA, kv rank 128), "
             "32 routed experts top-4 + 1 shared, bundled tokenizer (vocab 4096). One forward over a random prompt; "
             "every tool captures attention entropy per head, the routers' selection and token confidence. Seconds: "
             "median over the repetitions (1 from 2048 tokens); ratio: over the plain forward of the same length; peak: RSS "
             "high-water mark increase over the process's RSS after loading and a warm-up.", ""]
    header = "| tool | " + " | ".join(f"{n} tok: s (ratio) | {n}: peak MB" for n in args.lengths) + " |"
    lines += [header, "|---|" + "---|---|" * len(args.lengths)]
    for tool in args.tools:
        cells = []
        for n in args.lengths:
            r = results.get((tool, n), {"error": "not run"})
            if "s" not in r:
                cells += [r["error"], ""]
                continue
            s = statistics.median(r["s"])
            base = results.get(("plain", n), {})
            ratio = f" ({s / statistics.median(base['s']):.2f}x)" if "s" in base else ""
            cells += [f"{s:.2f}{ratio}", f"{r['peak_mb']:.0f}"]
        lines.append(f"| {LABELS[tool]} | " + " | ".join(cells) + " |")
    ours = [n for n in args.lengths if "pair" in results.get(("workbench_native", n), {})]
    if ours:  # the recording-speed targets: recorded / our own plain forward, time <= 1.20x, peak <= 1.10x
        lines += ["", "Against our own plain forward, side by side in the `workbench.record (native)` process (the "
                  "same weights in workbench's `Transformer`; plain = `generate` of one token, what "
                  "`record(max_new_tokens=1)` runs without probes or a store; the two alternate, each peak from its own "
                  "reset of the high-water mark); the last column: our plain forward / transformers' plain forward, the two "
                  "alternating in the `our plain forward` process (9 pairs under 1024 tokens, 2 under 4096, else 1). "
                  "Ratios: median of the pairs' ratios of CPU time (the process's, all threads), wall-clock beside it:",
                  "",
                  "| tokens | our plain s | recorded s | time ratio, CPU (target <= 1.10x) | wall ratio "
                  "| our plain peak MB | recorded peak MB | memory ratio (target <= 1.10x) "
                  "| our plain / transformers plain, CPU (target <= 0.5x at 4096) | wall |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for n in ours:
            pair = results[("workbench_native", n)]["pair"]
            ps, rs = statistics.median(pair["plain_s"]), statistics.median(pair["rec_s"])
            ratio = _ratio(pair, "rec", "plain", "_cpu")
            wall = _ratio(pair, "rec", "plain", "_s")
            vp = results.get(("native_plain", n), {}).get("pair")
            vs = (f"**{_ratio(vp, 'ours', 'hf', '_cpu'):.2f}x** | {_ratio(vp, 'ours', 'hf', '_s'):.2f}x" if vp
                  else "not run | ")
            lines.append(f"| {n} | {ps:.2f} | {rs:.2f} | **{ratio:.2f}x** | {wall:.2f}x | "
                         f"{pair['plain_peak_mb']:.0f} | "
                         f"{pair['rec_peak_mb']:.0f} | **{pair['rec_peak_mb'] / max(pair['plain_peak_mb'], 1):.2f}x** | "
                         f"{vs} |")
    rows = [r for (t, n), r in results.items() if "rows" in r]
    if rows:
        lines += ["", "workbench rows per run (written to DuckDB inside the timing): " + "; ".join(
            f"{LABELS[r['tool']].removeprefix('workbench.record ')} at {r['length']} tokens: "
            + ", ".join(f"{t} {v}" for t, v in r["rows"].items()) for r in rows) + "."]
    if missing:
        lines += ["", f"Not installed here: {', '.join(missing)}."]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
