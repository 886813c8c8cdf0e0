"""The expert atlas (issue #28 point 1): ``Batch.atlas()`` / ``Workbench.atlas(run_ids)``, ``workbench atlas`` and
the Atlas tab, on a store written by hand (the numbers checked against direct counts) and on a recorded batch
(the browser test)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import polars as pl
import pytest
from helpers import XSS, chromium_page, needs_chromium, served, tiny_model, wait_plot, wait_text
from markupsafe import escape as _escape

import workbench
from workbench import cli
from workbench.analysis import atlas as A
from workbench.apps.shared import AppContext
from workbench.apps.tabs import atlas as tab
from workbench.data.export import export_parquet
from workbench.data.store import Store, TraceStore
from workbench.model import load_tokenizer

E, K = 6, 2  # experts, top-k
SUMMARY = json.dumps({"family": "hand", "backend": "native", "n_layers": 3, "n_heads": 1, "n_kv_heads": 1,
                      "vocab_size": 100, "max_seq_len": 64, "moe_layers": [1, 2], "n_routed_experts": E, "top_k": K})
CODE = ["def", " add", "(", "a", ",", " b", "):", "\n", "    ", "return", " a", " +", " b", "\n", "def", " sub", "(",
        "a", "):", "\n", "    ", "return", " -", "a"]
TEXT = ["The", " cat", " sat", " on", " the", " mat", ".", " It", " was", " 12", " years", " old", "!", " ", XSS,
        " end"]


def _write(store: Store, runs: list[tuple[str, str, list[str], str | None, str]], seed: int = 0) -> None:
    """Runs (run_id, status, token texts, batch_id, checkpoint) with random routing: experts 0..E-2 only
    (expert E-1 is never chosen), distinct weights."""
    rng = random.Random(seed)
    rows, toks, rout = [], [], []
    for rid, status, texts, batch, sha in runs:
        rows.append({"run_id": rid, "status": status, "prompt": "".join(texts[:6]), "batch_id": batch,
                     "summary": SUMMARY, "checkpoint_sha256": sha})
        for pos, t in enumerate(texts):
            toks.append({"run_id": rid, "pos": pos, "step": 0, "token_id": pos, "text": t, "is_prompt": True})
            for layer in (1, 2):
                chosen = rng.sample(range(E - 1), K)
                ws = sorted((rng.random() for _ in chosen), reverse=True)
                for slot, (e, w) in enumerate(zip(chosen, ws)):
                    rout.append({"run_id": rid, "pos": pos, "layer": layer, "slot": slot, "expert": e, "weight": w})
    store.append({"runs": pl.DataFrame(rows), "tokens": pl.DataFrame(toks), "routing": pl.DataFrame(rout)})


RUNS = [("code", "complete", CODE, "b1", "m"), ("prose", "complete", TEXT, "b1", "m"),
        ("broken", "failed", TEXT[:5], "b1", "m"), ("alone", "complete", CODE[:9], None, "m")]


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path / "w.duckdb")
    _write(s, RUNS)
    return s


def _routed(store: Store, run_ids: list[str]) -> pl.DataFrame:
    return store.sql("SELECT r.run_id, r.pos, r.layer, r.expert, r.weight, t.text FROM routing r JOIN tokens t "
                     "USING (run_id, pos) WHERE list_contains(?, r.run_id)", [run_ids])


def test_load_share_equals_a_direct_count_and_never_routed_experts_are_listed(store):
    df = workbench.open(store).batch("b1").atlas()
    assert set(A.COLUMNS) >= {"layer", "expert", "load_share", "label", "top_tokens", "top_classes"}
    assert df.columns == A.COLUMNS and df.height == 2 * E  # the failed run and the run outside the batch: not counted
    rows = _routed(store, ["code", "prose"]).iter_rows(named=True)
    count = Counter((r["layer"], r["expert"]) for r in rows)
    per_layer = Counter()
    for (layer, _), n in count.items():
        per_layer[layer] += n
    for r in df.iter_rows(named=True):
        n = count.get((r["layer"], r["expert"]), 0)
        assert r["slots"] == n and r["load_share"] == pytest.approx(n / per_layer[r["layer"]])
    assert df.filter(pl.col("expert") == E - 1)["label"].to_list() == [A.NEVER, A.NEVER]
    assert df.group_by("layer").agg(pl.col("load_share").sum())["load_share"].to_list() == pytest.approx([1, 1])


def test_top_tokens_and_contexts_are_the_highest_weight_ones(store):
    df = workbench.open(store).batch("b1").atlas()
    routed = _routed(store, ["code", "prose"])
    texts = {"code": CODE, "prose": TEXT}
    for r in df.filter(pl.col("slots") > 0).iter_rows(named=True):
        mine = routed.filter((pl.col("layer") == r["layer"]) & (pl.col("expert") == r["expert"]))
        summed = defaultdict(float)
        for t, w in zip(mine["text"], mine["weight"]):
            summed[t] += w
        want = sorted(summed.items(), key=lambda kv: -kv[1])[:A.TOP_TOKENS]
        assert r["top_tokens"] == [t for t, _ in want]
        assert r["token_weights"] == pytest.approx([w for _, w in want])
        # key tokens: summed weight x the share of the layer's tokens of that text routed here, texts seen twice
        layer_n = Counter(routed.filter(pl.col("layer") == r["layer"]).unique(["run_id", "pos"])["text"])
        n = Counter(mine["text"])
        often = [t for t in summed if n[t] >= min(A.KEY_MIN, max(n.values()))]
        key = sorted(often, key=lambda t: (-summed[t] * n[t] / layer_n[t], -n[t], t))[:A.TOP_TOKENS]
        assert r["key_tokens"] == key
        assert r["key_scores"] == pytest.approx([summed[t] * n[t] / layer_n[t] for t in key])
        assert r["label"] == A.make_label(key, r["top_classes"], r["class_shares"])
        ctx = json.loads(r["contexts"])
        assert [c["weight"] for c in ctx] == pytest.approx(sorted(mine["weight"], reverse=True)[:A.TOP_CONTEXTS])
        for c in ctx:  # 8 tokens either side, as text
            t, p = texts[c["run_id"]], c["pos"]
            assert (c["before"], c["token"], c["after"]) == ("".join(t[max(0, p - 8):p]), t[p], "".join(t[p + 1:p + 9]))


def test_classes_and_co_experts_from_direct_counts(store):
    df = workbench.open(store).batch("b1").atlas()
    routed = _routed(store, ["code", "prose"])
    code_classes = dict(zip(range(len(CODE)), workbench.open(store).run("code").code_view(per_token=True)["class"]))
    prose_classes = {i: A.text_class(t) for i, t in enumerate(TEXT)}  # "The cat sat ..." does not read as Python
    assert A.reads_as_python("".join(CODE[:6])) and not A.reads_as_python("".join(TEXT[:6]))
    assert A.reads_as_python("def f(x):\nreturn x") and not A.reads_as_python("It's a cat.")
    assert prose_classes[9] == "number" and prose_classes[12] == "punctuation" and prose_classes[13] == "whitespace"
    chosen = defaultdict(set)
    for r in routed.iter_rows(named=True):
        chosen[(r["run_id"], r["pos"], r["layer"])].add(r["expert"])
    for r in df.filter(pl.col("slots") > 0).iter_rows(named=True):
        mine = routed.filter((pl.col("layer") == r["layer"]) & (pl.col("expert") == r["expert"]))
        cls = Counter((code_classes if rid == "code" else prose_classes)[p]
                      for rid, p in zip(mine["run_id"], mine["pos"]))
        got = dict(zip(r["top_classes"], r["class_shares"]))
        assert got == pytest.approx({k: v / mine.height for k, v in cls.items()})
        assert r["class_shares"] == sorted(r["class_shares"], reverse=True)
        co = Counter(o for rid, p in zip(mine["run_id"], mine["pos"])
                     for o in chosen[(rid, p, r["layer"])] - {r["expert"]})
        assert dict(zip(r["co_experts"], r["co_shares"])) == pytest.approx(
            {e: n / mine.height for e, n in co.items()})
        assert len(co) <= A.CO_EXPERTS  # K=2 of E-1 used experts: every partner is listed


def test_stored_once_read_back_and_recomputed_when_the_batch_changes(store, monkeypatch):
    batch = workbench.open(store).batch("b1")
    first = batch.atlas()
    assert A.scopes(store) == ["batch:b1"]
    calls = []
    real = A.compute
    monkeypatch.setattr(A, "compute", lambda *a, **k: calls.append(1) or real(*a, **k))
    store.execute("UPDATE atlas SET label = 'sentinel' WHERE scope = 'batch:b1' AND layer = 1 AND expert = 0")
    again = batch.atlas()
    assert calls == [] and again["label"][0] == "sentinel"  # read back, not recomputed
    assert again.drop("label").equals(first.drop("label"))
    _write(store, [("late", "complete", CODE[:7], "b1", "m")], seed=1)  # a resumed batch: other runs
    third = batch.atlas()
    assert calls == [1] and third["label"][0] != "sentinel" and int(third["slots"].sum()) > int(first["slots"].sum())
    assert store.execute("SELECT count(*) FROM atlas WHERE scope = 'batch:b1'")[0][0] == 2 * E  # replaced, not added
    batch.atlas(recompute=True)
    assert calls == [1, 1]


def test_an_atlas_over_a_list_of_runs(store):
    wb = workbench.open(store)
    a = wb.atlas(["prose", "code"])
    b = wb.atlas([wb.run("code"), "prose"])  # Runs or ids, any order: one scope
    assert a.equals(b) and a.equals(wb.batch("b1").atlas())
    assert A.scopes(store) == sorted(["batch:b1", A.runs_scope(["code", "prose"])])
    with pytest.raises(workbench.run.query.RunNotFound):
        wb.atlas(["code", "nope"])
    _write(store, [("other", "complete", CODE[:5], None, "another model")], seed=2)
    with pytest.raises(ValueError, match="one model"):
        wb.atlas(["code", "other"])


def test_a_read_only_folder_of_shards_gets_its_atlas_computed_not_stored(store, tmp_path):
    export_parquet(store, tmp_path / "shards")
    shards = TraceStore(tmp_path / "shards")
    got = workbench.open(shards).batch("b1").atlas()
    assert got.equals(workbench.open(store).batch("b1").atlas())
    assert A.scopes(shards) == []


def test_label_is_deterministic(store, tmp_path):
    df = workbench.open(store).batch("b1").atlas()
    again = A.compute(store, ["prose", "code"])
    assert again["label"].to_list() == df["label"].to_list()
    other = Store(tmp_path / "other.duckdb")  # the same rows written in another order
    rows = {t: store.sql(f"SELECT * FROM {t}").sample(fraction=1.0, shuffle=True, seed=3)
            for t in ("runs", "tokens", "routing")}
    other.append(rows)
    assert A.compute(other, ["code", "prose"]).equals(again)
    assert A.make_label(["def", " return", "\n", " x"], ["keyword", "name"], [0.62, 0.38]) == \
        "`def`, `return`, `\\n` (keyword 62%)"
    assert A.make_label(["    ", " ", "\n"], ["indent"], [1.0]) == "`␣␣␣␣`, `␣`, `\\n` (indent 100%)"
    assert A.make_label([], [], []) == A.NEVER


def test_reading_the_atlas_needs_no_torch(store, tmp_path):
    workbench.open(store).batch("b1").atlas()
    db = store.path
    store.close()
    code = (f"import sys, workbench\nfrom workbench.analysis.atlas import cards_text\n"
            f"wb = workbench.open({str(db)!r})\n"
            f"print(len(cards_text(wb.batch('b1').atlas(recompute=True))) > 0, wb.atlas(['code']).height)\n"
            f"assert 'torch' not in sys.modules, 'torch was imported'\n")
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["True", str(2 * E)]


def test_cli_prints_the_cards(store, capsys):
    db = str(store.path)
    assert cli.main(["atlas", "b1", "--db", db, "--layer", "2"]) == 0
    out = capsys.readouterr().out
    want = workbench.open(store).batch("b1").atlas().filter(pl.col("layer") == 2)
    assert "layer 1 " not in out and all(f"layer 2 expert {e}:" in out for e in range(E))
    assert A.shown(want.sort("load_share", descending=True)["top_tokens"][0][0]) in out
    assert "\x1b" not in out
    assert cli.main(["atlas", "b1", "--db", db, "--top", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["experts"]
    assert len(got) == 3 and got[0]["load_share"] >= got[1]["load_share"] >= got[2]["load_share"]
    assert isinstance(got[0]["contexts"], list)
    assert cli.main(["atlas", "b1", "--db", db, "--layer", "7"]) == 2
    assert "no MoE layer 7" in capsys.readouterr().err
    assert cli.main(["atlas", "nope", "--db", db]) == 2
    assert cli.main(["atlas", "b1", "--db", str(Path(db).parent / "missing.duckdb")]) == 2


def test_tab_callbacks_show_an_escaped_card(store):
    app = AppContext(store)
    fig, layer, expert, card, msg = tab.atlas_views(app, "b1")
    assert layer.value == 1 and layer.choices and expert.value is not None
    df = workbench.open(store).batch("b1").atlas().filter(pl.col("layer") == 1)
    assert expert.value == df.sort(["load_share", "expert"], descending=[True, False])["expert"][0]  # the busiest
    assert len(fig.data[0].z) == 2 and len(fig.data[0].z[0]) == E
    assert "2 complete runs" in msg
    # the hostile token, wherever the atlas shows it: contexts, top tokens, labels
    hostile = [r for r in df.iter_rows(named=True) if XSS in r["contexts"]]
    assert hostile
    html_card = tab.atlas_card(app, "b1", 1, hostile[0]["expert"])
    assert "<img" not in html_card and "&lt;img src=x onerror=alert(1)&gt;" in html_card
    assert "<mark>" in html_card and "Token classes" in html_card
    labels = tab.card_html({**hostile[0], "label": XSS, "top_tokens": [XSS], "top_classes": [XSS]})
    assert "<img" not in labels
    figure = tab.grid_figure(df.with_columns(pl.lit(XSS).alias("label")), XSS)
    assert "<img" not in json.dumps(figure.to_plotly_json()["data"][0]["text"])
    assert "<img" not in figure.layout.title.text
    assert tab.atlas_views(app, None)[3] == tab.EMPTY
    assert "no complete runs" in tab.atlas_views(app, "nope")[4]
    assert "never routed" in tab.atlas_card(app, "b1", 1, E - 1)


# -- a recorded batch: the report and the browser -----------------------------------------------------

@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A batch of three prompts on a tiny model, its atlas computed, a hostile token in its stored contexts."""
    store = Store(tmp_path_factory.mktemp("atlas") / "wb.duckdb")
    batch = workbench.record_many(["def add(a, b):", "x = [1, 2, 3]", "print('hi')"], model=tiny_model(vocab_size=4096),
                                  tokenizer=load_tokenizer(), db=store, max_new_tokens=4, progress=False)
    load = batch.expert_load()
    got = batch.atlas().filter(pl.col("slots") > 0).select("layer", "expert", "slots", "load_share")
    assert got.equals(load.select("layer", "expert", "slots", pl.col("share").alias("load_share"))
                      .with_columns(pl.col("layer").cast(pl.Int32), pl.col("expert").cast(pl.Int32),
                                    pl.col("slots").cast(pl.Int64)))
    store.execute("UPDATE atlas SET contexts = replace(contexts, '\"token\": \"', '\"token\": \"' || ?)", [XSS])
    return batch


