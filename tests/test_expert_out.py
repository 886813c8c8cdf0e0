"""expert_extremes read inside the model's own expert calls (the native adapter's ``expert_out`` seam, issue 29):
the same rows as running the chosen experts again, nothing run again, under a fault too, and in a batch."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import polars as pl
import torch
from helpers import tiny_model

import workbench
from workbench.capture import probes as P
from workbench.capture.adapters.base import Route
from workbench.capture.adapters.native import NativeAdapter
from workbench.capture.probes import ExpertExtremesProbe, StepInfo
from workbench.capture.recorder import RecordSettings, new_run_id, record_batch
from workbench.data.store import Store
from workbench.model import MoE, save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER

PROMPT = [5, 17, 101, 3, 3, 250, 42, 9, 77, 18, 200, 64]


def _extremes(model, db, **kw) -> pl.DataFrame:
    run = workbench.record(PROMPT, model=model, max_new_tokens=6, db=db, detect=False, **kw)
    return run.expert_extremes().sort("layer", "pos")


def _same(got: pl.DataFrame, want: pl.DataFrame) -> None:
    assert got.height == want.height > 0
    for c in ("pos", "layer", "max_out_expert", "max_act_expert"):
        assert got[c].to_list() == want[c].to_list(), c
    for c in ("max_out_norm", "max_act"):
        np.testing.assert_allclose(got[c].to_numpy(), want[c].to_numpy(), rtol=1e-5, atol=1e-6)


def test_read_in_the_model_equals_running_the_experts_again_and_runs_nothing(tmp_path, monkeypatch):
    model = tiny_model()
    db = Store(tmp_path / "w.duckdb")
    monkeypatch.setattr(NativeAdapter, "expert_out_seam", False)  # the earlier path: experts run again
    want = _extremes(model, db)
    monkeypatch.setattr(NativeAdapter, "expert_out_seam", True)

    def refuse(*_a, **_k):
        raise AssertionError("the experts ran again")
    monkeypatch.setattr(P, "expert_internals", refuse)
    monkeypatch.setattr(P, "_grouped_internals", refuse)
    _same(_extremes(model, db), want)


def test_a_fault_on_an_expert_is_seen_as_the_model_ran_it(tmp_path, monkeypatch):
    """A weight edit and an output hook on a chosen expert (what faults do) show in the rows, as when the experts
    were run again through the same module."""
    model = tiny_model()
    db = Store(tmp_path / "w.duckdb")
    moe = next(layer.ffn for layer in model.layers if isinstance(layer.ffn, MoE))
    clean = _extremes(model, db)
    with torch.no_grad():
        for e in moe.experts:
            e.w1.weight.mul_(3.0)
    handles = [e.hook_out.register_forward_hook(lambda _m, _a, out: out * 5) for e in moe.experts]
    try:
        monkeypatch.setattr(NativeAdapter, "expert_out_seam", False)
        want = _extremes(model, db)
        monkeypatch.setattr(NativeAdapter, "expert_out_seam", True)
        got = _extremes(model, db)
    finally:
        for h in handles:
            h.remove()
    _same(got, want)
    layer = next(i for i, b in enumerate(model.layers) if b.ffn is moe)  # its input is the clean one's
    fed = (pl.col("layer") == layer) & (pl.col("pos") < len(PROMPT))
    assert not np.allclose(got.filter(fed)["max_act"].to_numpy(), clean.filter(fed)["max_act"].to_numpy())

def test_a_batch_splits_each_expert_call_by_row(tmp_path):
    """Each row of a batch gets its own rows of every expert call: its table equals its single recording."""
    ckpt = save_checkpoint(tiny_model(vocab_size=4096), tmp_path / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    prompts = ["def add(a, b):", "for i in range(10):\n", "class Point:"]
    db = Store(tmp_path / "b.duckdb")
    run_ids = [new_run_id() for _ in prompts]
    settings = RecordSettings(max_new_tokens=6)
    assert record_batch(prompts, [settings] * 3, model=str(ckpt), db=db, run_ids=run_ids,
                        run_fields=[None] * 3) == [None] * 3
    q = "SELECT * EXCLUDE (run_id) FROM expert_extremes WHERE run_id = ? ORDER BY layer, pos"
    for prompt, rid in zip(prompts, run_ids):
        single = workbench.record(prompt, model=str(ckpt), max_new_tokens=6, db=db, detect=False)
        _same(db.sql(q, [rid]), db.sql(q, [single.run_id]))


def test_calls_that_are_not_the_choice_give_no_rows_and_the_others_their_own():
    """Synthetic calls through the probe: a forward whose expert calls do not hold its choice's rows is dropped;
    the other forward's rows get each (row, slot)'s own output norm and activation, a slot naming no expert none."""
    adapter = SimpleNamespace(expert_out_seam=True, summary=SimpleNamespace(n_routed_experts=4))
    p = ExpertExtremesProbe(adapter, "r1")
    assert set(p.listeners()) == {"routed", "expert_out"}

    def forward(idx: torch.Tensor, short: int | None = None) -> dict:
        p.on_route(1, Route(1, torch.zeros(idx.size(0), 4), idx, torch.ones(idx.shape), None))
        want = {}
        for e in range(4):
            rows, slots = torch.where(idx == e)
            if rows.numel():
                n = rows.numel() - (e == short)
                y, a = torch.randn(n, 3), torch.randn(n, 5)
                p.on_out(1, e, y, a)
                want.update({(int(r), int(s)): (float(y[j].norm()), float(a[j].abs().max()), e)
                             for j, (r, s) in enumerate(zip(rows[:n], slots[:n]))})
        return want

    def step(i: int, start: int, n: int) -> None:
        p.collect(StepInfo("r1", i, start, [0] * n, torch.zeros(n, 8), 0, "", [], False, 0.0, 5))

    good = forward(torch.tensor([[2, 0], [1, 2], [3, -1]]))
    step(0, 0, 3)
    forward(torch.tensor([[0, 1]]), short=1)  # expert 1's call holds no row: this forward is dropped
    step(1, 3, 1)
    rows = p.flush()["expert_extremes"].cols
    assert rows["pos"].tolist() == [0, 1, 2] and rows["layer"].tolist() == [1, 1, 1]
    for r in range(3):
        norms = {s: v for (rr, s), v in good.items() if rr == r}
        best = max(norms.values(), key=lambda v: v[0])
        assert rows["max_out_expert"][r] == best[2]
        np.testing.assert_allclose(rows["max_out_norm"][r], best[0], rtol=1e-6)
        top = max(norms.values(), key=lambda v: v[1])
        assert rows["max_act_expert"][r] == top[2]
        np.testing.assert_allclose(rows["max_act"][r], top[1], rtol=1e-6)


def test_calls_reduced_when_they_happen_give_the_rows_of_calls_kept_whole(tmp_path, monkeypatch):
    """A long prompt's expert calls are reduced as they happen (``REDUCE_ROWS``: nothing [N, D] outlives the forward);
    the rows equal those of the same calls kept whole and reduced at the flush, alone and in a batch, a decode step's
    few-row calls mixed in with the prefill's reduced ones."""
    model = tiny_model()
    db = Store(tmp_path / "w.duckdb")
    monkeypatch.setattr(P, "REDUCE_ROWS", 1 << 30)  # every call kept whole
    whole = _extremes(model, db)
    monkeypatch.setattr(P, "REDUCE_ROWS", 2)  # prefill calls of 2+ rows reduced at once, decode rows kept
    _same(_extremes(model, db), whole)
    monkeypatch.setattr(P, "REDUCE_ROWS", 1)  # every call reduced at once
    _same(_extremes(model, db), whole)
    ckpt = save_checkpoint(tiny_model(vocab_size=4096), tmp_path / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    prompts = ["def add(a, b):", "for i in range(10):\n"]
    run_ids = [new_run_id() for _ in prompts]
    assert record_batch(prompts, [RecordSettings(max_new_tokens=6)] * 2, model=str(ckpt), db=db, run_ids=run_ids,
                        run_fields=[None] * 2) == [None] * 2
    monkeypatch.setattr(P, "REDUCE_ROWS", 1 << 30)
    q = "SELECT * EXCLUDE (run_id) FROM expert_extremes WHERE run_id = ? ORDER BY layer, pos"
    for prompt, rid in zip(prompts, run_ids):
        single = workbench.record(prompt, model=str(ckpt), max_new_tokens=6, db=db, detect=False)
        _same(db.sql(q, [rid]), db.sql(q, [single.run_id]))


def test_a_long_prompts_expert_calls_are_not_held_until_the_flush():
    """A call of REDUCE_ROWS rows or more is kept as two numbers per row, not its output and activation."""
    y, a = torch.randn(P.REDUCE_ROWS, 16), torch.randn(P.REDUCE_ROWS, 32)
    e, yk, ak = P.expert_call(3, y, a)
    assert e == 3 and yk.shape == ak.shape == (P.REDUCE_ROWS,)
    torch.testing.assert_close(yk, y.norm(dim=-1))
    torch.testing.assert_close(ak, a.abs().amax(dim=-1))
    e, yk, ak = P.expert_call(3, y[:1], a[:1])
    assert yk.shape == (1, 16) and ak.shape == (1, 32)
