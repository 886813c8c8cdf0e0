"""Fewer hook dispatches per decode step (issue 29 point 2): an expert whose output is its down projection's own
(no hook on it or its ``hook_out``) hands ``expert_out`` its output and activation from one hook on the down
projection; the rows equal the two-hook path's, and an expert carrying a fault's output hook keeps two hooks."""
from __future__ import annotations

import numpy as np
from helpers import tiny_model

import workbench
from workbench.capture.adapters import native
from workbench.capture.adapters.native import NativeAdapter
from workbench.data.store import Store
from workbench.model import MoE

PROMPT = [5, 17, 101, 3, 3, 250, 42, 9, 77, 18, 200, 64]


def _hooks(moe: MoE) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for e in moe.experts for m in (e, e.w2))


def test_a_bare_expert_hands_over_from_one_hook_with_the_same_rows(tmp_path, monkeypatch):
    model = tiny_model()
    moe = next(layer.ffn for layer in model.layers if isinstance(layer.ffn, MoE))
    adapter = NativeAdapter(model)
    with adapter.seams({"expert_out": lambda *a: None}):
        assert _hooks(moe) == len(moe.experts)  # one per expert
    handle = moe.experts[0].hook_out.register_forward_hook(lambda _m, _a, out: out * 2)
    with adapter.seams({"expert_out": lambda *a: None}):
        assert _hooks(moe) == len(moe.experts) + 1  # the hooked expert keeps its two
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
