"""The logit lens (issue 27, point 3): at the last layer it is the model's own output distribution, on our model and
on tiny transformers folders; its rows are stored and read back without the model; its heat map in the Run view and
in the report."""
from __future__ import annotations

import json
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.analysis import lens as lens_mod
from workbench.capture.adapters import adapter_for
from workbench.data import query
from workbench.data.store import Store
from workbench.model import load_tokenizer
from workbench.views import figures
from workbench.views import report as report_mod

pytestmark = pytest.mark.usefixtures("one_thread")

EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def native(tmp_path_factory, one_thread):
    db = tmp_path_factory.mktemp("lens") / "w.duckdb"
    model, tok = tiny_model(vocab_size=4096), load_tokenizer()
    run = workbench.record("alpha = 1\nbeta = 2\n", model=model, tokenizer=tok, max_new_tokens=6, db=db)
    return {"run": run, "model": model, "tok": tok, "db": db}


def own_distribution(adapter, ids: list[int]) -> dict[str, list]:
    """The model's own output at every position (a plain forward): prob and rank of the next token, and the top-1."""
    with torch.no_grad(), adapter._without_cache():
        logits = adapter.forward(torch.tensor([ids]))[0, :-1].float()
    nxt = torch.tensor(ids[1:])
    p = logits.softmax(-1)
    chosen = logits.gather(1, nxt[:, None])[:, 0]
    return {"prob": p.gather(1, nxt[:, None])[:, 0].tolist(), "rank": ((logits > chosen[:, None]).sum(-1) + 1).tolist(),
            "top_token_id": logits.argmax(-1).tolist(), "top_prob": p.max(-1).values.tolist()}


def check_last_layer(run, adapter) -> None:
    df = run.logit_lens()
    t = run.tokens()
    ids = t["token_id"].to_list()
    n_layers = run.model_summary.n_layers
    assert df.columns[:6] == ["pos", "layer", "token_id", "prob", "rank", "top_token_id"]
    assert df.height == (len(ids) - 1) * n_layers and set(df["layer"].to_list()) == set(range(n_layers))
    last = df.filter(pl.col("layer") == n_layers - 1).sort("pos")
    assert last["pos"].to_list() == list(range(1, len(ids))) and last["token_id"].to_list() == ids[1:]
    own = own_distribution(adapter, ids)
    assert last["prob"].to_list() == pytest.approx(own["prob"], rel=1e-5, abs=1e-7)
    assert last["rank"].to_list() == own["rank"]
    assert last["top_token_id"].to_list() == own["top_token_id"]
    assert last["top_prob"].to_list() == pytest.approx(own["top_prob"], rel=1e-5)
    # and what the recorder stored for those tokens (incremental decoding: equal up to float error)
    assert last["prob"].to_list() == pytest.approx(t["prob"].to_list()[1:], rel=1e-3, abs=1e-6)
    assert last["rank"].to_list() == t["rank"].to_list()[1:]
    # an earlier layer is another distribution (the lens reads each layer's own stream)
    first = df.filter(pl.col("layer") == 0).sort("pos")
    assert first["prob"].to_list() != pytest.approx(last["prob"].to_list(), rel=1e-3)


def test_last_layer_is_the_models_own_distribution_native(native):
    check_last_layer(native["run"], adapter_for(native["model"]))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "llama"])
def test_last_layer_is_the_models_own_distribution_on_transformers(family, tmp_path):
    from workbench.capture.tiny import make_folder
    folder = make_folder(family, tmp_path / family)
    run = workbench.record("def add(a, b):\n", model=str(folder), max_new_tokens=5, db=tmp_path / "w.duckdb")
    check_last_layer(run, run.adapter())
    adapter = run.adapter()
    assert adapter.final_norm() is adapter.module.model.norm


