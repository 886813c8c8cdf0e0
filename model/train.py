"""Train the bundled demo model from scratch on the Python source installed on this machine.

Corpus (``model/corpus.py``): the running interpreter's standard library plus the pure-Python files
of the installed packages, deduplicated, at most 1.5 MB per package; whole packages are held out
for validation. ``<out>/corpus.json`` lists every source package, its licence and the bytes taken.

Seeded, resumable (state in ``<out>/train_state``, safetensors + JSON, no pickle), with a progress bar
and the loss logged to ``<out>/train_log.jsonl``. The DeepSeek-V3 aux-loss-free rule balances the
experts: after each step, ``bias += rate * sign(mean load - expert load)`` in every MoE layer.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from . import corpus
from .checkpoint import save_checkpoint
from .model import ModelArgs, MoE, Transformer
from .tokenizer import train_tokenizer

EOT = "<|endoftext|>"


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def encode_files(tok, files: list[Path]) -> torch.Tensor:
    """All files tokenized and joined by the end-of-text token, as one int32 stream."""
    eot = torch.tensor([tok.token_to_id(EOT)], dtype=torch.int32)
    parts: list[torch.Tensor] = []
    for i in range(0, len(files), 256):  # in slices: the whole corpus as Python ints would take GBs
        for enc in tok.encode_batch([read_text(f) for f in files[i: i + 256]]):
            parts += [torch.tensor(enc.ids, dtype=torch.int32), eot]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


def balance_update(model: Transformer, loads: dict[int, torch.Tensor], rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3 paper, sec. 2.1.2): nudge the selection bias toward balance."""
    for i, layer in enumerate(model.layers):
        if isinstance(layer.ffn, MoE) and i in loads:
            load = loads[i].float()
            layer.ffn.gate.bias += rate * torch.sign(load.mean() - load)


