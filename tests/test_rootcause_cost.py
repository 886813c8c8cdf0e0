"""Root cause's cost (issue 29 point 4): the batched IG and the ablation whose rows join at their own layer give
captum's sums; the forwards one root cause takes; progress reports; ``workbench explain``'s bar only on a terminal."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from captum.attr import FeatureAblation, LayerIntegratedGradients
from helpers import tiny_model

import workbench
from workbench.analysis import faults
from workbench.analysis.patching import last_position_only
from workbench.analysis.rootcause import (
    component_ablation,
    frozen_routing,
    integrated_gradients,
    root_cause,
    rows_per_forward,
    target_fn,
)
from workbench.capture.adapters import Route, adapter_for
from workbench.cli import main as cli_main
from workbench.commands import explain
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_model()


IDS = torch.tensor([[17, 3, 99, 45, 200, 8, 64, 12, 150, 33, 71, 5]])


def _captum_ig(model, ids, target, steps, mode):
    """The captum computation root cause used before (LayerIntegratedGradients, Gauss-Legendre)."""
    a = adapter_for(model)
    f = target_fn(a, target)
    base = torch.zeros_like(ids)
    frozen = a.routing_of(ids) if mode == "frozen" else {}
    with a.analysis(), frozen_routing(a, frozen):
        attr, delta = LayerIntegratedGradients(f, a.embedding()).attribute(
            ids, baselines=base, n_steps=steps, method="gausslegendre", internal_batch_size=16,
            return_convergence_delta=True)
    return attr.sum(-1)[0].detach().double().numpy(), float(delta.reshape(-1)[0])


def _captum_ablation(model, ids, target):
    """Every component's row from the embedding on (captum's FeatureAblation, one batch row per component)."""
    a = adapter_for(model)
    comps = a.components()
    col = {c: k for k, c in enumerate(comps)}
    seq, e = ids.size(1), a.summary.n_routed_experts
    state = {}

    def heads(layer, z):
        return z * state["m"][:, [col[("head", layer, h, None)] for h in range(z.size(2))]][:, None, :, None]

    def route(layer, r: Route):
        rows = torch.arange(r.indices.size(0)) // seq
        keep = state["m"][:, [col[("expert", layer, None, j)] for j in range(e)]][rows] > 0.5
        if not keep.all():
            r.remove(keep)

    def shared(layer, out):
        return out * state["m"][torch.arange(out.size(0)) // seq, col[("shared_expert", layer, None, None)]][:, None]

    f = target_fn(a, target)

    def forward(mask):
        state["m"] = mask
        return f(ids.expand(mask.size(0), -1))

    with a.analysis(), torch.no_grad(), a.seams({"head_out": heads, "route": route, "shared_out": shared}):
        attr = FeatureAblation(forward).attribute(torch.ones(1, len(comps)), baselines=0.0, perturbations_per_eval=64)
    return comps, attr[0].double().numpy()


@pytest.mark.parametrize("mode", ["frozen", "plain"])
def test_batched_ig_gives_captums_sums(tiny, mode):
    ref, ref_delta = _captum_ig(tiny, IDS, 7, 32, mode)
    for batch in (5, None):  # uneven chunks of points, and every point in one forward-backward
        got, delta, gap = integrated_gradients(tiny, IDS, 7, steps=32, mode=mode, batch_size=batch)
        np.testing.assert_allclose(got, ref, atol=1e-5 * max(1.0, np.abs(ref).max()))
        assert delta == pytest.approx(ref_delta, abs=1e-5)
        assert got.sum() - delta == pytest.approx(gap, abs=1e-5)


def test_ablation_rows_joining_at_their_layer_give_captums_sums(tiny):
    comps, ref = _captum_ablation(tiny, IDS, 7)
    assert np.abs(ref).max() > 1e-3  # something to compare
    for batch in (2, 7, None):  # one component per forward, chunks that split a layer, all in one forward
        got_comps, got = component_ablation(tiny, IDS, 7, batch_size=batch or 1000)
        assert got_comps == comps
        np.testing.assert_allclose(got, ref, atol=1e-5)
    # a fault's own pre-hook on a block sees the joined rows (the rows join first): the faulty model's sums
    with faults.skip_layer(tiny, 1):
        ref = _captum_ablation(tiny, IDS, 7)[1]
        np.testing.assert_allclose(component_ablation(tiny, IDS, 7, batch_size=9)[1], ref, atol=1e-5)


def test_the_output_projection_on_the_last_position_only(tiny):
    f = target_fn(adapter_for(tiny), 7)
    rows = torch.cat([IDS, IDS.flip(1)])
    with torch.no_grad():
        full = f(rows)
        with last_position_only(tiny):
            last = f(rows)
            assert tiny(IDS).shape[1] == 1  # the logits of the last position only
    torch.testing.assert_close(last, full, atol=1e-5, rtol=0)
    assert tiny(IDS).shape[1] == IDS.size(1)  # the hook is gone


def test_one_root_cause_takes_a_handful_of_forwards_and_reports_progress(tiny, tmp_path):
    run = workbench.record(list(range(30, 50)), model=tiny, max_new_tokens=3, db=tmp_path / "w.duckdb")
    calls = []
    handle = tiny.register_forward_hook(lambda m, args, out: calls.append(out.size(0)))
    seen: list[tuple] = []
    try:
        df = root_cause(run.store, run.run_id, 15, adapter=run.adapter(), steps=32, save=False,
                        progress=lambda *p: seen.append(p))
    finally:
        handle.remove()
    # the routing forward, IG's ends (input and baseline), 32 points in one forward-backward, every component in
    # one forward (row 0 unablated), the components' evidence forward (its routing check) -- with captum at 16
    # rows: 7 batch-1 forwards around 2 IG batches, then 1 + 2 ablation forwards of 16 rows from the embedding
    n_comps = len(adapter_for(tiny).components())
    assert calls == [1, 2, 32, 1 + n_comps, 1], calls
    assert rows_per_forward(15, None) >= 32 + 1 and rows_per_forward(4000, None) == 16
    assert df.height and set(df["kind"]) >= {"token", "head", "expert"}
    phases = {}
    for phase, done, total in seen:
        assert done <= total and done >= phases.get(phase, (0, 0))[0]
        phases[phase] = (done, total)
    assert {"integrated gradients", "ablation"} <= set(phases)
    assert all(done == total for done, total in phases.values())
    assert phases["ablation"] == (n_comps, n_comps) and phases["integrated gradients"] == (32, 32)


def test_explain_draws_progress_on_a_terminal_only(tiny, tmp_path, capsys, monkeypatch):
    db = tmp_path / "w.duckdb"
    ckpt = save_checkpoint(tiny, tmp_path / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    run = workbench.record(list(range(60, 72)), model=str(ckpt), max_new_tokens=2, db=db)
    assert cli_main(["explain", run.run_id, "6", "--json", "--steps", "8", "--db", str(db)]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out.strip().splitlines()[-1])["pos"] == 6
    assert "ablation" not in got.err and "integrated gradients" not in got.err  # not a terminal: no bar
    monkeypatch.setattr(explain, "_stderr_tty", lambda: True)
    assert cli_main(["explain", run.run_id, "6", "--json", "--steps", "8", "--db", str(db)]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out.strip().splitlines()[-1])["pos"] == 6  # stdout stays the JSON alone
    for phase in ("loading the model", "integrated gradients", "ablation"):
        assert phase in got.err


def test_patching_batches_the_experts_of_its_own_module_on_another_prompt(tiny):
    from copy import deepcopy

    from workbench.analysis.patching import patch_causes

    a = adapter_for(tiny)
    other = IDS.clone()
    other[0, 4], other[0, -1] = 201, 6  # the same model on an edited prompt: a known-good run
    twin = adapter_for(deepcopy(tiny))  # the same weights in another module: each expert a forward of its own
    sites, score, restored, gap, stats = patch_causes(a, IDS, 7, a, other, batch_size=8)
    t_sites, t_score, t_restored, t_gap, t_stats = patch_causes(a, IDS, 7, twin, other, batch_size=8)
    experts = [k for k in t_sites if k[0] == "expert"]
    assert sites == t_sites and experts and abs(gap) > 1e-3
    np.testing.assert_allclose(score, t_score, atol=1e-5)
    np.testing.assert_allclose(restored, t_restored, atol=1e-5)
    assert np.abs(score[[n for n, k in enumerate(sites) if k[0] == "expert"]]).max() > 0  # experts that matter
    assert stats.forwards <= t_stats.forwards - 2 * len(experts) + 2  # their forwards batched, both directions
