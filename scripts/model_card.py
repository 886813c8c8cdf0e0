"""Write data/MODEL_CARD.md (and the "Demo model" section of benchmarks/RESULTS.md) from the bundled
checkpoint's own records and a `workbench eval --json` result.

    .venv/bin/workbench eval --json | tail -1 > data/demo/eval.json
    .venv/bin/python scripts/model_card.py            # reads data/demo/*.json, writes both

Every number in the card comes from data/demo (config.json, train_meta.json, train_log.jsonl,
corpus.json) or from data/demo/eval.json; nothing is typed in by hand.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench.model import MoE, load_checkpoint  # noqa: E402
from workbench.model.corpus import EXCLUDE, MAX_FILE_BYTES, PACKAGE_CAP  # noqa: E402
from workbench.model.evaluate import COMPLETION_TOKENS  # noqa: E402

DEMO = ROOT / "data" / "demo"
SHOWN = ("01_fibonacci.txt", "03_stack.txt", "05_load_config.txt")


def _table(head: list[str], rows: list[list], right: set[int] | None = None) -> str:
    right = set(range(1, len(head))) if right is None else right
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---:" if i in right else "---" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _params(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            per = sum(p.numel() for p in layer.ffn.experts[0].parameters())
            idle += per * (model.args.n_routed_experts - model.args.n_activated_experts)
    return total, total - idle


def render() -> str:
    cfg = json.loads((DEMO / "config.json").read_text())
    meta = json.loads((DEMO / "train_meta.json").read_text())
    log = [json.loads(line) for line in (DEMO / "train_log.jsonl").read_text().splitlines()]
    packages = json.loads((DEMO / "corpus.json").read_text())
    ev = json.loads((DEMO / "eval.json").read_text())
    model = load_checkpoint(DEMO)
    total, active = _params(model)
    size = (DEMO / "model.safetensors").stat().st_size
    train = [p for p in packages if p["split"] == "train"]
    val = [p for p in packages if p["split"] == "validation"]
    train_bytes = sum(p["bytes"] for p in train)
    steps, batch, seq = int(meta["steps"]), int(meta["batch"]), int(meta["seq_len"])
    seen = int(meta["tokens_seen"])
    last = statistics.mean(r["loss"] for r in log[-50:])
    steps_seen = [r["step"] for r in log]
    redone = len(steps_seen) - len(set(steps_seen))
    resumed = (f" The run was interrupted and resumed from its last saved state: {redone} steps were redone "
               "and appear twice in the log (a resumed run continues bitwise where it stopped)." if redone else "")
    bpb = ev["bits_per_byte"]
    wall = int(meta["wall_s"])
    E, K = cfg["n_routed_experts"], cfg["n_activated_experts"]
    parts = []
    parts.append(f"""# Model card: the bundled demo model (`data/demo`)

A small DeepSeek-V3-style mixture-of-experts language model, trained from scratch on this project's
machine so the workbench has a real model to observe (no model may be downloaded). It writes Python
that a Python programmer recognises, and is wrong often enough to be worth debugging. This card is
written by `scripts/model_card.py` from the checkpoint's own records and `workbench eval --json`.

Files: `data/demo/model.safetensors` ({size / 1e6:.1f} MB, fp32, {total:,} parameters, {active:,} active per
token), `data/demo/config.json` (`ModelArgs`), `data/demo/tokenizer.json`; the training record in
`data/demo/train_meta.json` and `data/demo/train_log.jsonl`, the corpus in `data/demo/corpus.json`, the
evaluation in `data/demo/eval.json`.

```python
import workbench.model as model
m = model.load_checkpoint()      # no argument: this checkpoint, in eval mode
tok = model.load_tokenizer()     # no argument: this tokenizer
```

## Architecture (`data/demo/config.json`, preset `demo`)