def _save_state(folder: Path, model: Transformer, opt: torch.optim.Optimizer, step: int, gen: torch.Generator,
                meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, val in opt.state.get(p, {}).items():
                if torch.is_tensor(val):
                    tensors[f"opt.{names[id(p)]}.{key}"] = val.detach().contiguous().reshape(val.shape)
    tensors["rng"] = gen.get_state()
    save_file(tensors, str(folder / "state.safetensors.tmp"))
    os.replace(folder / "state.safetensors.tmp", folder / "state.safetensors")
    (folder / "state.json").write_text(json.dumps({"step": step, **meta}))


def _load_state(folder: Path, model: Transformer, opt: torch.optim.Optimizer, gen: torch.Generator) -> dict:
    tensors = load_file(str(folder / "state.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    params = dict(model.named_parameters())
    for k, v in tensors.items():
        if k.startswith("opt."):
            name, key = k[4:].rsplit(".", 1)
            opt.state[params[name]][key] = v
    gen.set_state(tensors["rng"])
    return json.loads((folder / "state.json").read_text())


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(out: str | Path = "models/demo", preset: str = "demo", steps: int = 1200, batch: int = 8,
          seq_len: int = 512, lr: float = 3e-3, warmup: int = 50, balance_rate: float = 1e-3, seed: int = 0,
          save_every: int = 50, vocab_size: int = 4096, threads: int | None = None,
          progress: bool = True, files: list[Path] | None = None, force: bool = False) -> Path:
    """Train (or resume) and write the checkpoint + tokenizer to ``out``. Returns ``out``.

    ``files`` replaces the stdlib training split (smoke tests train on a few small files). The bundled
    demo folder, or any folder that holds a finished checkpoint (and no training state to resume), is
    refused unless ``force``: a new run would rewrite its tokenizer within seconds.
    """
    from tqdm import tqdm

    from .checkpoint import DEFAULT_CHECKPOINT

    out = Path(out)
    if not force:
        if out.resolve() == DEFAULT_CHECKPOINT.resolve():
            raise ValueError(f"{out} is the bundled demo checkpoint: training would overwrite it; pick another "
                             "--out (default models/demo) or pass --force")
        if (out / "model.safetensors").exists() and not (out / "train_state" / "state.json").exists():
            raise ValueError(f"{out} already holds a finished checkpoint; pick another --out or pass --force")
    if threads:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    state_dir = out / "train_state"
    torch.manual_seed(seed)
    manifest = None
    if files is not None:
        train_files = list(files)
    else:
        packages = corpus.corpus()
        train_files = corpus.corpus_files(packages)[0]
        manifest = [{"package": p.name, "version": p.version, "licence": p.licence, "split": p.split,
                     "files": len(p.files), "bytes": p.bytes, "skipped_generated": p.skipped_generated,
                     "skipped_duplicate": p.skipped_duplicate, "skipped_cap": p.skipped_cap} for p in packages]
    # what the data is: a resumed run must read the same files (installed packages can change in between)
    corpus_id = hashlib.sha1("\n".join(f"{f}:{f.stat().st_size}" for f in train_files).encode()).hexdigest()
    tok_path = out / "tokenizer.json"
    if tok_path.exists() and (state_dir / "state.json").exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer((read_text(f) for f in train_files), vocab_size=vocab_size)
        tok.save(str(tok_path))
    data = encode_files(tok, train_files)
    args = ModelArgs.preset(preset)
    args.vocab_size = tok.get_vocab_size()
    model = Transformer(args).init_weights(seed=seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    start, wall0, tokens_seen = 0, 0.0, 0
    if (state_dir / "state.json").exists():
        meta = _load_state(state_dir, model, opt, gen)
        if meta.get("corpus", corpus_id) != corpus_id:
            raise ValueError(f"{out} was trained on other files than the corpus now gives (packages installed or "
                             "removed since?): resuming would train on other data; train into a new --out")
        start, wall0, tokens_seen = meta["step"], meta["wall_s"], meta["tokens_seen"]
    if manifest is not None:
        (out / "corpus.json").write_text(json.dumps(manifest, indent=1) + "\n")
    loads: dict[int, torch.Tensor] = {}

    def count(i):
        def hook(_m, _a, idx):
            loads[i] = loads.get(i, 0) + torch.bincount(idx.flatten(), minlength=args.n_routed_experts)
        return hook

    handles = [layer.ffn.gate.hook_indices.register_forward_hook(count(i))
               for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
    log = open(out / "train_log.jsonl", "a")
    t0 = time.time()
    model.train()
    bar = tqdm(range(start, steps), initial=start, total=steps, disable=not progress, desc="train")
    for step in bar:
        ix = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([data[i: i + seq_len] for i in ix.tolist()]).long()
        y = torch.stack([data[i + 1: i + seq_len + 1] for i in ix.tolist()]).long()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        loads.clear()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            balance_update(model, loads, balance_rate)
        tokens_seen += x.numel()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        log.write(json.dumps({"step": step + 1, "loss": round(loss.item(), 4), "lr": g["lr"],
                              "tokens": tokens_seen, "wall_s": round(wall0 + time.time() - t0, 1)}) + "\n")
        log.flush()
        if (step + 1) % save_every == 0 or step + 1 == steps:
            _save_state(state_dir, model, opt, step + 1, gen,
                        {"wall_s": wall0 + time.time() - t0, "tokens_seen": tokens_seen, "corpus": corpus_id})
    for h in handles:
        h.remove()
    meta = {"steps": str(steps), "tokens_seen": str(tokens_seen), "seed": str(seed),
            "wall_s": f"{wall0 + time.time() - t0:.0f}", "batch": str(batch), "seq_len": str(seq_len),
            "lr": str(lr), "warmup": str(warmup), "balance_rate": str(balance_rate),
            "threads": str(torch.get_num_threads()), "corpus": corpus_id}
    save_checkpoint(model.eval(), out, extra=meta)
    (out / "train_meta.json").write_text(json.dumps({k: v for k, v in meta.items()}, indent=2) + "\n")
    return out
