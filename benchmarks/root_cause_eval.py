"""Fault-injection evaluation of root cause, over every fault kind of ``workbench.analysis.faults.KINDS``.

For each injected fault and its prompt: record the faulty generation with ``workbench.record(model=module)``,
find the most affected token (largest |logprob under the faulty model - logprob under the clean model|,
teacher-forced on the faulty run's tokens), explain it with ``run.root_cause(pos)`` (alone: what a user
gets from one run) and ``run.root_cause(pos, reference=clean)`` (activation patching against the clean
model), and note whether the top 3 name the fault (``FaultKind.names``: the component, or for a layer-wide
fault a row of its layer; for an embedding fault a position holding the token).

Root cause answers "why did this token go wrong", so it is asked only where a token did: a drawn fault that
moves no token's logprob by ``--min-effect`` nats (default 0.5) has no symptom to explain; it is counted
separately and the next fault of that kind is drawn (up to ``--max-draws``) until each kind has
``--per-kind`` faults with a symptom. Faults are drawn with a fixed seed: the layer uniformly over the
layers the kind applies to, heads and KV channels uniformly, experts among those the clean run routed
tokens to in that layer (router faults: any expert), token rows among the prompt's tokens.

    .venv/bin/python benchmarks/root_cause_eval.py                      # the demo model: its RESULTS section
    .venv/bin/python benchmarks/root_cause_eval.py --tiny mixtral       # a tiny random transformers model
    .venv/bin/python benchmarks/root_cause_eval.py --no-write --per-kind 1 --kinds head,rotary

Detectors are evaluated over the same registry by benchmarks/anomaly_eval.py.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import torch  # noqa: E402

import workbench  # noqa: E402
from workbench.analysis import activations, faults  # noqa: E402
from workbench.analysis.baseline import build_profile, load_profile, save_profile  # noqa: E402
from workbench.capture.adapters import Adapter, adapter_for, load_adapter  # noqa: E402
from workbench.model import load_tokenizer  # noqa: E402
from results_md import write_section  # noqa: E402

SECTION = "## Root cause (fault injection)"
PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n",
    "import os\nimport sys\n\n\nclass Cache:\n    def __init__(self, size):\n",
    "    for i, line in enumerate(lines):\n        if line.startswith(",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Node:\n    def __init__(self, value, next=None):\n        self.value = value\n",
    "    try:\n        result = func(*args, **kwargs)\n    except Exception as e:\n",
    "def __repr__(self):\n    return '%s(%r)' % (self.__class__.__name__, ",
    "    if not isinstance(key, str):\n        raise TypeError(",
]

# profile calibration for a model without one (the tiny random models): prompts the faults are not drawn on
CALIBRATION = [
    "def load(path):\n    data = []\n    for line in open(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "    while queue:\n        node = queue.pop(0)\n        if node in seen:\n",
    "import json\n\n\ndef dump(obj, path):\n    with open(path, 'w') as f:\n",
    "    return {k: v for k, v in items if v is not None}\n",
    "def main():\n    args = parse()\n    print(args.name)\n",
    "    except KeyError:\n        return default\n    finally:\n",
    "for x, y in zip(xs, ys):\n    total += x * y\n",
]
CALIBRATION_FILE = ROOT / "data" / "prompts" / "calibration.jsonl"  # the rest: as a user's `workbench profile` set
CALIBRATION_TOKENS = 64  # each calibration prompt's first tokens (the tiny models hold 128 positions)


def calibration_ids(tok, n: int) -> list[list[int]]:
    """``n`` calibration prompts' ids: ``CALIBRATION``, then data/prompts/calibration.jsonl's, each cut at
    ``CALIBRATION_TOKENS`` (none is a prompt the faults are drawn on)."""
    texts = CALIBRATION + [json.loads(line)["prompt"] for line in CALIBRATION_FILE.read_text().splitlines() if line]
    return [tok.encode(t).ids[:CALIBRATION_TOKENS] for t in texts[:n]]


@dataclass
class Case:
    kind: str  # a key of faults.KINDS
    layer: int
    index: int  # head, expert, channel or token id (faults.KINDS[kind].index), else 0
    prompt: int
    result: dict = field(default_factory=dict)

    @property
    def fault(self) -> faults.FaultKind:
        return faults.ALL_KINDS[self.kind]

    def label(self) -> str:
        k = self.fault
        where = "" if k.where == "model" else f"layer {self.layer}"
        what = f" {k.index} {self.index}" if k.index else ""
        return f"{self.kind}: {where}{what}".strip()


def load_model(folder: Path) -> tuple[Adapter, str]:
    """A checkpoint folder (ours or transformers'), or a training-state folder (``state.safetensors``: an
    intermediate demo model)."""
    if (folder / "config.json").exists():
        return load_adapter(folder), str(folder)
    from safetensors.torch import load_file

    from workbench.model import ModelArgs, Transformer
    state = load_file(str(folder / "state.safetensors"))
    model = Transformer(ModelArgs.preset("demo"))
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    step = json.loads((folder / "state.json").read_text()).get("step") if (folder / "state.json").exists() else "?"
    return adapter_for(model.eval()), f"{folder} (intermediate training state, step {step})"


def teacher_forced_logprobs(model: Adapter, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 under ``model`` (full forward, no cache)."""
    with torch.no_grad():
        logits = model.forward(torch.tensor([ids], device=model.device))[0, :-1].float().cpu()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def draw_case(kind: str, k: int, rng: random.Random, model: Adapter, routing: dict[int, pl.DataFrame],
              prompts: list[list[int]]) -> Case:
    """The k-th fault of a kind (its own random stream), on prompt k in rotation."""
    fk = faults.ALL_KINDS[kind]
    p = k % len(prompts)
    layer = rng.choice(fk.layers(model))
    if fk.index == "token":
        return Case(kind, layer, rng.choice(prompts[p][1:]), p)
    if fk.index == "expert" and kind not in ("router_bias", "router_affinity"):  # one the prompt uses
        used = sorted(set(routing[p].filter(pl.col("layer") == layer)["expert"].to_list()))
        return Case(kind, layer, rng.choice(used), p)
    n = fk.n_index(model, layer)
    return Case(kind, layer, rng.randrange(n) if n else 0, p)


