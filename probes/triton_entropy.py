"""A fused Triton kernel for the attention-row reductions: entropy, max weight and sink weight in one pass.

The plain torch path (``probes.signals.attention_stats``) reads the probabilities three times (xlogy,
amax, the sink column) and materialises ``p * log p``; this kernel streams each row once in blocks of
keys. ``attention_stats`` dispatches here for CUDA tensors when Triton is importable. On a machine
without a GPU the kernel still runs under ``TRITON_INTERPRET=1`` (that is how the tests check it).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = None


if triton is not None:
    @triton.jit
    def _row_stats_kernel(p_ptr, ent_ptr, max_ptr, sink_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = p_ptr + row * stride_row
        ent = tl.zeros([BLOCK], dtype=tl.float32)
        mx = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            safe = tl.where(p > 0, p, 1.0)  # 0 * log 0 = 0
            ent += tl.where(p > 0, -p * tl.log(safe), 0.0)
            mx = tl.maximum(mx, p)
        tl.store(ent_ptr + row, tl.sum(ent, axis=0))
        tl.store(max_ptr + row, tl.max(mx, axis=0))
        tl.store(sink_ptr + row, tl.load(base).to(tl.float32))


def available() -> bool:
    return triton is not None


def row_stats(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy, max, first-column weight) of each row of ``probs`` [..., S], as fp32 [...]."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    shape = probs.shape[:-1]
    rows = probs.reshape(-1, probs.size(-1))
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_rows, n_cols = rows.shape
    ent = torch.empty(n_rows, dtype=torch.float32, device=rows.device)
    mx = torch.empty_like(ent)
    sink = torch.empty_like(ent)
    block = min(1024, triton.next_power_of_2(max(n_cols, 16)))
    _row_stats_kernel[(n_rows,)](rows, ent, mx, sink, n_cols, rows.stride(0), BLOCK=block)
    return ent.view(shape), mx.view(shape), sink.view(shape)
