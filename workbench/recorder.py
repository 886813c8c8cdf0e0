"""The recorder: runs generation with probes attached and streams each step's signals into the store.

Hooks reduce tensors on the fly (probes/), the recorder turns one step's reductions into polars
frames, and a background ``Writer`` commits them as one transaction per step.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import polars as pl
import torch

from workbench.model import MoE, Transformer, file_sha256, load_checkpoint, load_tokenizer, state_sha256, stream
from workbench.probes import attach
from workbench.probes.signals import (attention_received, attention_stats, kv_token_norms, routing_records,
                            token_confidence)

from .store import Rows, Store, Writer

PROBES = ("tokens", "attention", "routing", "kv", "steps")
MAX_PROMPT_CHARS = 200_000


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])


@dataclass
class _StepBuffers:
    attention: list[dict] = field(default_factory=list)
    single_rows: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (layer, pos, [H, S])
    routing: dict[int, dict] = field(default_factory=lambda: defaultdict(dict))


class Recorder:
    """Hooks for one model; ``collect`` after each step returns that step's frames."""

    def __init__(self, model: Transformer, run_id: str, probes: Iterable[str] = PROBES, topk: int = 5):
        self.model, self.run_id, self.topk = model, run_id, topk
        self.probes = set(probes)
        unknown = self.probes - set(PROBES)
        if unknown:
            raise ValueError(f"unknown probes {sorted(unknown)}; choose from {PROBES}")
        self.buf = _StepBuffers()
        self.received: dict[int, torch.Tensor] = {}
        self.moe_layers = [i for i, l in enumerate(model.layers) if isinstance(l.ffn, MoE)]

    def hooks(self) -> dict[str, Callable]:
        h: dict[str, Callable] = {}
        if "attention" in self.probes or "kv" in self.probes:
            h["layers.*.attn.hook_attn_probs"] = self._on_probs
        if "routing" in self.probes and self.moe_layers:
            h["layers.*.ffn.gate.hook_scores"] = self._keep("scores")
            h["layers.*.ffn.gate.hook_indices"] = self._keep("indices")
            h["layers.*.ffn.gate.hook_weights"] = self._keep("weights")
        return h

    def _on_probs(self, probs: torch.Tensor, name: str, q_start: int, **_) -> None:
        layer = _layer_of(name)
        p = probs[0].detach()  # [Tc, H, S], batch 1
        if "attention" in self.probes:
            if p.size(0) == 1:  # a decode step: reduced for all layers at once in collect (cheaper)
                self.buf.single_rows.append((layer, q_start, p[0]))
            else:
                self.buf.attention.append({"layer": layer, **attention_stats(p, q_start)})
        if "kv" in self.probes:
            cache = self.model.layers[layer].attn.cache  # sized to the cache once: decode steps do not reallocate
            add_received(self.received, layer, attention_received(p), cache.max_len if cache is not None else 1)

    def _keep(self, key: str) -> Callable:
        def fn(t: torch.Tensor, name: str, **_) -> None:
            self.buf.routing[_layer_of(name)][key] = t.detach()
        return fn

    def collect(self, step_index: int, start_pos: int, n_fed: int, tokens_frame: list | None,
                wall_ms: float, final: bool) -> dict:
        rid = self.run_id
        out: dict = {}
        if tokens_frame is not None:
            out["tokens"] = tokens_frame
        # numpy arrays are concatenated first and turned into one frame per table: building many small
        # polars frames per step cost more than a small model's decode step
        if self.buf.single_rows:
            # one query row per layer, same position: one [1, layers*H, S] reduction instead of one per layer
            rows = self.buf.single_rows
            h = rows[0][2].size(0)
            st = attention_stats(torch.cat([r[2] for r in rows])[None], rows[0][1])
            for i, (layer, q, _) in enumerate(rows):
                self.buf.attention.append({"layer": layer, "pos": np.array([q], np.int32),
                                           **{c: st[c][:, i * h:(i + 1) * h] for c in st if c != "pos"}})
        if self.buf.attention:
            out["attention"] = attention_rows(rid, self.buf.attention)
        layers = [(i, d) for i, d in sorted(self.buf.routing.items()) if {"scores", "indices", "weights"} <= d.keys()]
        if layers:
            # all MoE layers in one call: per-layer calls cost more than the reductions themselves
            n, k = layers[0][1]["indices"].shape
            bias = torch.cat([self.model.layers[i].ffn.gate.bias.detach().expand(n, -1) for i, _ in layers])
            r = routing_records(torch.cat([d["indices"] for _, d in layers]), torch.cat([d["weights"] for _, d in layers]),
                                torch.cat([d["scores"] for _, d in layers]), bias)
            pos = np.arange(start_pos, start_pos + n, dtype=np.int32)
            out["routing"] = _frame(rid, {
                "pos": np.tile(np.repeat(pos, k), len(layers)),
                "layer": np.repeat(np.array([i for i, _ in layers], np.int32), n * k), "slot": r["slot"].ravel(),
                "expert": r["expert"].ravel(), "weight": r["weight"].ravel(), "score": r["score"].ravel(),
                "margin": np.repeat(r["margin"], k),
            })
        if "kv" in self.probes:
            rows, tok_frames = [], []
            for i, layer in enumerate(self.model.layers):
                cache = layer.attn.cache
                if cache is None:
                    continue
                rows.append((i, cache.length, cache.length * cache.bytes_per_token()))
                if final or step_index == 0:
                    norms = kv_token_norms(cache.kv[0, : cache.length], cache.pe[0, : cache.length])
                    tok_frames.append(kv_token_cols(i, cache.length, norms, self.received))
            out.update(kv_rows(rid, step_index, rows, tok_frames))
        if "steps" in self.probes:
            out["steps"] = steps_rows(rid, step_index, n_fed, wall_ms)
        self.buf = _StepBuffers()
        return out


