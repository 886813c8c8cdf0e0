"""Recompute the model card's numbers on the held-out validation packages (``model/corpus.py``).

What is measured (``evaluate()``), all on the same validation text:

- **bits per byte of the model**: the validation packages' files are tokenized and joined into one
  stream ``[EOT] file1 [EOT] file2 ... [EOT]``, package after package (with ``max_tokens``, the
  first ``max_tokens / packages`` tokens of each package); the stream is cut into non-overlapping windows of ``seq_len``
  (512, the training context) predicted tokens (no stride: a token's context is what precedes it in
  its window, at least its previous token). The summed negative log-likelihood in bits of every
  non-EOT target token, divided by the UTF-8 bytes of those tokens (exactly the bytes of the files'
  text when nothing is capped). EOT targets are separators, not text: they are left out of both the
  bits and the bytes, for every method alike.
- **bits per byte of a token-bigram baseline**: counts of (previous token, token) pairs on the
  training files' tokens, Dirichlet-smoothed toward an add-one unigram:
  ``P(b | a) = (c(a, b) + k * P1(b)) / (c(a) + k)``. ``k`` is chosen on training data only: fitted
  on 9 of every 10 training files, scored on the 10th, best of a fixed grid; then refitted on all.
- **bits per byte of gzip -9**: 8 * len(deflate level 9 of the scored bytes) / len(scored bytes)
  (Python's ``gzip`` module: the same DEFLATE at level 9 as ``gzip -9``).
- **expert load** per MoE layer on the validation windows: the share of routed slots (token x top-k)
  that each expert receives, counted on ``layers.*.ffn.gate.hook_indices``, and the smallest share
  relative to the uniform 1 / n_routed_experts.
- **per package**: the model's and gzip's bits per byte on each validation package alone.
- **gzip on the whole packages** (``gzip_whole``): gzip -9 of each package's whole text, package by
  package. Equal in spirit to the above when nothing is capped; with ``max_tokens`` it is the fair
  reference, because DEFLATE compresses a short slice much worse than it compresses a package (a
  3,000-token slice: 3.1 bits per byte against about 2 for the whole packages).
- **completions**: the greedy 64-token continuation of every ``data/prompts/*.txt`` file (its text
  without trailing whitespace), and whether
  it is Python (``python_measure``): the text (prompt + continuation) is cut after its last complete
  line, then *closed*: an open string gets its closing quote, open brackets their closers, and a
  trailing block opener (a last line ending in ``:``) an indented ``pass``. It **parses** when
  ``ast.parse`` accepts the closed text. Otherwise the measure is how far the continuation gets: the
  longest run of its complete lines that parses when closed the same way (``valid_lines`` of
  ``lines``), and the first error's message and line.
- **sample**: the greedy continuation (48 tokens) of ``def fibonacci(n):``.
"""
from __future__ import annotations

import ast
import gzip
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from .corpus import VALIDATION_PACKAGES, corpus, corpus_files
from .generate import generate
from .model import MoE, Transformer
from .tokenizer import DATA, load_tokenizer
from .train import EOT, encode_files

SAMPLE_PROMPT = "def fibonacci(n):"
PROMPTS = DATA / "prompts"
COMPLETION_TOKENS = 64
CLOSERS = {"(": ")", "[": "]", "{": "}"}
K_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the alphabet the ``ByteLevel`` pre-tokenizer maps bytes to."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tok) -> list[bytes]:
    """The raw bytes each token id stands for (special tokens: ``b""``, they are not text)."""
    dec = _byte_decoder()
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    out = []
    for i in range(tok.get_vocab_size()):
        s = tok.id_to_token(i)
        out.append(b"" if s is None or s in special else bytes(dec[c] for c in s))
    return out


