"""The app in headless Chromium: pick a run and a token, the heat maps render, no error; token text stays text.

Set ``WORKBENCH_SCREENSHOT=1`` to write the screenshot to docs/screenshot.png (with the demo model if it
is bundled); otherwise it goes to the test's tmp folder.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import polars as pl
import pytest
from helpers import free_port, tiny_model

import workbench
from workbench.data import query
from workbench.model import load_tokenizer

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
XSS = "<img src=x onerror=alert(1)>"
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo" / "model.safetensors"
FOR_README = os.environ.get("WORKBENCH_SCREENSHOT") == "1"

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(shutil.which(CHROMIUM) is None and not Path(CHROMIUM).exists(),
                                 reason=f"Debian chromium not installed at {CHROMIUM} (apt-get install chromium)")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from workbench.apps.app import build_app

    db = tmp_path_factory.mktemp("browser") / "wb.duckdb"
    if FOR_README and DEMO.exists():
        model, tok, prompt, n = None, None, (ROOT / "data" / "prompts" / "01_fibonacci.txt").read_text(), 40
    else:
        model, tok, prompt, n = tiny_model(vocab_size=4096), load_tokenizer(), "def fibonacci(n):\n", 12
    xss = workbench.record("print('hi')\n", model=model, tokenizer=tok, max_new_tokens=4, db=db)
    # untrusted text where a model's token and a prompt would put it
    xss.store.execute("UPDATE tokens SET text = ? WHERE run_id = ? AND pos = 2", [XSS, xss.run_id])
    xss.store.execute("UPDATE runs SET prompt = ? WHERE run_id = ?", [XSS + " prompt", xss.run_id])
    run = workbench.record(prompt, model=model, tokenizer=tok, max_new_tokens=n, db=db)
    if FOR_README:  # show an attribution heat map in the picture too
        run.root_cause(run.info["n_prompt_tokens"] + 2, steps=16)
    app = build_app(run.store)
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/", run, xss
    app.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    pg = browser.new_page(viewport={"width": 1400, "height": 1900})
    pg.dialogs = []
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    # any alert() that would run, even without a dialog, leaves a mark
    pg.add_init_script("window.__alerts = []; window.alert = (m) => window.__alerts.push(String(m));")
    yield pg
    pg.close()


def _open_run(pg, url: str, run_id: str, n_prompt: int) -> None:
    pg.goto(url)
    pg.wait_for_selector("#runs-table", timeout=30_000)
    pg.locator("#runs-table").get_by_text(run_id, exact=True).locator("visible=true").first.click()
    # loaded when the run view shows this run and has moved to its first generated token
    pg.wait_for_function(f"() => (document.querySelector('#run-head')?.innerText || '').includes('{run_id}') && "
                         f"document.querySelector('#token-pos input')?.value === '{n_prompt}' && "
                         "document.querySelectorAll('#token-strip .token').length > 0", timeout=30_000)


def _traces(pg, elem: str) -> int:
    return pg.evaluate(f"() => {{ const p = document.querySelector('#{elem} .js-plotly-plot'); "
                       "return p && p.data ? p.data.length : 0; }")


def _toasts(pg) -> int:
    return pg.locator(".toast-body").count()


def test_pick_run_and_token_renders_heat_maps(server, page, tmp_path):
    url, run, _ = server
    _open_run(page, url, run.run_id, run.info['n_prompt_tokens'])
    # clicking a token picks it (spans before the first newline are one per token)
    page.locator("#token-strip .token").nth(2).click()
    page.wait_for_function("() => document.querySelector('#token-pos input').value === '2'", timeout=15_000)
    page.wait_for_function("() => [...document.querySelectorAll('#heads-plot .gtitle')]"
                           ".some(e => e.textContent.includes('pos 2'))", timeout=30_000)
    # and so does typing a position: a generated token
    pos = run.info["n_prompt_tokens"] + 2
    page.locator("#token-pos input").fill(str(pos))
    page.locator("#token-pos input").press("Enter")
    page.wait_for_function(f"() => [...document.querySelectorAll('#heads-plot .gtitle')]"
                           f".some(e => e.textContent.includes('pos {pos}'))", timeout=30_000)
    page.wait_for_function("() => ['heads-plot', 'routing-plot', 'topk-plot'].every(id => { "
                           "const p = document.querySelector('#' + id + ' .js-plotly-plot'); "
                           "return p && p.data && p.data.length > 0; })", timeout=30_000)
    # the heat maps hold this token's numbers: layers x heads, k experts per MoE layer
    heads = page.evaluate("() => document.querySelector('#heads-plot .js-plotly-plot').data[0].z")
    ms = run.model_summary
    assert len(heads) == ms.n_layers and all(len(r) == ms.n_heads for r in heads)
    routing = page.evaluate("() => document.querySelector('#routing-plot .js-plotly-plot').data[0].z")
    assert all(sum(v is not None for v in r) == ms.top_k for r in routing)
    assert page.locator("#heads-plot .heatmaplayer, #heads-plot image, #heads-plot .hm").count() > 0
    assert _toasts(page) == 0
    shot = ROOT / "docs" / "screenshot.png" if FOR_README else tmp_path / "screenshot.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000
    # the no-toast check above is meaningful: a bad position does raise one
    page.locator("#token-pos input").fill("9999")
    page.locator("#token-pos input").press("Enter")
    page.wait_for_selector(".toast-body", timeout=15_000)
    assert "9999" in page.locator(".toast-body").first.inner_text()


def test_token_text_is_shown_as_text(server, page):
    url, _, xss = server
    _open_run(page, url, xss.run_id, xss.info['n_prompt_tokens'])
    strip = page.locator("#token-strip .token").nth(2)
    assert strip.inner_text().strip() == XSS
    page.locator("#token-strip .token").nth(2).click()
    page.wait_for_function("() => document.querySelector('#token-pos input').value === '2'", timeout=15_000)
    page.wait_for_function("(x) => document.querySelector('#token-info').innerText.includes(x)", arg=XSS,
                           timeout=15_000)
    page.wait_for_function("() => [...document.querySelectorAll('#topk-plot .gtitle')]"
                           ".some(e => e.textContent.includes('<img src=x'))", timeout=15_000)
    assert XSS + " prompt" in page.locator("#runs-table").inner_text()
    assert page.locator("img[src='x']").count() == 0
    assert page.dialogs == [] and page.evaluate("() => window.__alerts") == []


@pytest.fixture(scope="module")
def mixtral_server(tmp_path_factory):
    """A tiny random transformers Mixtral recorded from its folder, served by the app."""
    pytest.importorskip("transformers")
    from workbench.apps.app import build_app
    from workbench.capture.tiny import make_folder

    root = tmp_path_factory.mktemp("mixtral")
    folder = make_folder("mixtral", root / "model")
    run = workbench.record("def add(a, b):\n    return", model=folder, max_new_tokens=8, db=root / "wb.duckdb")
    app = build_app(run.store)
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/", run
    app.close()


def test_a_transformers_mixtral_run_is_shown_completely(mixtral_server, page):
    """Header names the family and its MoE (never "dense"); routing at a token, the Experts tab and the
    Explain button work on a run of a transformers MoE family."""
    url, run = mixtral_server
    ms = run.model_summary
    _open_run(page, url, run.run_id, run.info["n_prompt_tokens"])
    head = page.locator("#run-head").inner_text()
    assert "mixtral" in head and "MoE in 2 layers: 8 experts top-2" in head and "dense" not in head
    # the run's own first views settle before another position is asked for (a busy CI machine is slow)
    first = run.info["n_prompt_tokens"]
    page.wait_for_function(f"() => [...document.querySelectorAll('#routing-plot .gtitle')]"
                           f".some(e => e.textContent.includes('pos {first}'))", timeout=90_000)
    pos = first + 2
    page.locator("#token-pos input").fill(str(pos))
    page.locator("#token-pos input").press("Enter")
    page.wait_for_function(f"() => [...document.querySelectorAll('#routing-plot .gtitle')]"
                           f".some(e => e.textContent.includes('pos {pos}'))", timeout=90_000)
    routing = page.evaluate("() => document.querySelector('#routing-plot .js-plotly-plot').data[0].z")
    want = run.routing().filter(pl.col("pos") == pos)
    assert len(routing) == len(ms.moe_layers) and all(sum(v is not None for v in r) == ms.top_k for r in routing)
    assert {(i, j) for i, r in enumerate(routing) for j, v in enumerate(r) if v is not None} == \
        {(ms.moe_layers.index(r["layer"]), r["expert"]) for r in want.iter_rows(named=True)}
    # root cause from the button: heads, experts, tokens and the embedding / output weight rows ranked
    page.locator("#explain-button").click()
    page.wait_for_function("() => (document.querySelector('#rc-msg')?.innerText || '').includes('ranked causes')",
                           timeout=120_000)
    assert _traces(page, "comp-plot") > 0
    assert query.attributions(run.store, run.run_id, pos)["kind"].unique().sort().to_list() == \
        ["embed", "expert", "head", "token", "unembed"]
    # the Experts tab: load per expert for both MoE layers
    page.get_by_role("tab", name="Experts").click()
    page.wait_for_function("() => { const p = document.querySelector('#load-plot .js-plotly-plot'); "
                           "return p && p.data && p.data.length > 0; }", timeout=30_000)
    load = page.evaluate("() => document.querySelector('#load-plot .js-plotly-plot').data[0].z")
    assert len(load) == len(ms.moe_layers) and all(len(r) == ms.n_routed_experts for r in load)
    assert _toasts(page) == 0


def test_anomalies_tab_leads_with_findings_and_filters(mixtral_server, page):
    url, run = mixtral_server
    _open_run(page, url, run.run_id, run.info["n_prompt_tokens"])
    page.get_by_role("tab", name="Anomalies").click()
    page.wait_for_function("() => (document.querySelector('#anom-msg')?.innerText || '').includes('finding')",
                           timeout=30_000)
    total = run.anomalies().height
    assert f"of {total} anomaly rows" in page.locator("#anom-msg").inner_text()
    assert page.locator("#findings-table").count() == 1
    # widen the severity filter: every row shows
    page.locator("#anom-severity input").click()
    page.get_by_role("option", name="all").click()
    page.wait_for_function(f"(t) => (document.querySelector('#anom-msg')?.innerText || '').includes(t + ' of ' + t)",
                           arg=str(total), timeout=30_000)
    assert _toasts(page) == 0