def _frame(run_id: str, cols: dict[str, np.ndarray], nan_to_null: tuple[str, ...] = ()) -> Rows:
    """One table's rows from numpy columns; the writer thread makes the frame."""
    return Rows(run_id, cols, nan_to_null=nan_to_null)


# Row builders shared with workbench/hf.py: both recorders store the same tables the same way.

def add_received(received: dict[int, torch.Tensor], layer: int, got: torch.Tensor, size: int = 1) -> None:
    """Add one block's attention-received [S] to a layer's running total (grown to ``size`` or S)."""
    acc = received.get(layer)
    if acc is None or acc.numel() < got.numel():
        grown = torch.zeros(max(got.numel(), size))
        if acc is not None:
            grown[: acc.numel()] = acc
        acc = grown
    acc[: got.numel()] += got
    received[layer] = acc


def attention_rows(run_id: str, recs: list[dict]) -> Rows:
    """``attention`` rows from ``attention_stats`` records, each tagged with its layer."""
    h = recs[0]["entropy"].shape[1]
    return _frame(run_id, {
        "pos": np.concatenate([np.repeat(r["pos"], h) for r in recs]),
        "layer": np.concatenate([np.full(r["entropy"].size, r["layer"], np.int32) for r in recs]),
        "head": np.tile(np.arange(h, dtype=np.int32), sum(r["entropy"].shape[0] for r in recs)),
        **{c: np.concatenate([r[c].ravel() for r in recs])
           for c in ("entropy", "norm_entropy", "max_weight", "sink_weight")},
    }, nan_to_null=("norm_entropy",))


def kv_token_cols(layer: int, n: int, norms: dict[str, np.ndarray], received: dict[int, torch.Tensor]) -> dict:
    """One layer's ``kv_tokens`` columns for its n cached tokens."""
    recv = received.get(layer, torch.zeros(n))
    recv = torch.nn.functional.pad(recv, (0, max(0, n - recv.numel())))[:n]
    return {"layer": np.full(n, layer, np.int32), "pos": np.arange(n, dtype=np.int32), **norms,
            "attn_received": recv.numpy().astype(np.float64)}


def kv_rows(run_id: str, step: int, rows: list[tuple[int, int, int]], tok_cols: list[dict]) -> dict[str, Rows]:
    """``kv`` rows from (layer, cached_tokens, bytes) and ``kv_tokens`` rows from ``kv_token_cols``."""
    out: dict[str, Rows] = {}
    if rows:
        out["kv"] = _frame(run_id, {"step": np.full(len(rows), step, np.int32),
                                    **{c: np.array([r[j] for r in rows], np.int32 if j < 2 else np.int64)
                                       for j, c in enumerate(("layer", "cached_tokens", "bytes"))}})
    if tok_cols:
        cols = {c: np.concatenate([t[c] for t in tok_cols]) for c in tok_cols[0]}
        out["kv_tokens"] = _frame(run_id, {"step": np.full(len(cols["pos"]), step, np.int32), **cols})
    return out


def steps_rows(run_id: str, step: int, n_fed: int, wall_ms: float) -> Rows:
    return _frame(run_id, {"step": np.array([step], np.int32),
                           "kind": np.array(["prefill" if step == 0 else "decode"], dtype=object),
                           "n_tokens": np.array([n_fed], np.int32), "wall_ms": np.array([wall_ms])})