def named_rank(case: Case, rc: pl.DataFrame, ids: list[int]) -> int | None:
    """The best rank of a row that names the fault (None: no row does)."""
    fk = case.fault
    ranks = [r["rank"] for r in rc.iter_rows(named=True) if fk.names(r, case.layer, case.index, ids)]
    return min(ranks) if ranks else None


class Counter:
    """Counts forwards of a model (its embedding's calls: a batched forward counts once)."""

    def __init__(self, *adapters: Adapter):
        self.n = 0
        self.handles = [a.embedding().register_forward_hook(self._hit) for a in adapters]

    def _hit(self, *_):
        self.n += 1

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run_case(case: Case, model, reference, tok, prompt_ids: list[int], db, args) -> dict:
    """Record the faulty run, find its symptom; if there is one, explain it (alone and against the reference)."""
    t0 = time.perf_counter()
    with case.fault(model, case.layer, case.index):
        run = workbench.record(prompt_ids, model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens, db=db)
        ids = run.tokens()["token_id"].to_list()
        faulty_lp = teacher_forced_logprobs(model, ids)
    clean_lp = teacher_forced_logprobs(model, ids)
    diff = (faulty_lp - clean_lp).abs().nan_to_num(nan=float("inf"))  # index t -> position t + 1
    pos = 1 + int(diff.argmax())
    out = {"case": case.label(), "kind": case.kind, "prompt": case.prompt, "pos": pos,
           "token": run.tokens()["text"][pos], "dlogprob": float(diff[pos - 1]),
           "symptom": float(diff[pos - 1]) >= args.min_effect}
    if out["symptom"]:
        with case.fault(model, case.layer, case.index):
            rc = run.root_cause(pos, steps=args.steps, batch_size=args.batch_size, store=False)
            counter = Counter(model, reference)
            t1 = time.perf_counter()
            try:
                rc_ref = rc if args.alone_only else run.root_cause(
                    pos, batch_size=args.batch_size, reference=reference, store=False, top_layers=args.top_layers)
            finally:
                counter.close()
            ref_seconds = time.perf_counter() - t1
        out |= {"rank_all": named_rank(case, rc, ids), "rank_ref": named_rank(case, rc_ref, ids),
                "top3": [list(t) for t in rc.head(3).select("kind", "layer", "head", "expert", "source_pos").rows()],
                "top3_ref": [list(t) for t in
                             rc_ref.head(3).select("kind", "layer", "head", "expert", "source_pos").rows()],
                "restored_top": float(rc_ref["restored"][0]) if rc_ref["restored"][0] is not None else None,
                "ref_forwards": counter.n, "ref_seconds": ref_seconds, "n_tokens": pos}
    return out | {"seconds": time.perf_counter() - t0}


