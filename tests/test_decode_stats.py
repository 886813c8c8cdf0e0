"""The decode step of MLA's reduced-statistics path (what ``hook_attn_stats`` hands over while a recording listens):
the plain decode's matmuls and softmax, its statistics against an explicit float64 softmax, and its output equal to
the plain decode's (issue 29: a recorded decode step costs few operations more than a plain one)."""
from __future__ import annotations

import dataclasses

import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.capture.adapters.native import NativeAdapter
from workbench.model.model import MLA, ModelArgs


@pytest.mark.parametrize("s", [1, 2, 60])
def test_a_decode_step_hands_the_explicit_softmax_statistics_and_the_plain_output(s):
    torch.manual_seed(0)
    a = MLA(dataclasses.replace(ModelArgs.preset("tiny"))).eval()
    h, c, r = a.n_heads, a.kv_lora_rank, a.qk_rope_head_dim
    g = torch.Generator().manual_seed(3)
    q_abs, q_pe = torch.randn(2, 1, h, c, generator=g) * 2, torch.randn(2, 1, h, r, generator=g)
    kv, k_pe = torch.randn(2, s, c, generator=g), torch.randn(2, s, r, generator=g)
    seen = []
    a.hook_attn_stats.register_forward_hook(lambda _m, _a, kw, out: seen.append((out, kw)), with_kwargs=True)
    with torch.no_grad():
        got = a._attend_stats(q_abs, q_pe, kv, k_pe, s - 1)
        plain = a._attend_fused(q_abs, q_pe, kv, k_pe, s - 1)
    assert torch.equal(got, plain)  # the recorded decode computes the plain decode's output
    sc = (torch.einsum("bthc,bsc->bths", q_abs.double(), kv.double())
          + torch.einsum("bthr,bsr->bths", q_pe.double(), k_pe.double())) * a.softmax_scale
    p = sc.softmax(-1)  # [B, 1, H, S]
    want = torch.stack([-torch.special.xlogy(p, p).sum(-1), p.amax(-1), p[..., 0]], -1)
    (stats, kw), = seen
    assert stats.shape == (2, 1, h, 3) and kw["q_start"] == s - 1
    torch.testing.assert_close(stats.double(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kw["received"].double(), p.sum((1, 2)), atol=1e-5, rtol=1e-5)


def test_a_decode_step_under_autograd_keeps_the_plain_gradient():
    torch.manual_seed(1)
    a = MLA(dataclasses.replace(ModelArgs.preset("tiny"))).eval()
    h, c, r = a.n_heads, a.kv_lora_rank, a.qk_rope_head_dim
    q_abs = torch.randn(1, 1, h, c, requires_grad=True)
    q_pe, kv, k_pe = torch.randn(1, 1, h, r), torch.randn(1, 9, c), torch.randn(1, 9, r)
    a.hook_attn_stats.register_forward_hook(lambda *_: None, with_kwargs=True)
    g1, = torch.autograd.grad(a._attend_stats(q_abs, q_pe, kv, k_pe, 8).sum(), q_abs)
    g2, = torch.autograd.grad(a._attend_fused(q_abs, q_pe, kv, k_pe, 8).sum(), q_abs)
    torch.testing.assert_close(g1, g2)


def test_a_recording_keeps_decode_rows_and_stores_what_the_reduced_path_stores(tmp_path, monkeypatch):
    """With the ``attn_row`` seam a decode step hands its probabilities (no ``hook_attn_stats`` call, no reduction
    in the step) and the flush reduces them: the attention and KV tables equal those of the reduced decode path."""
    model = tiny_model()
    db = tmp_path / "w.duckdb"
    prompt = [5, 17, 101, 3, 3, 250, 42, 9]

    def tables(row_seam: bool) -> tuple[pl.DataFrame, pl.DataFrame, list]:
        monkeypatch.setattr(NativeAdapter, "row_seam", row_seam)
        stats_rows = []
        hooks = [layer.attn.hook_attn_stats.register_forward_hook(
            lambda _m, _a, out: stats_rows.append(out.size(1))) for layer in model.layers]
        try:
            run = workbench.record(prompt, model=model, max_new_tokens=6, db=db, detect=False)
        finally:
            for h in hooks:
                h.remove()
        return (run.signal("attention").sort("pos", "layer", "head"),
                run.signal("kv_tokens").sort("step", "layer", "pos"), stats_rows)

    att0, kv0, rows0 = tables(False)
    att1, kv1, rows1 = tables(True)
    assert 1 in rows0 and set(rows1) == {len(prompt)}  # only the prefill block is reduced in the model
    assert att0.height == att1.height > 0 and kv0.height == kv1.height > 0
    for a, b in ((att0, att1), (kv0, kv1)):
        for c in a.columns:
            if a[c].dtype == pl.Float64:
                torch.testing.assert_close(torch.tensor(b[c].fill_null(-1.0).to_numpy()),
                                           torch.tensor(a[c].fill_null(-1.0).to_numpy()), atol=2e-5, rtol=1e-4)
            elif c != "run_id":
                assert a[c].to_list() == b[c].to_list(), c