class Bigram:
    """Token-bigram language model, Dirichlet-smoothed toward an add-one unigram (see module docstring)."""

    def __init__(self, ids: torch.Tensor, vocab: int, k: float = 1.0):
        ids = ids.long()
        self.vocab, self.k = vocab, k
        self.pairs = torch.bincount(ids[:-1] * vocab + ids[1:], minlength=vocab * vocab).view(vocab, vocab).float()
        self.ctx = self.pairs.sum(1)  # c(a): how often a is followed by anything
        uni = torch.bincount(ids, minlength=vocab).double()
        self.unigram = ((uni + 1) / (uni.sum() + vocab)).float()

    def nll_bits(self, prev: torch.Tensor, nxt: torch.Tensor, k: float | None = None) -> torch.Tensor:
        """-log2 P(nxt | prev) per pair."""
        k = self.k if k is None else k
        prev, nxt = prev.long(), nxt.long()
        p = (self.pairs[prev, nxt].double() + k * self.unigram[nxt].double()) / (self.ctx[prev].double() + k)
        return -torch.log2(p)

    @classmethod
    def fit(cls, tok, files: list[Path], grid: tuple[float, ...] = K_GRID) -> "Bigram":
        """Pick k on a held-out tenth of ``files`` (every 10th file), then fit on all of them."""
        held = files[9::10]
        rest = [f for i, f in enumerate(files) if i % 10 != 9]
        vocab = tok.get_vocab_size()
        eot = tok.token_to_id(EOT)
        fit_ids, held_raw = encode_files(tok, rest), encode_files(tok, held)
        held_ids = torch.cat([torch.tensor([eot], dtype=held_raw.dtype), held_raw]).long()
        keep = held_ids[1:] != eot
        probe = cls(fit_ids, vocab)
        scores = {k: probe.nll_bits(held_ids[:-1][keep], held_ids[1:][keep], k).mean().item() for k in grid}
        del probe
        best = min(scores, key=scores.get)
        return cls(torch.cat([fit_ids, held_raw]), vocab, k=best)


def close_python(text: str) -> str:
    """``text`` cut after its last complete line and closed (see the module docstring): an open string,
    open brackets, a trailing block opener."""
    text = text[: text.rfind("\n") + 1]
    stack: list[str] = []
    quote = ""  # the open string's delimiter (one or three quote characters); "" outside strings
    last, last_at = "", 0  # the last code character outside strings and comments, and where it is
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote, last, last_at = "", c, i - 1
                continue
            if c == "\n" and len(quote) == 1:
                quote = ""  # a one-line string never spans lines (ast reports it)
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            continue
        elif c in CLOSERS:
            stack.append(CLOSERS[c])
        elif stack and c == stack[-1]:
            stack.pop()
        if not quote and not c.isspace():
            last, last_at = c, i
        i += 1
    out = text + quote + "".join(reversed(stack))
    if not quote and not stack and last == ":":  # a block opener with no body yet
        line = text[text.rfind("\n", 0, last_at) + 1:]
        indent = line[: len(line) - len(line.lstrip())]
        out = out.rstrip("\n") + "\n" + indent + ("\t" if "\t" in indent else "    ") + "pass"
    return out if out.endswith("\n") else out + "\n"


def _syntax_error(text: str) -> SyntaxError | None:
    try:
        ast.parse(close_python(text))
    except SyntaxError as e:
        return e
    except ValueError as e:  # e.g. a NUL byte
        return SyntaxError(str(e))
    return None


def python_measure(prompt: str, continuation: str) -> dict:
    """Whether ``prompt + continuation`` parses once closed, else how many of the continuation's complete
    lines do (the module docstring defines both)."""
    if continuation.startswith("\n"):  # the end of the prompt's last line, no line of the continuation
        prompt, continuation = prompt + "\n", continuation[1:]
    lines = continuation.split("\n")[:-1]  # complete lines only; the last one may be cut mid-token
    if not any(x.strip() and not x.lstrip().startswith("#") for x in lines):
        # nothing but blank or comment lines: that is no Python, although it parses
        return {"parses": False, "lines": len(lines), "valid_lines": 0, "error": "no complete line of code"}
    err = _syntax_error(prompt + continuation)
    valid = len(lines)
    if err is not None:
        valid = next((k for k in range(len(lines) - 1, -1, -1)
                      if _syntax_error(prompt + "".join(x + "\n" for x in lines[:k])) is None), 0)
    return {"parses": err is None, "lines": len(lines), "valid_lines": valid,
            "error": None if err is None else f"{err.msg} (line {err.lineno})"}


def completions(model: Transformer, tok, files: list[Path] | None = None, tokens: int = COMPLETION_TOKENS,
                progress: Callable[[str], None] | None = None) -> list[dict]:
    """Greedy continuations of the prompt files, each with its ``python_measure``."""
    out = []
    files = files if files is not None else sorted(PROMPTS.glob("*.txt"))
    for i, f in enumerate(files):
        if progress:
            progress(f"completing prompt file {i + 1}/{len(files)} ({f.name})")
        # without trailing whitespace: a prompt's final "\n" (or " ") becomes a token of its own, which the
        # tokenizer only ever made before column-0 code, so the model would leave the block it was in
        prompt = f.read_text(encoding="utf-8").rstrip()
        ids = generate(model, tok.encode(prompt).ids, max_new_tokens=tokens, temperature=0.0)
        text = tok.decode(ids)
        out.append({"file": f.name, "prompt": prompt, "continuation": text, "tokens": len(ids),
                    **python_measure(prompt, text)})
    return out


