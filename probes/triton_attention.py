"""A fused Triton attention forward that also returns each query row's entropy, max, sink weight and lse.

The observed attention path (``probes.signals``) materialises the probability matrix [B, H, T, S] to reduce
it; at 8K-32K tokens that matrix is what makes recording a prefill impossible. This kernel is a
FlashAttention-2 style forward (one program per block of ``BLOCK_M`` queries of one head, keys streamed in
blocks of ``BLOCK_N``, online softmax, fp32 accumulators, O(L) memory) that keeps, per query row, besides the
output accumulator:

- ``m``: the running max of the scaled scores ``s = scale * q.k``,
- ``l``: the running sum of ``exp(s - m)``,
- ``a``: the running sum of ``exp(s - m) * (s - m)``.

When a block raises the max from ``m_old`` to ``m_new``, ``l`` is rescaled by ``alpha = exp(m_old - m_new)``
and ``a`` becomes ``alpha * (a + (m_old - m_new) * l)`` (the shift of every earlier term). At the end
``lse = m + log l``, ``entropy = log l - a / l`` (= ``lse - E_p[s]``; keeping ``a`` relative to ``m`` instead of
summing ``p * s`` avoids the cancellation of two large numbers when scores are large), ``max_weight = 1 / l``
(the max key has weight ``exp(m - lse)``), and ``sink_weight = exp(s_0 - lse)`` from one extra dot product per
row with key 0 (zero when a sliding window hides key 0). Internally scores are kept in log2 units
(``exp2``, as FlashAttention does); the outputs are in nats.

Layout: q [B, H, T, Dqk], k [B, Hk, S, Dqk], v [B, Hk, S, Dv] with Hk dividing H (query head h reads key
head ``h // (H // Hk)``: MHA, GQA, MQA, and the MLA latent case Hk = 1 where Dqk = kv_lora_rank + rope dim
and Dv differs). Head dims that are not powers of two are padded to the next one with masked loads.
Causal masking is relative to ``q_start``: query i sits at absolute position ``q_start + i``, keys at 0..S-1,
and a query at position p sees keys <= p (and > p - window with a sliding window). Each program walks only
the key blocks its queries can see, in three runs: a masked head (window edge), an unmasked middle, and a
masked tail (diagonal and the ragged end of the keys); a row with no visible key in a block is guarded so
that ``-inf - -inf`` never occurs. Query blocks are scheduled latest first (they have the most keys).

fp16/bf16 inputs use tensor cores (p is cast to v's dtype for the PV product, as FlashAttention does); fp32
inputs use exact fp32 dots (``input_precision="ieee"``, not tf32). Under the interpreter, bf16 inputs are
computed in fp32 (the interpreter's bf16 ``tl.dot`` is wrong), so bf16 kernel arithmetic is only exercised on
a GPU. ``reference`` is the same computation in
plain torch with a materialised softmax (float64), for tests and benchmarks. On a machine without a GPU the
kernel still runs under ``TRITON_INTERPRET=1`` (that is how the tests check it); ``benchmarks/gpu.py``
measures it against ``scaled_dot_product_attention`` on CUDA.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = None

STATS = ("entropy", "max_weight", "sink_weight", "lse")


if triton is not None:
    @triton.jit
    def _attend_blocks(acc, m_i, l_i, a_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       pos, lo, hi, S, window, qk_scale,
                       MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr):
        """Fold key blocks [lo, hi) into the accumulators; MASKED applies the causal/window/length mask."""
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_dk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_dk[:, None] * stride_kd
            if MASKED:  # keys past S (only here: the unmasked run lies inside [0, S))
                k = tl.load(k_ptrs, mask=(offs_dk[:, None] < DQK) & (offs_n[None, :] < S), other=0.0)
            elif DQK != BLOCK_DQK:  # padded head dim
                k = tl.load(k_ptrs, mask=offs_dk[:, None] < DQK, other=0.0)
            else:
                k = tl.load(k_ptrs)
            s = tl.dot(q, k, input_precision=PREC) * qk_scale  # log2 units
            if MASKED:
                keep = offs_n[None, :] < S
                if CAUSAL:
                    keep = keep & (offs_n[None, :] <= pos[:, None])
                if HAS_WINDOW:
                    keep = keep & (offs_n[None, :] > pos[:, None] - window)
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if MASKED:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            else:
                m_use = m_new
            x = s - m_use[:, None]
            p = tl.math.exp2(x)
            if MASKED:
                px = p * tl.where(keep, x, 0.0)  # never 0 * -inf
            else:
                px = p * x
            alpha = tl.math.exp2(m_i - m_use)
            shift = tl.where(l_i > 0, m_i - m_use, 0.0) * l_i  # l_i = 0 while m_i = -inf
            a_i = alpha * (a_i + shift) + tl.sum(px, 1)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
            if MASKED:
                v = tl.load(v_ptrs, mask=(offs_n[:, None] < S) & (offs_dv[None, :] < DV), other=0.0)
            elif DV != BLOCK_DV:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                v = tl.load(v_ptrs)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        return acc, m_i, l_i, a_i

    @triton.jit
    def _attn_fwd_kernel(Q, K, V, O, LSE, ENT, MAXW, SINK,
                         stride_qb, stride_qh, stride_qt, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_ob, stride_oh, stride_ot, stride_od,
                         H, T, S, GROUP, q_start, window, qk_scale,
                         CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
                         BLOCK_DV: tl.constexpr, PREC: tl.constexpr):
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # latest queries (most keys) first
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        hk = h // GROUP
        q_base = Q + b * stride_qb + h * stride_qh
        k_base = K + b * stride_kb + hk * stride_kh
        v_base = V + b * stride_vb + hk * stride_vh

        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_dk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        pos = q_start + offs_m
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_dk[None, :] * stride_qd,
                    mask=(offs_m[:, None] < T) & (offs_dk[None, :] < DQK), other=0.0)

        # the sink: one dot product with key 0 per row (before the loops: fewer live registers)
        k0 = tl.load(k_base + offs_dk * stride_kd, mask=offs_dk < DQK, other=0.0).to(tl.float32)
        s0 = tl.sum(q.to(tl.float32) * k0[None, :], 1) * qk_scale

        # key ranges: [lo, mid_lo) masked, [mid_lo, mid_hi) visible to every row, [mid_hi, hi) masked
        first_pos = q_start + start_m * BLOCK_M
        last_pos = q_start + tl.minimum(start_m * BLOCK_M + BLOCK_M, T) - 1
        if CAUSAL:
            hi = tl.minimum(S, last_pos + 1)
            full_hi = (tl.minimum(S, first_pos + 1) // BLOCK_N) * BLOCK_N
        else:
            hi = S
            full_hi = (S // BLOCK_N) * BLOCK_N
        if HAS_WINDOW:
            lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
            mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        else:
            lo = 0
            mid_lo = 0
        mid_hi = tl.maximum(mid_lo, tl.minimum(full_hi, hi))

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        a_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        acc, m_i, l_i, a_i = _attend_blocks(acc, m_i, l_i, a_i, q, k_base, v_base, stride_kn, stride_kd,
                                            stride_vn, stride_vd, pos, lo, mid_lo, S, window, qk_scale,
                                            True, CAUSAL, HAS_WINDOW, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, PREC)
        acc, m_i, l_i, a_i = _attend_blocks(acc, m_i, l_i, a_i, q, k_base, v_base, stride_kn, stride_kd,
                                            stride_vn, stride_vd, pos, mid_lo, mid_hi, S, window, qk_scale,
                                            False, CAUSAL, HAS_WINDOW, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, PREC)
        acc, m_i, l_i, a_i = _attend_blocks(acc, m_i, l_i, a_i, q, k_base, v_base, stride_kn, stride_kd,
                                            stride_vn, stride_vd, pos, mid_hi, hi, S, window, qk_scale,
                                            True, CAUSAL, HAS_WINDOW, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, PREC)

        l_safe = tl.where(l_i > 0, l_i, 1.0)  # only padding rows (never stored) can have l = 0
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        log2_l = tl.math.log2(l_safe)
        lse = (m_use + log2_l) * 0.6931471805599453  # ln 2: back to nats
        ent = tl.maximum((log2_l - a_i / l_safe) * 0.6931471805599453, 0.0)  # >= 0 up to rounding
        max_w = 1.0 / l_safe
        sink = tl.math.exp2(tl.minimum(s0 - m_use, 0.0)) / l_safe
        if HAS_WINDOW:
            sink = tl.where(pos - window < 0, sink, 0.0)

        row_ok = offs_m < T
        o = acc / l_safe[:, None]
        o_base = O + b * stride_ob + h * stride_oh
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_dv[None, :] * stride_od, o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        stat = bh.to(tl.int64) * T + offs_m
        tl.store(LSE + stat, lse, mask=row_ok)
        tl.store(ENT + stat, ent, mask=row_ok)
        tl.store(MAXW + stat, max_w, mask=row_ok)
        tl.store(SINK + stat, sink, mask=row_ok)

    @triton.jit
    def _received_kernel(Q, K, LSE, REC,
                         stride_qb, stride_qh, stride_qt, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         H, T, S, GROUP, q_start, window, qk_scale,
                         CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DQK: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, PREC: tl.constexpr):
        """REC[b, h, key] = sum over query rows of exp(s - lse): one program per block of BLOCK_N keys of one
        head, query blocks streamed (only those that can see a key of the block), lse from the forward."""
        start_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        hk = h // GROUP
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_dk = tl.arange(0, BLOCK_DQK)
        k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[None, :] * stride_kn + offs_dk[:, None] * stride_kd,
                    mask=(offs_dk[:, None] < DQK) & (offs_n[None, :] < S), other=0.0)  # [D, BLOCK_N]
        q_base = Q + b * stride_qb + h * stride_qh
        lo = 0
        if CAUSAL:  # rows before the block's first key see none of it
            lo = (tl.maximum(start_n * BLOCK_N - q_start, 0) // BLOCK_M) * BLOCK_M
        hi = T
        if HAS_WINDOW:  # rows at or past the block's last key + window see none of it
            hi = tl.minimum(T, tl.maximum(start_n * BLOCK_N + BLOCK_N - 1 + window - q_start, 0))
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        offs_m0 = tl.arange(0, BLOCK_M)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            row_ok = offs_m < T
            q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_dk[None, :] * stride_qd,
                        mask=row_ok[:, None] & (offs_dk[None, :] < DQK), other=0.0)
            lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
            s = tl.dot(q, k, input_precision=PREC) * qk_scale - lse[:, None]  # log2 units
            pos = q_start + offs_m
            keep = row_ok[:, None] & (offs_n[None, :] < S)
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                keep = keep & (offs_n[None, :] > pos[:, None] - window)
            p = tl.where(keep, tl.math.exp2(tl.where(keep, s, 0.0)), 0.0)
            acc += tl.sum(p, 0)
        tl.store(REC + bh.to(tl.int64) * S + offs_n, acc, mask=offs_n < S)


def available() -> bool:
    return triton is not None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, T, D], [B, Hk, S, D], [B, Hk, S, Dv]")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key heads do not divide {q.shape[1]} query heads")
    if k.shape[2] < 1:
        raise ValueError("no keys")
    if window is not None and (window < 1 or not causal):
        raise ValueError("a sliding window needs causal=True and window >= 1")


def _config(on_gpu: bool, block_d: int, fp32: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a padded head dim ``block_d``.

    Chosen from ptxas register/spill reports for sm_90 (bf16: no or 8-byte spills up to 256 dims);
    ``benchmarks/gpu.py`` times a few alternatives on the device.
    """
    if not on_gpu:  # the interpreter: small blocks, so that tests cross several of them
        return 32, 32, 1, 1
    if fp32:  # exact fp32 dots (no tensor cores): smaller tiles
        return (64, 32, 8, 2) if block_d <= 128 else (32, 16, 8, 2)
    if block_d <= 128:
        return 128, 64, 8, 3
    if block_d <= 256:
        return 64, 32, 4, 2
    return 64, 16, 8, 1  # MLA absorbed (576/512): spills ~2 KB; tiling Dv would do better


