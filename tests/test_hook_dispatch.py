"""Fewer hook dispatches per decode step (issue 29 point 2): an expert whose output and down projection input are
what its ``hook_out`` hands over (no hook on the expert itself) gives ``expert_out`` both from one tap, no hook
machinery; the rows equal the two-hook path's, and an expert carrying a hook of its own keeps two hooks. The
recorder's seams are taps (``HookPoint.tap``): they see the value after the point's hooks (an intervention's
replacement) and may replace it (root cause's ablations)."""
from __future__ import annotations

import numpy as np
import torch
from helpers import tiny_model

import workbench
from workbench.capture.adapters import native
from workbench.capture.adapters.native import NativeAdapter
from workbench.data.store import Store
from workbench.model import MoE
from workbench.model.model import HookPoint

PROMPT = [5, 17, 101, 3, 3, 250, 42, 9, 77, 18, 200, 64]


def _hooks(moe: MoE) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for e in moe.experts for m in (e, e.w2))


def _taps(moe: MoE) -> int:
    return sum(len(e.hook_out.taps) for e in moe.experts)


def test_a_bare_expert_hands_over_from_one_tap_with_the_same_rows(tmp_path, monkeypatch):
    model = tiny_model()
    moe = next(layer.ffn for layer in model.layers if isinstance(layer.ffn, MoE))
    adapter = NativeAdapter(model)
    with adapter.seams({"expert_out": lambda *a: None}):
        assert (_hooks(moe), _taps(moe)) == (0, len(moe.experts))  # one tap per expert, no hook
    assert _taps(moe) == 0  # removed on exit
    handle = moe.experts[0].register_forward_hook(lambda _m, _a, out: out * 2)
    with adapter.seams({"expert_out": lambda *a: None}):
        assert (_hooks(moe), _taps(moe)) == (3, len(moe.experts) - 1)  # the hooked expert keeps its two
    handle.remove()

    db = Store(tmp_path / "h.duckdb")

    def extremes():
        return workbench.record(PROMPT, model=model, max_new_tokens=6, db=db, detect=False).expert_extremes() \
            .sort("layer", "pos")
    got = extremes()
    monkeypatch.setattr(native, "_bare_expert", lambda _ex: False)
    want = extremes()
    assert got.height == want.height > 0
    for c in ("pos", "layer", "max_out_expert", "max_act_expert"):
        assert got[c].to_list() == want[c].to_list(), c
    for c in ("max_out_norm", "max_act"):
        np.testing.assert_array_equal(got[c].to_numpy(), want[c].to_numpy())


def test_a_tap_sees_the_value_after_the_points_hooks_and_may_replace_it():
    hp, seen = HookPoint(), []
    x = torch.arange(3.0)
    tap = hp.tap(lambda v, info: seen.append((v.clone(), info)))
    assert hp.active and torch.equal(hp(x, q_start=4), x)
    hook = hp.register_forward_hook(lambda _m, _a, out: out + 1)  # an intervention's replacement
    assert torch.equal(hp(x, q_start=5), x + 1)
    double = hp.tap(lambda v, _info: v * 2)  # a replacement (root cause's ablations), after the hooks
    assert torch.equal(hp(x), (x + 1) * 2)
    assert [(v.tolist(), i) for v, i in seen] == [([0.0, 1.0, 2.0], {"q_start": 4}), ([1.0, 2.0, 3.0], {"q_start": 5}),
                                                  ([1.0, 2.0, 3.0], {})]
    for h in (hook, tap, double, tap):  # twice: nothing
        h.remove()
    assert not hp.active and torch.equal(hp(x), x) and len(seen) == 3


def test_a_module_wide_hook_still_sees_every_hook_point():
    hp, calls = HookPoint(), []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, _a, out: calls.append(type(m).__name__))
    try:
        hp(torch.zeros(2))
    finally:
        handle.remove()
    assert calls == ["HookPoint"]