def test_report_shows_the_atlas_card_of_an_expert_a_finding_names(recorded, tmp_path, monkeypatch):
    from workbench.views import report

    run = recorded.run(recorded.run_ids[0])
    layer = run.model_summary.moe_layers[0]
    expert = int(recorded.atlas().filter(pl.col("layer") == layer).sort("load_share", descending=True)["expert"][0])
    finding = {"rank": 1, "component": "expert", "layer": layer, "head": None, "expert": expert, "pos_start": 1,
               "pos_end": 2, "positions": [1, 2], "n_rows": 2, "kinds": ["resid_norm_outlier"], "severity": "warning",
               "score": 5.0, "explanation": f"layer {layer} expert {expert}: made up for the test"}
    monkeypatch.setattr(report, "_findings", lambda *a: pl.DataFrame([finding]))
    page = Path(run.report(tmp_path / "r.html")).read_text()
    label = recorded.atlas().filter((pl.col("layer") == layer) & (pl.col("expert") == expert))["label"][0]
    assert "Expert atlas" in page and str(_escape(label)) in page  # Jinja's escaping
    assert XSS not in page and str(_escape(XSS)) in page  # the hostile context, escaped
    md = Path(run.report(tmp_path / "r.md", "md")).read_text()
    assert "Expert atlas (batch" in md and XSS not in md
    facts = json.loads(Path(run.report(tmp_path / "r.json", "json")).read_text())
    assert facts["findings"][0]["atlas"]["expert"] == expert
    # a run outside any batch, or a batch without a stored atlas: no card, no error
    recorded.store.execute("DELETE FROM atlas")
    assert "Expert atlas" not in Path(run.report(tmp_path / "r2.html")).read_text()


