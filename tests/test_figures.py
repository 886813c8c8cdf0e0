"""workbench.views.figures: every figure's data equal the query layer's numbers; token text escaped."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import plotly.graph_objects as go
import polars as pl
import pytest

import workbench
from workbench.data import query
from workbench.model import ModelArgs, Transformer, load_tokenizer
from workbench.views import figures

XSS = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    args = dataclasses.replace(ModelArgs.preset("tiny"), vocab_size=4096)
    model = Transformer(args).init_weights(seed=1, std=0.1).eval()
    db = tmp_path_factory.mktemp("fig") / "wb.duckdb"
    r = workbench.record("def fibonacci(n):\n    return", model=model, tokenizer=load_tokenizer(),
                         max_new_tokens=10, db=db)
    # untrusted token text, as a model could emit it
    r.store.execute("UPDATE tokens SET text = ? WHERE run_id = ? AND pos = 3", [XSS, r.run_id])
    return r


def _strings(fig: go.Figure) -> str:
    return json.dumps(fig.to_plotly_json(), default=str)


def test_tokens_confidence_equals_store(run):
    t = query.tokens(run.store, run.run_id).filter(pl.col("pos") > 0)
    fig = run.fig_tokens()
    assert list(fig.data[0].x) == t["pos"].to_list()
    np.testing.assert_allclose(fig.data[0].y, t["confidence"].to_numpy())
    np.testing.assert_allclose(fig.data[1].y, t["prob"].to_numpy())


def test_tokens_follow_replay_step(run):
    n_prompt = run.info["n_prompt_tokens"]
    fig = run.fig_tokens(step=2)  # prompt (pos 1..n_prompt-1) + tokens produced by steps 0, 1, 2
    assert list(fig.data[0].x) == list(range(1, n_prompt + 3))


def test_token_heads_matrix(run):
    pos = 5
    h = query.token_heads(run.store, run.run_id, pos)
    z = np.array(run.fig_token_heads(pos).data[0].z, dtype=float)
    assert z.shape == (h["layer"].n_unique(), h["head"].n_unique())
    for r in h.iter_rows(named=True):
        assert z[r["layer"], r["head"]] == pytest.approx(r["entropy"])


def test_token_routing_matrix(run):
    pos = 4
    r = query.token_routing(run.store, run.run_id, pos)
    fig = run.fig_token_routing(pos)
    z = np.array(fig.data[0].z, dtype=float)
    layers = sorted(set(r["layer"].to_list()))
    assert z.shape == (len(layers), run.config["n_routed_experts"])
    for row in r.iter_rows(named=True):
        assert z[layers.index(row["layer"]), row["expert"]] == pytest.approx(row["weight"])
    # exactly k experts chosen per layer, the rest blank
    assert (~np.isnan(z)).sum(axis=1).tolist() == [run.config["n_activated_experts"]] * len(layers)


def test_topk_bars(run):
    pos = run.info["n_prompt_tokens"] + 1
    row = query.tokens(run.store, run.run_id).row(pos, named=True)
    fig = run.fig_topk(pos)
    np.testing.assert_allclose(list(fig.data[0].x)[::-1], row["topk_probs"])
    assert list(fig.data[0].x)[::-1] == sorted(row["topk_probs"], reverse=True)
    tok = load_tokenizer()
    assert [figures.token_label(tok.decode([i]), 20) for i in row["topk_ids"]] == \
        [y.split(". ", 1)[1] for y in list(fig.data[0].y)[::-1]]
    with pytest.raises(ValueError, match="no token at position"):
        run.fig_topk(10_000)


def test_head_entropy_and_along(run):
    h = query.head_entropy(run.store, run.run_id)
    z = np.array(run.fig_head_entropy().data[0].z, dtype=float)
    for r in h.iter_rows(named=True):
        assert z[r["layer"], r["head"]] == pytest.approx(r["entropy"])
    fig = run.fig_entropy_along(heads=[(0, 1), (1, 3)])
    a = query.attention(run.store, run.run_id)
    assert [t.name for t in fig.data] == ["layer 0, head 1", "layer 1, head 3"]
    ref = a.filter((pl.col("layer") == 1) & (pl.col("head") == 3)).sort("pos")
    np.testing.assert_allclose(fig.data[1].y, ref["entropy"].to_numpy())
    assert len(run.fig_entropy_along().data) == 4  # default: the 4 most diffuse heads
    with pytest.raises(ValueError, match="layer 9"):
        run.fig_entropy_along(heads=[(9, 0)])


def test_expert_load_rows_sum_to_one(run):
    z = np.array(run.fig_expert_load().data[0].z, dtype=float)
    np.testing.assert_allclose(z.sum(axis=1), 1.0)
    load = query.expert_load(run.store, run.run_id)
    assert z.shape[0] == load["layer"].n_unique()


def test_coactivation_symmetric_and_counts(run):
    layer = int(query.expert_load(run.store, run.run_id)["layer"].min())
    z = np.array(run.fig_coactivation().data[0].z, dtype=float)
    np.testing.assert_array_equal(z, z.T)
    # top-2 routing: each token gives one unordered pair, counted in both cells
    n_tokens = query.routing(run.store, run.run_id).filter(pl.col("layer") == layer)["pos"].n_unique()
    assert z.sum() == 2 * n_tokens


def test_load_along_windows(run):
    fig = run.fig_load_along(window=4)
    z = np.array(fig.data[0].z, dtype=float)  # experts x windows
    np.testing.assert_allclose(z.sum(axis=0), 1.0)
    with pytest.raises(ValueError, match="window"):
        run.fig_load_along(window=0)


def test_kv_bytes_stack_equals_total(run):
    kv = query.kv(run.store, run.run_id)
    fig = run.fig_kv_bytes()
    last = int(kv["step"].max())
    total = sum(tr.y[list(tr.x).index(last)] for tr in fig.data)
    assert total == kv.filter(pl.col("step") == last)["bytes"].sum()
    assert len(run.fig_kv_bytes(step=1).data[0].x) == 2


def test_kv_received(run):
    kt = query.kv_tokens(run.store, run.run_id)
    last = kt.filter(pl.col("step") == kt["step"].max())
    fig = run.fig_kv_received(layer=1)
    np.testing.assert_allclose(fig.data[0].y, last.filter(pl.col("layer") == 1).sort("pos")["attn_received"].to_numpy())
    z = np.array(run.fig_kv_received().data[0].z, dtype=float)
    assert z.shape == (last["layer"].n_unique(), last["pos"].n_unique())


def test_attribution_from_table(run):
    pos = 6
    empty = run.fig_attribution(pos)
    assert len(empty.data) == 0 and "no attribution" in empty.layout.title.text
    scores = [0.5, -0.25, 0.1, 0.0, 0.3, 0.05]
    df = pl.DataFrame({"run_id": run.run_id, "target_pos": pos, "kind": "token", "source_pos": list(range(pos)),
                       "score": scores, "rank": list(range(1, pos + 1)), "method": "ig_routing_frozen",
                       "delta": 1e-5})
    run.store.replace_rows("attributions", {"run_id": run.run_id, "target_pos": pos}, df)
    fig = run.fig_attribution(pos)
    assert list(fig.data[0].x) == list(range(pos))
    np.testing.assert_allclose(fig.data[0].z[0], scores)
    assert XSS not in _strings(fig) and "&lt;img src=x onerror=alert(1)&gt;" in _strings(fig)


def test_token_text_escaped_everywhere(run):
    for fig in (run.fig_tokens(), run.fig_entropy_along(), run.fig_kv_received(), run.fig_kv_received(layer=0),
                run.fig_topk(4)):
        s = _strings(fig)
        assert "<img" not in s, fig.layout.title.text
    assert figures.token_label(XSS, 60) == "&lt;img src=x onerror=alert(1)&gt;"
    assert figures.token_label("\n") == "\u21b5" and figures.token_label("  ") == "\u00b7\u00b7"


def test_dense_run_gives_empty_expert_figures(tmp_path):
    args = dataclasses.replace(ModelArgs.preset("tiny"), vocab_size=4096, n_dense_layers=2)
    model = Transformer(args).init_weights(seed=2, std=0.1).eval()
    r = workbench.record([5, 6, 7], model=model, max_new_tokens=3, db=tmp_path / "d.duckdb")
    for fig in (r.fig_expert_load(), r.fig_coactivation(), r.fig_load_along(), r.fig_token_routing(1)):
        assert len(fig.data) == 0 and "no routing" in fig.layout.title.text


def test_figures_carry_the_validated_plotly_white_template(run):
    """``_layout`` assigns the registered template without plotly's per-figure validation: the figure's
    JSON must be what ``update_layout(template="plotly_white")`` gives, and the registered template stays
    untouched when a figure's template is edited."""
    import plotly.io as pio

    fig = run.fig_head_entropy()
    ref = go.Figure(fig).update_layout(template="plotly_white")
    assert fig.to_dict()["layout"]["template"] == ref.to_dict()["layout"]["template"]
    assert fig.to_dict()["layout"]["template"] == pio.templates["plotly_white"].to_plotly_json()
    before = pio.templates["plotly_white"].to_plotly_json()
    fig.layout.template.layout.font.size = 31
    assert pio.templates["plotly_white"].to_plotly_json() == before


def test_component_names_say_what_each_row_is():
    """Rows without a layer (the embedding and output weight rows) are named by their kind and source position,
    never "LNone"; the title names the methods the scores come from."""
    from workbench.views.figures import fig_components

    rows = pl.DataFrame({"target_pos": [5] * 5, "kind": ["attn_block", "head", "embed", "unembed", "token"],
                         "layer": [0, 2, None, None, None], "head": [None, 1, None, None, None],
                         "expert": [None] * 5, "source_pos": [None, None, 3, None, 2],
                         "score": [4.0, 1.0, 0.5, 0.3, 2.0], "rank": [1, 2, 3, 4, 5],
                         "method": ["profile", "ablation", "row_evidence", "row_evidence", "ig_plain"]})
    fig = fig_components(rows, 5)
    names = list(fig.data[0].y)
    assert names == ["unembed", "embed at pos 3", "L2 head 1", "L0 attn_block"]
    assert "ablation, profile, row_evidence" in fig.layout.title.text