def test_an_intermediate_layer_is_its_own_stream_through_norm_and_head(native):
    """Layer 0's row: the residual stream after block 0 (captured by workbench.capture), through the final norm and
    the unembedding by hand."""
    run, model = native["run"], native["model"]
    ids = run.tokens()["token_id"].to_list()
    h = workbench.capture(model, ids, "layers.0.hook_resid_post")["layers.0.hook_resid_post"][0, :-1]
    with torch.no_grad():
        p = model.head(model.norm(h)).float().softmax(-1)
    want = p.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    got = run.logit_lens().filter(pl.col("layer") == 0).sort("pos")
    assert got["prob"].to_list() == pytest.approx(want, rel=1e-5, abs=1e-8)
    assert got["top_token_id"].to_list() == p.argmax(-1).tolist()
    tok = native["tok"]
    assert got["top_text"].to_list() == [tok.decode([i]) for i in p.argmax(-1).tolist()]


def test_rows_are_stored_and_read_back_without_the_model(native, monkeypatch):
    run = native["run"]
    first = run.logit_lens()
    stored = query.table(run.store, "logit_lens", run.run_id, "pos, layer")
    assert stored.height == first.height and stored["created_at"].null_count() == 0
    # a fresh Run of the store (no model): the second call reads the table, never loads or runs a model
    monkeypatch.setattr(lens_mod, "compute", lambda *a, **k: pytest.fail("the logit lens was recomputed"))
    monkeypatch.setattr(workbench.Run, "adapter", lambda self: pytest.fail("a model was loaded"))
    again = workbench.open(run.store).run(run.run_id)
    assert again.logit_lens().equals(first)
    at = again.logit_lens(3)
    assert set(at["pos"].to_list()) == {3} and at.height == run.model_summary.n_layers
    assert at["text"].to_list() == [run.tokens()["text"][3]] * at.height  # the produced token's own text
    assert set(again.logit_lens([2, 4])["pos"].to_list()) == {2, 4}
    with pytest.raises(ValueError, match="outside"):
        again.logit_lens(0)
    with pytest.raises(ValueError, match="outside"):
        again.logit_lens(run.tokens().height)


def test_recompute_replaces_the_runs_rows(native):
    run = native["run"]
    run.logit_lens()
    before = query.table(run.store, "logit_lens", run.run_id, "pos, layer")
    run.logit_lens(recompute=True)
    after = query.table(run.store, "logit_lens", run.run_id, "pos, layer")
    assert after.height == before.height  # replaced, not appended
    assert after.drop("created_at").equals(before.drop("created_at"))


def test_the_heat_map_escapes_token_text_on_hover(native):
    df = native["run"].logit_lens().with_columns(pl.lit(EVIL).alias("top_text"), pl.lit(EVIL).alias("text"))
    fig = figures.logit_lens_figure(df)
    n_layers = native["run"].model_summary.n_layers
    assert len(fig.data[0].z) == n_layers and len(fig.data[0].z[0]) == df["pos"].n_unique()
    hover = json.dumps(fig.to_plotly_json()["data"][0]["customdata"])
    assert "<img" not in hover and "&lt;img src=x onerror=" in hover
    ticks = " ".join(fig.layout.xaxis.ticktext)
    assert "<img" not in ticks
    assert figures.logit_lens_figure(df.head(0)).layout.title.text.startswith("no logit-lens rows")


def test_run_view_button_computes_then_reads(native, monkeypatch):
    from workbench.apps.shared import AppContext
    from workbench.apps.tabs import run_view, runs

    run = native["run"]
    app = AppContext(Store(native["db"]), native["model"], native["tok"])
    s = app.session()
    runs.refresh_runs(app, s, None)
    run_view.load_run(app, s, run.run_id)
    quiet = lambda *a, **k: None  # noqa: E731 - gr.Progress outside a server
    run.store.replace_rows("logit_lens", {"run_id": run.run_id}, pl.DataFrame({"run_id": [run.run_id]}).head(0))
    msg, fig = run_view.logit_lens(app, s, run.run_id, progress=quiet)
    n = run.tokens().height
    assert f"{n - 1} positions x {run.model_summary.n_layers} layers" in msg
    assert len(fig.data[0].z) == run.model_summary.n_layers and len(fig.data[0].z[0]) == n - 1
    monkeypatch.setattr(lens_mod, "compute", lambda *a, **k: pytest.fail("the logit lens was recomputed"))
    msg2, _ = run_view.logit_lens(app, s, run.run_id, progress=quiet)  # stored now: read back
    assert msg2 == msg
    assert run_view.logit_lens(app, s, None, progress=quiet) == ("Choose a run first.", None)


