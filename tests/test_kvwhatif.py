"""The KV-cache policy what-if (workbench.analysis.kv_policies): exactness of the full cache, eviction against a hand-masked
forward, INT8 fake quantisation, spec parsing, the CLI, transformers folders, and the policy_results table."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.analysis.kv_policies import COLUMNS, Full, fake_quant, kv_whatif, parse_policy, run_tokens, trace
from workbench.data import query
from workbench.data.store import Store
from workbench.model import save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER

PROMPT = [5, 17, 3, 99, 42, 7, 250, 11]
KEEP_ALL = ["window:sink=4,recent=100", "window:sink=100,recent=0", "heavy_hitters:budget=100",
            "confidence:threshold=0", "topk_int8:k=100", "entropy:ratio=0", "recompute"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def native(tmp_path_factory, one_thread):
    """A greedy run of a tiny random model (8 prompt + 12 generated tokens), with its live adapter."""
    db = tmp_path_factory.mktemp("kvw") / "w.duckdb"
    model = tiny_model()
    run = workbench.record(PROMPT, model=model, max_new_tokens=12, db=db, detect=False)
    return run


def _same_as_full(row: dict, full: dict) -> None:
    assert row["delta_nll"] == 0.0 and row["top1_agreement"] == 1.0 and row["first_divergence"] is None, row
    assert row["bytes_kept"] == row["bytes_full"] == full["bytes_full"], row


def test_full_is_exact_and_policies_that_keep_every_token_equal_it(native):
    df = native.kv_whatif(["full", *KEEP_ALL], save=False)
    assert df.columns == COLUMNS and df.height == 1 + len(KEEP_ALL)
    rows = {r["policy"]: r for r in df.iter_rows(named=True)}
    full = rows["full"]
    assert full["delta_nll"] == 0.0 and full["bytes_kept"] == full["bytes_full"] > 0 and full["events"] == 0
    # the latent cache of the fed tokens (the last generated one is never fed): the kv table's last step
    kv = native.kv()
    assert full["bytes_full"] == kv.filter(pl.col("step") == kv["step"].max())["bytes"].sum()
    for spec in KEEP_ALL:
        _same_as_full(rows[parse_policy(spec).spec], full)
        assert rows[parse_policy(spec).spec]["events"] == 0 or spec == "recompute"
    # the full cache re-run reproduces the recorded log-probabilities of the generated tokens
    ids, n_prompt = run_tokens(native.store, native.run_id)
    t = trace(native.adapter(), ids, n_prompt, Full())
    rec = native.tokens().filter(~pl.col("is_prompt"))["logprob"].to_numpy()
    assert np.abs(t.logprob - rec).max() < 1e-4


def test_window_evicts_exactly_the_positions_a_hand_masked_forward_leaves_out(native, monkeypatch):
    import workbench.model.model as mm

    sink, recent = 2, 3
    ids, n_prompt = run_tokens(native.store, native.run_id)
    adapter = native.adapter()
    got = trace(adapter, ids, n_prompt, parse_policy(f"window:sink={sink},recent={recent}"))
    # the cache after the run holds the N - 1 fed tokens: the first `sink` and the last `recent` survive
    n = len(ids) - 1
    want = torch.tensor([k < sink or k >= n - recent for k in range(n)])
    assert all(torch.equal(k, want) for k in got.keep)

    # reference: one full forward whose causal mask also hides, from each query q fed after the prompt,
    # the keys the policy had evicted by then (sink <= k < q - recent), as -inf scores
    plain = mm.causal_mask

    def masked(seqlen, keys, start_pos, device):
        m = plain(seqlen, keys, start_pos, device)
        q = torch.arange(start_pos, start_pos + seqlen)[:, None]
        k = torch.arange(keys)[None, :]
        return m.masked_fill((q >= n_prompt) & (k >= sink) & (k < q - recent), float("-inf"))

    monkeypatch.setattr(mm, "causal_mask", masked)
    model = adapter.module
    handles = [layer.attn.hook_attn_probs.register_forward_hook(lambda *a: None) for layer in model.layers]
    try:  # a listener on hook_attn_probs selects the explicit-softmax path, which takes the mask above
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]]))[0].double()
    finally:
        for h in handles:
            h.remove()
    lp = torch.log_softmax(logits, -1)
    ref = np.array([float(lp[p - 1, ids[p]]) for p in range(n_prompt, len(ids))])
    assert np.abs(got.logprob - ref).max() < 1e-4
    full = trace(adapter, ids, n_prompt, Full())
    assert np.abs(full.logprob - ref).max() > 1e-3  # the eviction did change the predictions
    assert got.logprob[0] == full.logprob[0]  # the first prediction comes from the prefill, before any policy


def test_confidence_and_heavy_hitters_evict_what_they_say(native):
    ids, n_prompt = run_tokens(native.store, native.run_id)
    adapter = native.adapter()
    n_layers, g, n = adapter.summary.n_layers, len(ids) - n_prompt, len(ids) - 1
    # a threshold no step reaches: the oldest cached token (after the sinks) goes after every step, in every layer
    t = trace(adapter, ids, n_prompt, parse_policy("confidence:threshold=1.5"))
    assert all(torch.equal(k, torch.arange(n) >= g) for k in t.keep) and t.events == n_layers * g
    t = trace(adapter, ids, n_prompt, parse_policy("confidence:threshold=1.5,sink=2"))
    pos = torch.arange(n)
    assert all(torch.equal(k, (pos < 2) | (pos >= g + 2)) for k in t.keep)
    # H2O: `budget` tokens per layer at the end, the `recent` newest among them
    t = trace(adapter, ids, n_prompt, parse_policy("heavy_hitters:budget=6,recent=2"))
    assert all(int(k.sum()) == 6 and bool(k[-2:].all()) for k in t.keep)
    assert t.events == n_layers * (n - 6)

def test_int8_fake_quant_is_exact_on_representable_values():
    x = torch.arange(-127, 128, dtype=torch.float32) * 0.25  # multiples of a power-of-two scale, max 127 steps
    assert torch.equal(fake_quant(x, 8), x)
    y = torch.arange(-7, 8, dtype=torch.float32) * 2.0 ** -3
    assert torch.equal(fake_quant(y, 4), y)
    assert torch.equal(fake_quant(torch.zeros(5), 8), torch.zeros(5))
    r = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    err = (fake_quant(r, 8) - r).abs().max()
    assert 0 < err <= r.abs().max() / 127 / 2 + 1e-7


def test_quantising_policies_count_their_bytes(native):
    ids, n_prompt = run_tokens(native.store, native.run_id)
    adapter = native.adapter()
    args = adapter.module.args
    n, k = len(ids) - 1, 3
    t = trace(adapter, ids, n_prompt, parse_policy(f"topk_int8:k={k}"))
    per_tok = args.kv_lora_rank + args.qk_rope_head_dim
    # per layer: k tokens at fp32, the rest at one byte per element, one 4-byte scale per tensor (latent, rope)
    assert t.bytes_full == args.n_layers * n * per_tok * 4
    assert t.bytes_kept == args.n_layers * (k * per_tok * 4 + (n - k) * per_tok + 2 * 4)
    assert t.events == args.n_layers * (n - k)
    q = trace(adapter, ids, n_prompt, parse_policy("quant_tree"))
    assert all(set(b.tolist()) <= {4, 6, 8} for b in q.bits)
    assert q.bytes_kept < t.bytes_full * 8 // 32 + 100  # at most 8 of 32 bits per element, plus scales
    assert q.events == sum(int((b == 4).sum()) for b in q.bits)


def test_specs_parse_to_canonical_forms_and_bad_ones_fail_in_one_line():
    assert parse_policy("window:recent=8, sink=2").spec == "window:sink=2,recent=8"
    assert parse_policy(" full ").spec == "full"
    p = parse_policy("confidence:shallow=0.80,deep=0.92")
    assert p.spec == "confidence:shallow=0.8,deep=0.92"
    p.start(6)
    assert p.thresholds == [0.8, 0.8, 0.8, 0.92, 0.92, 0.92]
    assert parse_policy("heavy_hitters:budget=10").recent == 5
    assert parse_policy("recompute:delta=0.012,window=3").spec == "recompute:delta=0.012,window=3"
    bad = ["", "nope", "nope\n<b>x</b>", "window:sink", "window:sink=a", "window:foo=1", "window:sink=1,sink=2",
           "window:sink=-1", "confidence:threshold=0.8,shallow=0.7", "confidence:shallow=0.8",
           "heavy_hitters:budget=0", "heavy_hitters:budget=4,recent=5", "recompute:delta=nan", "topk_int8:k=1.5",
           "full:x=1", "quant_tree:near=-2"]
    for spec in bad:
        with pytest.raises(ValueError) as e:
            parse_policy(spec)
        assert "\n" not in str(e.value) and str(e.value), spec


def test_cli_prints_json_and_reports_bad_specs(tmp_path, capsys):
    from workbench import cli

    ckpt = tmp_path / "ckpt"
    save_checkpoint(tiny_model(3, vocab_size=4096), ckpt, tokenizer=DEFAULT_TOKENIZER)
    db = str(tmp_path / "w.duckdb")
    run = workbench.record("def f(x):\n", model=str(ckpt), max_new_tokens=6, db=db, detect=False)
    capsys.readouterr()
    rc = cli.main(["kv-whatif", run.run_id, "--policy", "full", "--policy", "window:sink=1,recent=2", "--json",
                   "--db", db])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0
    doc = json.loads(out)
    assert doc["run_id"] == run.run_id and [r["policy"] for r in doc["results"]] == ["full", "window:sink=1,recent=2"]
    assert set(doc["results"][0]) == set(COLUMNS) and doc["results"][0]["delta_nll"] == 0.0
    assert cli.main(["kv-whatif", run.run_id, "--policy", "full", "--db", db]) == 0  # a table for people
    assert "full" in capsys.readouterr().out
    rc = cli.main(["kv-whatif", run.run_id, "--policy", "window:sink=x", "--db", db])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "sink must be an integer" in err


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_works_on_a_tiny_transformers_folder(tmp_path, family):
    pytest.importorskip("transformers")
    from workbench.capture.tiny import make_folder

    folder = make_folder(family, tmp_path / family)
    run = workbench.record("def add(a, b):\n    return", model=str(folder), max_new_tokens=10,
                           db=tmp_path / "w.duckdb", detect=False)
    df = run.kv_whatif(["full", "window:sink=1,recent=2", "heavy_hitters:budget=100", "confidence:threshold=0",
                        "topk_int8:k=2", "quant_tree"])
    rows = {r["policy"]: r for r in df.iter_rows(named=True)}
    full = rows["full"]
    # keys + values of every layer: the kv table's last step
    kv = run.kv()
    assert full["bytes_full"] == kv.filter(pl.col("step") == kv["step"].max())["bytes"].sum()
    for spec in ("full", "heavy_hitters:budget=100", "confidence:threshold=0"):
        _same_as_full(rows[spec], full)
    win = rows["window:sink=1,recent=2"]
    assert win["bytes_kept"] < full["bytes_full"] and win["events"] > 0 and win["delta_nll"] != 0.0
    assert rows["topk_int8:k=2"]["bytes_kept"] < full["bytes_full"] and rows["topk_int8:k=2"]["events"] > 0
    assert rows["quant_tree"]["bytes_kept"] < full["bytes_full"] // 2
    ids, n_prompt = run_tokens(run.store, run.run_id)
    t = trace(run.adapter(), ids, n_prompt, Full())
    rec = run.tokens().filter(~pl.col("is_prompt"))["logprob"].to_numpy()
    assert np.abs(t.logprob - rec).max() < 1e-4


def test_policy_results_round_trip_through_the_store(native, tmp_path):
    from workbench.views.figures import fig_kv_pareto
    from workbench.views.report import build_report, render_html, render_md

    store = native.store
    df = kv_whatif(store, native.run_id, ["full", "window:sink=1,recent=3", "topk_int8:k=2"], adapter=native.adapter())
    back = native.policy_results()
    assert back.columns == COLUMNS + ["created_at"]
    assert back.drop("created_at").sort("policy").equals(df.sort("policy"))
    # a policy re-run replaces its row, the others stay
    native.kv_whatif(["window:sink=1,recent=3"])
    again = query.policy_results(store, native.run_id)
    assert sorted(again["policy"].to_list()) == sorted(df["policy"].to_list())
    # the same rows reopened from the file
    fresh = Store(store.path).sql("SELECT policy, delta_nll FROM policy_results WHERE run_id = ? ORDER BY policy",
                                  [native.run_id])
    assert fresh.height == 3
    fig = fig_kv_pareto(df)
    assert {t.name for t in fig.data} >= {"Pareto front", "full", "window", "topk_int8"}
    assert len(native.fig_kv_pareto().data) == len(fig.data)
    rep = build_report(native, explain=0)
    assert [r["policy"] for r in rep.facts["kv_policies"]] == back["policy"].to_list()
    assert "KV-cache policies" in render_md(rep) and "KV-cache policies" in render_html(rep)
    assert any(key == "kv_pareto" for _, key, _ in rep.figures)


def test_ui_tab_runs_policies_and_escapes_errors(native):
    import os
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from workbench.apps.shared import AppContext
    from workbench.apps.tabs.kv_whatif import kv_whatif_run

    app = AppContext(native.store, model=native.model())
    s = app.session()
    msg, table, fig = kv_whatif_run(app, s, native.run_id, ["full"], "window:sink=1,recent=2",
                                    progress=lambda *a, **k: None)
    assert table["policy"].to_list() == ["full", "window:sink=1,recent=2"] and fig.data
    msg, table, fig = kv_whatif_run(app, s, native.run_id, [], "nope<img src=x onerror=alert(1)>",
                                    progress=lambda *a, **k: None)
    assert table.height == 0 and "<img" not in msg and "&lt;img" in msg