| part | setting |
|---|---|
| vocabulary | byte-level BPE (`tokenizers`), {cfg['vocab_size']} tokens incl. `<\\|endoftext\\|>`, trained on the training files |
| width, depth | dim {cfg['dim']}, {cfg['n_layers']} layers; layer 0 a dense SwiGLU MLP (hidden {cfg['inter_dim']}), layers {cfg['n_dense_layers']}-{cfg['n_layers'] - 1} DeepSeekMoE |
| attention | Multi-head Latent Attention, {cfg['n_heads']} heads; `q_lora_rank` {cfg['q_lora_rank']} (a plain `wq`), `kv_lora_rank` {cfg['kv_lora_rank']}, `qk_nope_head_dim` {cfg['qk_nope_head_dim']}, `qk_rope_head_dim` {cfg['qk_rope_head_dim']}, `v_head_dim` {cfg['v_head_dim']}; the KV cache holds the {cfg['kv_lora_rank']}-dim latent + the {cfg['qk_rope_head_dim']}-dim shared rope key per token and layer |
| MoE | {E} routed experts (hidden {cfg['moe_inter_dim']}), top-{K}, + {cfg['n_shared_experts']} shared expert of the same size |
| gate | `{cfg['score_func']}` scores; a selection bias (aux-loss-free balancing) added for the choice only; group-limited routing: {cfg['n_expert_groups']} groups of {E // cfg['n_expert_groups']}, the best {cfg['n_limited_groups']} groups per token; top-k weights normalised, `route_scale` {cfg['route_scale']} |
| position | RoPE with YaRN: trained at `original_seq_len` {cfg['original_seq_len']}, `rope_factor` {cfg['rope_factor']:g} for up to `max_seq_len` {cfg['max_seq_len']}, `mscale` {cfg['mscale']:g} (softmax-scale correction) |

## Corpus (`model/corpus.py`, `data/demo/corpus.json`)

Python source installed on the training machine (Python {next(p['version'] for p in packages if p['package'] == 'python-stdlib')}, x86_64 Linux): the standard
library (every `*.py` under `sysconfig.get_paths()["stdlib"]`) and the `*.py` files of every
distribution installed in the interpreter's site-packages (this project's virtual environment with its
test and peers extras), except folders named {', '.join(f'`{x}`' for x in sorted(EXCLUDE))} (test suites,
vendored copies, caches, codec tables, demos) and this project itself. A file is left out when it looks
generated (over {MAX_FILE_BYTES:,} bytes, more than 1% of its lines over 200 characters, or more than a quarter
of its bytes digits); files are deduplicated by content (SHA-1 of the bytes; the validation packages are
read first, so no copy of a held-out file is trained on). A package gives at most {PACKAGE_CAP:,} bytes
(its files in the order of a hash of their path, so the sample spreads over the package); the standard
library is taken whole.

**Validation is whole packages, never trained on:** {', '.join(f'`{p["package"]}` {p["version"]}' for p in val)}
({sum(p['files'] for p in val)} files, {sum(p['bytes'] for p in val):,} bytes).

**Training:** {len(train)} packages, {sum(p['files'] for p in train):,} files, {train_bytes:,} bytes. Every source package, its
licence (from its metadata: `License-Expression`, else `License`, else the classifiers) and what it gave:

""")
    rows = [[f"`{p['package']}`", p["version"], p["licence"].replace("|", "/"), p["split"], p["files"],
             f"{p['bytes']:,}", p["skipped_duplicate"], p["skipped_generated"], p["skipped_cap"]]
            for p in sorted(packages, key=lambda p: (p["split"] != "validation", -p["bytes"]))]
    parts.append(_table(["package", "version", "licence", "split", "files", "bytes taken", "duplicates left out",
                         "generated-looking left out", "over the cap"], rows, right={4, 5, 6, 7, 8}))
    parts.append(f"""

Another machine has other packages (and versions) installed, so `workbench train` there gives a
similar model, not this one.

## Training (`model/train.py`, `data/demo/train_meta.json`)

