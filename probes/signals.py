"""Probes: pure functions of captured tensors -> small columnar records (dicts of numpy arrays).

No model access, no I/O: each function takes tensors that a hook saw and returns what the store keeps,
so every signal is testable on random tensors. Everything is reduced here, inside the hook, so nothing
O(T^2) outlives a block of attention rows.
"""
from __future__ import annotations

import math

import numpy as np
import torch

ROWS = 256  # logits rows per block in token_confidence


def token_confidence(logits: torch.Tensor, next_ids: torch.Tensor, k: int = 5) -> dict[str, np.ndarray]:
    """Confidence of each produced token under the distribution that produced it.

    Args:
        logits: [T, V] logits; row t is the distribution for the token at t+1.
        next_ids: [T] the tokens actually produced (teacher-forced for the prompt).
        k: number of top alternatives kept.
    Returns: prob, logprob, confidence (max prob), entropy (nats), rank (1 = argmax), topk_ids, topk_probs.
    Non-finite logits give NaN signals and rank -1, never an exception. A long prefill goes in blocks of
    ``ROWS`` rows, so the [T, V] temporaries stay small.
    """
    if logits.size(0) > ROWS:
        parts = [token_confidence(logits[i:i + ROWS], next_ids[i:i + ROWS], k) for i in range(0, logits.size(0), ROWS)]
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)  # [T, V]
    p = logp.exp()
    chosen = logp.gather(1, next_ids.long()[:, None])[:, 0]  # [T]
    # -sum p log p as one dot product (xlogy is several times slower over the vocabulary); a -inf logit (p = 0)
    # adds 0 through the clamp, as xlogy's 0 log 0 = 0; NaN stays NaN
    entropy = -torch.linalg.vecdot(p, logp.clamp(min=torch.finfo(logp.dtype).min))
    finite = torch.isfinite(logits).all(-1)
    rank = (logits > logits.gather(1, next_ids.long()[:, None])).sum(-1) + 1
    rank = torch.where(finite, rank, torch.full_like(rank, -1))
    top_p, top_i = p.topk(min(k, p.size(-1)), dim=-1)  # its first column is the confidence (max prob)
    # one stacked conversion: this runs at every decode step
    conf = top_p[:, 0] if top_p.size(1) else p.amax(-1)  # k = 0: no top-k to read it from
    f = torch.stack([chosen.exp(), chosen, conf, entropy]).numpy().astype(np.float64)
    return {
        "prob": f[0], "logprob": f[1], "confidence": f[2], "entropy": f[3],
        "rank": rank.numpy().astype(np.int32),
        "topk_ids": top_i.numpy().astype(np.int32),
        "topk_probs": top_p.numpy().astype(np.float64),
    }


def attention_stats(probs: torch.Tensor, q_start: int, window: int | None = None) -> dict[str, np.ndarray]:
    """Per query row x head statistics of causal attention probabilities.

    Args:
        probs: [Tc, H, S] attention probabilities of queries q_start..q_start+Tc-1 over S keys: positions
            0..S-1, or, when S is shorter than q_start + Tc (a sliding-window cache holding the newest S), the
            S positions that end at the last query; keys after a query are zero.
        q_start: absolute position of the first query row.
        window: the layer's sliding attention window (None: full causal attention).
    Returns: pos [Tc], entropy / norm_entropy / max_weight / sink_weight [Tc, H]. norm_entropy is
        entropy / log(number of visible keys), NaN where only one key is visible; sink_weight is the weight
        on position 0 (0 once a sliding window has moved past it).
    """
    tc, s = probs.size(0), probs.size(-1)
    pos = np.arange(q_start, q_start + tc, dtype=np.int32)
    return {"pos": pos, **attention_row_stats(probs, pos, max(0, q_start + tc - s), window)}


def reduced_stats(stats: torch.Tensor, n_keys: int, q_start: int, window: int | None = None) -> dict[str, np.ndarray]:
    """``attention_stats`` of a block of query rows a model has reduced itself: ``stats`` [Tc, H, 3] (see
    ``reduced_row_stats``) over ``n_keys`` keys that end at the last query."""
    tc = stats.size(0)
    pos = np.arange(q_start, q_start + tc, dtype=np.int32)
    return {"pos": pos, **reduced_row_stats(stats, pos, max(0, q_start + tc - n_keys), window)}


