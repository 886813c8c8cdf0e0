"""The faster recording paths (issue 29) give the values of the paths they replace."""
from __future__ import annotations

import torch
from helpers import tiny_model

from workbench.capture import batched
from workbench.capture import probes as P
from workbench.capture import recorder
from workbench.capture.experts import expert_internals
from workbench.capture.probes import _grouped_internals
from workbench.capture.recorder import RecordSettings, new_run_id, record_batch
from workbench.data.store import Store
from workbench.model import ModelArgs, MoE, save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER


def _moe(seed: int = 0) -> MoE:
    args = ModelArgs.preset("demo")
    torch.manual_seed(seed)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return moe.eval()


def test_grouped_expert_internals_equal_one_call_per_expert():
    moe = _moe()
    x = torch.randn(200, moe.dim)
    idx = torch.randint(0, moe.n_routed_experts, (200, 2))
    idx[3, 1] = -1  # a slot naming no real expert: NaN in both
    want = expert_internals(moe.experts, x, idx)
    got = _grouped_internals(moe.experts, x, idx)
    assert got is not None
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.isnan(g[3, 1]) and torch.isnan(w[3, 1])
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_grouped_expert_internals_follow_edits_and_step_aside_for_hooks():
    moe = _moe(1)
    x = torch.randn(120, moe.dim)
    idx = torch.randint(0, moe.n_routed_experts, (120, 2))
    before = _grouped_internals(moe.experts, x, idx)
    with torch.no_grad():
        moe.experts[int(idx[0, 0])].w2.weight.mul_(3.0)  # an in-place edit (a fault) is seen
    after = _grouped_internals(moe.experts, x, idx)
    torch.testing.assert_close(after[0][0, 0], 3 * before[0][0, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after[0], expert_internals(moe.experts, x, idx)[0], rtol=1e-5, atol=1e-6)
    # one row over 16 experts: padding every expert to one row costs more than two calls; one call per expert
    assert _grouped_internals(moe.experts, x[:1], idx[:1]) is None
    h = moe.experts[0].hook_out.register_forward_hook(lambda _m, _a, out: out * 2)
    try:  # a hooked expert runs as the model runs it: one call per expert
        assert _grouped_internals(moe.experts, x, idx) is None
    finally:
        h.remove()


def test_no_stacked_copy_of_experts_past_the_size_bound(monkeypatch):
    moe = _moe(2)
    x = torch.randn(120, moe.dim)
    idx = torch.randint(0, moe.n_routed_experts, (120, 2))
    weights = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    monkeypatch.setattr(P, "STACKED_BYTES", weights - 1)  # a layer whose experts are larger: one call each
    assert _grouped_internals(moe.experts, x, idx) is None and "_workbench_stacked" not in moe.experts.__dict__
    monkeypatch.setattr(P, "STACKED_BYTES", weights)
    assert _grouped_internals(moe.experts, x, idx) is not None and "_workbench_stacked" in moe.experts.__dict__


def test_a_batch_reduces_its_rows_together(tmp_path, monkeypatch):
    """A batch's rows flush together: one flush of the batch-wide expert_extremes probe over every row (not one
    call per row), and each row's expert_extremes rows are its own (its positions, all its MoE layers)."""
    ckpt = save_checkpoint(tiny_model(vocab_size=4096), tmp_path / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    sizes: list[int] = []
    flush = batched.ExpertExtremesBatch.flush

    def spy(self, rows):
        sizes.append(len(rows))
        return flush(self, rows)
    monkeypatch.setattr(batched.ExpertExtremesBatch, "flush", spy)
    monkeypatch.setattr(recorder, "FLUSH_STEPS", 4)  # due by steps: every row stepped so far flushes
    prompts = ["def add(a, b):", "for i in range(10):\n", "class Point:"]
    db = Store(tmp_path / "b.duckdb")
    run_ids = [new_run_id() for _ in prompts]
    errors = record_batch(prompts, [RecordSettings(max_new_tokens=8)] * 3, model=str(ckpt), db=db, run_ids=run_ids,
                          run_fields=[None] * 3)
    assert errors == [None] * 3
    assert max(sizes) == 3  # the rows' kept steps in one call
    for rid in run_ids:
        got = db.sql("SELECT pos, layer FROM expert_extremes WHERE run_id = ? ORDER BY layer, pos", [rid])
        n = db.sql("SELECT n_tokens FROM runs WHERE run_id = ?", [rid])["n_tokens"][0]
        layers = sorted(set(got["layer"].to_list()))
        assert layers and got.height == len(layers) * (n - 1)  # every fed position once per MoE layer
