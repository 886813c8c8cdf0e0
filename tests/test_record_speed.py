"""The faster recording paths (issue 29) give the values of the paths they replace."""
from __future__ import annotations

import torch

from workbench.capture.experts import expert_internals
from workbench.capture.probes import _grouped_internals
from workbench.model import ModelArgs, MoE


def _moe(seed: int = 0) -> MoE:
    args = ModelArgs.preset("demo")
    torch.manual_seed(seed)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return moe.eval()


def test_grouped_expert_internals_equal_one_call_per_expert():
    moe = _moe()
    x = torch.randn(37, moe.dim)
    idx = torch.randint(0, moe.n_routed_experts, (37, 2))
    idx[3, 1] = -1  # a slot naming no real expert: NaN in both
    want = expert_internals(moe.experts, x, idx)
    got = _grouped_internals(moe.experts, x, idx)
    assert got is not None
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.isnan(g[3, 1]) and torch.isnan(w[3, 1])
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_grouped_expert_internals_follow_edits_and_step_aside_for_hooks():
    moe = _moe(1)
    x = torch.randn(9, moe.dim)
    idx = torch.randint(0, moe.n_routed_experts, (9, 2))
    before = _grouped_internals(moe.experts, x, idx)
    with torch.no_grad():
        moe.experts[int(idx[0, 0])].w2.weight.mul_(3.0)  # an in-place edit (a fault) is seen
    after = _grouped_internals(moe.experts, x, idx)
    torch.testing.assert_close(after[0][0, 0], 3 * before[0][0, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after[0], expert_internals(moe.experts, x, idx)[0], rtol=1e-5, atol=1e-6)
    h = moe.experts[0].hook_out.register_forward_hook(lambda _m, _a, out: out * 2)
    try:  # a hooked expert runs as the model runs it: one call per expert
        assert _grouped_internals(moe.experts, x, idx) is None
    finally:
        h.remove()