def attention_row_stats(probs: torch.Tensor, pos, key0=0, window=None) -> dict[str, np.ndarray]:
    """``attention_stats`` for rows that need not be consecutive queries (decode steps batched together).

    Args:
        probs: [N, H, S] each row's probabilities over its keys; keys past a row's own (zero weights, or zero
            padding to a common S) add nothing to any statistic.
        pos: [N] the absolute query position of each row.
        key0: position of each row's key 0 ([N] or one int): > 0 where a sliding-window cache has dropped
            older tokens.
        window: each row's sliding attention window ([N], one int, or None: full causal attention).
    Returns: entropy / norm_entropy / max_weight / sink_weight [N, H].
    """
    if probs.is_cuda and _fused_rows_available():
        from .triton_entropy import row_stats
        entropy, max_weight, sink = row_stats(probs)  # one fused pass over each row
    else:
        probs = probs.float()
        entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [N, H]
        max_weight, sink = probs.amax(-1), probs[..., 0]
    return reduced_row_stats(torch.stack([entropy, max_weight, sink], -1), pos, key0, window)


def reduced_row_stats(stats: torch.Tensor, pos, key0=0, window=None) -> dict[str, np.ndarray]:
    """``attention_row_stats`` of rows a model has reduced itself (the ``attn_stats`` seam).

    Args:
        stats: [N, H, 3] per row and head: entropy (nats), max weight, weight on the row's key 0.
        pos, key0, window: as for ``attention_row_stats``.
    Returns: entropy / norm_entropy / max_weight / sink_weight [N, H].
    """
    stats = stats.float()
    entropy, max_weight, sink = stats[..., 0], stats[..., 1], stats[..., 2]
    dev = entropy.device
    key0 = torch.as_tensor(key0, device=dev).expand(entropy.size(0))[:, None]
    sink = torch.where(key0 > 0, torch.zeros_like(sink), sink)
    n_keys = (torch.as_tensor(pos, device=dev, dtype=torch.float32)[:, None] + 1 - key0)
    if window is not None:
        n_keys = torch.minimum(n_keys, torch.as_tensor(window, device=dev, dtype=torch.float32).expand(
            entropy.size(0))[:, None])
    norm = torch.where(n_keys > 1, entropy / torch.log(n_keys.clamp(min=2)), torch.full_like(entropy, float("nan")))
    # one stacked conversion instead of four: with decode steps batched this runs once per flush
    stats = torch.stack([entropy, norm, max_weight, sink]).cpu().numpy().astype(np.float64)  # [4, N, H]
    return {"entropy": stats[0], "norm_entropy": stats[1], "max_weight": stats[2], "sink_weight": stats[3]}


def _fused_rows_available() -> bool:
    try:
        from .triton_entropy import available
    except Exception:  # noqa: BLE001 - triton missing or broken: the torch path is exact too
        return False
    return available()


def attention_received(probs: torch.Tensor) -> torch.Tensor:
    """Attention each key received from a block of queries, summed over heads and queries. [Tc,H,S] -> [S]."""
    return probs.float().sum(dim=(0, 1))


def routing_records(indices: torch.Tensor, weights: torch.Tensor, scores: torch.Tensor,
                    selection: torch.Tensor) -> dict[str, np.ndarray]:
    """Routing slots of each token, by decreasing gate weight.

    Args:
        indices, weights: [N, K] the experts the router chose and their mixing weights.
        scores: [N, E] raw scores (softmax or sigmoid of the router logits).
        selection: [N, E] what the top-k ranks by, before group limits: scores + selection bias.
    Returns: slot, expert, weight, score [N, K] and margin [N]: the lowest chosen selection score minus
        the best unchosen one, over all experts (negative where group-limited routing overrode a better
        expert).
    """
    order = weights.float().argsort(dim=-1, descending=True)
    idx = indices.long().gather(1, order)
    w = weights.float().gather(1, order)
    sel = selection.float()
    chosen = torch.zeros_like(sel, dtype=torch.bool).scatter_(1, indices.long(), True)
    last_chosen = sel.masked_fill(~chosen, float("inf")).amin(-1)
    best_other = sel.masked_fill(chosen, float("-inf")).amax(-1)
    n, k = idx.shape
    return {
        "slot": np.broadcast_to(np.arange(k, dtype=np.int32), (n, k)).copy(),
        "expert": idx.numpy().astype(np.int32),
        "weight": w.numpy().astype(np.float64),
        "score": scores.float().gather(1, idx).numpy().astype(np.float64),
        "margin": (last_chosen - best_other).numpy().astype(np.float64),
    }


def kv_token_norms(latent: torch.Tensor, rope: torch.Tensor) -> dict[str, np.ndarray]:
    """L2 norms of cached latents [S, C] and rope keys [S, R]."""
    return {
        "latent_norm": latent.float().norm(dim=-1).numpy().astype(np.float64),
        "rope_norm": rope.float().norm(dim=-1).numpy().astype(np.float64),
    }


def entropy_bound(n: int) -> float:
    """Upper bound of a distribution's entropy over n outcomes (nats)."""
    return math.log(n)