def summarise(results: list[dict]) -> dict:
    """Rates over the faults with a symptom."""
    def rate(rs, f):
        return sum(1 for r in rs if f(r)) / len(rs) if rs else float("nan")

    def top(key, k):
        return lambda r: r[key] is not None and r[key] <= k

    def block(rs: list[dict]) -> dict:
        explained = [r for r in rs if r["symptom"]]
        return {"n": len(explained), "drawn": len(rs), "silent": len(rs) - len(explained),
                "top1": rate(explained, top("rank_all", 1)), "top3": rate(explained, top("rank_all", 3)),
                "top1_ref": rate(explained, top("rank_ref", 1)), "top3_ref": rate(explained, top("rank_ref", 3)),
                "forwards": float(np.median([r["ref_forwards"] for r in explained])) if explained else float("nan"),
                "ref_seconds": float(np.median([r["ref_seconds"] for r in explained])) if explained else float("nan")}

    kinds = list(dict.fromkeys(r["kind"] for r in results))
    return block(results) | {"by_kind": {k: block([r for r in results if r["kind"] == k]) for k in kinds}}


def markdown(summary: dict, results: list[dict], meta: dict) -> str:
    s = summary
    alone = meta.get("alone_only", False)
    lines = [
        meta["section"], "",
        f"`benchmarks/root_cause_eval.py` on {meta['checkpoint']} ({meta['when']}, {meta['machine']}, "
        f"{meta['seconds']:.0f} s; {meta['architecture']}): up to {meta['per_kind']} faults of each kind with a "
        f"symptom (default strengths of `faults.ALL_KINDS`), drawn with seed {meta['seed']} over {meta['prompts']} "
        f"prompts, greedy generation of {meta['max_new_tokens']} tokens. A fault has a symptom when it moves some "
        f"token's logprob (teacher-forced) by >= {meta['min_effect']:g} nat; that token is explained. \"alone\": "
        f"`run.root_cause(pos)` (IG with {meta['steps']} steps over source tokens, ablation of heads, experts, "
        f"shared experts and routers, unusual activations against {meta['profile']})"
        + ("" if alone else "; \"vs reference\": `run.root_cause(pos, reference=clean_model)`, activation "
           f"patching (layers, then {meta['top_layers']} layers descended into)")
        + ". Named: a top-3 row is the faulted "
        "component (router faults: the router or the expert; starved: the expert or the router), or for a "
        "layer-wide fault (norm, rotary, KV latent, residual scale, skipped layer) a row of its layer "
        "(attn_block, mlp_block, resid) or of its kind there; embedding: a position holding the token. "
        "Counts per kind are small (compute is shared): read a rate as k of n."
        + (" `--alone-only`: no root cause against a reference was run; draws of this seed were not looked at "
           "while the no-reference rules were chosen unless the notes say so." if alone else ""), "",
        "| fault kind (explained / drawn) | named in top 3, alone | top 1 alone"
        + (" |" if alone else " | named in top 3, vs reference | top 1 vs reference | forwards per root cause vs "
           "reference (median) | seconds (median) |"),
        "|---|---|---|" + ("" if alone else "---|---|---|---|"),
    ]

    def row(name, v):
        return f"| {name} | {v['top3']:.0%} | {v['top1']:.0%} |" + ("" if alone else (
            f" {v['top3_ref']:.0%} | {v['top1_ref']:.0%} | {v['forwards']:.0f} | {v['ref_seconds']:.2f} |"))

    for k, v in s["by_kind"].items():
        lines.append(row(f"{k} ({v['n']} / {v['drawn']})", v) if v["n"] else f"| {k} (0 / {v['drawn']}) | no "
                     "fault of this kind moved a token enough |" + (" |" if alone else " | | | | |"))
    lines.append(row(f"**all ({s['n']} / {s['drawn']})**", s))
    ok_ref = all(v["top3_ref"] >= meta["target_ref"] for v in s["by_kind"].values() if v["n"])
    ok_alone = all(v["top3"] >= meta["target_alone"] for v in s["by_kind"].values() if v["n"])
    target_alone = (f"{meta['target_alone']:.0%} alone: {'met' if ok_alone else 'missed'} ({s['top3']:.0%} "
                    "overall)")
    lines += ["", f"Target (every kind): named in the top 3 for >= {target_alone}." if alone else
              f"Targets (every kind): named in the top 3 for >= {meta['target_ref']:.0%} of faults with a "
              f"reference: {'met' if ok_ref else 'missed'} ({s['top3_ref']:.0%} overall); >= {target_alone}. "
              f"One root cause against a reference: median {s['forwards']:.0f} forwards (both models, batched "
              f"forwards counted once), {s['ref_seconds']:.2f} s.", "",
              "| fault | prompt | explained pos (token) | Δ logprob | rank alone | top 3 alone"
              + (" |" if alone else " | rank vs reference | top 3 vs reference | restored by the top row |"),
              "|---|---|---|---|---|---|" + ("" if alone else "---|---|---|")]
    for r in results:
        tok = json.dumps(r["token"])[1:-1].replace("|", "\\|").replace("`", "'")
        if r["symptom"]:
            ranks = f"{r['rank_all'] or '-'} | {'; '.join(_name(t) for t in r['top3'])}" + ("" if alone else (
                f" | {r['rank_ref'] or '-'} | {'; '.join(_name(t) for t in r['top3_ref'])} | "
                f"{'-' if r['restored_top'] is None else format(r['restored_top'], '.2f')}"))
        else:
            ranks = "no symptom: not explained | -" + ("" if alone else " | - | - | -")
        lines.append(f"| {r['case']} | {r['prompt']} | {r['pos']} (`{tok}`) | {r['dlogprob']:.2f} | {ranks} |")
    if meta["notes"]:
        lines += ["", meta["notes"], ""]
    return "\n".join(lines)


