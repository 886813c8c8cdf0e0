"""Every MoE family of the installed ``transformers`` records (issue 26, item 5).

The families are enumerated from transformers itself (``tiny.moe_families``: a causal LM whose modeling module
defines an expert / router / MoE class, or whose config counts experts); each is built as a tiny random model
from its own default config, shrunk (``tiny.tiny_family``), and 12 tokens are recorded. For every family whose
routing is recorded, what the experts received during the recording (hooks of the test's own,
``tiny.RouterReference``) must equal the recorded routing row by row, expert sets and weights; the others must
record every other signal and say, in one line, what is not modelled. Never an exception at load, never a lost
run.
"""
from __future__ import annotations

import json
import warnings

import numpy as np
import polars as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")

import workbench  # noqa: E402
from workbench.capture.adapters import adapter_for, load_adapter  # noqa: E402
from workbench.capture.tiny import RouterReference, moe_families, save_tokenizer, tiny_family  # noqa: E402

PROMPT = [5, 17, 42, 99, 123, 7, 250, 64]
NEW = 4
FAMILIES = moe_families()
# families whose routing is not recorded, and what their note names
UNROUTED = {"doge": "DogeCDMoE"}
# routing recorded exactly as the experts receive it, but the router's rule is not one RouterMath models
OBSERVED = {"inkling_text", "phimoe"}
# layers of a routed family that are not routed (hash routing by token id), and their note
PARTLY = {"deepseek_v4": ([0], "DeepseekV4HashRouter")}
EXACT_AT_LEAST = 65  # of the 66 families of transformers 5.24 (70 of 5.25): one that stops recording its routing fails


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return workbench.Store(tmp_path_factory.mktemp("families") / "w.duckdb")