@needs_chromium
def test_browser_atlas_tab_picks_a_batch_and_shows_a_card(recorded):
    from workbench.apps.app import build_app

    recorded.atlas()
    recorded.store.execute("UPDATE atlas SET contexts = replace(contexts, '\"token\": \"', '\"token\": \"' || ?) "
                           "WHERE contexts NOT LIKE '%onerror%'", [XSS])
    with served(build_app(recorded.store)) as url, chromium_page() as pg:
        pg.goto(url)
        pg.get_by_role("tab", name="Atlas").click()
        wait_text(pg, "#atlas-msg", "Atlas of batch")
        wait_plot(pg, "atlas-grid")
        z = pg.evaluate("() => document.querySelector('#atlas-grid .js-plotly-plot').data[0].z")
        assert len(z) == len(recorded.run(recorded.run_ids[0]).model_summary.moe_layers)
        card = pg.locator("#atlas-card")
        card.locator("mark").first.wait_for(timeout=30_000)
        assert "Top contexts" in card.inner_text() and XSS in card.inner_text()  # shown as text
        assert pg.locator("#atlas-card img").count() == 0
        # another expert of the layer: its card
        other = 0 if ", expert 0:" not in card.inner_text() else 1
        pg.locator("#atlas-expert input").click()
        pg.get_by_role("option").nth(other).click()
        wait_text(pg, "#atlas-card", f", expert {other}:")
        assert pg.evaluate("() => window.__alerts.length") == 0
