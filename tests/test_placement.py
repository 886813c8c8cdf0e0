"""Issue 28 points 2 and 3: MaxVio (Run.maxvio, Batch.maxvio) and the expert-parallel placement what-if
(Batch.placement, workbench placement), each checked against a hand computation over the routing rows."""
from __future__ import annotations

import json
import os
import random
from collections import Counter

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import polars as pl
import pytest

import workbench
from workbench import cli
from workbench.apps import app as app_mod
from workbench.apps.shared import AppContext
from workbench.apps.tabs import batches, experts
from workbench.analysis import placement as P
from workbench.data.store import Store

PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n", "class Point:\n    def __init__(self",
           "import os\nimport sys\n", "x = [1, 2, 3]\nprint(", "with open('f.txt') as f:\n"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def env(tmp_path_factory, one_thread):
    """The bundled demo model (16 experts, top-2, 5 MoE layers) on six short prompts."""
    db = tmp_path_factory.mktemp("placement") / "wb.duckdb"
    batch = workbench.record_many(PROMPTS, db=Store(db), max_new_tokens=8, progress=False, detect=False)
    runs = [batch.run(r) for r in batch.runs().filter(pl.col("status") == "complete")["run_id"].to_list()]
    assert len(runs) == len(PROMPTS)
    rows = [(i, r["pos"], r["layer"], r["expert"]) for i, run in enumerate(runs)
            for r in run.routing().sort("pos", "layer", "slot").iter_rows(named=True)]
    return {"db": str(db), "batch": batch, "runs": runs, "rows": rows,
            "E": runs[0].model_summary.n_routed_experts}


# -- hand computations: plain Python over the routing rows ---------------------------------------------

def hand_maxvio(rows, E, chunk):
    """{layer: (global, chunk mean, chunk max, chunks)}; rows (run index, pos, layer, expert) of runs in order."""
    tokens = sorted({(i, p) for i, p, _, _ in rows})
    tok_chunk = {t: n // chunk for n, t in enumerate(tokens)}
    n_chunks = (len(tokens) + chunk - 1) // chunk
    keep = list(range(n_chunks))
    if n_chunks > 1 and len(tokens) % chunk:
        keep = keep[:-1]  # the trailing partial chunk
    out = {}
    for layer in sorted({r[2] for r in rows}):
        mine = [r for r in rows if r[2] == layer]
        load = Counter(r[3] for r in mine)
        glob = max(load.values()) / (len(mine) / E) - 1
        vals = []
        for c in keep:
            lc = Counter(r[3] for r in mine if tok_chunk[(r[0], r[1])] == c)
            vals.append(max(lc.values()) / (sum(lc.values()) / E) - 1)
        out[layer] = (glob, sum(vals) / len(vals), max(vals), len(vals))
    return out


def hand_loads(rows, E):
    out = {}
    for _, _, layer, e in rows:
        out.setdefault(layer, [0] * E)[e] += 1
    return out


def hand_devices(rows, layouts, G):
    """Per layer and device: each routing row split equally over its expert's replicas; and the off-device slots,
    each row's source device taken as each of the G devices with weight 1/G."""
    dev, off = {}, {}
    for _, _, layer, e in rows:
        held = layouts[layer]
        reps = sum(d.count(e) for d in held)
        for d, exps in enumerate(held):
            dev.setdefault(layer, [0.0] * G)[d] += exps.count(e) / reps
        off[layer] = off.get(layer, 0.0) + sum(1 for src in range(G) if e not in held[src]) / G
    return dev, off


def _cmp(frame, policy, layer):
    part = frame.filter((pl.col("policy") == policy) & (pl.col("layer") == layer)).sort("device")
    return part["slots"].to_list(), [list(x) for x in part["experts"].to_list()]


# -- MaxVio ---------------------------------------------------------------------------------------------

def test_batch_and_run_maxvio_equal_the_hand_computation(env):
    rows, E, batch = env["rows"], env["E"], env["batch"]
    for chunk in (16, 50, 10_000):
        got = batch.maxvio(chunk=chunk)
        assert got.columns[:2] == ["layer", "maxvio"]
        want = hand_maxvio(rows, E, chunk)
        assert got["layer"].to_list() == sorted(want)
        for r in got.iter_rows(named=True):
            g, m, x, n = want[r["layer"]]
            assert (r["maxvio"], r["maxvio_chunk_mean"], r["maxvio_chunk_max"]) == pytest.approx((g, m, x), abs=1e-12)
            assert r["chunks"] == n and r["slots"] == sum(1 for q in rows if q[2] == r["layer"])
        if chunk == 10_000:  # one chunk: the chunked variants are the global value
            assert got["maxvio_chunk_mean"].to_list() == pytest.approx(got["maxvio"].to_list())
    run = env["runs"][2]
    one = [q for q in rows if q[0] == 2]
    want = hand_maxvio(one, E, 4)
    got = run.maxvio(chunk=4)
    assert got["layer"].to_list() == sorted(want)
    for r in got.iter_rows(named=True):
        assert (r["maxvio"], r["maxvio_chunk_mean"], r["maxvio_chunk_max"]) == pytest.approx(want[r["layer"]][:3])
    assert 0 <= got["maxvio"].min() and got["maxvio"].max() <= E / 2 - 1  # top-2: at most E / k - 1
    # the store's SQL and the polars path agree on the same runs
    routing = pl.concat([r.routing().select("pos", "layer", "expert").with_columns(pl.lit(r.run_id).alias("run_id"))
                         for r in env["runs"]])
    assert P.routing_loads(routing, 16).equals(P.store_loads(batch.store, [r.run_id for r in env["runs"]], 16))
    with pytest.raises(ValueError, match="chunk"):
        batch.maxvio(chunk=0)


# -- placement ----------------------------------------------------------------------------------------------

def test_contiguous_and_eplb_loads_equal_the_hand_computation(env):
    rows, E, batch = env["rows"], env["E"], env["batch"]
    for G, R in ((4, 0), (4, 4), (16, 16), (2, 0)):
        frame = batch.placement(G, R, ["contiguous", "eplb"])
        assert frame.columns[:4] == ["policy", "layer", "device", "slots"]
        summ = batch.placement_summary(G, R)
        for policy in ("contiguous", "eplb"):
            layouts = {layer: _cmp(frame, policy, layer)[1] for layer in set(frame["layer"].to_list())}
            if policy == "contiguous" and R == 0:  # expert e on device e // (E / G)
                assert all(held == [[e for e in range(E) if e // (E // G) == d] for d in range(G)]
                           for held in layouts.values())
            dev, off = hand_devices(rows, layouts, G)
            for layer in layouts:
                slots, held = _cmp(frame, policy, layer)
                assert slots == pytest.approx(dev[layer], abs=1e-9)
                assert sum(len(h) for h in held) == E + R and all(len(h) == (E + R) // G for h in held)
                s = summ.filter((pl.col("policy") == policy) & (pl.col("layer") == layer)).row(0, named=True)
                n = sum(1 for q in rows if q[2] == layer)
                assert s["slots"] == n and s["mean_load"] == pytest.approx(n / G)
                assert s["max_load"] == pytest.approx(max(dev[layer])) and s["imbalance"] == pytest.approx(
                    max(dev[layer]) / (n / G))
                assert s["offdevice_slots"] == pytest.approx(off[layer]) and s["offdevice_share"] == pytest.approx(
                    off[layer] / n)


def test_eplb_replication_and_packing_by_hand():
    load = [100.0, 10, 10, 10, 10, 10, 10, 40]
    assert P.replicate(load, 3) == [3, 1, 1, 1, 1, 1, 1, 2]  # 100 -> 50 -> 40 (expert 7) -> 33.3 vs 20
    assert P.replicate(load, 4) == [4, 1, 1, 1, 1, 1, 1, 2]
    # 12 replicas, 3 per device: 25 (e0) x4 one per device, 20 (e7) onto d0 and d1, then the 10s onto the least
    # loaded device with room (d2, d3, d2, d3, d0, d1)
    assert P.eplb_layout(load, 4, 4) == [[0, 5, 7], [0, 6, 7], [0, 1, 3], [0, 2, 4]]
    assert P.contiguous_layout([1.0] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert P.contiguous_layout(load, 2, 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]]  # replicas in the last slots


def test_eplb_never_exceeds_its_slot_count_and_beats_contiguous_on_the_demo_batch(env):
    rng = random.Random(0)
    for _ in range(200):
        E = rng.choice([8, 16, 32])
        G = rng.choice([g for g in (1, 2, 4, 8) if g <= E])
        R = G * rng.randint(0, 3)
        load = [rng.expovariate(1.0) * rng.choice([1, 1, 10]) for _ in range(E)]
        held = P.eplb_layout(load, G, R)
        assert len(held) == G and all(len(h) == (E + R) // G for h in held)
        assert Counter(e for h in held for e in h) == Counter(
            {e: n for e, n in enumerate(P.replicate(load, R))})
    batch = env["batch"]
    for G, R in ((4, 0), (4, 4), (16, 0), (16, 16), (8, 8)):
        s = batch.placement_summary(G, R)
        for layer in set(s["layer"].to_list()):
            by = dict(s.filter(pl.col("layer") == layer).select("policy", "imbalance").iter_rows())
            assert by["eplb"] <= by["contiguous"] + 1e-12, (G, R, layer, by)
        assert batch.placement(G, R, "eplb").group_by("layer").agg(pl.col("replicas").max())["replicas"].max() \
            == (env["E"] + R) // G
    fig = batch.fig_placement(4, 4)
    assert {t.name for t in fig.data} == {"contiguous", "eplb"} and len(fig.data) == 4


def test_json_placement_round_trip_and_errors(env, tmp_path):
    batch, E = env["batch"], env["E"]
    eplb = batch.placement(4, 4, "eplb")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(P.to_json(eplb)))
    back = batch.placement(4, 0, str(path))
    assert set(back["policy"]) == {"mine.json"}
    assert back.drop("policy").equals(eplb.drop("policy"))
    star = batch.placement(None, 0, {"*": [list(range(E // 2)), list(range(E // 2, E))]})
    assert star.equals(batch.placement(2, 0, "contiguous").with_columns(pl.lit("custom").alias("policy")))
    assert set(batch.placement(2, 0, {"*": [list(range(E))] * 2})["slots"].to_list()) == {
        sum(1 for q in env["rows"] if q[2] == env["rows"][0][2]) / 2}  # every expert on both: half each
    bad = [({"*": [list(range(E - 1)), [], [], []]}, f"experts \\[{E - 1}\\] are on no device"),
           ({"1": [list(range(E)), [], [], []]}, "names no layer"), ({"*": [[E], [], [], []]}, "integers"),
           ({"*": [list(range(E))]}, "has 1 devices, --devices says 4")]
    for spec, msg in bad:
        with pytest.raises(ValueError, match=msg):
            batch.placement(4, 0, spec)
    with pytest.raises(ValueError, match="drop --redundant"):
        batch.placement(4, 4, str(path))
    with pytest.raises(ValueError, match="must divide experts \\+ redundant"):
        batch.placement(3, 0, "eplb")
    with pytest.raises(ValueError, match="unknown policy"):
        batch.placement(4, 0, "round-robin")


def test_cli_placement(env, capsys, tmp_path):
    db, bid = env["db"], env["batch"].batch_id
    assert cli.main(["placement", bid, "--devices", "4", "--redundant", "4", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "contiguous" in out and "eplb" in out and "max / mean" in out
    assert cli.main(["placement", bid, "--devices", "4", "--policy", "eplb", "--json", "--db", db]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in got["summary"]} == {"eplb"} and len(got["placements"]["eplb"]["1"]) == 4
    path = tmp_path / "p.json"
    path.write_text(json.dumps(got["placements"]["eplb"]))
    assert cli.main(["placement", bid, "--devices", "4", "--policy", str(path), "--db", db]) == 0
    assert "p.json" in capsys.readouterr().out
    for argv, msg in ((["--devices", "3"], "--devices 3 must divide experts + redundant = 16 + 0 = 16"),
                      (["--devices", "4", "--redundant", "-4"], "--redundant must be >= 0"),
                      (["--devices", "4", "--policy", str(tmp_path / "none.json")], "no placement file")):
        assert cli.main(["placement", bid, *argv, "--db", db]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, err
    assert cli.main(["placement", "nope", "--devices", "4", "--db", db]) == 2
    assert "no batch 'nope'" in capsys.readouterr().err
    assert cli.main(["placement", bid, "--devices", "4", "--db", str(tmp_path / "missing.duckdb")]) == 2
    assert "no database" in capsys.readouterr().err


def test_experts_and_batches_tabs_show_maxvio_and_placement(env):
    batch, run = env["batch"], env["runs"][0]
    app = AppContext(batch.store)
    s = app.session()
    vio, note = experts.maxvio_view(app, s, run.run_id)
    assert vio["maxvio"].to_list() == pytest.approx(run.maxvio()["maxvio"].round(3).to_list()) and "MaxVio" in note
    assert s.frames.reads["routing"] == 1  # the routing frame the other Experts views read
    experts.expert_views(app, s, run.run_id, None, 16)
    assert s.frames.reads["routing"] == 1
    assert experts.maxvio_view(app, s, None)[0].height == 0
    vio, note, fig = batches.batch_balance(app, batch.batch_id, 4, 4)
    assert vio["maxvio"].to_list() == pytest.approx(batch.maxvio()["maxvio"].round(3).to_list())
    assert "MaxVio" in note and {t.name for t in fig.data} == {"contiguous", "eplb"}
    _, _, fig = batches.batch_balance(app, batch.batch_id, 3, 0)
    assert len(fig.data) == 0 and "must divide" in fig.layout.title.text
    assert batches.batch_balance(app, None, 4, 0)[2] is None
    assert isinstance(app_mod.build_app(batch.store), gr.Blocks)
