"""Interventions as recorded child runs, and expert contrast (issue 27, points 1 and 2).

On our own model and on a tiny Mixtral and Qwen3-MoE: a banned expert never appears in the child's routing and the
logits equal a forward with the expert masked out of the router by hand (force and boost likewise);
``scale_head(..., 0)`` equals root cause's head ablation; ``scale(path, 1.0)`` changes nothing bitwise;
interventions round-trip through the store, the CLI and replay; an in-place weight edit changes the fingerprint;
expert contrast recovers experts planted by a boosted router.
"""
from __future__ import annotations

import json
import subprocess
import sys

import polars as pl
import pytest
import torch
import torch.nn.functional as F

import workbench
from helpers import tiny_model
from workbench import cli
from workbench.analysis.contrast import expert_contrast, welch_p
from workbench.analysis.rootcause import component_ablation, target_fn
from workbench.capture.adapters import adapter_for, load_adapter
from workbench.interventions import (Intervention, applied, ban_expert, boost_expert, force_expert, parse,
                                     router_bias, scale, scale_head)

transformers = pytest.importorskip("transformers")
from workbench.capture.tiny import make_folder, tiny_family  # noqa: E402

# an in-memory model's ids are decoded with the bundled demo tokenizer (a warning each recording)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:no tokenizer given")]
FAMILIES = ("native", "mixtral", "qwen3_moe")
IDS = [5, 17, 42, 99, 123, 7, 250, 64, 3, 11]
# a module whose output scale() edits, per family
SCALE_PATH = {"native": "layers.1.ffn", "mixtral": "model.layers.1.mlp", "qwen3_moe": "model.layers.1.mlp"}


@pytest.fixture(scope="module")
def models():
    got = {"native": tiny_model(seed=3)}
    for fam in FAMILIES[1:]:
        got[fam] = tiny_family(fam, seed=0)
    return got


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return workbench.Store(tmp_path_factory.mktemp("interventions") / "w.duckdb")


def _busiest(adapter, ids) -> tuple[int, int]:
    """(MoE layer, its expert chosen most often on ``ids``): the ban and force tests act where it matters."""
    layer = adapter.summary.moe_layers[-1]
    idx = adapter.routing_of(ids)[layer]
    return layer, int(torch.bincount(idx.flatten(), minlength=adapter.summary.n_routed_experts).argmax())


def _idle(adapter, ids, layer) -> int:
    """An expert of ``layer`` no token of ``ids`` chose (else the least chosen)."""
    idx = adapter.routing_of(ids)[layer]
    return int(torch.bincount(idx.flatten(), minlength=adapter.summary.n_routed_experts).argmin())


def _logits(adapter, ids, interventions=()):
    with adapter.analysis(), torch.no_grad(), applied(adapter, interventions):
        return adapter.forward(ids).float()


def _by_hand(adapter, family: str, layer: int, select):
    """A forward hook that re-computes layer ``layer``'s routing by hand: ``select(scores [N, E]) -> selection scores``
    (what top-k ranks by); the weights stay the router's own scores of the chosen experts, as each family computes
    them. Returns removable handles."""
    if family == "native":
        gate = adapter.module.layers[layer].ffn.gate  # sigmoid scores + bias, group-limited, normalised, scaled
        seen = {}

        def scores_hook(_m, _a, out):
            seen["scores"] = out
            return None

        def selection_hook(_m, _a, sel):
            s = seen["scores"]
            return gate.selection(select(s), gate.bias) if select is not None else sel
        return [gate.hook_scores.register_forward_hook(scores_hook),
                gate.hook_selection.register_forward_hook(selection_hook)]
    router = adapter.module.model.layers[layer].mlp.gate  # (logits, weights, indices): softmax, top-k

    def hook(_m, _a, out):
        logits, weights, _ = out
        probs = F.softmax(logits.float(), dim=-1)
        idx = select(probs).topk(router.top_k, dim=-1)[1]
        w = probs.gather(1, idx)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises; Qwen3-MoE as configured
            w = w / w.sum(-1, keepdim=True)
        return logits, w.to(weights.dtype), idx
    return [router.register_forward_hook(hook)]


