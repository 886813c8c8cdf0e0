"""Anomaly reports: offline self-contained HTML in headless Chromium, escaping, JSON with the same facts."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

import polars as pl
import pytest
from helpers import tiny_model

import workbench
from workbench import cli, record
from workbench.data.store import Store
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.views.report import build_report, script_json, write_report

EVIL = "</script><script>alert(1)</script>"
CHROMIUM = Path("/usr/bin/chromium")
RC = {"steps": 4}  # IG steps: enough to produce a ranking, fast on two busy cores


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    model = tiny_model()
    ckpt = str(save_checkpoint(model, root / "ckpt", tokenizer=DEFAULT_TOKENIZER))
    store = Store(root / "wb.duckdb")
    run = record([5, 17, 42, 7, 99, 3], model=ckpt, max_new_tokens=6, db=store)
    # a model can emit any text: make one generated token a script-injection attempt
    store.execute("UPDATE tokens SET text = ? WHERE run_id = ? AND pos = 8", [EVIL, run.run_id])
    return {"root": root, "store": store, "run": run}


@pytest.fixture(scope="module")
def html_report(env) -> Path:
    return write_report(env["run"], env["root"] / "r.html", "html", explain=1, root_cause_kw=RC)


def test_script_json_cannot_break_out():
    s = script_json(json.dumps({"t": EVIL + "<!-- & \u2028"}))
    assert "<" not in s and ">" not in s and "&" not in s and "\u2028" not in s
    assert json.loads(s) == {"t": EVIL + "<!-- & \u2028"}


def test_json_and_html_carry_the_same_facts(env, html_report, tmp_path):
    run = env["run"]
    pj = write_report(run, tmp_path / "r.json", "json", explain=1, root_cause_kw=RC)
    ph = html_report
    facts = json.loads(pj.read_text())
    page = ph.read_text()
    embedded = json.loads(re.search(r"<script type='application/json' id='report-data'>(.*?)</script>", page,
                                    re.S).group(1))
    for d in (facts, embedded):
        d["report"].pop("created_at")
    assert facts == embedded
    assert facts["run"]["run_id"] == run.run_id
    assert [t["text"] for t in facts["tokens"]][8] == EVIL
    # anomalies ranked by severity, exactly the run's anomalies
    assert len(facts["anomalies"]) == run.anomalies().height
    sev = {"critical": 0, "warning": 1, "info": 2}
    ranks = [sev[a["severity"]] for a in facts["anomalies"]]
    assert ranks == sorted(ranks) and [a["rank"] for a in facts["anomalies"]] == list(range(1, len(ranks) + 1))
    # the top anomalous position is explained with a ranked root cause and its attribution over the context
    targets = {f["explained_pos"] for f in facts["findings"] if f.get("explained_pos") is not None}
    assert len(facts["explained"]) == min(len(targets), 1)  # the html_report fixture explains 1
    if facts["explained"]:
        ex = facts["explained"][0]
        assert ex["pos"] == next(a["pos"] for a in facts["anomalies"] if a["pos"] is not None and a["pos"] >= 1)
        assert [c["rank"] for c in ex["causes"]] == sorted(c["rank"] for c in ex["causes"])
        assert {a["source_pos"] for a in ex["attribution"]} == set(range(ex["pos"]))
    assert {"head_entropy", "expert_load", "kv"} <= set(facts["signals"])
    assert {"head_entropy", "expert_load", "kv_bytes"} <= set(facts["figures"])


def test_html_is_self_contained_and_escapes_token_text(html_report):
    path = html_report
    page = path.read_text()
    assert EVIL not in page and html.escape(EVIL) in page
    assert page.count("<script") == page.count("</script>")
    # no external resource anywhere outside plotly's own bundle (whose strings are never fetched offline)
    bundle_end = page.index("</script>")
    rest = page[bundle_end:]
    assert not re.search(r"(src|href)\s*=\s*['\"]?\s*(https?:)?//", rest, re.I)
    assert "cdn" not in rest.lower()
    assert page.count("Plotly.newPlot") == 1


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium")
def test_html_opens_offline_in_headless_chromium(html_report, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    path = html_report
    n_figs = path.read_text().count("<div class='fig'")
    assert n_figs >= 3
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page()
            attempted, dialogs, errors = [], [], []

            def route(r):
                if r.request.url.startswith("file://"):
                    r.continue_()
                else:
                    attempted.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(path.as_uri())
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length === {n_figs}",
                                   timeout=60_000)
            traces = page.evaluate("Array.from(document.querySelectorAll('.js-plotly-plot'))"
                                   ".map(e => (e.data || []).length)")
            text = page.inner_text("#text")
            injected = page.evaluate("document.querySelectorAll('script').length")
            page.screenshot(path=str(tmp_path / "report.png"))
        finally:
            browser.close()
    assert attempted == [] and dialogs == [] and errors == []
    assert len(traces) == n_figs and all(n > 0 for n in traces)
    assert EVIL in text  # shown literally, as text
    assert injected == path.read_text().count("<script")  # the token added no script element


def test_markdown_escapes_and_default_name(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_report(env["run"], format="md", explain=0)
    assert path == tmp_path / f"report_{env['run'].run_id}.md"
    md = path.read_text()
    assert "<script>" not in md and "&lt;/script&gt;" in md
    with pytest.raises(ValueError, match="format"):
        write_report(env["run"], format="pdf")


def test_missing_analyses_degrade_to_notes(env, tmp_path, monkeypatch):
    run = env["run"]

    def gone(*a, **k):
        raise ImportError("No module named 'workbench.analysis.anomalies'")

    monkeypatch.setattr(run, "anomalies", gone)
    rep = build_report(run, explain=2)
    assert rep.facts["anomalies"] == [] and rep.facts["explained"] == []
    assert any("anomaly detection is not available" in n for n in rep.notes)
    path = write_report(run, tmp_path, "html", explain=2)
    assert "anomaly detection is not available" in path.read_text()
    monkeypatch.undo()

    def broken(pos, **k):
        raise RuntimeError("model unavailable")

    monkeypatch.setattr(run, "root_cause", broken)
    # one finding over positions 7 and 8 (whatever the detectors find on this tiny run): its token is explained
    import workbench.views.report as report_mod
    found = pl.DataFrame({"rank": [1], "severity": ["warning"], "explanation": ["test"], "positions": [[7, 8]]})
    monkeypatch.setattr(report_mod, "_findings", lambda *a: found)
    rep = build_report(run, explain=3)
    assert rep.facts["explained"] == [] and rep.facts["findings"][0]["explained_pos"] in (7, 8, 9)
    assert any(re.match(r"root cause of position \d+ not computed: RuntimeError", n) for n in rep.notes), rep.notes


def test_explain_time_budget(env, monkeypatch):
    import workbench.views.report as report_mod
    # two findings over different tokens (whatever the detectors find on this tiny run): two positions to explain
    found = pl.DataFrame({"rank": [1, 2], "severity": ["warning"] * 2, "explanation": ["a", "b"],
                          "positions": [[3], [7]]})
    monkeypatch.setattr(report_mod, "_findings", lambda *a: found)
    rep = build_report(env["run"], explain=3, explain_budget_s=0.0, root_cause_kw=RC)
    assert len({f["explained_pos"] for f in rep.facts["findings"]}) == 2
    assert len(rep.facts["explained"]) == 1  # the first is always explained
    assert any("budget" in n and "skipped" in n for n in rep.notes)


def test_cli_report(env, tmp_path, capsys):
    out = tmp_path / "cli.json"
    code = cli.main(["report", env["run"].run_id, "--out", str(out), "--format", "json", "--explain", "1",
                     "--db", str(env["store"].path)])
    assert code == 0 and Path(capsys.readouterr().out.strip()) == out
    assert json.loads(out.read_text())["run"]["run_id"] == env["run"].run_id
    assert cli.main(["report", "nope", "--db", str(env["store"].path)]) == 2


def test_report_leads_with_the_diagnosis(tmp_path):
    """With a baseline profile, a broken head becomes the report's first finding, before any table."""
    import polars as pl
    from helpers import tiny_model

    from workbench.analysis import faults

    model = tiny_model()
    db = workbench.Store(tmp_path / "w.duckdb")
    workbench.profile([[5 + i, 17 + i, 101, 3, 40 + i, 9] for i in range(8)], model=model, db=db, max_new_tokens=8)
    with faults.break_head(model, 1, 2, scale=30.0):
        run = workbench.record([6, 18, 101, 3, 41, 9], model=model, db=db, max_new_tokens=8)
    f = run.findings()
    assert f.height and (f["component"][0], f["layer"][0], f["head"][0]) == ("head", 1, 2)
    facts = json.loads(Path(run.report(tmp_path / "r.json", "json")).read_text())
    assert facts["findings"][0]["explanation"].startswith("layer 1 head 2")
    html = Path(run.report(tmp_path / "r.html", "html")).read_text()
    assert html.index("Diagnosis") < html.index("layer 1 head 2") < html.index("<h2>Summary") < html.index("by kind")
    md = Path(run.report(tmp_path / "r.md", "md")).read_text()
    assert md.index("## Diagnosis") < md.index("## Summary")
    assert pl.DataFrame(facts["anomalies"]).height == run.anomalies().height
