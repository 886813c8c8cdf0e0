"""Row builders: what the probes reduce, as ``Rows`` (numpy columns) of the signal tables."""
from __future__ import annotations

import numpy as np
import polars as pl
import torch

from workbench.data.rows import Rows
from workbench.probes.signals import token_confidence


def add_received(received: dict[int, torch.Tensor], layer: int, got: torch.Tensor, offset: int = 0) -> None:
    """Add one block's attention-received [S] (keys from position ``offset``) to a layer's running total
    by position (grown geometrically)."""
    acc = received.get(layer)
    end = offset + got.numel()
    if acc is None or acc.numel() < end:
        grown = torch.zeros(max(end, 2 * (acc.numel() if acc is not None else 0), 64))
        if acc is not None:
            grown[: acc.numel()] = acc
        acc = grown
    acc[offset:end] += got.float().cpu()
    received[layer] = acc


def attention_rows(run_id: str, recs: list[dict]) -> Rows:
    """``attention`` rows from ``attention_stats`` / ``attention_row_stats`` records: each has pos [N], layer
    (one int or [N]) and the [N, H] statistics."""
    h = recs[0]["entropy"].shape[1]
    return Rows(run_id, {
        "pos": np.concatenate([np.repeat(r["pos"], h) for r in recs]),
        "layer": np.concatenate([np.repeat(np.broadcast_to(np.asarray(r["layer"], np.int32), r["pos"].shape), h)
                                 for r in recs]),
        "head": np.tile(np.arange(h, dtype=np.int32), sum(r["entropy"].shape[0] for r in recs)),
        **{c: np.concatenate([r[c].ravel() for r in recs])
           for c in ("entropy", "norm_entropy", "max_weight", "sink_weight")},
    }, nan_to_null=("norm_entropy",))


def kv_token_cols(layer: int, n: int, norms: dict[str, np.ndarray], received: dict[int, torch.Tensor],
                  first_pos: int = 0) -> dict:
    """One layer's ``kv_tokens`` columns for its n cached tokens (positions first_pos..first_pos+n-1)."""
    recv = received.get(layer, torch.zeros(0))
    recv = torch.nn.functional.pad(recv, (0, max(0, first_pos + n - recv.numel())))[first_pos:first_pos + n]
    return {"layer": np.full(n, layer, np.int32), "pos": np.arange(first_pos, first_pos + n, dtype=np.int32), **norms,
            "attn_received": recv.numpy().astype(np.float64)}


def kv_rows(run_id: str, step, rows: list[tuple[int, int, int]], tok_cols: list[dict]) -> dict[str, Rows]:
    """``kv`` rows from (layer, cached_tokens, bytes) and ``kv_tokens`` rows from ``kv_token_cols``; ``step``
    is one step or each row's step."""
    out: dict[str, Rows] = {}
    if rows:
        out["kv"] = Rows(run_id, {"step": np.broadcast_to(np.asarray(step, np.int32), (len(rows),)).copy(),
                                  **{c: np.array([r[j] for r in rows], np.int32 if j < 2 else np.int64)
                                     for j, c in enumerate(("layer", "cached_tokens", "bytes"))}})
    if tok_cols:
        cols = {c: np.concatenate([t[c] for t in tok_cols]) for c in tok_cols[0]}
        out["kv_tokens"] = Rows(run_id, {"step": np.full(len(cols["pos"]), step, np.int32), **cols})
    return out


def steps_rows(run_id: str, step, n_fed, wall_ms) -> Rows:
    """``steps`` rows of one step (ints and a float) or of several (sequences of them)."""
    step = np.atleast_1d(np.asarray(step, np.int32))
    return Rows(run_id, {"step": step, "kind": np.where(step == 0, "prefill", "decode").astype(object),
                         "n_tokens": np.atleast_1d(np.asarray(n_fed, np.int32)),
                         "wall_ms": np.atleast_1d(np.asarray(wall_ms, np.float64))})


def token_frame(run_id: str, step, positions: list[int], token_ids: list[int], texts: list[str],
                is_prompt: list[bool], logits: torch.Tensor | None, k: int, sig: dict | None = None) -> pl.DataFrame | Rows:
    """Token rows; ``logits`` [n, V] are the distributions that produced them (None: position 0); ``step``
    is one step or each row's step; ``sig``: their ``token_confidence`` computed already (several runs' rows in one
    call), instead of from ``logits``."""
    n = len(positions)
    schema = {"prob": pl.Float64, "logprob": pl.Float64, "confidence": pl.Float64, "entropy": pl.Float64,
              "rank": pl.Int32, "topk_ids": pl.List(pl.Int32), "topk_probs": pl.List(pl.Float64)}
    if logits is None and sig is None:
        # typed Series built eagerly: a lazy with_columns per decode step costs milliseconds
        series = [pl.Series("run_id", [run_id], pl.String).new_from_index(0, n), pl.Series("pos", positions, pl.Int32),
                  pl.Series("step", [step] * n, pl.Int32), pl.Series("token_id", token_ids, pl.Int32),
                  pl.Series("text", texts, pl.String), pl.Series("is_prompt", is_prompt, pl.Boolean)]
        return pl.DataFrame(series + [pl.Series(c, [None] * n, t) for c, t in schema.items()])
    if sig is None:
        sig = token_confidence(logits, torch.tensor(token_ids), k)
    # NaN stays NaN (not NULL): the anomaly detectors look for non-finite values
    return Rows(run_id, {
        "pos": np.asarray(positions, np.int32), "step": np.broadcast_to(np.asarray(step, np.int32), (n,)).copy(),
        "token_id": np.asarray(token_ids, np.int32), "text": np.asarray(texts, dtype=object),
        "is_prompt": np.asarray(is_prompt, bool), **{c: sig[c] for c in ("prob", "logprob", "confidence", "entropy")},
        "rank": sig["rank"], "topk_ids": sig["topk_ids"], "topk_probs": sig["topk_probs"],
    }, dtypes={"text": pl.String, "topk_ids": schema["topk_ids"], "topk_probs": schema["topk_probs"]})