def token_frame(run_id: str, step: int, positions: list[int], token_ids: list[int], texts: list[str],
                is_prompt: list[bool], logits: torch.Tensor | None, k: int) -> pl.DataFrame | Rows:
    """Token rows; ``logits`` [n, V] are the distributions that produced them (None: position 0)."""
    n = len(positions)
    # typed Series built eagerly: a lazy with_columns per decode step costs milliseconds
    series = [pl.Series("run_id", [run_id], pl.String).new_from_index(0, n), pl.Series("pos", positions, pl.Int32),
              pl.Series("step", [step] * n, pl.Int32), pl.Series("token_id", token_ids, pl.Int32),
              pl.Series("text", texts, pl.String), pl.Series("is_prompt", is_prompt, pl.Boolean)]
    schema = {"prob": pl.Float64, "logprob": pl.Float64, "confidence": pl.Float64, "entropy": pl.Float64,
              "rank": pl.Int32, "topk_ids": pl.List(pl.Int32), "topk_probs": pl.List(pl.Float64)}
    if logits is None:
        return pl.DataFrame(series + [pl.Series(c, [None] * n, t) for c, t in schema.items()])
    sig = token_confidence(logits, torch.tensor(token_ids), k)
    # NaN stays NaN (not NULL): the anomaly detectors look for non-finite values
    return Rows(run_id, {
        "pos": np.asarray(positions, np.int32), "step": np.full(n, step, np.int32),
        "token_id": np.asarray(token_ids, np.int32), "text": np.asarray(texts, dtype=object),
        "is_prompt": np.asarray(is_prompt, bool), **{c: sig[c] for c in ("prob", "logprob", "confidence", "entropy")},
        "rank": sig["rank"], "topk_ids": sig["topk_ids"], "topk_probs": sig["topk_probs"],
    }, dtypes={"text": pl.String, "topk_ids": schema["topk_ids"], "topk_probs": schema["topk_probs"]})


def resolve_model(model, dtype: torch.dtype | None = None, device: str = "cpu"):
    """(module, label, sha256) for None (bundled demo), a checkpoint path, or a loaded module."""
    if isinstance(model, (str, Path)):
        from .hf import is_foreign_folder, load_hf
        if is_foreign_folder(model):  # a dense Hugging Face model runs through transformers (workbench/hf.py)
            mod = load_hf(model, dtype=dtype, device=device)
            return mod, str(mod.checkpoint_path), file_sha256(mod.checkpoint_path)
    if model is None or isinstance(model, (str, Path)):
        path = Path(model) if model else None
        mod = load_checkpoint(path, dtype=dtype or torch.float32, device=device)
        return mod, str(mod.checkpoint_path), file_sha256(mod.checkpoint_path)
    if dtype is not None:
        model = model.to(dtype)
    label = getattr(model, "checkpoint_path", None) or type(model).__name__
    sha = file_sha256(label) if getattr(model, "checkpoint_path", None) and dtype is None else _state_sha(model)
    return model, str(label), sha


def _state_sha(model: torch.nn.Module) -> str:
    """``state_sha256``, remembered on the module until a tensor is replaced or changed in place."""
    key = tuple((k, v.data_ptr(), v._version) for k, v in model.state_dict().items())
    cached = getattr(model, "_workbench_sha", None)
    if cached is None or cached[0] != key:
        cached = (key, state_sha256(model))
        model._workbench_sha = cached  # type: ignore[attr-defined]
    return cached[1]


