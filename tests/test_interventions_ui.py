"""The Run view's Interventions panel in headless Chromium: pick an action, re-run the prompt, see the child run."""
from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import polars as pl  # noqa: E402
import pytest  # noqa: E402
from helpers import BROWSER_MARKS, chromium_page, fill, served  # noqa: E402

import workbench  # noqa: E402
from workbench.data import query  # noqa: E402

pytestmark = BROWSER_MARKS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("transformers")
    from workbench.apps.app import build_app
    from workbench.capture.tiny import make_folder

    root = tmp_path_factory.mktemp("iv")
    folder = make_folder("mixtral", root / "model")
    run = workbench.record("def add(a, b):\n    return", model=folder, max_new_tokens=8, db=root / "wb.duckdb",
                           detect=False)
    with served(build_app(run.store)) as url:
        yield url, run


@pytest.fixture()
def page():
    with chromium_page(height=2400) as pg:
        yield pg


def test_the_interventions_panel_records_a_child_run(server, page):
    url, run = server
    rt = run.routing().filter(pl.col("layer") == 1)
    expert = int(rt.group_by("expert").len().sort("len", descending=True)["expert"][0])  # its busiest expert
    page.goto(url)
    page.wait_for_selector("#runs-table", timeout=30_000)
    page.locator("#runs-table").get_by_text(run.run_id, exact=True).locator("visible=true").first.click()
    page.wait_for_function(f"() => (document.querySelector('#run-head')?.innerText || '').includes('{run.run_id}')",
                           timeout=30_000)
    fill(page, "#iv-layer input", "1")
    fill(page, "#iv-expert input", str(expert))
    fill(page, "#iv-specs textarea", "scale_head:L0H1=0")
    assert [page.locator(f"#iv-{k} input").input_value() for k in ("layer", "expert")] == ["1", str(expert)]
    page.locator("#iv-button").click()
    page.wait_for_function("() => (document.querySelector('#iv-msg')?.innerText || '').includes('Child run')",
                           timeout=120_000)
    msg = page.locator("#iv-msg").inner_text()
    children = run.store.sql("SELECT run_id FROM runs WHERE parent_run_id = ?", [run.run_id])["run_id"].to_list()
    assert len(children) == 1 and children[0] in msg
    child = workbench.Workbench(run.store).run(children[0])
    assert child.interventions()["spec"].to_list() == [f"ban:L1E{expert}", "scale_head:L0H1=0"]
    assert child.routing().filter((pl.col("layer") == 1) & (pl.col("expert") == expert)).height == 0
    assert f"ban:L1E{expert}" in msg
    # the two runs' confidence, and the changed tokens as the diff has them
    page.wait_for_function("() => { const p = document.querySelector('#iv-plot .js-plotly-plot'); "
                           "return p && p.data && p.data.length === 2; }", timeout=30_000)
    assert query.run_row(run.store, children[0])["status"] == "complete"
    changed = workbench.Workbench(run.store).diff(run.run_id, children[0]).tokens.filter(~pl.col("same_token"))
    assert changed.height > 0  # the ban changed the generation (a table of nothing would test nothing)
    last = repr(changed["d_logprob"][-1])  # each changed token's row, as the diff has it
    page.wait_for_function(f"() => (document.querySelector('#iv-changed')?.innerText || '').includes('{last}')",
                           timeout=30_000)
    shown = page.locator("#iv-changed").inner_text()
    assert all(repr(v) in shown for v in changed["d_logprob"].to_list())
    # a bad spec says why in one line, and records nothing
    fill(page, "#iv-specs textarea", "ban:L1")
    page.locator("#iv-button").click()
    page.wait_for_function("() => (document.querySelector('#iv-msg')?.innerText || '').includes('L<layer>E<expert>')",
                           timeout=30_000)
    assert run.store.sql("SELECT count(*) AS n FROM runs")["n"][0] == 2
