"""The cache check (``anomalies.cache_rows``): a recorded run against one forward of its tokens without the KV cache.

A fault only the cached step-by-step path has (``faults.corrupt_cache``: what one layer writes into the cache, scaled)
leaves the weights and a cache-free forward as they were, so root cause (which recomputes without the cache) and the
component check cannot see it; the recorded token logprobs can. A clean run agrees to rounding; a corrupted cache is a
critical ``cache_mismatch`` row at the faulted layer and a ``kv`` finding there; a run with interventions, and a model
whose attention selects its keys (its cached decode is another computation), are not compared."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.analysis import activations, faults
from workbench.capture.adapters import load_adapter
from workbench.capture.tiny import make_folder, tiny_family
from workbench.data.store import Store
from workbench.interventions import ban_expert

PROMPT = [5, 17, 101, 3, 3, 250, 42, 9, 77, 18, 200, 64]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_model()


def _cache_rows(run) -> pl.DataFrame:
    return run.anomalies().filter(pl.col("kind") == "cache_mismatch")


def test_the_cache_free_forward_gives_back_the_recorded_logprobs(tiny, tmp_path):
    run = workbench.record(PROMPT, model=tiny, max_new_tokens=12, db=Store(tmp_path / "c.duckdb"), detect=False)
    t = run.tokens().sort("pos")
    lp, norms = activations.cache_free(load_adapter(tiny), t["token_id"].to_list())
    norms = norms["resid"]
    np.testing.assert_allclose(lp, t["logprob"].to_numpy()[1:], atol=1e-5)
    resid = run.signal("resid_norm")
    mine = np.array([norms[layer][pos] for pos, layer in zip(resid["pos"], resid["layer"])])
    np.testing.assert_allclose(mine, resid["norm"].to_numpy(), rtol=1e-5)


def test_a_clean_run_agrees_and_a_corrupted_cache_is_named_at_its_layer(tiny, tmp_path):
    db = Store(tmp_path / "c.duckdb")
    clean = workbench.record(PROMPT, model=tiny, max_new_tokens=16, db=db)
    assert _cache_rows(clean).height == 0
    assert json.loads(clean.info["detection"])["cache_check"].startswith("agrees")
    layer = 1
    with torch.no_grad():
        base = load_adapter(tiny).forward(torch.tensor([PROMPT]))
    with faults.HELD_OUT["kv_cache"](tiny, layer):
        with torch.no_grad():  # a forward without the cache: unchanged
            assert torch.equal(load_adapter(tiny).forward(torch.tensor([PROMPT])), base)
        bad = workbench.record(PROMPT, model=tiny, max_new_tokens=16, db=db)
    rows = _cache_rows(bad)
    assert rows.height == 1 and rows["severity"][0] == "critical" and rows["layer"][0] == layer
    assert rows["score"][0] > 0.05
    f = bad.findings()
    kv = f.filter(pl.col("component") == "kv")
    assert kv.height == 1 and kv["layer"][0] == layer and "without the KV cache" in kv["explanation"][0]
    assert f["kinds"][0].to_list() == ["cache_mismatch"]  # it leads: the rest is what the cached path computed
    after = workbench.record(PROMPT, model=tiny, max_new_tokens=16, db=db)  # the fault is gone with its block
    assert _cache_rows(after).height == 0


def test_a_run_with_interventions_is_not_compared(tiny, tmp_path):
    run = workbench.record(PROMPT, model=tiny, max_new_tokens=8, db=Store(tmp_path / "c.duckdb"),
                           interventions=[ban_expert(1, 1)])
    assert _cache_rows(run).height == 0
    assert "cache_check" not in json.loads(run.info["detection"])


def test_a_transformers_family_with_a_corrupted_cache(tmp_path):
    folder = make_folder("mixtral", tmp_path / "mixtral")
    a = load_adapter(folder)
    assert a.cache_exact
    db = Store(tmp_path / "c.duckdb")
    clean = workbench.record(PROMPT, model=a, max_new_tokens=10, db=db)
    assert _cache_rows(clean).height == 0
    layer = a.summary.n_layers - 1
    with faults.HELD_OUT["kv_cache"](a, layer):
        bad = workbench.record(PROMPT, model=a, max_new_tokens=10, db=db)
    rows = _cache_rows(bad)
    assert rows.height == 1 and rows["layer"][0] == layer


def test_attention_that_selects_its_keys_is_not_compared():
    """DeepSeek-V3.2's indexer picks the keys a query attends to: its cached decode and its whole-sequence forward
    differ on a clean model (2.7 nats on the tiny config), so the check does not run there."""
    a = load_adapter(tiny_family("deepseek_v32"))
    assert not a.cache_exact
    assert load_adapter(tiny_family("deepseek_v3")).cache_exact


def test_explain_and_the_report_say_root_cause_cannot_see_a_corrupted_cache(tiny, tmp_path):
    from workbench.analysis.rootcause import cache_note

    db = Store(tmp_path / "c.duckdb")
    clean = workbench.record(PROMPT, model=tiny, max_new_tokens=8, db=db)
    assert cache_note(db, clean.run_id) is None
    with faults.HELD_OUT["kv_cache"](tiny, 0):
        bad = workbench.record(PROMPT, model=tiny, max_new_tokens=8, db=db)
    note = cache_note(db, bad.run_id)
    assert note is not None and "layer 0" in note and "root cause recomputes without the cache" in note
    md = bad.report(tmp_path / "bad.md", format="md").read_text()
    assert "without the KV cache" in md and "cache_mismatch" in md


def test_with_a_profile_the_component_checks_forward_is_reused(tmp_path, monkeypatch):
    """The demo model has a profile: its component check runs one forward of the run's tokens, and the cache check
    takes the logprobs and residual norms from it instead of a forward of its own (a clean run costs no more)."""
    from workbench.model import load_checkpoint

    model = load_checkpoint()

    def no_forward(*_a, **_k):
        raise AssertionError("a forward of its own")
    monkeypatch.setattr(activations, "cache_free", no_forward)
    run = workbench.record("def add(a, b):\n    return", model=model, max_new_tokens=12, db=Store(tmp_path / "c.db"))
    assert json.loads(run.info["detection"])["cache_check"].startswith("agrees")


def test_the_faulted_layer_is_where_a_heads_output_first_differs(tiny, tmp_path):
    """A head's output norm changes at once with what it reads from the cache; the residual's norm only to second
    order (a change across it): the cache-free forward's head norms equal the recorded ones on a clean run, and the
    faulted layer is named at every layer."""
    db = Store(tmp_path / "c.duckdb")
    clean = workbench.record(PROMPT, model=tiny, max_new_tokens=12, db=db, detect=False)
    t = clean.tokens().sort("pos")
    _, norms = activations.cache_free(load_adapter(tiny), t["token_id"].to_list())
    h = clean.signal("head_norm")
    mine = np.array([norms["head"][layer][pos, head] for pos, layer, head in zip(h["pos"], h["layer"], h["head"])])
    np.testing.assert_allclose(mine, h["norm"].to_numpy(), rtol=1e-5)
    for layer in range(tiny.args.n_layers):
        with faults.HELD_OUT["kv_cache"](tiny, layer):
            bad = workbench.record(PROMPT, model=tiny, max_new_tokens=12, db=db)
        assert _cache_rows(bad)["layer"].to_list() == [layer]


def test_a_recompute_without_the_model_keeps_the_check(tiny, tmp_path):
    """The cache check runs the model: a recompute where none is loaded (the CLI, the app, new thresholds) keeps the
    row and what the recording's detection said, as the component check's rows are kept."""
    from workbench.analysis import anomalies

    db = Store(tmp_path / "c.duckdb")
    with faults.HELD_OUT["kv_cache"](tiny, 1):
        bad = workbench.record(PROMPT, model=tiny, max_new_tokens=12, db=db)
    assert _cache_rows(bad).height == 1
    again = anomalies.detect(db, bad.run_id, recompute=True, alpha=0.02)  # no model: thresholds force a recompute
    assert again.filter(pl.col("kind") == "cache_mismatch")["layer"].to_list() == [1]
    info = json.loads(workbench.Workbench(db).run(bad.run_id).info["detection"])
    assert info["cache_check"].startswith("differs") and "kept from the detection" in info["cache_check"]


def test_the_faulted_layer_through_the_component_checks_forward(tmp_path):
    """The demo model has a profile: its component check's forward is the one the cache check reads, faulty run
    included."""
    from workbench.model import load_checkpoint

    model = load_checkpoint()
    with faults.HELD_OUT["kv_cache"](model, 2):
        bad = workbench.record("def add(a, b):\n    return", model=model, max_new_tokens=12,
                               db=Store(tmp_path / "c.db"))
    assert _cache_rows(bad)["layer"].to_list() == [2]


def test_half_precision_is_judged_by_its_looser_threshold(tmp_path):
    from workbench.analysis import anomalies
    from workbench.model import load_checkpoint

    model = load_checkpoint()
    db = Store(tmp_path / "c.db")
    run = workbench.record("def add(a, b):\n    return", model=model, max_new_tokens=48, db=db, dtype="bfloat16",
                           temperature=1.0, seed=3)
    meta: dict = {}
    got = anomalies.cache_rows(run.tokens(), run.signal("resid_norm"), run.adapter(), "bfloat16", meta=meta)
    assert got.height == 0 and meta["cache_check"].startswith("agrees"), meta
    # the same numbers judged as fp32 (a run's dtype said wrongly): the model's own dtype still rules
    assert anomalies.cache_rows(run.tokens(), run.signal("resid_norm"), run.adapter(), "float32").height == 0


def test_a_rotary_embedding_that_depends_on_the_length_is_compared_only_up_to_it(tmp_path):
    from workbench.analysis import anomalies

    folder = make_folder("mixtral", tmp_path / "mixtral")
    a = load_adapter(folder)
    a.module.config.rope_parameters = {"rope_type": "longrope", "original_max_position_embeddings": 8,
                                       "rope_theta": 1e6}
    assert a.cache_exact_len == 8
    run = workbench.record(PROMPT, model=a, max_new_tokens=4, db=Store(tmp_path / "c.db"), detect=False)
    meta: dict = {}
    assert anomalies.cache_rows(run.tokens(), None, a, "float32", meta=meta).height == 0
    assert meta["cache_check"].startswith("not run") and "8 tokens" in meta["cache_check"]


def test_a_corrupted_cache_keeps_acting_on_every_generation_of_its_block(tiny):
    """Each generation sets up fresh caches; one whose id a freed cache had is hooked all the same."""
    a = load_adapter(tiny)
    with torch.no_grad():
        clean = list(a.stream(PROMPT, 1, 0.0, 1.0, 0, None))[0].logits
        with faults.HELD_OUT["kv_cache"](tiny, 0):
            for _ in range(6):
                got = list(a.stream(PROMPT, 1, 0.0, 1.0, 0, None))[0].logits
                assert (got - clean).abs().max() > 1e-3


def test_a_fault_in_decode_steps_only_is_found_at_its_layer(tiny, tmp_path):
    """A decode kernel gone wrong: a prefill and a whole forward are right, every decode step's attention at one layer
    is not. Only the recorded steps show it."""
    db = Store(tmp_path / "c.duckdb")
    with faults.HELD_OUT["decode_attn"](tiny, 1):
        bad = workbench.record(PROMPT, model=tiny, max_new_tokens=16, db=db)
    rows = _cache_rows(bad)
    assert rows["layer"].to_list() == [1] and rows["pos"][0] >= len(PROMPT)  # first off where decoding began


def test_the_suspects_lead_with_the_cache_root_cause_cannot_see(tiny, tmp_path):
    db = Store(tmp_path / "c.duckdb")
    with faults.HELD_OUT["kv_cache"](tiny, 1):
        bad = workbench.record(PROMPT, model=tiny, max_new_tokens=8, db=db)
    s = bad.suspects(len(PROMPT) + 2, steps=4)
    assert s.select("kind", "layer").row(0) == ("kv_cache", 1) and "without the KV cache" in s["evidence"][0]


def _judged_half(gaps: list[float], n_prompt: int = 4) -> tuple[pl.DataFrame, dict]:
    """``cache_rows`` of a bf16 run whose recorded logprobs sit ``gaps`` (one per generated token) from the cache-free
    forward's (handed in as the component check's, so no model runs), the prompt's exactly on it."""
    from workbench.analysis import anomalies

    n = n_prompt + len(gaps)
    free = -np.linspace(0.5, 3.0, n - 1)
    rec = np.concatenate([[np.nan], free - np.concatenate([np.zeros(n_prompt - 1), gaps])])
    tokens = pl.DataFrame({"pos": np.arange(n, dtype=np.int32), "token_id": np.arange(n, dtype=np.int32),
                           "is_prompt": [i < n_prompt for i in range(n)], "logprob": rec})
    meta: dict = {}
    seen = {"logprobs": free, "norms": {}}
    return anomalies.cache_rows(tokens, None, _Exact(), "bfloat16", seen=seen, meta=meta), meta