def _name(t) -> str:
    kind, layer, head, expert, src = t
    if kind == "token":
        return f"token@{src}"
    if kind == "head":
        return f"L{layer}H{head}"
    if kind == "expert":
        return f"L{layer}E{expert}"
    return kind if layer is None else f"L{layer} {kind}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", "--model", dest="checkpoint", default=str(ROOT / "data" / "demo"),
                    help="a checkpoint folder: ours (default: the bundled demo) or any transformers causal LM")
    ap.add_argument("--tiny", default=None, help="a tiny random transformers family (workbench.capture.tiny) instead")
    ap.add_argument("--kinds", default=",".join(faults.KINDS),
                    help="fault kinds (keys of faults.KINDS; the held-out kinds of faults.HELD_OUT by name)")
    ap.add_argument("--per-kind", type=int, default=3, help="faults with a symptom of each kind")
    ap.add_argument("--max-draws", type=int, default=12, help="faults drawn at most per kind")
    ap.add_argument("--min-effect", type=float, default=0.5,
                    help="nats a fault must move some token's logprob by to be explained")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--prompt-file", default=None,
                    help="draw the faults on this JSONL prompt set instead (every k-th of its prompts, --prompts of "
                         "them, each cut to --prompt-tokens; its own RESULTS section, '..., prompts of FILE')")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--top-layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibration", type=int, default=48,
                    help="prompts a model without a profile is calibrated on (the tiny models; was 8 before 12-03)")
    ap.add_argument("--machine", default="shared 2-core CPU")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared machine more threads mostly wait for each other)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--alone-only", action="store_true",
                    help="skip the root cause against a reference (a quicker look at the no-reference ranking; "
                         "writes its own section, '...: alone only, seed N', unless --no-write)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    tmp_model = None
    if args.tiny:
        from workbench.capture.tiny import make_folder
        tmp_model = tempfile.TemporaryDirectory()
        args.checkpoint = str(make_folder(args.tiny, Path(tmp_model.name) / args.tiny))
    ckpt = Path(args.checkpoint)
    if not ((ckpt / "config.json").exists() or (ckpt / "state.safetensors").exists()) \
            or not any(ckpt.glob("*.safetensors")):
        print(f"root_cause_eval: no trained checkpoint in {ckpt} (config.json + model.safetensors); train it with "
              "`workbench train`, or pass --checkpoint DIR", file=sys.stderr)
        return 1
    unknown = [k for k in args.kinds.split(",") if k and k not in faults.ALL_KINDS]
    if unknown:
        print(f"root_cause_eval: unknown fault kinds {unknown}; known: {list(faults.ALL_KINDS)}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    model, label = load_model(ckpt)
    reference = adapter_for(copy.deepcopy(model.module))  # the known-good model; faults go into `model` only
    # a cache-only kind is no root-cause case: root cause recomputes without the cache (anomaly_eval judges it)
    kinds = [k for k in args.kinds.split(",") if k and faults.ALL_KINDS[k].layers(model)
             and not faults.ALL_KINDS[k].cached_only]
    tok_path = next((p for p in (ckpt / "tokenizer.json", ckpt.parent / "tokenizer.json") if p.exists()), None)
    tok = load_tokenizer(tok_path)
    if args.prompt_file:  # another kind of text than the code the default prompts are
        items = [json.loads(line)["prompt"] for line in Path(args.prompt_file).read_text().splitlines() if line]
        step = max(len(items) // args.prompts, 1)
        prompts = [tok.encode(p).ids[: args.prompt_tokens] for p in items[::step][: args.prompts]]
    else:
        prompts = [tok.encode(p).ids for p in PROMPTS[: args.prompts]]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        db = workbench.Store(Path(tmp) / "eval.duckdb")
        clean = [workbench.record(ids, model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens, db=db)
                 for ids in prompts]
        routing = {i: r.routing() for i, r in enumerate(clean)}
        sha = clean[0].info["checkpoint_sha256"]
        profiled = load_profile(db, sha) is not None
        if not profiled:  # root cause alone compares with the model's profile: calibrate one on other prompts
            calib = [workbench.record(ids, model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens, db=db)
                     for ids in calibration_ids(tok, args.calibration)]
            save_profile(db, sha, build_profile(db, [r.run_id for r in calib]), "root_cause_eval calibration")
        if activations.load(db, sha) is None:  # and the components' activations, on the same other prompts
            activations.save(db, sha, activations.build(model, calibration_ids(tok, args.calibration)),
                             "root_cause_eval calibration")
        for n_kind, kind in enumerate(kinds):
            rng = random.Random(args.seed * 1000 + list(faults.ALL_KINDS).index(kind))
            found, seen = 0, set()
            for k in range(args.max_draws):
                if found == args.per_kind:
                    break
                try:
                    case = draw_case(kind, k, rng, model, routing, prompts)
                    if (case.layer, case.index, case.prompt) in seen:  # the same fault on the same prompt: no news
                        continue
                    seen.add((case.layer, case.index, case.prompt))
                    r = run_case(case, model, reference, tok, prompts[case.prompt], db, args)
                except ValueError as e:  # a kind this model has no such part for (e.g. a rotary layout we cannot scale)
                    print(f"{kind}: not applicable to {model.summary.family}: {e}", flush=True)
                    break
                results.append(r)
                found += r["symptom"]
                ranks = (f"rank alone {r['rank_all'] or '-':>3} vs reference {r['rank_ref'] or '-':>3} "
                         f"({r['ref_forwards']} forwards, {r['ref_seconds']:.1f}s)") if r["symptom"] else "no symptom"
                print(f"{r['case']:<36} pos {r['pos']:>3}  Δ {r['dlogprob']:6.2f}  {ranks}  {r['seconds']:.1f}s",
                      flush=True)
        db.close()
    summary = summarise(results)
    seconds = time.perf_counter() - t_start
    print(json.dumps(summary, indent=1))
    tiny = ckpt / "tiny.json"
    if tiny.exists():  # a folder made by workbench.capture.tiny: say how to make it again, not where it lay
        t = json.loads(tiny.read_text())
        label = f"python -m workbench.capture.tiny {t['family']} DIR --seed {t['seed']}"
    demo = ckpt.resolve() == (ROOT / "data" / "demo").resolve()
    meta = {"checkpoint": "`" + label.replace(str(ROOT) + "/", "") + "`",
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": seconds,
            "machine": f"{args.machine}, {torch.get_num_threads()} torch threads",
            "per_kind": args.per_kind, "seed": args.seed, "top_layers": args.top_layers,
            "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "steps": args.steps,
            "min_effect": args.min_effect, "architecture": model.summary.describe(),
            "section": SECTION if demo else f"{SECTION}: tiny random {model.summary.family}",
            "target_ref": 0.9 if demo else 0.8, "target_alone": 0.7 if demo else 0.8,
            "profile": "the bundled profile" if profiled else f"a profile calibrated on {args.calibration} other prompts",
            "notes": NOTES if demo else TINY_NOTES}
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    if args.prompt_file:  # its own section: faults drawn on another kind of text
        meta["section"] += f", prompts of {Path(args.prompt_file).name}"
    if args.alone_only:
        held = "" if not set(kinds) & set(faults.HELD_OUT) else \
            ", every kind" if set(kinds) & set(faults.KINDS) else ", held-out kinds"
        meta |= {"alone_only": True, "section": f"{meta['section']}: alone only, seed {args.seed}{held}"}
    if not args.no_write:
        write_section(Path(args.out), meta["section"], markdown(summary, results, meta))
        print(f"wrote the root-cause section of {args.out}")
    return 0


NOTES = """How to read it. "vs reference" is activation patching (`workbench.analysis.patching`): each component of
the faulty run taken from the clean model (and the reverse), scored by how exactly the patch gives the clean
logprob back; a layer row (attn_block, mlp_block, resid) ranks after the parts of its layer that explain it.
Cost: 2 capture forwards, then per direction the level-1 rows (3 per layer, embed, unembed, one per source
token; batched) and, inside the 2 best layers, heads, norms, KV latent, shared experts and router (batched),
the rotary part and every routed expert some token reaches (one forward each). "alone" (no reference): the
components' activations against the model's activation profile (`workbench.analysis.activations`: one
teacher-forced forward; a dead shared expert, a skipped layer, a scaled norm, KV channel or residual, a head,
routing that disagrees with the router's logits, a layer rotated otherwise than its clean rotation, an expert
chosen more often than on any clean text, the expert whose own contribution carries an unusual MoE block;
and, where the context begins with one of the 48 tokens the profile holds exactly at position 0 (the
calibration prompts' first tokens and the tokens their lines begin with), every component whose output there
differs from the clean model's: a router row, an output row, an expert chosen there, a dead shared expert, on
a context of one token; a routed expert whose own contribution is unusual where its ablation also moves the
token by a quarter of the top component's; a selection bias far from its layer's other experts'; the output
row of the token that displaced the target), ablation and IG take turns (rootcause module doc); contexts are
judged against calibration prefixes of their own length bucket, down to 2 tokens. The first-position check is
the clean model's own output on a known input (a stored forward of one token): it names weight faults the first
position passes through, and nothing on a run beginning with another token. Also: an expert that outputs
nothing (its own contribution far past anything clean); an unusual MoE block with the one expert of its layer
whose removal moves the token; a layer row ranks beside its most unusual part, near ties the earlier layer
first. Known answers (since 2026-12-03 afternoon): each routed expert, shared expert, dense MLP, router weight and
attention linear map (head by head where its rows or columns are per head) is run on a few fixed inputs and
compared with what the profile holds; a component that answers otherwise is named (60 nats) and caps what is
unusual after it. This names any weight edit of those components (a sign-flipped, swapped or noisy expert, a
pushed or noisy router row, a head's output weights), provided the profile was made from the good weights in the
same dtype; a profile made from the faulty model, or a fault outside the weights (a mixing weight, the cache,
the residual), leaves it to the statistics above. Where it still misses: an expert whose mixing weight is scaled
x4 (weak_expert: 6 of 9 on the demo model over three seeds, 14 of 18 in all); a 2-token context, where one position's statistics are weak and
a rare pair of tokens ranks first; rotary scaling on the tiny DeepSeek-V3 / Qwen2-MoE (2 of 3). The rules were
chosen while looking at this evaluation's misses and at seed 2's (the 2-token bucket, the corroborated expert,
the bias and rival rows, after seeing their misses): read those rates as optimistic; the sections "alone only,
seed 5" and "held-out kinds" are the check. faults.HELD_OUT: expert_noise, router_heat and attn_shift were made
before session 12's rules were tried on them; eight more on 2026-12-03 morning, measured once before any rule
looked at them (demo seed 0, alone, a swap naming its index only: 17 of 23; tiny Mixtral 18 of 24); their misses
then led to the layer-row turns, the earlier-layer tie rule, OWN_ALONE_Z (dead_expert), behind_block
(expert_swap) and the "alone" output row. The last six (weight edits of a head's output columns, the query and
key/value projections, an expert's gate projection, the shared experts' down projection) were written as an
outside check would, after the experts' known answers and before the attention's: 7 of 16 named then on the demo
model (a head's output weights 0 of 6); the attention's known answers came from those misses. Ten more on
2026-12-04 (session 18: an expert loaded with its partner's weights, two router rows exchanged, top-1 routing, a
ternary expert, an attention output or query projection scaled, a noisy dense MLP or shared-expert gate, an outlier
MLP-norm channel, a noisy embedding): 9 of 10 kinds named at first measurement, top-1 routing 0 of 3 (the mixing
weights' exact check came from it). Four more on 2026-12-05 (session 19: a routed scaling factor forgotten, an
expert's gate and up projections exchanged, two tokens' embedding rows exchanged, an outlier attention-norm
channel): 11 of 12 in the top 3 at first measurement, the swapped embedding rows at ranks 3, 6 and 3 (a row of usual
size is invisible to the statistics); the embedding's known answer (every row held, projected) came from that miss.
Read held-out seed 0 as partly tuned too. Counts are small: a rate is k of n."""

TINY_NOTES = """How to read it: as for the demo model (a profile and an activation profile for "alone" calibrated on
`--calibration` prompts the faults are not drawn on: the script's 8, then data/prompts/calibration.jsonl's, each cut at
64 tokens; 8 until 2026-12-03, 48 since, as a user's `workbench profile` set would be)."""


if __name__ == "__main__":
    sys.exit(main())