def _hand_logits(adapter, family, ids, layer, select):
    handles = _by_hand(adapter, family, layer, select)
    try:
        with adapter.analysis(), torch.no_grad():
            return adapter.forward(ids).float()
    finally:
        for h in handles:
            h.remove()


# -- specs -----------------------------------------------------------------------------------------------------
def test_specs_round_trip_and_bad_ones_are_refused():
    made = [ban_expert(3, 5), boost_expert(3, 5, 1.5), force_expert(3, 5), scale_head(2, 1, 0),
            scale("layers.2.ffn", 0.5), router_bias(3, [0.5, 0, -1e-5])]
    assert [m.spec for m in made] == ["ban:L3E5", "boost:L3E5=1.5", "force:L3E5", "scale_head:L2H1=0",
                                      "scale:layers.2.ffn=0.5", "router_bias:L3=[0.5,0,-1e-05]"]
    assert [parse(m.spec) for m in made] == made
    for bad in ("ban:L3", "boost:L3E5", "nope:L1E1", "scale_head:L2H1=x", "router_bias:L3=[]", "scale:=2",
                "boost:L1E2=inf", "ban:L-1E2"):
        with pytest.raises(ValueError):
            parse(bad)
    with pytest.raises(ValueError):
        Intervention("ban", layer=1)


def test_importing_the_interventions_and_the_contrast_needs_no_torch(tmp_path):
    code = ("import sys, workbench, workbench.interventions as i, workbench.analysis.contrast\n"
            "assert i.parse('ban:L1E2') == i.ban_expert(1, 2)\n"
            "assert 'torch' not in sys.modules\nprint('ok')")
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert got.stdout.strip() == "ok", got.stderr


# -- each family: ban, force, boost, heads, modules ------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_ban_reroutes_like_a_router_without_the_expert(family, models, store):
    adapter = adapter_for(models[family])
    ids = torch.tensor([IDS])
    layer, e = _busiest(adapter, ids)
    got = _logits(adapter, ids, [ban_expert(layer, e)])
    want = _hand_logits(adapter, family, ids, layer, lambda s: s.masked_fill(
        torch.arange(s.size(1)) == e, float("-inf")))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, _logits(adapter, ids), atol=1e-4)  # the ban changed something
    parent = workbench.record(IDS, model=adapter, max_new_tokens=4, db=store, detect=False)
    child = parent.rerun([ban_expert(layer, e)], detect=False)
    rt, prt = child.routing(), parent.routing()
    assert prt.filter((pl.col("layer") == layer) & (pl.col("expert") == e)).height > 0
    assert rt.filter(pl.col("layer") == layer).height == prt.filter(pl.col("layer") == layer).height
    assert rt.filter((pl.col("layer") == layer) & (pl.col("expert") == e)).height == 0
    assert child.info["parent_run_id"] == parent.run_id
    assert child.interventions()["spec"].to_list() == [f"ban:L{layer}E{e}"]


