"""Replay: ``at_step`` against what the model did at that step, re-execution, divergence detection."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import tiny_model

from workbench import cli, record
from workbench.analysis.diff import first_divergence
from workbench.analysis.replay import at_step, replay_run, step_range
from workbench.data.signals import TABLES as SIGNAL_TABLES
from workbench.data.store import Store
from workbench.model import ModelArgs, Transformer, load_checkpoint, save_checkpoint, stream
from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.probes import attach
from workbench.probes.signals import attention_stats

PROMPT = [5, 17, 42, 7, 99, 3]
NEW = 6


def tiny() -> Transformer:
    return tiny_model()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    ckpt = save_checkpoint(tiny(), root / "ckpt", tokenizer=DEFAULT_TOKENIZER)
    store = Store(root / "wb.duckdb")
    run = record(PROMPT, model=str(ckpt), max_new_tokens=NEW, db=store)
    return {"root": root, "ckpt": ckpt, "store": store, "run": run}


def reference_steps(ckpt) -> list[dict]:
    """What the model computes at each step, captured directly with hooks (no recorder, no store)."""
    model = load_checkpoint(ckpt)
    moe = [i for i, l in enumerate(model.layers) if hasattr(l.ffn, "gate")]
    seen: dict = {}

    def probs(p, name, q_start, **_):  # keep the newest query row's statistics
        st = attention_stats(p[0].detach(), q_start)
        seen.setdefault("heads", {})[int(name.split(".")[1])] = st["entropy"][-1]

    def indices(t, name, **_):
        seen.setdefault("experts", {})[int(name.split(".")[1])] = sorted(t[-1].tolist())

    out = []
    hooks = {"layers.*.attn.hook_attn_probs": probs}
    if moe:
        hooks["layers.*.ffn.gate.hook_indices"] = indices
    with attach(model, hooks):
        for step in stream(model, PROMPT, NEW):
            p = torch.softmax(step.logits[-1].float(), -1)
            out.append({"heads": dict(seen["heads"]), "experts": dict(seen.get("experts", {})),
                        "next": step.next_token, "confidence": float(p.max()),
                        "prob": float(p[step.next_token]), "cache": model.layers[0].attn.cache.length,
                        "fed": list(step.input_ids)})
            seen.clear()
    return out


def test_at_step_equals_what_the_model_did_at_that_step(env):
    store, run = env["store"], env["run"]
    ref = reference_steps(env["ckpt"])
    assert step_range(store, run.run_id) == (0, len(ref) - 1)
    generated = []
    for t, r in enumerate(ref):
        st = at_step(store, run.run_id, t)
        generated.append(r["next"])
        # tokens so far: the prompt plus every token produced up to and including step t
        assert st.tokens["token_id"].to_list() == PROMPT + generated
        assert st.produced_pos == len(PROMPT) + t
        assert st.produced["token_id"] == r["next"]
        assert st.produced["confidence"] == pytest.approx(r["confidence"], abs=1e-6)
        assert st.produced["prob"] == pytest.approx(r["prob"], abs=1e-6)
        # the newest token fed at step t, and its heads' entropy / routing
        assert st.tokens.filter(st.tokens["pos"] == st.newest_pos)["token_id"][0] == r["fed"][-1]
        assert st.fed_positions == (list(range(len(PROMPT))) if t == 0 else [len(PROMPT) + t - 1])
        for layer, ent in r["heads"].items():
            got = st.heads.filter(st.heads["layer"] == layer).sort("head")["entropy"].to_numpy()
            assert got == pytest.approx(ent.tolist(), abs=1e-5)
        for layer, experts in r["experts"].items():
            assert sorted(st.routing.filter(st.routing["layer"] == layer)["expert"].to_list()) == experts
        # KV size after the step, per layer, and the step's timing row
        assert set(st.kv["cached_tokens"].to_list()) == {r["cache"]}
        assert st.cached_tokens == len(PROMPT) + t
        assert st.kv_bytes == int(st.kv["bytes"].sum()) > 0
        assert st.kind == ("prefill" if t == 0 else "decode") and st.wall_ms is not None and st.wall_ms >= 0
    assert at_step(store, run.run_id, 0).kv_tokens.height > 0  # norms are kept for the prefill


def test_at_step_takes_numpy_and_torch_integers(env):
    store, rid = env["store"], env["run"].run_id
    want = at_step(store, rid, 1)
    for t in (np.int32(1), np.int64(1), torch.tensor(1)):
        got = at_step(store, rid, t)
        assert got.step == 1 and got.tokens.equals(want.tokens) and got.newest_pos == want.newest_pos


@pytest.mark.parametrize("bad", [-1, NEW, 2.0, "1", True])
def test_at_step_rejects_out_of_range_with_the_valid_range(env, bad):
    with pytest.raises(ValueError, match=rf"valid steps are 0\.\.{NEW - 1}"):
        at_step(env["store"], env["run"].run_id, bad)


def test_replay_of_a_run_without_token_rows_says_there_were_none_to_compare(env, capsys):
    store = env["store"]
    probes = ("steps", "routing", "attention")
    run = record(PROMPT, model=str(env["ckpt"]), max_new_tokens=3, db=store, probes=probes, detect=False)
    res = replay_run(store, run.run_id)
    assert res["match"] is True and res["tokens_match"] is None
    assert res["n_tokens"] == [len(PROMPT) + 3] * 2
    assert cli.main(["replay", run.run_id, "--db", str(store.path)]) == 0
    assert "no tokens rows to compare" in capsys.readouterr().out


def test_replay_of_a_greedy_run_matches_exactly(env, capsys):
    store, run = env["store"], env["run"]
    res = replay_run(store, run.run_id)
    assert res["match"] is True and res["first_divergence"] is None and res["tokens_match"]
    assert res["parent_run_id"] == run.run_id and res["run_id"] != run.run_id
    new = store.sql("SELECT parent_run_id, checkpoint_sha256 FROM runs WHERE run_id = ?", [res["run_id"]]).row(0)
    assert new == (run.run_id, run.info["checkpoint_sha256"])
    a = store.sql("SELECT pos, token_id FROM tokens WHERE run_id = ? ORDER BY pos", [run.run_id])
    b = store.sql("SELECT pos, token_id FROM tokens WHERE run_id = ? ORDER BY pos", [res["run_id"]])
    assert a.equals(b)
    # the CLI prints one JSON object with "match" and exits 0 on a match
    assert cli.main(["replay", run.run_id, "--json", "--db", str(store.path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["match"] is True and out["parent_run_id"] == run.run_id


def test_first_divergence_names_step_position_signal_and_magnitude(env):
    store, run = env["store"], env["run"]
    rid, n = run.run_id, len(PROMPT)
    for table in ("runs", *SIGNAL_TABLES):
        store.execute(f"INSERT INTO {table} SELECT * REPLACE ('edited' AS run_id) FROM {table} WHERE run_id = ?",
                      [rid])
    assert first_divergence(store, rid, "edited") is None
    pos = n + 2  # fed at decode step 3
    store.execute("UPDATE attention SET entropy = entropy + 0.25 WHERE run_id = 'edited' AND pos = ? AND layer = 1 "
                  "AND head = 2", [pos])
    store.execute("UPDATE routing SET weight = weight + 0.5 WHERE run_id = 'edited' AND pos = ?", [pos + 1])
    d = first_divergence(store, rid, "edited")
    assert (d["step"], d["pos"], d["signal"], d["layer"], d["head"]) == (3, pos, "attention.entropy", 1, 2)
    assert d["magnitude"] == pytest.approx(0.25, abs=1e-9)
    # a changed token wins over later signals and is exact, not toleranced
    store.execute("UPDATE tokens SET token_id = token_id + 1 WHERE run_id = 'edited' AND pos = ?", [n + 1])
    d = first_divergence(store, rid, "edited")
    assert (d["step"], d["pos"], d["signal"], d["magnitude"]) == (1, n + 1, "tokens.token_id", 1.0)
    # a missing row is a divergence too
    store.execute("DELETE FROM kv WHERE run_id = 'edited' AND step = 0 AND layer = 1")
    d = first_divergence(store, rid, "edited")
    assert (d["step"], d["signal"], d["b"]) == (0, "kv.missing", "absent")


def test_replay_refuses_a_changed_checkpoint(env):
    ckpt = shutil.copytree(env["ckpt"], env["root"] / "ckpt_changed")
    store = env["store"]
    run = record(PROMPT, model=str(ckpt), max_new_tokens=2, db=store)
    save_checkpoint(Transformer(ModelArgs.preset("tiny")).init_weights(seed=2, std=0.1), ckpt)
    n_runs = store.sql("SELECT count(*) AS n FROM runs")["n"][0]
    with pytest.raises(ValueError, match="sha256"):
        replay_run(store, run.run_id)
    assert store.sql("SELECT count(*) AS n FROM runs")["n"][0] == n_runs  # nothing written
    assert cli.main(["replay", run.run_id, "--db", str(store.path)]) == 2


def test_replay_of_an_in_memory_sampled_run_needs_the_module(env):
    store = env["store"]
    module = tiny()
    # sampled, not greedy: the replay must reuse the recorded seed and settings to match
    run = record(PROMPT, model=module, max_new_tokens=4, db=store, temperature=0.9, top_p=0.95, seed=7)
    with pytest.raises(ValueError, match="in-memory"):
        replay_run(store, run.run_id)
    with pytest.raises(ValueError, match="sha256"):
        replay_run(store, run.run_id, model=Transformer(ModelArgs.preset("tiny")).init_weights(seed=3, std=0.1))
    res = replay_run(store, run.run_id, model=module)
    assert res["match"] is True and res["parent_run_id"] == run.run_id
