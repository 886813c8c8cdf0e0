"""Super experts (issue #28 point 4): the ``expert_extremes`` signal equals a direct computation of every chosen
expert on our model and on a tiny Mixtral (fused transformers-5 experts), the atlas flags experts whose
activations dwarf the clean extreme, and ``Run.super_experts()`` measures the attention sink's dependence."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model

import workbench
from workbench.model import MoE

PROMPT = [5, 17, 101, 3, 3, 250, 42, 9, 77, 18, 200, 64]
NEW = 5


def _reference_native(model, ids: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per MoE layer: (max output norm, its expert, max |down-projection input|, its expert) per position, from
    one full forward: each chosen expert computed by hand, w2(silu(w1 x) * w3 x)."""
    seen: dict[int, tuple] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.ffn, MoE):
            def grab(m, a, i=i):
                x = a[0].reshape(-1, a[0].size(-1))
                seen[i] = (x, m.gate(x)[1])
            hooks.append(layer.ffn.register_forward_pre_hook(grab))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    out = {}
    torch.set_grad_enabled(False)
    for i, (x, idx) in seen.items():
        experts = model.layers[i].ffn.experts
        norm, act = torch.zeros(idx.shape), torch.zeros(idx.shape)
        for t in range(idx.size(0)):
            for k in range(idx.size(1)):
                e = experts[int(idx[t, k])]
                h = F.silu(e.w1.weight @ x[t]) * (e.w3.weight @ x[t])
                norm[t, k], act[t, k] = (e.w2.weight @ h).norm(), h.abs().max()
        a, b = norm.argmax(1), act.argmax(1)
        r = torch.arange(idx.size(0))
        out[i] = (norm[r, a].numpy(), idx[r, a].numpy(), act[r, b].numpy(), idx[r, b].numpy())
    torch.set_grad_enabled(True)
    return out