def _windows(stream: torch.Tensor, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping (inputs, targets) windows covering every target of ``stream[1:]``."""
    n = stream.numel() - 1
    return [(stream[s: min(s + seq_len, n)], stream[s + 1: min(s + seq_len, n) + 1]) for s in range(0, n, seq_len)]


def model_nll_bits(model: Transformer, stream: torch.Tensor, seq_len: int = 512, batch: int = 8,
                   on_batch: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Per-target NLL in bits for ``stream[1:]`` and the routed-slot counts per MoE layer (``on_batch(done,
    total)`` after each batch of windows).

    Returns:
        (bits [len(stream) - 1], {layer index: counts [E]}).
    """
    counts: dict[int, torch.Tensor] = {}
    n_experts = model.args.n_routed_experts

    def count(layer: int, idx: torch.Tensor) -> None:
        counts[layer] = counts.get(layer, 0) + torch.bincount(idx.flatten().cpu(), minlength=n_experts)

    device = next(model.parameters()).device
    wins = _windows(stream.long(), seq_len)
    full = [w for w in wins if w[0].numel() == seq_len]
    groups = [full[i: i + batch] for i in range(0, len(full), batch)] + [[w] for w in wins if w[0].numel() < seq_len]
    bits = []
    # plain torch hooks on the gates' hook points: model/ stays free of probes/
    handles = [layer.ffn.gate.hook_indices.register_forward_hook(lambda _m, _a, idx, i=i: count(i, idx))
               for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
    try:
        with torch.inference_mode():
            for done, g in enumerate(groups, 1):
                x = torch.stack([w[0] for w in g]).to(device)
                y = torch.stack([w[1] for w in g]).to(device)
                logits = model(x)
                nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") / math.log(2)
                bits.append(nll.cpu())
                if on_batch:
                    on_batch(done, len(groups))
    finally:
        for h in handles:
            h.remove()
    # groups keep the windows in order (full ones first, then at most one partial at the end)
    return torch.cat(bits), counts


def evaluate(model: Transformer | str | Path | None = None, tokenizer=None, max_tokens: int | None = None,
             seq_len: int = 512, batch: int = 8, sample_tokens: int = 48,
             progress: Callable[[str], None] | None = None,
             on_batch: Callable[[int, int], None] | None = None) -> dict:
    """The model card's numbers on the validation files (see the module docstring for definitions).

    Args:
        model: a loaded ``Transformer``, a checkpoint folder, or None for the bundled demo checkpoint.
        tokenizer: a ``tokenizers.Tokenizer``; default: the checkpoint folder's, else the bundled one.
        max_tokens: score only the first N validation target tokens (None: all of them).
        seq_len: window length in tokens (the training context).
        progress: called with a line naming each step as it starts (``workbench eval`` prints them);
        on_batch: ``model_nll_bits``'s, for the longest step.
    Returns:
        a JSON-ready dict: ``bits_per_byte`` {model, bigram, gzip}, ``expert_load`` (per MoE layer),
        ``sample``, and the counts behind them.
    """
    t0 = time.time()
    say = progress or (lambda _msg: None)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be a positive number of tokens, got {max_tokens}")
    if not isinstance(model, torch.nn.Module):
        say("loading the model")
        folder = Path(model) if model else DEFAULT_CHECKPOINT
        model = load_checkpoint(folder)
        if tokenizer is None and (folder / "tokenizer.json").exists():
            tokenizer = load_tokenizer(folder)
    tok = tokenizer or load_tokenizer()
    if tok.get_vocab_size() != model.args.vocab_size:
        raise ValueError(f"tokenizer vocabulary ({tok.get_vocab_size()}) does not match the model's "
                         f"({model.args.vocab_size})")
    model.eval()
    packages = corpus()
    train_files, val_files = corpus_files(packages)
    val_packages = [p for p in packages if p.split == "validation"]
    if not val_packages:
        raise ValueError("none of the validation packages is installed: " + ", ".join(VALIDATION_PACKAGES))
    eot = tok.token_to_id(EOT)
    say(f"encoding the validation files of {', '.join(p.name for p in val_packages)}")
    per = [encode_files(tok, p.files) for p in val_packages]
    capped = max_tokens is not None and max_tokens < sum(x.numel() for x in per)
    if capped:  # the same share of every package, from its start
        per = [x[: max(1, max_tokens // len(per))] for x in per]
    owner = torch.cat([torch.full((x.numel(),), i) for i, x in enumerate(per)])  # the package of each target
    stream = torch.cat([torch.tensor([eot], dtype=torch.int32), *per]).long()
    prev, target = stream[:-1], stream[1:]
    text = target != eot  # EOT targets are separators, not text: scored by no method

    nbytes = token_bytes(tok)
    scored = b"".join(nbytes[i] for i in target[text].tolist())
    n_bytes = len(scored)

    t_model = time.time()
    say(f"scoring {stream.numel() - 1} tokens with the model")
    bits, counts = model_nll_bits(model, stream, seq_len=seq_len, batch=batch, on_batch=on_batch)
    t_model = time.time() - t_model
    model_bits = bits[text].double().sum().item()

    say(f"fitting the token bigram on {len(train_files)} training files")
    bigram = Bigram.fit(tok, train_files)
    bigram_bits = bigram.nll_bits(prev[text], target[text]).sum().item()
    say("gzip -9 of the same bytes and of the whole packages")
    gzip_bits = 8 * len(gzip.compress(scored, compresslevel=9, mtime=0))
    by_package = []
    for i, p in enumerate(val_packages):
        sel = text & (owner == i)
        raw = b"".join(nbytes[t] for t in target[sel].tolist())
        whole = b"".join(f.read_text(encoding="utf-8", errors="replace").encode() for f in p.files)
        by_package.append({"package": p.name, "version": p.version, "licence": p.licence, "files": len(p.files),
                           "tokens": int(sel.sum()), "bytes": len(raw),
                           "model": bits[sel].double().sum().item() / max(1, len(raw)),
                           "gzip": 8 * len(gzip.compress(raw, compresslevel=9, mtime=0)) / max(1, len(raw)),
                           "whole_bytes": len(whole), "gzip_whole_bits": 8 * len(gzip.compress(whole, 9, mtime=0))})

    uniform = 1 / model.args.n_routed_experts
    load = []
    for layer in sorted(counts):
        c = counts[layer].double()
        share = (c / c.sum()).tolist()
        load.append({"layer": layer, "slots": int(c.sum()), "share": share,
                     "min_share_vs_uniform": min(share) / uniform, "max_share_vs_uniform": max(share) / uniform})

    say(f"greedy sample of {sample_tokens} tokens")
    prompt_ids = tok.encode(SAMPLE_PROMPT).ids
    out_ids = generate(model, prompt_ids, max_new_tokens=sample_tokens, temperature=0.0)
    comps = completions(model, tok, progress=progress)
    n_tok = int(text.sum())
    return {
        "checkpoint": getattr(model, "checkpoint_path", None),
        "validation_packages": [p.name for p in val_packages],
        "validation_files": len(val_files),
        "training_files": len(train_files),
        "tokens_scored": n_tok,
        "bytes_scored": n_bytes,
        "max_tokens": max_tokens,
        "capped": capped,
        "window": seq_len,
        "stride": seq_len,
        "bits_per_byte": {"model": model_bits / n_bytes, "bigram": bigram_bits / n_bytes,
                          "gzip": gzip_bits / n_bytes,
                          "gzip_whole": sum(p["gzip_whole_bits"] for p in by_package)
                          / sum(p["whole_bytes"] for p in by_package)},
        "bits_per_token": {"model": model_bits / n_tok, "bigram": bigram_bits / n_tok},
        "model_vs_gzip": model_bits / gzip_bits,
        "by_package": by_package,
        "bigram_k": bigram.k,
        "expert_load": load,
        "min_share_vs_uniform": min((x["min_share_vs_uniform"] for x in load), default=None),
        "sample": {"prompt": SAMPLE_PROMPT, "continuation": tok.decode(out_ids), "tokens": len(out_ids)},
        "completions": comps,
        "completions_parsing": sum(c["parses"] for c in comps),
        "model_seconds": round(t_model, 1),
        "wall_s": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.model.evaluate [--model PATH] [--max-tokens N]``: print the result as JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    a = ap.parse_args(argv)
    print(json.dumps(evaluate(a.model, max_tokens=a.max_tokens), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
