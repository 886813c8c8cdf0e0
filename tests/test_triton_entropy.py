"""The fused Triton row-statistics kernel equals the torch reductions (run under TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
from helpers import run_interpreted

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from workbench.probes.triton_entropy import row_stats
g = torch.Generator().manual_seed(0)
for shape in [(3, 4, 37), (2, 2, 2100)]:  # one block, and several blocks of keys with a ragged tail
    p = torch.rand(shape, generator=g).mul(4).softmax(-1)
    p[..., 5] = 0.0                          # exact zeros: 0 log 0 = 0
    e, m, s = row_stats(p)
    torch.testing.assert_close(e, -torch.special.xlogy(p, p).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m, p.amax(-1))
    torch.testing.assert_close(s, p[..., 0])
    assert (e >= 0).all() and (e <= torch.log(torch.tensor(float(shape[-1]))) + 1e-5).all()
print("ok")
"""


def test_triton_row_stats_match_torch():
    run_interpreted(SCRIPT)