{steps:,} steps of batch {batch} x {seq} tokens (random windows of the training stream), {seen:,} tokens seen;
AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak learning rate {float(meta['lr']):g}, {meta['warmup']} warm-up steps then
cosine to 10%, gradient clipping at 1.0, seed {meta['seed']}, {meta['threads']} torch threads. Expert balance by the
aux-loss-free rule of the DeepSeek-V3 paper, no auxiliary loss: after every step, in every MoE layer,
`bias += {float(meta['balance_rate']):g} * sign(mean load - expert load)`. Training loss (nats/token) {log[0]['loss']:.2f} at step 1,
{last:.2f} averaged over the last 50 steps (`data/demo/train_log.jsonl`). Wall time {wall // 3600} h {wall % 3600 // 60} min
on the 2-core CPU machine (no accelerator was lent), which the session's other work shared at times.{resumed}
Set `MALLOC_MMAP_THRESHOLD_=4294967296` in the environment: without it glibc returns every large
tensor's pages to the kernel after each step and faults them back in on the next (measured on this
machine on 2026-12-01, one step of batch 8 x 512 on random tokens: 2.28 s without, 1.44 s with it, most
of the difference kernel time). {meta.get('note', '')}

## Results on the held-out packages (`workbench eval`)

Scored: {ev['tokens_scored']:,} tokens = {ev['bytes_scored']:,} bytes, every token of the {ev['validation_files']} validation files{' (capped)' if ev['capped'] else ', no `--max-tokens` cap'}. The
model reads the stream in non-overlapping windows of {ev['window']} tokens (no stride: a token sees what precedes
it in its window, at least its previous token). Bits per byte = summed negative log2-likelihood of every
scored token / UTF-8 bytes of those tokens; `<|endoftext|>` separators are scored by no method.

""")
    parts.append(_table(["method", "bits per byte", "bits per token"], [
        ["demo model", f"**{bpb['model']:.3f}**", f"{ev['bits_per_token']['model']:.3f}"],
        [f"token bigram, Dirichlet-smoothed toward an add-one unigram, k = {ev['bigram_k']:g}", f"{bpb['bigram']:.3f}",
         f"{ev['bits_per_token']['bigram']:.3f}"],
        ["`gzip -9` of the same bytes (Python's `gzip`, DEFLATE level 9)", f"{bpb['gzip']:.3f}", ""]]))
    verdict = "met" if ev["model_vs_gzip"] <= 0.85 else "missed"
    parts.append(f"""

The model needs **{ev['model_vs_gzip']:.3f}x** the bits of `gzip -9` (target <= 0.85x: {verdict}) and
{bpb['model'] / bpb['bigram']:.2f}x the bigram's. The bigram is fitted on the training files' tokens; its k
was picked from a fixed grid (0.01 to 1000) on a tenth of the training files, then refitted on all of
them: it never saw validation data. Per package:

""")
    parts.append(_table(["package", "tokens", "bytes", "model bits/byte", "gzip -9", "model / gzip"],
                        [[f"`{p['package']}`", f"{p['tokens']:,}", f"{p['bytes']:,}", f"{p['model']:.3f}",
                          f"{p['gzip']:.3f}", f"{p['model'] / p['gzip']:.3f}"] for p in ev["by_package"]]))
    loads = ev["expert_load"]
    low = min(x["min_share_vs_uniform"] for x in loads)
    parts.append(f"""

Expert load: the share of routed slots (tokens x {K}) each expert receives on the scored tokens, counted on
`layers.*.ffn.gate.hook_indices`, as a multiple of the uniform share 1/{E} (1.00 = exactly uniform). The
smallest share is **{low:.2f}x** uniform (target >= 0.3x: {'met' if low >= 0.3 else 'missed'}).

""")
    parts.append(_table(["layer", *map(str, range(E)), "min", "max"],
                        [[x["layer"], *(f"{s * E:.2f}" for s in x["share"]), f"**{x['min_share_vs_uniform']:.2f}**",
                          f"{x['max_share_vs_uniform']:.2f}"] for x in loads]))
    comps = ev["completions"]
    parts.append(f"""

## Completions (`data/prompts/*.txt`)

Greedy {COMPLETION_TOKENS}-token continuations of the prompt files (each file's text without trailing
whitespace: a prompt's final newline would be a token of its own, which the tokenizer only makes before
column-0 code, so the model would leave the block it was writing). **Measure** (`python_measure` in
`model/evaluate.py`): the prompt + continuation is cut after its last complete line (the last line may
end mid-token), then closed: an open string gets its closing quote, open brackets their closers, and a
last code line ending in `:` an indented `pass`. A completion **parses** when its complete lines hold at
least one line of code (not only blanks and comments) and `ast.parse` accepts the closed text; otherwise the measure is how far it gets, the longest run of its complete lines that parses
when closed the same way, and where the first syntax error is. Parsing is syntax only, not sense.