class _Exact:
    """A stand-in adapter: its cache is exact (compared), nothing runs (the component check's forward is given)."""
    cache_exact, cache_exact_len, dtype = True, None, torch.bfloat16


def test_half_precision_judges_the_generated_tokens_as_a_whole(monkeypatch):
    """bf16 rounds the cached and the whole forward differently: a few generated tokens 1-1.6 nats apart (a near tie
    of a router flipped) with the rest close is rounding; most tokens moved, or a quarter of them by over a nat, is
    the cache. Measured on clean bf16 runs of a 102M random DeepSeek-V3: medians 0.03-0.063 nats, at most 10% over 1."""
    from workbench.capture import adapters

    monkeypatch.setattr(adapters, "adapter_for", lambda a: a)
    rng = np.random.default_rng(0)
    noise = list(rng.uniform(0.0, 0.06, 40))
    for i in (3, 11, 20, 31):  # 10% of them over a nat: what the clean 102M runs showed at most
        noise[i] = 1.5
    rows, meta = _judged_half(noise)
    assert rows.height == 0 and meta["cache_check"].startswith("agrees") and "rounding" in meta["cache_check"]
    rows, meta = _judged_half([g + 0.3 for g in noise])  # every generated token moved: a median over 0.2 nats
    assert rows["kind"].to_list() == ["cache_mismatch"] and meta["cache_check"].startswith("differs")
    assert "a median of 0.3" in rows["explanation"][0] and rows["pos"][0] == 4  # the first generated token
    late = noise[:28] + [2.0] * 12  # a late fault: 30% of them over a nat, the median still small
    rows, _ = _judged_half(late)
    assert rows.height == 1 and rows["pos"][0] == 4 + 3  # the first over a nat: one of the rounding's
    assert "38% of them" in rows["explanation"][0]  # the rule that fired (15 of 40), not the median
    rows, _ = _judged_half([0.5, 1.5])  # two generated tokens, both moved
    assert rows.height == 1
    rows, _ = _judged_half([0.05, 1.5])  # one token moved, as in fp32 (CACHE_MIN): not the cache on its own
    assert rows.height == 0
    rows, _ = _judged_half([1.5])  # one generated token: every position judged, one of four moved
    assert rows.height == 0