def _check(table: pl.DataFrame, ref: dict, n_pos: int) -> None:
    assert sorted(table["layer"].unique().to_list()) == sorted(ref)
    for layer, (norm, ne, act, ae) in ref.items():
        got = table.filter(pl.col("layer") == layer).sort("pos")
        assert got["pos"].to_list() == list(range(n_pos))
        np.testing.assert_allclose(got["max_out_norm"].to_numpy(), norm[:n_pos], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["max_act"].to_numpy(), act[:n_pos], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(got["max_out_expert"].to_numpy(), ne[:n_pos])
        np.testing.assert_array_equal(got["max_act_expert"].to_numpy(), ae[:n_pos])


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    model = tiny_model()
    run = workbench.record(PROMPT, model=model, max_new_tokens=NEW, db=tmp_path_factory.mktemp("db") / "w.duckdb",
                           detect=False)
    return model, run


def test_native_signal_equals_a_direct_computation(native_run):
    model, run = native_run
    ids = run.tokens().sort("pos")["token_id"].to_list()
    table = run.expert_extremes()
    _check(table, _reference_native(model, ids), len(ids) - 1)  # every fed position (the last is never fed)
    assert (table["max_act"] > 0).all() and (table["max_out_norm"] > 0).all()


def test_mixtral_fused_experts_signal_equals_a_direct_computation(tmp_path):
    pytest.importorskip("transformers")
    from workbench.capture.adapters import adapter_for  # optional: after the transformers check
    from workbench.capture.tiny import tiny_family  # optional: after the transformers check

    hf = tiny_family("mixtral")
    adapter = adapter_for(hf)
    run = workbench.record(PROMPT, model=adapter, max_new_tokens=NEW, db=tmp_path / "w.duckdb", detect=False)
    ids = run.tokens().sort("pos")["token_id"].to_list()
    # the reference: every MoE layer's experts module, its input and choice captured in one full forward, each
    # chosen expert computed by hand from the fused weights (the eager formula), checked against the module
    seen: dict[int, tuple] = {}
    hooks = []
    for i, (_, _, ex, _) in adapter.moe.items():
        def grab(m, a, kw, out, i=i):
            seen[i] = (a[0], a[1], a[2], out)
        hooks.append(ex.register_forward_hook(grab, with_kwargs=True))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    ref = {}
    torch.set_grad_enabled(False)
    for i, (x, idx, w, out) in seen.items():
        ex = adapter.moe[i][2]
        assert type(ex).__name__ == "MixtralExperts" and ex.gate_up_proj.ndim == 3  # the fused layout
        norm, act, total = torch.zeros(idx.shape), torch.zeros(idx.shape), torch.zeros_like(x)
        for t in range(idx.size(0)):
            for k in range(idx.size(1)):
                e = int(idx[t, k])
                gate, up = (ex.gate_up_proj[e] @ x[t]).chunk(2)
                h = ex.act_fn(gate) * up
                y = ex.down_proj[e] @ h
                total[t] += w[t, k] * y
                norm[t, k], act[t, k] = y.norm(), h.abs().max()
        torch.testing.assert_close(total, out, rtol=1e-4, atol=1e-5)  # the hand computation is the module's
        a, b = norm.argmax(1), act.argmax(1)
        r = torch.arange(idx.size(0))
        ref[i] = (norm[r, a].detach().numpy(), idx[r, a].numpy(), act[r, b].detach().numpy(), idx[r, b].numpy())
    torch.set_grad_enabled(True)
    _check(run.expert_extremes(), ref, len(ids) - 1)
    assert not any("expert_extremes" in n for n in run.model_summary.notes)


def _planted(tmp_path_factory):
    """The tiny model with one super expert planted: the up projection of layer L's busiest expert times 100, so
    every activation inside it (and its output) is 100 times what it was. Three layers: MoE layers 1 and 2, so a
    layer after the planted one has attention whose sink can move."""
    probe = tiny_model(n_layers=3)
    db = tmp_path_factory.mktemp("plant") / "w.duckdb"
    first = workbench.record(PROMPT, model=probe, max_new_tokens=NEW, db=db, detect=False)
    rt = first.routing()
    layer = int(rt["layer"].min())
    busiest = rt.filter(pl.col("layer") == layer)["expert"].value_counts().sort(["count", "expert"],
                                                                                 descending=[True, False])
    e = int(busiest["expert"][0])
    model = tiny_model(n_layers=3)
    with torch.no_grad():
        model.layers[layer].ffn.experts[e].w3.weight.mul_(100.0)
    run = workbench.record(PROMPT, model=model, max_new_tokens=NEW, db=db, detect=False)
    return first, run, layer, e


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return _planted(tmp_path_factory)


def test_the_atlas_flags_a_planted_super_expert_and_nothing_in_a_clean_model(planted):
    from workbench.apps.tabs.atlas import card_html  # optional: gradio, the Atlas tab's card
    from workbench.analysis import atlas as A  # lazy: beside the tab's import

    clean, run, layer, e = planted
    for r in (clean, run):  # max_act per expert is the signal's own maximum where the expert was the largest
        flags = A.super_experts(r.store, [r.run_id])
        direct = (r.expert_extremes().group_by("layer", pl.col("max_act_expert").alias("expert"))
                  .agg(pl.col("max_act").max().alias("want")))
        both = flags.join(direct, on=["layer", "expert"])
        assert both.height == flags.height == direct.height
        np.testing.assert_allclose(both["max_act"].to_numpy(), both["want"].to_numpy())
        med = flags.group_by("layer").agg(pl.col("max_act").median().alias("m"))
        both = flags.join(med, on="layer")
        assert both["super"].to_list() == (both["max_act"] > 10 * both["m"]).to_list()
    assert not A.super_experts(clean.store, [clean.run_id])["super"].any()  # random weights: no super expert
    flagged = A.super_experts(run.store, [run.run_id]).filter(pl.col("super") & (pl.col("layer") == layer))
    assert flagged.select("layer", "expert").rows() == [(layer, e)]
    at = A.atlas(run.store, run_ids=[run.run_id])
    assert at.columns == A.COLUMNS and at["super"].dtype == pl.Boolean
    row = at.filter((pl.col("layer") == layer) & (pl.col("expert") == e)).row(0, named=True)
    assert row["super"] and row["max_act"] > 0
    assert "Super expert" in card_html(row)
    assert not A.atlas(clean.store, run_ids=[clean.run_id])["super"].any()


def test_sink_change_when_a_super_expert_is_banned(planted):
    _, run, layer, e = planted
    n_runs = run.store.sql("SELECT count(*) AS n FROM runs")["n"][0]
    got = run.super_experts()
    assert got.select("layer", "expert").rows() == [(layer, e)] and got["super"].to_list() == [True]
    change = got["sink_change"][0]
    assert np.isfinite(change) and change != 0  # banning a 100x expert moves every later layer's attention
    other = next(x for x in range(run.model_summary.n_routed_experts) if x != e)
    both = run.super_experts(experts=[(layer, other), (layer, e)])
    assert both["expert"].to_list() == [other, e] and both["super"].to_list() == [False, True]
    assert np.isfinite(both["sink_change"].to_numpy()).all()
    assert both["sink_change"][1] == pytest.approx(change)  # the same ban measured again: the same number
    assert run.store.sql("SELECT count(*) AS n FROM runs")["n"][0] == n_runs  # scratch runs stay out of the store


def test_demo_model_has_no_super_expert_and_the_sink_change_is_computed(tmp_path):
    from workbench.analysis import atlas as A  # lazy: only this test
    from workbench.model import load_checkpoint, load_tokenizer  # lazy: only this test

    run = workbench.record("def fibonacci(n):\n    if n < 2:\n        return n\n", model=load_checkpoint(),
                           tokenizer=load_tokenizer(), max_new_tokens=8, db=tmp_path / "w.duckdb", detect=False)
    flags = A.super_experts(run.store, [run.run_id])
    assert flags.height and not flags["super"].any()  # the trained demo: no expert 10x its layer's median
    assert run.super_experts().height == 0
    first = int(flags["layer"].min())
    top = flags.filter(pl.col("layer") == first).sort("max_act", descending=True).row(0, named=True)
    got = run.super_experts(experts=[(top["layer"], top["expert"])])
    assert np.isfinite(got["sink_change"][0]) and got["max_act"][0] == top["max_act"]


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "olmoe", "deepseek_v3", "gemma4_text"])
def test_fused_experts_run_again_add_up_to_the_modules_output(family):
    """For fused experts of other layouts (gpt-oss: transposed, biases, its own clamped gate; shared experts beside
    them; Gemma 4), each chosen expert run again (``workbench.capture.experts``), weighted and summed, is what the
    experts module returned in the model's own forward: the per-expert numbers the signal reduces are the model's."""
    pytest.importorskip("transformers")
    from workbench.capture.adapters import adapter_for  # optional: after the transformers check
    from workbench.capture.experts import _fused_expert  # lazy: beside the optional imports
    from workbench.capture.tiny import tiny_family  # optional: after the transformers check

    hf = tiny_family(family)
    adapter = adapter_for(hf)
    seen: dict[int, tuple] = {}

    def grab(m, args, kw, out, i):
        seen.setdefault(i, (m, [*args, *(kw[k] for k in ("hidden_states", "top_k_index", "top_k_weights")[len(args):]
                                         if k in kw)], out))
    hooks = [ex.register_forward_hook(lambda m, a, kw, o, i=i: grab(m, a, kw, o, i), with_kwargs=True)
             for i, (_, _, ex, _) in adapter.moe.items()]
    with torch.no_grad():
        hf(torch.tensor([PROMPT]))
    for h in hooks:
        h.remove()
    assert seen and not any("expert_extremes" in n for n in adapter.summary.notes)
    with torch.no_grad():
        for m, (x, idx, w, *_), out in seen.values():
            x, idx, w = x.reshape(-1, x.size(-1)), idx.reshape(-1, idx.size(-1)), w.reshape(-1, w.size(-1))
            total = torch.zeros(x.shape)
            for e in idx.unique().tolist():
                if 0 <= e < m.down_proj.size(0):
                    r, k = torch.where(idx == e)
                    total.index_add_(0, r, (_fused_expert(m, e, x[r])[0] * w[r, k, None]).float())
            o = (out[0] if isinstance(out, tuple) else out).reshape(total.shape).float()
            assert float((o - total).norm() / o.norm()) < 1e-4