def attention_with_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int = 0,
                         window: int | None = None, causal: bool = True, *, block_m: int | None = None,
                         block_n: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """softmax(scale * q k^T + mask) v as [B, H, T, Dv] in q's dtype, and fp32 [B, H, T] row statistics.

    ``stats``: ``entropy`` (nats), ``max_weight``, ``sink_weight`` (weight of key 0) and ``lse`` (natural
    log of the softmax denominator of the scaled scores). The block sizes and launch options default to a
    choice by head dim (see ``_config``).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check(q, k, v, window, causal)
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("attention_with_stats needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    B, H, T, dqk = q.shape
    hk, S, dv = k.shape[1], k.shape[2], v.shape[-1]
    o = torch.empty((B, H, T, dv), dtype=q.dtype, device=q.device)
    if not q.is_cuda and torch.bfloat16 in (q.dtype, k.dtype, v.dtype):
        # the interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584): compute in fp32
        o32, stats = attention_with_stats(q.float(), k.float(), v.float(), scale, q_start, window, causal,
                                          block_m=block_m, block_n=block_n)
        return o.copy_(o32), stats
    stats = {name: torch.empty((B, H, T), dtype=torch.float32, device=q.device) for name in STATS}
    if T == 0 or B * H == 0:
        return o, stats
    block_dqk = max(16, triton.next_power_of_2(dqk))
    block_dv = max(16, triton.next_power_of_2(dv))
    bm, bn, warps, stages = _config(q.is_cuda, max(block_dqk, block_dv), q.dtype == torch.float32)
    bm, bn = block_m or bm, block_n or bn
    warps, stages = num_warps or warps, num_stages or stages
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(T, bm), B * H)
    _attn_fwd_kernel[grid](
        q, k, v, o, stats["lse"], stats["entropy"], stats["max_weight"], stats["sink_weight"],
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, T, S, H // hk, int(q_start), int(window or 0), float(scale) * math.log2(math.e),
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, DQK=dqk, DV=dv, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DQK=block_dqk, BLOCK_DV=block_dv, PREC=prec, num_warps=warps, num_stages=stages)
    return o, stats


def received_attention(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float, q_start: int = 0,
                       window: int | None = None, causal: bool = True, *, block_m: int | None = None,
                       block_n: int | None = None) -> torch.Tensor:
    """fp32 [B, H, S]: the attention each key received, summed over the query rows of each head: the column sums
    of the softmax that ``attention_with_stats`` computed, from its ``lse`` (a second pass over the scores, as a
    FlashAttention backward recomputes them)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check(q, k, k, window, causal)
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("received_attention needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if not q.is_cuda and torch.bfloat16 in (q.dtype, k.dtype):  # the interpreter's bf16 tl.dot: see above
        q, k = q.float(), k.float()
    B, H, T, dqk = q.shape
    hk, S = k.shape[1], k.shape[2]
    rec = torch.zeros((B, H, S), dtype=torch.float32, device=q.device)
    if T == 0 or B * H == 0:
        return rec
    block_dqk = max(16, triton.next_power_of_2(dqk))
    bm, bn, warps, stages = _config(q.is_cuda, block_dqk, q.dtype == torch.float32)
    bm, bn = block_m or bm, block_n or bn
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(S, bn), B * H)
    _received_kernel[grid](
        q, k, lse.contiguous(), rec, *q.stride(), *k.stride(),
        H, T, S, H // hk, int(q_start), int(window or 0), float(scale) * math.log2(math.e),
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, DQK=dqk, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DQK=block_dqk, PREC=prec, num_warps=warps, num_stages=stages)
    return rec


