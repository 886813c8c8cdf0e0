"""Issue 27 point 5: the Run view's patch scan (a heat map layer x part of what restores the token, against a
picked reference run) and the Contrast tab (expert contrast of two batches, Steer set A): callbacks without a
server on a tiny native model, and the Contrast tab in headless Chromium."""
from __future__ import annotations

import math
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import polars as pl  # noqa: E402
import pytest  # noqa: E402
from helpers import XSS, chromium_page, needs_chromium, open_tab, served, tiny_model, wait_plot, wait_text  # noqa: E402,E501

import workbench  # noqa: E402
from workbench.analysis.contrast import steer_targets  # noqa: E402
from workbench.apps.shared import AppContext  # noqa: E402
from workbench.apps.tabs import contrast, run_view, runs  # noqa: E402
from workbench.data import query  # noqa: E402
from workbench.data.store import Store  # noqa: E402
from workbench.model import load_tokenizer  # noqa: E402
from workbench.views.figures import PATCH_PARTS, patch_scan_figure  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")



def quiet(*_a, **_k):  # stands in for gr.Progress outside a server
    return None


@pytest.fixture(scope="module")
def env(tmp_path_factory, one_thread):
    """Run a (the tiny model) and c (other weights, same prompt), and two batches of three prompts each (B's id
    hostile markup)."""
    store = Store(tmp_path_factory.mktemp("contrast") / "wb.duckdb")
    model, tok = tiny_model(vocab_size=4096), load_tokenizer()
    kw = {"tokenizer": tok, "db": store, "max_new_tokens": 3, "detect": False}
    a = workbench.record("alpha = 1\n", model=model, **kw)
    c = workbench.record("alpha = 1\n", model=tiny_model(seed=7, vocab_size=4096), **kw)
    ba = workbench.record_many(["def add(a, b):", "x = [1, 2, 3]", "print('hi')"], model=model, progress=False,
                               **kw)
    bb = workbench.record_many(["the cat sat", "hello world, friends", "one two three four"], model=model,
                               progress=False, batch_id=f"B{XSS}", **kw)
    app = AppContext(store, model, tok)
    app.live[c.run_id] = c  # recorded here: keeps its module (the reference model)
    return {"app": app, "store": store, "a": a, "c": c, "A": ba.batch_id, "B": bb.batch_id}


def _session(env):
    s = env["app"].session()
    runs.refresh_runs(env["app"], s, None)
    return s


# -- patch scan -----------------------------------------------------------------------------------------------

def test_patch_scan_shows_the_restored_fraction_of_every_patched_part(env):
    app, a, c, store = env["app"], env["a"], env["c"], env["store"]
    s = _session(env)
    run_view.load_run(app, s, a.run_id)
    pos = a.info["n_prompt_tokens"] + 1
    msg, fig = run_view.patch_scan(app, s, a.run_id, pos, c.run_id, progress=quiet)
    assert msg.startswith(f"Patch scan of pos {pos} against {c.run_id}") and "parts patched" in msg
    stored = query.attributions(store, a.run_id, pos)  # what the scan stored, like Explain
    assert set(stored["method"].to_list()) == {"patching"}
    parts = stored.filter(pl.col("kind") != "token")
    hm = fig.data[0]
    x, y = list(hm.x), list(hm.y)
    assert x[:3] == ["attn_block", "mlp_block / dense_mlp", "resid"] and "head 0" in x and "router" in x
    assert y == ["layer 0", "layer 1", "embed / unembed"]
    cells = {}
    for r in parts.iter_rows(named=True):
        col = ("mlp_block / dense_mlp" if r["kind"] in ("mlp_block", "dense_mlp") else
               f"head {r['head']}" if r["kind"] == "head" else
               f"expert {r['expert']}" if r["kind"] == "expert" else r["kind"])
        row = "embed / unembed" if r["layer"] is None else f"layer {r['layer']}"
        cells[(y.index(row), x.index(col))] = r
    assert len(cells) == parts.height  # one cell per patched part
    for i in range(len(y)):
        for j in range(len(x)):
            z = hm.z[i][j]
            if (i, j) not in cells:
                assert z is None and hm.customdata[i][j] == ""  # not patched: blank, never 0
                continue
            r = cells[(i, j)]
            assert z == pytest.approx(r["restored"]) if not math.isnan(r["restored"]) else z is None
            hover = hm.customdata[i][j]
            assert hover.startswith(r["kind"]) and f"{r['score']:+.4g} nats" in hover and "restored" in hover
    # layer 0 of the tiny model is dense: no router, no routed expert there (blank cells), layer 1 has them
    assert hm.z[0][x.index("router")] is None and hm.z[1][x.index("router")] is not None
    assert any(v is not None for v in hm.z[0])
    assert sum(v is None for row in hm.z for v in row) > 0


