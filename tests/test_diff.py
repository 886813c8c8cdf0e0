"""Run comparison: identity, fp32 vs bf16 twin, an edited prompt, frames against a direct computation."""
from __future__ import annotations

import json

import plotly.graph_objects as go
import polars as pl
import pytest
from helpers import tiny_model

from workbench import cli, record
from workbench.analysis.diff import diff_runs
from workbench.data.store import Store
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.run import Workbench

PROMPT = [5, 17, 42, 7, 99, 3, 64, 12]
EDIT = 4  # position changed in the edited prompt
NEW = 10


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    model = tiny_model()
    ckpt = str(save_checkpoint(model, root / "ckpt", tokenizer=DEFAULT_TOKENIZER))
    store = Store(root / "wb.duckdb")
    edited = list(PROMPT)
    edited[EDIT] = 200
    return {
        "store": store,
        "fp32": record(PROMPT, model=ckpt, max_new_tokens=NEW, db=store),
        "bf16": record(PROMPT, model=ckpt, max_new_tokens=NEW, db=store, dtype="bfloat16"),
        "edited": record(edited, model=ckpt, max_new_tokens=NEW, db=store),
    }


def test_diff_of_a_run_with_itself_is_all_zeros(env):
    a = env["fp32"].run_id
    d = Workbench(env["store"]).diff(a, a)
    s = d.summary
    assert s["first_divergence_pos"] is None and s["first_signal_divergence"] is None
    assert s["token_diff_share"] == 0.0 and s["n_compared"] == PROMPT.__len__() + NEW
    for k in ("mean_abs_d_confidence", "max_abs_d_confidence", "mean_abs_d_logprob", "max_abs_d_logprob",
              "mean_abs_d_head_entropy", "max_abs_d_head_entropy", "routing_change_share_all"):
        assert s[k] == 0.0, k
    assert d.tokens["same_token"].all()
    assert d.tokens["d_logprob"].drop_nulls().abs().max() == 0.0
    assert (d.heads["d_entropy"] == 0).all() and (d.routing["changed_share"] == 0).all()
    assert d.heads.height == 2 * 4  # tiny: 2 layers x 4 heads
    assert d.routing["layer"].to_list() == [1]  # tiny: layer 0 dense, layer 1 MoE


def test_bf16_twin_reports_a_plausible_divergence_or_none(env):
    a, b = env["fp32"], env["bf16"]
    s = diff_runs(env["store"], a.run_id, b.run_id).summary
    assert (s["dtype_a"], s["dtype_b"]) == ("float32", "bfloat16") and s["same_prompt"] and s["same_checkpoint"]
    # bf16 rounding moves the signals a little, not a lot
    assert 0 < s["mean_abs_d_confidence"] < 0.05
    assert 0 < s["mean_abs_d_logprob"] < 1.0
    assert s["mean_abs_d_head_entropy"] < 0.05
    first = s["first_divergence_pos"]
    if first is not None:
        # the prompt is shared, so tokens can only part after it, and every earlier token agrees
        assert first >= len(PROMPT)
        ta, tb = a.tokens(), b.tokens()
        assert ta["token_id"].to_list()[:first] == tb["token_id"].to_list()[:first]
        # plausible: bf16's choice was among fp32's top alternatives at that position
        assert tb["token_id"][first] in ta["topk_ids"][first].to_list()
    sig = s["first_signal_divergence"]
    assert sig is not None and sig["magnitude"] is not None and sig["magnitude"] > 1e-4


def test_edited_prompt_diverges_at_the_edit(env):
    a, c = env["fp32"], env["edited"]
    d = diff_runs(env["store"], a.run_id, c.run_id)
    s = d.summary
    assert not s["same_prompt"]
    assert s["first_divergence_pos"] == EDIT
    assert s["first_divergence_tokens"]["token_id_a"] == PROMPT[EDIT]
    assert s["first_divergence_tokens"]["token_id_b"] == 200
    assert (s["first_signal_divergence"]["pos"], s["first_signal_divergence"]["signal"]) == (EDIT, "tokens.token_id")
    # before the edit the runs saw the same context: the same signals there, up to fp32 summation order (an
    # expert's batch of tokens differs once the edited token routes elsewhere, so its matmul rounds otherwise)
    before = d.tokens.filter(pl.col("pos") < EDIT)
    assert before["same_token"].all() and before["d_logprob"].drop_nulls().abs().max() < 1e-5


def test_frames_equal_a_direct_computation(env):
    a, c = env["fp32"], env["edited"]
    d = diff_runs(env["store"], a.run_id, c.run_id)
    ta, tc = a.tokens(), c.tokens()
    j = ta.join(tc, on="pos", suffix="_c")
    assert d.tokens["d_logprob"].to_list()[1:] == pytest.approx((j["logprob_c"] - j["logprob"]).to_list()[1:])
    assert d.tokens["d_confidence"].to_list()[1:] == pytest.approx((j["confidence_c"] - j["confidence"]).to_list()[1:])
    assert d.summary["token_diff_share"] == pytest.approx(float((j["token_id"] != j["token_id_c"]).mean()))
    # routing: slot-by-slot share of differing experts, per layer
    r = a.routing().join(c.routing(), on=["pos", "layer", "slot"], suffix="_c")
    want = r.group_by("layer").agg((pl.col("expert") != pl.col("expert_c")).mean().alias("share")).sort("layer")
    assert d.routing["changed_share"].to_list() == pytest.approx(want["share"].to_list())
    assert d.summary["routing_change_share"] == {str(k): pytest.approx(v) for k, v in want.iter_rows()}
    # heads: change in mean entropy over shared positions (pos > 0)
    h = a.attention().join(c.attention(), on=["pos", "layer", "head"], suffix="_c").filter(pl.col("pos") > 0)
    want = h.group_by("layer", "head").agg((pl.col("entropy_c") - pl.col("entropy")).mean().alias("d")) \
        .sort("layer", "head")
    assert d.heads["d_entropy"].to_list() == pytest.approx(want["d"].to_list())


def test_figures_and_cli(env, capsys):
    a, c = env["fp32"], env["edited"]
    figs = diff_runs(env["store"], a.run_id, c.run_id).figures()
    assert set(figs) == {"confidence", "delta", "heads", "routing"}
    for f in figs.values():
        assert isinstance(f, go.Figure) and len(f.data) > 0
    assert cli.main(["diff", a.run_id, c.run_id, "--json", "--db", str(env["store"].path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["first_divergence_pos"] == EDIT
    assert cli.main(["diff", a.run_id, c.run_id, "--db", str(env["store"].path)]) == 0
    assert f"first divergence at pos {EDIT}" in capsys.readouterr().out
    assert cli.main(["diff", a.run_id, "nope", "--db", str(env["store"].path)]) == 2


def test_table_pair_equals_two_table_reads(env):
    """first_divergence reads both runs of a table in one query: the same frames as one read per run."""
    from workbench.analysis.diff import COMPARED
    from workbench.data import query

    a, c = env["fp32"].run_id, env["edited"].run_id
    for table in ("tokens", "attention", "routing", "kv_tokens"):
        cols = [col for col in query.table(env["store"], table, a, "1").columns]
        order = ", ".join(COMPARED[table][0])  # the table's key: a total order
        fa, fc = query.table_pair(env["store"], table, a, c, order, cols)
        assert fa.height and fc.height
        assert fa.equals(query.table(env["store"], table, a, order, cols))
        assert fc.equals(query.table(env["store"], table, c, order, cols))
