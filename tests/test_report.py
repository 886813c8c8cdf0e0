"""Anomaly reports: offline self-contained HTML in headless Chromium, escaping, JSON with the same facts."""
from __future__ import annotations

import html
import json
import os
import pickle
import re
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import plotly.graph_objects as go
import polars as pl
import pytest
from helpers import tiny_model
from markupsafe import escape

import workbench
from workbench import cli, record
from workbench.data.store import Store
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.views.report import Report, build_report, render_html, script_json, templates, write_report

EVIL = "</script><script>alert(1)</script>"
# what a model, a prompt or a user can put in any stored string: markup, a textarea break-out, template syntax
HOSTILE = "</textarea><script>alert('x')</script><b onmouseover=\"go()\">{{ 7*7 }}{% raw %}&amp;"
ROOT = Path(__file__).resolve().parents[1]
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
    return {"root": root, "store": store, "run": run, "ckpt": ckpt}


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
    n = f.height
    assert f"## Diagnosis: {n} finding{'s' if n != 1 else ''}\n" in md and f"Diagnosis: {n} finding" in html
    assert pl.DataFrame(facts["anomalies"]).height == run.anomalies().height


def test_hostile_strings_are_escaped_by_the_templates(env, tmp_path, monkeypatch):
    """Token text, the prompt, the model name and a finding's explanation, each a hostile string, come out of the
    templates escaped (never as markup, never evaluated as template syntax) and intact in the embedded JSON."""
    store = env["store"]
    run = record([5, 17, 42, 7], model=env["ckpt"], max_new_tokens=3, db=store)
    # one prompt token and one generated token
    store.execute("UPDATE tokens SET text = ? WHERE run_id = ? AND pos IN (1, 5)", [HOSTILE, run.run_id])
    store.execute("UPDATE runs SET model = ?, prompt = ? WHERE run_id = ?",
                  ["m" + HOSTILE, "p" + HOSTILE, run.run_id])
    import workbench.views.report as report_mod
    found = pl.DataFrame({"rank": [1], "severity": ["warning"], "explanation": ["e" + HOSTILE], "kinds": [["k"]],
                          "positions": [[5]]})
    monkeypatch.setattr(report_mod, "_findings", lambda *a: found)
    page = write_report(run, tmp_path / "h.html", "html", explain=0).read_text()
    assert "<script>alert(" not in page and "</textarea>" not in page and "<b onmouseover" not in page
    shown = str(escape(HOSTILE))
    assert "&lt;/textarea&gt;" in shown and "{{ 7*7 }}" in shown  # template syntax is printed, not run
    assert page.count(shown) >= 4  # prompt token, generated token (strip and evidence), model, explanation
    assert f"<td>{escape('m' + HOSTILE)}</td>" in page
    assert f"[warning] {escape('e' + HOSTILE)}</h3>" in page
    strip = re.search(r"<div class='strip' id='text'>(.*?)</div>", page, re.S).group(1)
    assert strip.count(f">{shown}</span>") == 2
    assert page.count("<script") == page.count("</script>") == 3 + page.count("<div class='fig'")
    facts = json.loads(re.search(r"<script type='application/json' id='report-data'>(.*?)</script>", page,
                                 re.S).group(1))
    assert facts["run"]["model"] == "m" + HOSTILE and facts["run"]["prompt"] == "p" + HOSTILE
    assert [t["text"] for t in facts["tokens"] if t["pos"] in (1, 5)] == [HOSTILE, HOSTILE]
    assert facts["findings"][0]["explanation"] == "e" + HOSTILE
    md = write_report(run, tmp_path / "h.md", "md", explain=0).read_text()
    assert "<script>" not in md and "</textarea>" not in md and "<b onmouseover" not in md
    assert f"| model | {report_mod._md('m' + HOSTILE)} |" in md and "&lt;/textarea&gt;" in md
    assert f"1. [warning] {report_mod._md('e' + HOSTILE)}\n" in md


def _every_section() -> Report:
    """A report with every section of the page filled (no store, no model: it travels by pickle)."""
    tok = [{"pos": i, "token_id": i, "text": t, "is_prompt": i < 2, "prob": 0.5, "logprob": -0.7, "confidence": c,
            "entropy": 1.0, "rank": 1} for i, (t, c) in enumerate([("a", 0.9), ("\tb", None), (HOSTILE, 0.1)])]
    causes = [{"rank": 1, "kind": "head", "layer": 0, "head": 1, "expert": None, "source_pos": 1, "score": 0.25,
               "method": "ig", "delta": None}]
    facts = {"report": {"kind": "moe-workbench anomaly report", "schema_version": 1, "created_at": "2026-01-01"},
             "run": {"run_id": "r1", "model": HOSTILE}, "model": {}, "params": {"max_new_tokens": 1}, "config": {},
             "summary": {"tested": "all", "anomalies": {"critical": 1}}, "tokens": tok,
             "findings": [{"rank": 1, "severity": "critical", "explanation": HOSTILE, "kinds": ["k"],
                           "positions": [2], "explained_pos": 2}],
             "anomalies": [{"rank": 1, "severity": "critical", "kind": "spike", "pos": 2, "explanation": HOSTILE}],
             "explained": [{"pos": 2, "text": HOSTILE, "anomaly_ids": [], "causes": causes, "attribution": []}],
             "signals": {}, "notes": [HOSTILE], "kv_policies": [{"policy": "full", "bytes_kept": 1, "bytes_full": 1}],
             "code": {"compile": {"ok": True, "lines": 1}, "classes": [{"class": "name", "tokens": 1}]}}
    fig = go.Figure(go.Bar(x=[1], y=[2], name=HOSTILE))
    return Report(facts, figures=[(s, s + "-fig", fig) for s in ("explain-2", "signals", "kv_whatif", "code")])


def test_templates_are_package_data(tmp_path, built_wheel):
    """The templates load from the package (not a path next to the source), and a non-editable install ships them:
    a wheel built from the source holds every file of workbench/views/templates, and the installed copy renders
    the same page as this checkout."""
    folder = resources.files("workbench.views").joinpath("templates")
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert "report.html.j2" in files and set(templates().list_templates()) == set(files)
    assert templates().get_template("report.html.j2").render  # compiles
    wheel = built_wheel[0]  # tests/conftest.py: pip wheel of a copy of the packaged sources, once a session
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("workbench/views/templates/")}
    assert shipped == {f"workbench/views/templates/{f}" for f in files}
    target = tmp_path / "site"
    got = subprocess.run(pip + ["install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    # a report with every section, rendered by the installed copy (PYTHONPATH comes before the editable finder)
    rep = _every_section()
    (tmp_path / "rep.pkl").write_bytes(pickle.dumps(rep))
    code = ("import pickle, sys, workbench.views.report as r\n"
            f"assert r.__file__.startswith({str(target)!r}), r.__file__\n"
            f"rep = pickle.loads(open({str(tmp_path / 'rep.pkl')!r}, 'rb').read())\n"
            "sys.stdout.write(r.render_html(rep))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert got.returncode == 0, got.stderr
    # the same page; plotly may order a figure's JSON keys differently in another process, so figures compare parsed
    fig_json = re.compile(r"(<script type='application/json' id='fig-\d+-data'>)(.*?)(</script>)", re.S)
    there, here = got.stdout, render_html(rep)
    assert fig_json.sub(r"\1\3", there) == fig_json.sub(r"\1\3", here) and "Anomaly report" in there
    assert [json.loads(m[1]) for m in fig_json.findall(there)] == [json.loads(m[1]) for m in fig_json.findall(here)]
    assert len(fig_json.findall(here)) == 4