def test_patch_scan_needs_a_reference_and_the_models(env):
    app, a, c, store = env["app"], env["a"], env["c"], env["store"]
    s = _session(env)
    pos = a.info["n_prompt_tokens"] + 1
    assert run_view.patch_scan(app, s, a.run_id, pos, "", progress=quiet) == (
        "Pick a known-good reference run first (the picker beside Explain).", None)
    assert "no reference for itself" in run_view.patch_scan(app, s, a.run_id, pos, a.run_id, progress=quiet)[0]
    assert run_view.patch_scan(app, s, None, pos, c.run_id, progress=quiet)[1] is None
    bare = AppContext(store)  # an app without the module these runs were recorded from
    msg, fig = run_view.patch_scan(bare, bare.session(), a.run_id, pos, c.run_id, progress=quiet)
    assert msg.startswith("⚠️ Patch scan failed") and "\n" not in msg and fig is None


def test_patch_scan_figure_blank_for_a_gap_too_small_and_empty_without_patching():
    frame = pl.DataFrame({"kind": ["resid", "head", "token"], "layer": [0, 1, None], "head": [None, 2, None],
                          "expert": [None, None, None], "source_pos": [None, None, 3], "score": [0.5, 0.0, 1.0],
                          "rank": [1, 2, 3], "method": ["patching"] * 3, "restored": [0.25, float("nan"), 0.9]})
    hm = patch_scan_figure(frame).data[0]
    assert list(hm.x) == ["resid", "head 2"] and list(hm.y) == ["layer 0", "layer 1"]  # source tokens left out
    assert [list(r) for r in hm.z] == [[0.25, None], [None, None]]
    assert "n/a (no gap)" in hm.customdata[1][1] and hm.customdata[0][1] == ""
    assert PATCH_PARTS[0] == "attn_block"
    none = patch_scan_figure(frame.with_columns(pl.lit("ablation").alias("method")))
    assert not none.data and "no patching rows" in none.layout.title.text


# -- expert contrast ------------------------------------------------------------------------------------------

def test_contrast_pickers_default_to_two_batches(env):
    pa, pb = contrast.contrast_choices(env["app"], None, None)
    assert {pa.value, pb.value} == {env["A"], env["B"]}
    pa, pb = contrast.contrast_choices(env["app"], env["B"], env["B"])  # B cannot stay on A's batch
    assert pa.value == env["B"] and pb.value == env["A"]


def test_contrast_view_ranks_the_experts_of_two_batches(env):
    app, A, B = env["app"], env["A"], env["B"]
    table, fig, msg = contrast.contrast_views(app, A, B)
    want = workbench.Workbench(env["store"]).expert_contrast(A, B)
    assert table.columns == contrast.RANK_COLUMNS and table.height == want.height > 0
    assert table["rank"].to_list() == list(range(1, want.height + 1))
    assert table.select("layer", "expert").equals(want.select("layer", "expert"))
    assert table["diff"].to_list() == pytest.approx(want["diff"].to_list(), abs=1e-4)
    hm = fig.data[0]
    top = want.row(0, named=True)
    i, j = list(hm.y).index(f"layer {top['layer']}"), list(hm.x).index(str(top["expert"]))
    assert hm.z[i][j] == pytest.approx(top["diff"]) and "rank 1" in hm.customdata[i][j]
    assert f"layer {top['layer']} expert {top['expert']}" in msg and "(A, 3 runs)" in msg
    assert XSS not in msg and "&lt;img" in msg  # the stored batch id, escaped
    assert XSS not in fig.layout.title.text
    t, f, m = contrast.contrast_views(app, A, A)
    assert t.height == 0 and f is None and "two different batches" in m
    t, f, m = contrast.contrast_views(app, A, "no-such-batch")
    assert t.height == 0 and f is None and m.startswith("⚠️") and "such" in m and "\n" not in m
    assert contrast.contrast_views(app, None, B)[2].startswith("Pick two batches")