def record(prompt: str | list[int], *, model=None, tokenizer=None, max_new_tokens: int = 64,
           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, db=None, dtype: str | None = None,
           probes: Iterable[str] = PROBES, topk: int = 5, progress: bool = False,
           on_token: Callable[[int, str], None] | None = None, parent_run_id: str | None = None,
           run_id: str | None = None, detect: bool = True):
    """Generate from ``prompt`` with probes attached and store every signal; returns the ``Run``.

    Args:
        prompt: text (encoded with ``tokenizer``) or token ids.
        model: None (bundled demo), a checkpoint folder (ours or Hugging Face DeepseekV3), or a module.
        tokenizer: a ``tokenizers.Tokenizer``, a path, or None (the checkpoint's, else the bundled one).
        db: database path or ``Store`` (default ``$WORKBENCH_DB`` or ``data/workbench.duckdb``).
        dtype: "float32" / "bfloat16" to run the model in that dtype.
        on_token: called as ``on_token(pos, text)`` for each generated token (live streaming).
        detect: run the anomaly detectors once the run completes (``Run.anomalies()`` recomputes on demand).
    """
    from .run import Run

    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("empty prompt: type some text to record")
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt of {len(prompt)} characters is over the {MAX_PROMPT_CHARS} limit")
    store = db if isinstance(db, Store) else Store(db)
    torch_dtype = {None: None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                   "bf16": torch.bfloat16, "float16": torch.float16}[dtype]
    module, label, sha = resolve_model(model, torch_dtype)
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        ckpt = getattr(module, "checkpoint_path", None)
        tok_path = tokenizer or (Path(ckpt) / "tokenizer.json" if ckpt and (Path(ckpt) / "tokenizer.json").exists()
                                 else None)
        tokenizer = load_tokenizer(tok_path)
    ids = list(prompt) if not isinstance(prompt, str) else tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    limit = module.args.max_seq_len
    if len(ids) + max_new_tokens > limit:
        raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                         f"context of {limit} tokens")
    run_id = run_id or "r" + uuid.uuid4().hex[:11]  # never all digits: Hive partitions would read it as BIGINT
    p = next(module.parameters())
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "topk": topk,
              "probes": sorted(set(probes)), "prompt_ids": ids}
    store.append({"runs": pl.DataFrame({
        "run_id": [run_id], "created_at": [datetime.now(timezone.utc).replace(tzinfo=None)], "status": ["running"],
        "model": [label], "config": [json.dumps(module.args.to_dict())], "checkpoint_sha256": [sha],
        "dtype": [str(p.dtype).removeprefix("torch.")], "device": [str(p.device)],
        "prompt": [prompt if isinstance(prompt, str) else tokenizer.decode(ids)], "params": [json.dumps(params)],
        "seed": [seed], "parent_run_id": [parent_run_id], "n_prompt_tokens": [len(ids)], "n_tokens": [len(ids)],
        "pid": [os.getpid()],
    })})
    # a transformers-run model brings its own recorder and stream (workbench/hf.py)
    rec = module.make_recorder(run_id, probes, topk) if hasattr(module, "make_recorder") else \
        Recorder(module, run_id, probes, topk)
    writer = Writer(store)
    eos = tokenizer.token_to_id("<|endoftext|>")
    texts = [tokenizer.decode([i]) for i in ids]
    n_tokens = len(ids)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=max_new_tokens, desc=f"record {run_id}", unit="tok", file=__import__("sys").stderr)
    status, error = "complete", None
    try:
        with attach(module, rec.hooks()):
            it = (module.stream if hasattr(module, "stream") else
                  lambda *a: stream(module, *a))(ids, max_new_tokens, temperature, top_p, seed, eos)
            t0 = time.perf_counter()
            for step in it:
                wall_ms = (time.perf_counter() - t0) * 1e3
                n = len(step.input_ids)
                new_pos = step.start_pos + n
                new_text = tokenizer.decode([step.next_token])
                frames = []
                if step.index == 0 and "tokens" in rec.probes:
                    frames.append(token_frame(run_id, 0, [0], ids[:1], texts[:1], [True], None, topk))
                    if n > 1:
                        frames.append(token_frame(run_id, 0, list(range(1, n)), ids[1:], texts[1:], [True] * (n - 1),
                                                  step.logits[:-1].cpu(), topk))
                if "tokens" in rec.probes:
                    frames.append(token_frame(run_id, step.index, [new_pos], [step.next_token], [new_text], [False],
                                              step.logits[-1:].cpu(), topk))
                final = new_pos + 1 >= len(ids) + max_new_tokens or step.next_token == eos
                batch = rec.collect(step.index, step.start_pos, n, frames or None, wall_ms, final)
                n_tokens = new_pos + 1
                writer.put(batch)
                if on_token:
                    on_token(new_pos, new_text)
                if bar:
                    bar.update(1)
                t0 = time.perf_counter()
    except KeyboardInterrupt:
        status, error = "interrupted", "KeyboardInterrupt"
        raise
    except BaseException as e:
        status, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        if bar:
            bar.close()
        try:
            writer.close()
        finally:
            store.update_run(run_id, status=status, error=error, n_tokens=n_tokens,
                             finished_at=datetime.now(timezone.utc).replace(tzinfo=None))
    run = Run(store, run_id, model=module, tokenizer=tokenizer)
    if detect:
        try:  # the runs table shows anomaly counts; a detector bug must not lose the recording
            run.anomalies()
        except Exception as e:  # noqa: BLE001
            import warnings
            warnings.warn(f"anomaly detection failed for run {run_id}: {e}")
    return run