def test_run_view_says_why_without_the_model(tmp_path, monkeypatch):
    """A run whose model is not here: a one-line message, no figure, the app alive."""
    from workbench.apps.shared import AppContext
    from workbench.apps.tabs import run_view

    model = tiny_model(vocab_size=4096)
    run = workbench.record([5, 6, 7, 8], model=model, max_new_tokens=3, db=tmp_path / "w.duckdb")
    app = AppContext(run.store, tiny_model(seed=9, vocab_size=4096), load_tokenizer())  # another model
    msg, fig = run_view.logit_lens(app, app.session(), run.run_id, progress=lambda *a, **k: None)
    assert msg.startswith("⚠️ Logit lens failed") and fig is None and "\n" not in msg


def test_report_shows_the_lens_at_each_findings_positions_only_when_stored(native, tmp_path, monkeypatch):
    from workbench.analysis.findings import SCHEMA

    run = native["run"]
    row = {k: None for k in SCHEMA} | {"rank": 1, "component": "head", "layer": 1, "head": 0, "severity": "warning",
                                        "explanation": "layer 1 head 0 <b>", "positions": [4, 5], "kinds": ["x"]}
    fake = pl.DataFrame([row], schema=SCHEMA)
    monkeypatch.setattr(report_mod, "_findings", lambda *a, **k: fake)
    run.store.replace_rows("logit_lens", {"run_id": run.run_id}, pl.DataFrame({"run_id": [run.run_id]}).head(0))
    rep = report_mod.build_report(run, explain=0)
    assert not [k for _, k, _ in rep.figures if k.startswith("logit_lens")]  # nothing stored: no lens, no model
    run.logit_lens()
    rep = report_mod.build_report(run, explain=0)
    lens_figs = [(sec, k, f) for sec, k, f in rep.figures if k.startswith("logit_lens")]
    assert [(sec, k) for sec, k, _ in lens_figs] == [("lens-1", "logit_lens_1")]
    assert rep.facts["findings"][0]["lens_positions"] == [4, 5, 6]
    assert len(lens_figs[0][2].data[0].z[0]) == 3
    page = report_mod.render_html(rep)
    assert "data-key='logit_lens_1'" in page
    assert page.index("data-key='logit_lens_1'") < page.index("<h2>Summary")


def test_a_child_run_is_lensed_under_its_interventions(native):
    """A run recorded under an intervention (a banned expert): its lens re-runs that intervention, so the last
    layer is the child's own recorded distribution, not the clean model's."""
    from workbench.interventions import ban_expert

    run = native["run"]
    layer = run.model_summary.moe_layers[0]
    top = int(run.routing().filter(pl.col("layer") == layer)["expert"].mode()[0])
    child = run.rerun([ban_expert(layer, top)])
    assert child.interventions().height == 1
    last = child.logit_lens().filter(pl.col("layer") == run.model_summary.n_layers - 1).sort("pos")
    t = child.tokens()
    assert last["prob"].to_list() == pytest.approx(t["prob"].to_list()[1:], rel=1e-3, abs=1e-6)
    clean = own_distribution(adapter_for(native["model"]), t["token_id"].to_list())
    assert last["prob"].to_list() != pytest.approx(clean["prob"], rel=1e-3, abs=1e-6)