def test_steer_set_a_records_child_runs_under_the_top_experts_banned(env):
    app, A, B, store = env["app"], env["A"], env["B"], env["store"]
    n_runs = store.sql("SELECT count(*) AS n FROM runs")["n"][0]
    bare = AppContext(store)  # no module: one line saying why, nothing recorded
    msg, rows = contrast.steer(bare, A, B, "ban", 2, 1.0, progress=quiet)
    assert msg.startswith("⚠️ Steering") and "\n" not in msg and rows.height == 0
    assert store.sql("SELECT count(*) AS n FROM runs")["n"][0] == n_runs
    msg, rows = contrast.steer(app, A, B, "ban", 2, 1.0, progress=quiet)
    specs = steer_targets(workbench.Workbench(store).expert_contrast(A, B), 2, "ban")
    parents = query.batch_runs(store, A).filter(pl.col("status") == "complete")["run_id"].to_list()
    assert rows.columns == contrast.CHILD_COLUMNS and sorted(rows["parent_run_id"].to_list()) == sorted(parents)
    assert set(rows["interventions"].to_list()) == {", ".join(specs)} and rows["status"].to_list() == ["complete"] * 3
    assert all(rid in msg for rid in rows["run_id"].to_list()) and "Steered set A" in msg
    banned = [(int(s.split("L")[1].split("E")[0]), int(s.split("E")[1])) for s in specs]
    for rid in rows["run_id"].to_list():
        routed = query.table(store, "routing", rid, "pos", cols=["layer", "expert"])
        assert not any(routed.filter((pl.col("layer") == la) & (pl.col("expert") == e)).height for la, e in banned)
    assert contrast.steer(app, A, A, "ban", 2, 1.0, progress=quiet)[0] == "Pick two different batches first."


# -- the Contrast tab in a browser ----------------------------------------------------------------------------

@needs_chromium
def test_browser_contrast_tab_picks_two_batches_and_shows_the_ranking(env):
    from workbench.apps.app import build_app

    A, B = env["A"], env["B"]
    want = workbench.Workbench(env["store"]).expert_contrast(B, A)  # picked the other way round below
    with served(build_app(env["store"])) as url, chromium_page() as pg:
        pg.goto(url)
        open_tab(pg, "Contrast")
        wait_text(pg, "#contrast-msg", "Expert contrast of batch")
        for picker, batch in (("#contrast-a", B), ("#contrast-b", A)):
            pg.locator(f"{picker} input").click()
            pg.get_by_role("option").filter(has_text=batch[:6]).first.click()
        wait_text(pg, "#contrast-msg", f"against {A} (B")
        top = want.row(0, named=True)
        wait_text(pg, "#contrast-msg", f"Largest: layer {top['layer']} expert {top['expert']} ({top['diff']:+.3f}")
        msg = pg.locator("#contrast-msg").inner_text()
        assert XSS in msg  # B's id as text
        shown = pg.locator("#contrast-table").inner_text()
        assert all(c in shown for c in contrast.RANK_COLUMNS)
        assert str(round(top["diff"], 4)) in shown
        wait_plot(pg, "contrast-plot", traces=1)
        assert pg.locator("#contrast-msg img").count() == 0
        assert pg.evaluate("() => window.__alerts.length") == 0


@needs_chromium
def test_browser_patch_scan_against_the_picked_reference(tmp_path):
    """The Run view's patch scan in Chromium: a run of a tiny Mixtral folder against another prompt of as many
    tokens on it (the app loads the model from the folder): the heat map, and the stored ranking beside it."""
    pytest.importorskip("transformers")
    from workbench.apps.app import build_app
    from workbench.capture.tiny import make_folder

    folder = make_folder("mixtral", tmp_path / "model")
    kw = {"model": folder, "max_new_tokens": 2, "detect": False}
    a = workbench.record("def add(a, b):\n    return", db=tmp_path / "wb.duckdb", **kw)
    ref = workbench.record("def sub(a, b):\n    return", db=a.store, **kw)
    with served(build_app(a.store)) as url, chromium_page(height=2400) as pg:
        pg.goto(url)
        pg.wait_for_selector("#runs-table", timeout=30_000)
        pg.locator("#runs-table").get_by_text(a.run_id, exact=True).locator("visible=true").first.click()
        wait_text(pg, "#run-head", a.run_id)
        pg.locator("#reference-picker input").click()
        pg.get_by_role("option").filter(has_text=ref.run_id).first.click()
        pg.locator("#patch-scan-button").click()
        wait_text(pg, "#patch-scan-msg", "parts patched", timeout=120_000)
        assert ref.run_id in pg.locator("#patch-scan-msg").inner_text()
        wait_plot(pg, "patch-scan-plot", traces=1)
        x = pg.evaluate("() => document.querySelector('#patch-scan-plot .js-plotly-plot').data[0].x")
        assert x[:3] == ["attn_block", "mlp_block / dense_mlp", "resid"] and "router" in x
        pos = a.info["n_prompt_tokens"]  # the position a pick opens on
        stored = query.attributions(a.store, a.run_id, pos)
        assert set(stored["method"].to_list()) == {"patching"}
        wait_text(pg, "#rc-msg", "(patching)")
        assert f"{stored.height} ranked causes" in pg.locator("#rc-msg").inner_text()