@pytest.mark.parametrize("family", FAMILIES)
def test_force_and_boost_equal_the_router_edited_by_hand(family, models):
    adapter = adapter_for(models[family])
    ids = torch.tensor([IDS])
    layer = adapter.summary.moe_layers[-1]
    e = _idle(adapter, ids, layer)
    onehot = torch.arange(adapter.summary.n_routed_experts) == e
    forced = _logits(adapter, ids, [force_expert(layer, e)])
    if family == "native":  # forced after the group limit, as the native gate's own selection hook sees it
        hand = _by_hand_selection(adapter, ids, layer, lambda sel: sel.masked_fill(onehot, float("inf")))
    else:
        hand = _hand_logits(adapter, family, ids, layer, lambda s: s + 2.0 * onehot)  # scores <= 1: always chosen
    assert torch.allclose(forced, hand, atol=1e-5, rtol=1e-4)
    with applied(adapter, [force_expert(layer, e)]):
        chosen = adapter.routing_of(ids)[layer]
    assert (chosen == e).any(-1).all()
    boosted = _logits(adapter, ids, [boost_expert(layer, e, 0.3)])
    if family == "native":  # the native gate's selection bias is what a boost adds to
        gate = adapter.module.layers[layer].ffn.gate
        saved = gate.bias.clone()
        try:
            gate.bias[e] += 0.3
            hand = _hand_logits(adapter, family, ids, layer, None)
        finally:
            gate.bias.copy_(saved)
    else:
        hand = _hand_logits(adapter, family, ids, layer, lambda s: s + 0.3 * onehot)
    assert torch.allclose(boosted, hand, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(boosted, _logits(adapter, ids), atol=1e-4)
    bias = [0.0] * adapter.summary.n_routed_experts
    bias[e] = 0.3
    assert torch.equal(_logits(adapter, ids, [router_bias(layer, bias)]), boosted)


def _by_hand_selection(adapter, ids, layer, edit):
    gate = adapter.module.layers[layer].ffn.gate
    h = gate.hook_selection.register_forward_hook(lambda _m, _a, sel: edit(sel))
    try:
        with adapter.analysis(), torch.no_grad():
            return adapter.forward(ids).float()
    finally:
        h.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_scale_head_zero_is_root_causes_head_ablation_and_scale_one_is_exact(family, models):
    adapter = adapter_for(models[family])
    ids = torch.tensor([IDS])
    target = 9
    comps, effects = component_ablation(adapter, ids, target)
    f = target_fn(adapter, target)
    with adapter.analysis(), torch.no_grad():
        clean = float(f(ids)[0])
        for layer, head in [(0, 1), (1, 2)]:
            with applied(adapter, [scale_head(layer, head, 0)]):
                ablated = float(f(ids)[0])
            assert clean - ablated == pytest.approx(effects[comps.index(("head", layer, head, None))], abs=1e-4)
    base = _logits(adapter, ids)
    assert torch.equal(_logits(adapter, ids, [scale(SCALE_PATH[family], 1.0)]), base)
    assert not torch.allclose(_logits(adapter, ids, [scale(SCALE_PATH[family], 0.5)]), base, atol=1e-4)


def test_refused_before_a_run_row(models, store):
    n = store.sql("SELECT count(*) AS n FROM runs")["n"][0]
    m = models["native"]
    for bad, words in [(ban_expert(0, 1), "no router"), (ban_expert(1, 99), "out of range"),
                       (scale_head(1, 9, 0), "out of range"), (scale("layers.9.ffn", 2), "no module"),
                       (router_bias(1, [1.0]), "values for"), ("force:L1E1", None)]:
        if words is None:
            with pytest.raises(ValueError, match="both forced and banned"):
                workbench.record(IDS, model=m, max_new_tokens=2, db=store, detect=False,
                                 interventions=[bad, ban_expert(1, 1)])
            continue
        with pytest.raises(ValueError, match=words):
            workbench.record(IDS, model=m, max_new_tokens=2, db=store, detect=False, interventions=[bad])
    with pytest.raises(ValueError, match="must still choose"):
        workbench.record(IDS, model=m, max_new_tokens=2, db=store, detect=False,
                         interventions=[ban_expert(1, j) for j in range(7)])
    assert store.sql("SELECT count(*) AS n FROM runs")["n"][0] == n


# -- the store, the CLI, replay and the weights' fingerprint ------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory):
    return make_folder("mixtral", tmp_path_factory.mktemp("mixtral") / "m")


def test_cli_store_diff_and_replay_round_trip(mixtral_folder, tmp_path, capsys):
    db = str(tmp_path / "cli.duckdb")
    common = ["record", "--prompt", "def add(a, b):", "--model", str(mixtral_folder), "--max-new-tokens", "5",
              "--no-detect", "--db", db, "--json"]
    assert cli.main(common) == 0
    parent = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    assert cli.main(common + ["--intervene", "ban:L1E3", "--intervene", "scale_head:L0H1=0", "--intervene",
                              "router_bias:L0=[0,0,0.5,0,0,0,0,0]", "--parent", parent]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["interventions"] == ["ban:L1E3", "scale_head:L0H1=0", "router_bias:L0=[0,0,0.5,0,0,0,0,0]"]
    wb = workbench.open(db)
    child = wb.run(out["run_id"])
    rows = child.interventions()
    assert rows.select("idx", "kind", "layer", "expert", "head", "value").rows() == [
        (0, "ban", 1, 3, None, None), (1, "scale_head", 0, None, 1, 0.0), (2, "router_bias", 0, None, None, None)]
    assert child.info["parent_run_id"] == parent and wb.run(parent).interventions().height == 0
    assert child.routing().filter((pl.col("layer") == 1) & (pl.col("expert") == 3)).height == 0
    d = wb.diff(parent, child.run_id)
    assert d.summary["interventions"] == out["interventions"] and d.summary["b_is_child_of_a"]
    assert d.summary["same_checkpoint"]  # hooks only: the weights are the checkpoint's
    res = child.replay()
    assert res["match"], res["first_divergence"]
    assert wb.run(res["run_id"]).interventions()["spec"].to_list() == out["interventions"]
    plain = wb.run(parent).replay()  # and a plain run's replay applies nothing
    assert plain["match"] and wb.run(plain["run_id"]).interventions().height == 0
    assert cli.main(common + ["--intervene", "ban:L1"]) == 2  # a bad spec: one line, exit 2
    assert "ban:L<layer>E<expert>" in capsys.readouterr().err
    n = wb.runs().height
    assert cli.main(common + ["--intervene", "ban:L9E3"]) == 2  # a layer the model lacks: before any run row
    assert "out of range" in capsys.readouterr().err and wb.runs().height == n
    prompts = tmp_path / "p.txt"
    prompts.write_text("x = 1\n")
    assert cli.main(["record", "--prompts", str(prompts), "--intervene", "ban:L1E3", "--db", db]) == 2
    assert "--intervene and --parent record one prompt" in capsys.readouterr().err


def test_an_in_place_weight_edit_changes_the_fingerprint(mixtral_folder, tmp_path):
    db = workbench.Store(tmp_path / "w.duckdb")
    adapter = load_adapter(str(mixtral_folder))
    hf = adapter.module
    clean = workbench.record(IDS, model=hf, max_new_tokens=3, db=db, detect=False)
    norm = adapter.parts(0)["attn_norm"].weight
    with torch.no_grad():
        norm.mul_(2.0)  # a user's own edit, in place
    try:
        edited = workbench.record(IDS, model=hf, max_new_tokens=3, db=db, detect=False)
    finally:
        with torch.no_grad():
            norm.div_(2.0)
    again = workbench.record(IDS, model=hf, max_new_tokens=3, db=db, detect=False)
    # the checkpoint folder's hash stays; the weights actually used are told apart
    assert clean.info["checkpoint_sha256"] == edited.info["checkpoint_sha256"]
    assert clean.info["weights_sha256"] != edited.info["weights_sha256"]
    assert clean.info["weights_sha256"] == again.info["weights_sha256"]
    wb = workbench.Workbench(db)
    assert not wb.diff(clean.run_id, edited.run_id).summary["same_checkpoint"]
    assert wb.diff(clean.run_id, again.run_id).summary["same_checkpoint"]
    # never taken for the clean checkpoint: a re-run from the folder, or with the module put back, is refused
    for model in (str(mixtral_folder), hf):
        with pytest.raises(ValueError, match="ran with weights changed in memory"):
            wb.run(edited.run_id).replay(model=model)
    assert wb.run(clean.run_id).replay(model=str(mixtral_folder))["match"]


# -- expert contrast ----------------------------------------------------------------------------------------------
PROMPTS = [[5, 17, 42, 99, 123, 7], [250, 64, 3, 11, 90, 45], [33, 77, 120, 8, 61, 200], [14, 150, 2, 99, 180, 6],
           [40, 41, 42, 43, 44, 45]]
PLANTED_A = [(0, 2), (1, 5)]  # experts set A's runs were recorded with a boosted router toward
PLANTED_B = [(1, 6)]


def test_welch_p():
    a = torch.tensor([[0.5, 0.6, 0.55], [0.2, 0.2, 0.2], [0.1, 0.1, 0.1]]).numpy()
    b = torch.tensor([[0.1, 0.15, 0.12], [0.2, 0.2, 0.2], [0.3, 0.3, 0.3]]).numpy()
    p = welch_p(a, b)
    assert p[0] < 0.01 and p[1] == 1.0 and p[2] == 0.0


def test_expert_contrast_recovers_planted_experts_and_steers(models, tmp_path, capsys):
    db = workbench.Store(tmp_path / "c.duckdb")
    hf = models["mixtral"]
    boost_a = [boost_expert(l, e, 0.6) for l, e in PLANTED_A]
    boost_b = [boost_expert(l, e, 0.6) for l, e in PLANTED_B]
    a = [workbench.record(p, model=hf, max_new_tokens=4, db=db, detect=False, interventions=boost_a).run_id
         for p in PROMPTS[:4]]
    b = [workbench.record(p, model=hf, max_new_tokens=4, db=db, detect=False, interventions=boost_b).run_id
         for p in PROMPTS[1:]]
    wb = workbench.Workbench(db)
    table = wb.expert_contrast(a, ",".join(b))
    assert table.columns[:7] == ["layer", "expert", "share_a", "share_b", "diff", "p", "rank"]
    cells = len(adapter_for(hf).summary.moe_layers) * 8
    assert table.height == cells and table["rank"].to_list() == list(range(1, cells + 1))
    top3 = {(r["layer"], r["expert"]) for r in table.head(3).iter_rows(named=True)}
    assert top3 == set(PLANTED_A + PLANTED_B)
    row = table.filter((pl.col("layer") == 0) & (pl.col("expert") == 2)).row(0, named=True)
    assert row["share_a"] == 1.0 and row["diff"] > 0.3 and row["p"] < 0.05
    assert table.filter((pl.col("layer") == 1) & (pl.col("expert") == 6))["diff"][0] < -0.3
    assert expert_contrast(db, a, b).equals(table)  # the torch-free computation for run ids
    children = wb.steer(a, table, top=2, action="ban", model=hf, detect=False)
    assert len(children) == len(a)
    for child, parent in zip(children, a):
        assert child.info["parent_run_id"] == parent
        assert sorted(child.interventions()["spec"].to_list()) == ["ban:L0E2", "ban:L1E5"]
        chosen = set(child.routing().select("layer", "expert").iter_rows())
        assert chosen and not chosen & set(PLANTED_A)
    # the CLI prints the ranking
    assert cli.main(["expert-contrast", ",".join(a), ",".join(b), "--db", str(db.path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.strip().splitlines()[2:]]
    assert {(int(x[1]), int(x[2])) for x in lines} == top3
    with pytest.raises(ValueError, match="in both sets"):
        expert_contrast(db, a, a[:1])
    missing = tmp_path / "typo" / "x.duckdb"  # ids on a database that is not there: refused, nothing created
    assert cli.main(["expert-contrast", "r1", "r2", "--db", str(missing)]) == 2
    assert "no database" in capsys.readouterr().err and not missing.parent.exists()