**{ev['completions_parsing']} of {len(comps)}** completions parse.

""")
    parts.append(_table(["prompt file", "complete lines", "lines that parse", "first syntax error"],
                        [[f"`{c['file']}`", c["lines"], c["valid_lines"], c["error"] or "none: parses"] for c in comps],
                        right={1, 2}))
    for c in comps:
        if c["file"] in SHOWN:
            text = (c["prompt"] + c["continuation"]).replace("```", "'''")
            parts.append(f"\n\n`{c['file']}` ({'parses' if c['parses'] else 'does not parse'}), the prompt then the "
                         f"model's {c['tokens']} tokens, cut where they ran out:\n\n```python\n{text.rstrip()}\n```")
    parts.append(f"""

## Reproduce

```bash
workbench train --out models/demo   # from scratch, seeded, progress bar, resumable: rerun after an interruption
workbench eval --model models/demo  # every number above; --max-tokens N caps the scored tokens, --json for machines
```

`workbench eval` on this checkpoint took {ev['wall_s']:.0f} s on the 2-core machine (the model's pass
{ev['model_seconds']:.0f} s; most of the rest is the bigram fit, which tokenizes the training files). The
definitions are in `model/evaluate.py`; `tests/test_demo_model.py` checks the targets on a 20,000-token
slice (the same share of each held-out package).
""")
    return "".join(parts)


def results_section() -> list[str]:
    ev = json.loads((DEMO / "eval.json").read_text())
    meta = json.loads((DEMO / "train_meta.json").read_text())
    bpb = ev["bits_per_byte"]
    total, _ = _params(load_checkpoint(DEMO))
    loads = ", ".join(f"layer {x['layer']}: {x['min_share_vs_uniform']:.2f}" for x in ev["expert_load"])
    comps = ev["completions"]
    return [
        "## Demo model", "",
        f"The bundled `data/demo` checkpoint (see `data/MODEL_CARD.md`) on the held-out packages "
        f"{', '.join(f'`{p}`' for p in ev['validation_packages'])} ({ev['validation_files']} files, never trained on): "
        f"{ev['tokens_scored']:,} tokens, {ev['bytes_scored']:,} bytes, non-overlapping {ev['window']}-token windows. "
        "Reproduce with `workbench eval`.", "",
        "| method | bits per byte |", "|---|---:|",
        f"| demo model ({total:,} parameters, {int(meta['steps']):,} steps, {int(meta['tokens_seen']):,} tokens seen) "
        f"| **{bpb['model']:.3f}** |",
        f"| token bigram (k = {ev['bigram_k']:g}, fitted on the training files) | {bpb['bigram']:.3f} |",
        f"| `gzip -9` | {bpb['gzip']:.3f} |", "",
        f"Model / gzip: **{ev['model_vs_gzip']:.3f}x** (target <= 0.85x); per package "
        + ", ".join(f"{p['package']} {p['model'] / p['gzip']:.2f}x" for p in ev["by_package"]) + ". "
        f"Smallest routed-slot share per MoE layer as a multiple of uniform: {loads} (target >= 0.3). "
        f"Greedy {COMPLETION_TOKENS}-token completions of the {len(comps)} prompt files: {ev['completions_parsing']} of {len(comps)} "
        "parse once closed (the measure is defined in the model card). `workbench eval` "
        f"{ev['wall_s']:.0f} s on 2 CPU cores.",
    ]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from probe_overhead import write_section

    (ROOT / "data" / "MODEL_CARD.md").write_text(render())
    lines = results_section()
    write_section(ROOT / "benchmarks" / "RESULTS.md", lines[0], "\n".join(lines))
    print(ROOT / "data" / "MODEL_CARD.md", "and the Demo model section of", ROOT / "benchmarks" / "RESULTS.md")