def mla_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int = 0):
    """What ``MLA.stats_kernel`` returns for one block of query rows, in the model's layout: q [B, T, H, Dqk],
    k [B, S, H, Dqk], v [B, S, H, Dv] -> output [B, T, H, Dv], stats [B, T, H, 3] (entropy, max weight, sink
    weight) and received [B, S] (attention on each key summed over the block's rows and heads). Causal, no
    window; no autograd (the model calls it only without gradients)."""
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    o, st = attention_with_stats(qh, kh, vh, scale, q_start)
    rec = received_attention(qh, kh, st["lse"], scale, q_start)
    stats = torch.stack([st["entropy"], st["max_weight"], st["sink_weight"]], -1).transpose(1, 2)
    return o.transpose(1, 2), stats, rec.sum(1)


def visible(T: int, S: int, q_start: int = 0, window: int | None = None, causal: bool = True,
            device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [T, S]: which keys each query sees (query i at position q_start + i)."""
    pos = q_start + torch.arange(T, device=device)[:, None]
    key = torch.arange(S, device=device)[None, :]
    keep = key <= pos if causal else torch.ones(T, S, dtype=torch.bool, device=device)
    if window is not None:
        keep = keep & (key > pos - window)
    return keep


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int = 0,
              window: int | None = None, causal: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``attention_with_stats`` in plain torch: the softmax materialised, in float64."""
    _check(q, k, v, window, causal)
    group = q.shape[1] // k.shape[1]
    kf = k.double().repeat_interleave(group, 1)
    vf = v.double().repeat_interleave(group, 1)
    s = torch.matmul(q.double(), kf.transpose(-1, -2)) * scale
    keep = visible(q.shape[2], k.shape[2], q_start, window, causal, q.device)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    o = torch.matmul(p, vf)
    stats = {"entropy": -torch.special.xlogy(p, p).sum(-1), "max_weight": p.amax(-1), "sink_weight": p[..., 0],
             "lse": lse}
    return o.to(q.dtype), {name: t.float() for name, t in stats.items()}