def record(family: str, store):
    torch.manual_seed(0)
    hf = tiny_family(family)
    adapter = adapter_for(hf)  # its load-time probe of the routers runs before the reference listens
    ref = RouterReference(hf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = workbench.record(PROMPT, model=adapter, max_new_tokens=NEW, db=store, detect=False)
    return hf, adapter, run, ref.close(), [str(w.message) for w in caught]


def by_expert(idx: np.ndarray, w: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((idx.shape[0], n))
    np.add.at(out, (np.arange(idx.shape[0])[:, None], idx), w)
    return out


def test_every_family_is_enumerated_and_most_are_exact():
    assert len(FAMILIES) >= 66 and {"mixtral", "jamba", "dbrx", "llama4_text", "gemma4", "hy_v4"} <= set(FAMILIES)
    assert len([f for f in FAMILIES if f not in UNROUTED]) >= EXACT_AT_LEAST
    assert set(UNROUTED) | OBSERVED | set(PARTLY) <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_records_its_routers_choice(family, store):
    hf, adapter, run, ref, msgs = record(family, store)
    s = run.model_summary
    n_tok = run.tokens().height  # generation may stop early at the family's end-of-sequence token
    assert run.status == "complete" and len(PROMPT) < n_tok <= len(PROMPT) + NEW
    assert all("\n" not in n for n in s.notes)  # each note is one line
    assert run.signal("resid_norm")["layer"].n_unique() == s.n_layers  # every layer's residual stream
    if any(a is not None for a in adapter.attn):  # attention where a layer has it
        assert set(run.signal("attention")["layer"].unique()) <= {i for i, a in enumerate(adapter.attn) if a is not None}
        assert run.signal("attention").height > 0
    rt = run.routing()
    if family in UNROUTED:
        assert s.moe_layers == [] and s.unrouted_layers and rt.height == 0
        assert any(UNROUTED[family] in n and "not recorded" in n for n in s.notes), s.notes
        assert any("no adapter recognises" in m for m in msgs)  # said once, as the recording starts
        return
    assert s.moe_layers and sorted(rt["layer"].unique().to_list()) == s.moe_layers
    assert sorted(ref) == sorted(set(s.moe_layers) | set(PARTLY.get(family, ([], ""))[0]))
    if family in PARTLY:
        layers, what = PARTLY[family]
        assert s.unrouted_layers == layers and any(what in n for n in s.notes)
    else:
        assert s.unrouted_layers == []  # a dense layer of an MoE family is dense, not "unrecognised"
    for layer in s.moe_layers:
        got = rt.filter(pl.col("layer") == layer).sort("pos", "slot")
        idx_ref, w_ref = (t.numpy() for t in ref[layer])
        k = idx_ref.shape[1]
        assert got.height == idx_ref.shape[0] * k == (n_tok - 1) * k
        idx = got["expert"].to_numpy().reshape(-1, k)
        np.testing.assert_array_equal(np.sort(idx, 1), np.sort(idx_ref, 1))  # the router's own choice, per token
        n = max(s.n_routed_experts, int(idx_ref.max()) + 1)
        np.testing.assert_allclose(by_expert(idx, got["weight"].to_numpy().reshape(-1, k), n),
                                   by_expert(idx_ref, w_ref, n), atol=1e-4)
        assert adapter.router(layer).exact == (family not in OBSERVED)
    if family in OBSERVED:
        assert any("not modelled" in n for n in s.notes)
    assert len({tuple(r) for r in idx_ref.tolist()}) >= 2  # routing depends on the input


def test_hybrid_layers_record_routing_and_name_the_other_kinds(store):
    _, adapter, run, _, _ = record("jamba", store)
    s = run.model_summary
    assert s.moe_layers == [1, 3] and [i for i, a in enumerate(adapter.attn) if a is not None] == [1, 3]
    assert sorted(run.signal("attention")["layer"].unique().to_list()) == [1, 3]
    assert any("[0, 2] have no softmax attention (JambaMambaMixer)" in n for n in s.notes), s.notes


@pytest.mark.parametrize("family,linear", [("minimax", [3]), ("kimi_linear", [0, 1, 2])])
def test_linear_attention_in_a_softmax_attention_slot_is_not_read_as_probabilities(family, linear, store):
    """A layer the config declares linear attention is no softmax attention even in ``self_attn`` (MiniMax's lightning
    attention returns a matrix whose rows sum to 10-80 beside its output: read as probabilities, every clean run had
    a critical NaN entropy row at that layer); a full-attention layer whose class name says the family's "Linear"
    (Kimi-Linear's) is still read. The run has no NaN in its attention rows and its notes name the layers."""
    _, adapter, run, _, _ = record(family, store)
    assert [i for i, a in enumerate(adapter.attn) if a is None] == linear
    att = run.signal("attention")
    assert set(att["layer"].unique().to_list()) == set(range(adapter.summary.n_layers)) - set(linear)
    assert att.filter(~pl.col("entropy").is_finite()).height == 0
    assert any(f"{linear} have no softmax attention" in n for n in run.model_summary.notes)


def test_attention_head_experts_are_noted(store):
    s = record("jetmoe", store)[2].model_summary  # its MLP experts are routed, its attention-head experts noted
    assert s.moe_layers == [0, 1, 2, 3] and any("attention-head experts (JetMoeAttention)" in n for n in s.notes)


def test_a_dense_first_layer_of_an_moe_family_is_dense(store):
    for family in ("glm4_moe", "bailing_hybrid"):  # Glm4MoeMLP, a linear-attention forget gate: no experts
        s = record(family, store)[2].model_summary
        assert 0 not in s.moe_layers and s.unrouted_layers == [] and "unrecognised" not in s.describe()


def test_parallel_streams_looped_layers_and_per_layer_heads(store):
    s = record("hy_v4", store)[2].model_summary  # 4 residual streams: the run is written, one norm per token
    assert any("4 parallel streams" in n for n in s.notes)
    hf, _, run, ref, _ = record("inkling2_loop_text", store)  # looped layers: their first pass
    assert any("first pass" in n for n in run.model_summary.notes)
    _, adapter, run, _, _ = record("dots3_note_text", store)  # a layer with its own head count
    assert any("another head count" in n for n in run.model_summary.notes)
    assert run.signal("head_norm")["head"].n_unique() == run.model_summary.n_heads


def test_zero_experts_are_recorded_as_the_router_chose_them(store):
    """LongCat-Flash's zero-compute (identity) experts, scored by its router beside the real ones: its experts module
    applies them (transformers 5.24), or its MoE block does and hands the experts module those slots as a real expert
    with weight 0 (5.25). Either way a token sent there is recorded as the router chose it (expert 8 or 9, with its
    weight), and the router's rule is matched exactly."""
    _, adapter, run, _, _ = record("longcat_flash", store)
    s = run.model_summary
    zero = run.routing().filter(pl.col("expert") >= 8)
    assert s.n_routed_experts == 10 and zero.height and (zero["weight"] > 0).all()
    assert all(adapter.router(i).exact and not adapter.router(i).norm for i in s.moe_layers)
    if getattr(adapter.moe[s.moe_layers[0]][0], "zero_expert_num", 0):  # the block applies them: a note says so
        assert any("zero-compute experts its MoE block applies itself" in n for n in s.notes), s.notes


def test_indexed_attention_layers_reading_another_layers_keys_record_attention(store):
    """Kolibri 1.1 (transformers 5.25): a sliding layer, an indexer, a sliding layer and a reindexer that attends to the
    indexer's keys and values (the tiny layout; the default's indexers fail validation once shrunk)."""
    if "kolibri1_1" not in FAMILIES:
        pytest.skip("transformers before 5.25 has no kolibri1_1")
    hf, adapter, run, _, _ = record("kolibri1_1", store)
    assert hf.config.kv_sharing_modes == [None, "store", None, "reuse"] and hf.config.index_layers == [1]
    assert run.model_summary.moe_layers == [1, 2, 3]
    assert sorted(run.signal("attention")["layer"].unique().to_list()) == [0, 1, 2, 3]


def test_a_router_that_fails_when_probed_records_without_routing(store, monkeypatch):
    hf = tiny_family("mixtral")
    for layer in hf.model.layers:
        def broken(*_a, **_k):
            raise RuntimeError("custom kernel missing")
        monkeypatch.setattr(layer.mlp.gate, "forward", broken)
    adapter = adapter_for(hf)
    assert adapter.summary.moe_layers == [] and adapter.summary.unrouted_layers == [0, 1, 2, 3]
    assert any("custom kernel missing" in n for n in adapter.summary.notes)


def test_a_failing_routing_attach_shows_its_own_error(store, monkeypatch):
    adapter = adapter_for(tiny_family("mixtral"))

    def boom():
        raise RuntimeError("attach failed")
    monkeypatch.setattr(adapter, "_attach_routing", boom)
    with pytest.raises(RuntimeError, match="attach failed"):  # not "'HFAdapter' object has no attribute ..."
        with adapter.seams({"routed": lambda *_: None}):
            pass


@pytest.mark.parametrize("family", ["mixtral", "gemma4_text", "llama4_text", "hy_v3", "jetmoe", "longcat_flash"])
def test_rerouting_reaches_the_experts_whatever_the_seam(family):
    """Removing an expert re-routes its tokens, and the experts receive the new choice: the experts' call (Mixtral,
    HY-V3 whose router takes its bias as an argument), a router's output tuple (Gemma 4; LongCat-Flash from
    transformers 5.25, whose block re-points its zero experts' slots), a dense score matrix (Llama 4), tokens sorted
    by expert (JetMoE)."""
    torch.manual_seed(0)
    adapter = adapter_for(tiny_family(family))
    ids = torch.tensor([PROMPT])
    base = adapter.routing_of(ids)
    layer = adapter.summary.moe_layers[-1]
    expert = int(base[layer].flatten().mode().values)

    def remove(i, r):
        if i == layer:
            keep = torch.ones_like(r.logits, dtype=torch.bool)
            keep[:, expert] = False
            r.remove(keep)
    with torch.no_grad(), adapter.seams({"route": remove}):
        ref = RouterReference(adapter.module)  # its hooks after the adapter's: it sees what the experts get
        before = adapter.forward(ids)
    got = ref.close()[layer][0]
    assert expert in base[layer] and expert not in got  # what the experts received
    with torch.no_grad():
        after = adapter.forward(ids)
    assert not torch.allclose(before, after)  # and it changed the model's output


@pytest.mark.parametrize("family", ["qwen2_moe", "ernie4_5_moe", "deepseek_v4", "dbrx"])
def test_rules_are_matched_in_bfloat16_folders(family, tmp_path):
    """A folder loaded in bfloat16 (a router kept in fp32 beside bf16 experts, weights rounded to bf16) still has its
    router's rule matched, not reported as approximate."""
    tiny_family(family).save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    adapter = load_adapter(tmp_path, dtype=torch.bfloat16)
    assert adapter.summary.moe_layers and all(adapter.router(i).exact for i in adapter.summary.moe_layers)
    assert not any("not modelled" in n for n in adapter.summary.notes)


@pytest.mark.parametrize("family", ["hunyuan_v1_moe", "dbrx", "qwen3_next"])
def test_fault_kinds_act_or_say_why_not_on_every_layout(family):
    """The fault registry on layouts it was not written for: a router whose weight sits in a child (HunYuan's gate
    ``wg``) is edited there, and a kind whose part a layer lacks (a fused QKV projection, a linear-attention layer:
    no separate KV latent) is a ValueError naming it, never an AttributeError that ends a benchmark."""
    from workbench.analysis import faults

    torch.manual_seed(0)
    a = adapter_for(tiny_family(family))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        base = a.forward(ids)
    layer = a.summary.moe_layers[-1]
    router = a.parts(layer)["router"]
    assert router.weight.dim() == 2 and router.weight.size(0) == a.summary.n_routed_experts
    acted = set()
    for name in ("router_affinity", "kv_latent", "kv_noise", "final_norm", "layer_swap"):
        kind = faults.ALL_KINDS[name]
        for lay in kind.layers(a):
            try:
                n = kind.n_index(a, lay)
                made = kind(a, lay, min(2, n - 1) if n else 0)
                with torch.no_grad(), made:
                    broken = a.forward(ids)
            except ValueError as e:
                assert "layer" in str(e) or "final norm" in str(e), (name, e)
                continue
            assert not torch.equal(broken, base), (name, lay)
            acted.add(name)
    assert {"router_affinity", "final_norm", "layer_swap"} <= acted  # the router found, the far end, whole blocks
    with torch.no_grad():
        assert torch.equal(a.forward(ids), base)


def test_a_family_whose_final_norm_is_not_found_still_gets_an_activation_profile():
    """LFM2-MoE's final norm has a name the adapter does not know: the profile holds no answer for it (the final-norm
    fault kind says so), and is built all the same (the norms' known answers once made building it fail)."""
    from workbench.analysis import activations, faults

    torch.manual_seed(0)
    a = adapter_for(tiny_family("lfm2_moe"))
    with pytest.raises(ValueError, match="final norm"):
        a.final_norm()
    prof = activations.build(a, [list(range(5, 25)), list(range(30, 50)), list(range(60, 80))])
    assert prof.filter(pl.col("kind") == "final_norm").height == 0 and prof.height > 0
    with pytest.raises(ValueError, match="final norm"):
        faults.HELD_OUT["final_norm"](a)


def test_a_tiny_folder_of_any_family_is_made_where_the_benchmarks_make_them(tmp_path):
    """``make_folder`` builds any MoE family of transformers (its own default config shrunk, as ``tiny_family``), with
    the tiny tokenizer and its provenance, and refuses a name it does not know."""
    from workbench.capture.tiny import make_folder

    folder = make_folder("phimoe", tmp_path / "phimoe")
    assert json.loads((folder / "tiny.json").read_text())["family"] == "phimoe"
    assert load_adapter(str(folder)).summary.family == "phimoe"
    with pytest.raises(ValueError, match="unknown family"):
        make_folder("no_such_family", tmp_path / "x")