def test_half_precision_without_generated_tokens_judges_every_position(monkeypatch):
    """A recording of one new token has no generated tokens to judge as a whole: every compared position is, so a
    cache written wrong under the prompt is still found (and a clean prompt's rounding is not); the row's score and
    worst position come from what was judged."""
    from workbench.capture import adapters

    monkeypatch.setattr(adapters, "adapter_for", lambda a: a)
    rows, meta = _judged_half([0.0], n_prompt=21)
    assert rows.height == 0 and "21 token logprobs judged" in meta["cache_check"]
    from workbench.analysis import anomalies

    n = 22
    free = -np.linspace(0.5, 3.0, n - 1)
    rec = np.concatenate([[np.nan], free - 3.0])  # every prompt position 3 nats off
    tokens = pl.DataFrame({"pos": np.arange(n, dtype=np.int32), "token_id": np.arange(n, dtype=np.int32),
                           "is_prompt": [i < n - 1 for i in range(n)], "logprob": rec})
    got = anomalies.cache_rows(tokens, None, _Exact(), "bfloat16", seen={"logprobs": free, "norms": {}})
    assert got.height == 1 and got["score"][0] == pytest.approx(3.0)
    # generated tokens judged: a prompt position far off is not their score
    rows, _ = _judged_half([0.5] * 10, n_prompt=4)
    assert rows.height == 1 and rows["score"][0] == pytest.approx(0.5) and rows["pos"][0] >= 4


def test_a_component_forward_longer_than_the_compared_tokens(monkeypatch):
    """The component check's forward can cover more tokens than the check compares (CACHE_TOKENS): its first ones
    are held against them, no error."""
    from workbench.analysis import anomalies
    from workbench.capture import adapters

    monkeypatch.setattr(adapters, "adapter_for", lambda a: a)
    monkeypatch.setattr(anomalies, "CACHE_TOKENS", 16)
    n = 30
    free = -np.linspace(0.5, 3.0, n - 1)
    tokens = pl.DataFrame({"pos": np.arange(n, dtype=np.int32), "token_id": np.arange(n, dtype=np.int32),
                           "is_prompt": [i < 4 for i in range(n)], "logprob": np.concatenate([[np.nan], free])})
    meta: dict = {}
    got = anomalies.cache_rows(tokens, None, _Exact(), "float32", seen={"logprobs": free, "norms": {}}, meta=meta)
    assert got.height == 0 and meta["cache_check"].startswith("agrees (positions 1-15")
