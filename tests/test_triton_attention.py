"""The fused Triton attention + entropy forward equals a materialised softmax (run under TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest
from helpers import run_interpreted

pytest.importorskip("triton")


SCRIPT = r"""
import math
import torch
import torch.nn.functional as F
from workbench.probes.triton_attention import attention_with_stats, reference, visible
g = torch.Generator().manual_seed(0)
# (B, H, Hk, T, S, Dqk, Dv, q_start, window, causal, spread, block_m, block_n)
# two batch rows where the batch stride is first met (both key-head layouts); one row where a case is about the
# mask or the blocks (the interpreter's time grows with B x H x blocks)
CASES = [
    (2, 4, 1, 70, 70, 96, 64, 0, None, True, 2.0, None, None),     # MLA-like prefill: Hk=1, Dqk=96 (pad 128), Dv=64
    (2, 4, 2, 37, 150, 32, 32, 113, None, True, 2.0, None, None),  # GQA chunk after a prefix: unmasked middle blocks
    (1, 4, 1, 1, 150, 96, 64, 149, None, True, 2.0, None, None),   # decode: one query at the last position
    (1, 4, 2, 70, 150, 40, 24, 80, 40, True, 2.0, None, None),     # sliding window, key 0 hidden, Dqk/Dv padded
    (1, 4, 2, 70, 70, 40, 24, 0, 20, True, 2.0, 32, 16),           # window from 0: rows with no visible key in a block
    (1, 4, 1, 1, 150, 96, 64, 149, 33, True, 2.0, None, None),     # windowed decode
    (1, 4, 2, 37, 150, 32, 32, 0, None, False, 2.0, 16, 16),       # not causal: ragged key tail only
    (1, 4, 1, 70, 150, 96, 64, 80, None, True, 8.0, 16, 64),       # peaked rows (large scores)
]
for B, H, Hk, T, S, dqk, dv, q0, win, causal, spread, bm, bn in CASES:
    q = torch.randn(B, H, T, dqk, generator=g) * spread
    k = torch.randn(B, Hk, S, dqk, generator=g)
    k[:, :, 0] += q.mean((1, 2))[:, None] / spread  # some weight on the sink
    v = torch.randn(B, Hk, S, dv, generator=g)
    scale = 1 / math.sqrt(dqk)
    o, st = attention_with_stats(q, k, v, scale, q0, win, causal, block_m=bm, block_n=bn)
    ro, rs = reference(q, k, v, scale, q0, win, causal)
    keep = visible(T, S, q0, win, causal)
    # the reference itself against torch's attention with the same mask
    sdpa = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(H // Hk, 1),
                                          v.double().repeat_interleave(H // Hk, 1), attn_mask=keep, scale=scale)
    torch.testing.assert_close(ro, sdpa.float(), atol=1e-5, rtol=1e-5)
    assert o.shape == (B, H, T, dv) and o.dtype == q.dtype
    torch.testing.assert_close(o, ro, atol=1e-4, rtol=1e-4)
    for name in ("entropy", "max_weight", "sink_weight", "lse"):
        assert st[name].shape == (B, H, T) and st[name].dtype == torch.float32, name
        torch.testing.assert_close(st[name], rs[name], atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    n_vis = keep.sum(-1).double()
    assert (st["entropy"] >= 0).all()
    assert (st["entropy"] <= torch.log(n_vis) + 1e-5).all()
    assert (st["sink_weight"] <= st["max_weight"] + 1e-6).all() and (st["max_weight"] <= 1 + 1e-6).all()
    assert ((st["sink_weight"] == 0) == ~keep[:, 0]).all()  # zero exactly where key 0 is hidden
    assert st["entropy"].std() > 0.05, "degenerate case"  # rows differ: the comparison has teeth
print("ok")
"""


def test_triton_attention_matches_materialised_softmax():
    run_interpreted(SCRIPT)


def test_needs_cuda_or_interpreter():
    import torch

    from workbench.probes import triton_attention as ta
    assert ta.available()
    q = torch.zeros(1, 2, 3, 16)
    kv = torch.zeros(1, 1, 3, 16)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError):
            ta.attention_with_stats(q, kv, kv, 0.25)
    with pytest.raises(ValueError):
        ta.attention_with_stats(q, torch.zeros(1, 3, 3, 16), torch.zeros(1, 3, 3, 16), 0.25)  # 3 does not divide 2
