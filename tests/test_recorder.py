"""workbench.record and `workbench record`: inputs checked, runs stored, readable while recording."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench import cli
from workbench.capture.recorder import MAX_PROMPT_CHARS
from workbench.data.signals import PROBES, SIGNALS
from workbench.data.signals import TABLES as SIGNAL_TABLES
from workbench.data.store import Store
from workbench.model import ModelArgs, Transformer, save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER

ROOT = Path(__file__).resolve().parent.parent


def tiny(vocab: int = 256) -> Transformer:
    return tiny_model(vocab_size=vocab)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny checkpoint folder (ours) holding the bundled tokenizer (vocab 4096)."""
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(tiny(4096), folder, tokenizer=DEFAULT_TOKENIZER)
    shutil.copy(DEFAULT_TOKENIZER, folder / "tokenizer.json")
    return folder


def test_bad_prompts_are_value_errors(tmp_path, checkpoint):
    db = tmp_path / "w.duckdb"
    with pytest.raises(ValueError, match="empty prompt"):
        workbench.record("   ", model=checkpoint, db=db)
    with pytest.raises(ValueError, match="over the"):
        workbench.record("x" * (MAX_PROMPT_CHARS + 1), model=checkpoint, db=db)
    with pytest.raises(ValueError, match="exceeds"):
        workbench.record("hello " * 100, model=checkpoint, max_new_tokens=200, db=db)  # tiny context is 256
    with pytest.raises(ValueError, match="unknown probes"):
        workbench.record([1, 2], model=tiny(), probes=["tokens", "vibes"], db=db)
    with pytest.raises(ValueError, match="no probes chosen"):
        workbench.record([1, 2], model=tiny(), probes=(), db=db)
    with pytest.raises(ValueError, match="no prompts given"):
        workbench.record_many([], model=tiny(), db=db)
    wb = workbench.open(db, create=True)
    assert wb.runs().height == 0 or wb.runs()["status"].to_list() != ["complete"]


def test_record_from_checkpoint_folder(tmp_path, checkpoint):
    run = workbench.record("def add(a, b):", model=checkpoint, max_new_tokens=5, db=tmp_path / "w.duckdb")
    info = run.refresh().info
    assert info["status"] == "complete"
    assert info["model"] == str(checkpoint)
    assert len(info["checkpoint_sha256"]) == 64
    tok = run.tokens()
    assert tok.filter(pl.col("is_prompt"))["text"].str.join("").item() == "def add(a, b):"
    assert tok.height == info["n_tokens"] == info["n_prompt_tokens"] + 5


def test_probe_subsets(tmp_path):
    """probes= decides which tables get rows; tokens are always consistent with the full recording."""
    model, db = tiny(), Store(tmp_path / "w.duckdb")
    full = workbench.record([1, 2, 3, 4], model=model, max_new_tokens=3, db=db)
    for probe in PROBES:
        run = workbench.record([1, 2, 3, 4], model=model, max_new_tokens=3, db=db, probes=[probe])
        heights = {t: run.signal(t).height for t in SIGNAL_TABLES}
        assert {k for k, v in heights.items() if v} == {t.name for t in SIGNALS[probe].tables}
        if probe == "tokens":
            assert run.tokens()["token_id"].to_list() == full.tokens()["token_id"].to_list()


def test_readers_see_steps_while_recording(tmp_path):
    """In-process: during on_token of step n, a reader sees the rows of steps 0..n-1 (and the run running)."""
    import time

    store = Store(tmp_path / "w.duckdb")
    seen = []

    def on_token(pos, text):
        step = pos - 3  # prompt of 3 tokens: step n produces the token at pos 3 + n
        deadline = time.monotonic() + 10  # the writer commits asynchronously, within a fraction of a second
        while True:
            n = store.sql("SELECT count(DISTINCT step) AS n FROM steps")["n"][0]
            if n >= step or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        rows = store.sql("SELECT count(*) AS n FROM tokens WHERE pos < ?", [pos])["n"][0]
        seen.append((step, n, rows, store.sql("SELECT status FROM runs")["status"][0]))

    run = workbench.record([1, 2, 3], model=tiny(), max_new_tokens=6, db=store, on_token=on_token)
    assert [s[3] for s in seen] == ["running"] * 6
    for step, n, rows, _ in seen:
        assert n >= step  # every earlier step is committed and visible
        if step:
            assert rows == 3 + step  # the prompt and the tokens of steps 0..n-1
    assert run.status == "complete" and run.steps().height == 6


def test_failure_marks_run_failed(tmp_path):
    store = Store(tmp_path / "w.duckdb")

    def boom(pos, text):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError):
        workbench.record([1, 2, 3], model=tiny(), max_new_tokens=4, db=store, on_token=boom)
    r = store.sql("SELECT status, error FROM runs")
    assert r["status"][0] == "failed" and "stop here" in r["error"][0]
    assert store.sql("SELECT count(*) AS n FROM steps")["n"][0] == 1  # the finished step is kept


def test_cli_record_json(tmp_path, checkpoint, capsys):
    """``python -m workbench.cli record --json`` in its own process; then bad input through the same ``main``."""
    db = tmp_path / "cli.duckdb"
    cmd = [sys.executable, "-m", "workbench.cli", "record", "--prompt", "import os\n", "--model", str(checkpoint),
           "--max-new-tokens", "4", "--db", str(db), "--json"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    run = workbench.open(db).run(out["run_id"])
    assert run.status == "complete" == out["status"]
    assert out["tokens"] == run.tokens().height
    # bad input: one line on stderr, exit 2, no traceback (in this process: the entry point was run above)
    assert cli.main([*cmd[3:5], "  ", *cmd[6:]]) == 2
    err = capsys.readouterr().err
    assert "empty prompt" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bfloat16_run(tmp_path):
    run = workbench.record([1, 2, 3], model=tiny(), max_new_tokens=2, db=tmp_path / "w.duckdb", dtype="bfloat16")
    assert run.info["dtype"] == "bfloat16"
    kv = run.kv()
    a = ModelArgs.preset("tiny")
    assert (kv["bytes"] == kv["cached_tokens"] * (a.kv_lora_rank + a.qk_rope_head_dim) * 2).all()
    assert torch.isfinite(torch.tensor(run.attention()["entropy"].to_numpy())).all()


def test_model_identity_follows_weight_changes(tmp_path):
    """An in-memory model's checkpoint_sha256 is its weights' hash, recomputed after an in-place edit."""
    from workbench.model import state_sha256

    model, db = tiny(), Store(tmp_path / "w.duckdb")
    a = workbench.record([1, 2], model=model, max_new_tokens=1, db=db).info["checkpoint_sha256"]
    assert a == state_sha256(model)
    assert workbench.record([1, 2], model=model, max_new_tokens=1, db=db).info["checkpoint_sha256"] == a
    with torch.no_grad():
        model.layers[1].ffn.gate.bias[0] += 0.5
    b = workbench.record([1, 2], model=model, max_new_tokens=1, db=db).info["checkpoint_sha256"]
    assert b != a and b == state_sha256(model)


def test_anomalies_detected_when_a_run_completes(tmp_path):
    """The runs table's anomaly count is filled by record(); detect=False leaves it to the first look."""
    model, db = tiny(), Store(tmp_path / "w.duckdb")
    run = workbench.record([1, 2, 3, 4], model=model, max_new_tokens=12, db=db)
    stored = db.sql("SELECT count(*) AS n FROM anomalies WHERE run_id = ?", [run.run_id])["n"][0]
    assert stored > 0  # a random tiny model is unsure of nearly every token
    assert stored == run.anomalies(recompute=True).height
    assert workbench.open(db).runs().filter(pl.col("run_id") == run.run_id)["n_anomalies"][0] == stored
    quiet = workbench.record([1, 2, 3, 4], model=model, max_new_tokens=12, db=db, detect=False)
    assert db.sql("SELECT count(*) AS n FROM anomalies WHERE run_id = ?", [quiet.run_id])["n"][0] == 0


@pytest.mark.parametrize("kw, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"), ({"max_new_tokens": -1}, "max_new_tokens must be >= 1"),
    ({"temperature": float("nan")}, "temperature must be finite"), ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"top_p": 0.0, "temperature": 1.0}, "top_p must be in"), ({"top_p": 2.0}, "top_p must be in"),
    ({"dtype": "int8"}, "dtype must be one of"), ({"probes": ["nope"]}, "unknown probes"),
    ({"prompt": [1, 2, 10**30]}, "outside the model's vocabulary"), ({"prompt": [1, -3]}, "outside"),
    ({"prompt": [1, 2.5]}, "not an integer"), ({"prompt": []}, "empty prompt"), ({"topk": 0}, "topk must be >= 1"),
])
def test_bad_inputs_are_refused_before_a_run_exists(tmp_path, kw, message):
    db = Store(tmp_path / "w.duckdb")
    kw = {"prompt": [1, 2, 3], "max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=message):
        workbench.record(kw.pop("prompt"), model=tiny(), db=db, **kw)
    assert workbench.open(db).runs().height == 0


def test_cli_refuses_bad_generation_settings_with_exit_code_2(tmp_path, capsys):
    from workbench import cli

    db = str(tmp_path / "w.duckdb")
    for bad in (["--top-p", "0", "--temperature", "1"], ["--temperature", "nan"], ["--max-new-tokens", "0"],
                ["--temperature", "-1"], ["--top-p", "2"]):
        assert cli.main(["record", "--prompt", "x = 1", *bad, "--db", db]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("workbench record: error:"), err
    assert workbench.open(db, create=True).runs().height == 0


def test_a_truncated_checkpoint_is_a_one_line_error(tmp_path, capsys):
    import shutil

    from workbench import cli
    from workbench.model import DEFAULT_CHECKPOINT

    bad = tmp_path / "ckpt"
    bad.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(DEFAULT_CHECKPOINT / f, bad / f)
    (bad / "model.safetensors").write_bytes((DEFAULT_CHECKPOINT / "model.safetensors").read_bytes()[:100_000])
    assert cli.main(["record", "--model", str(bad), "--prompt", "x", "--db", str(tmp_path / "w.duckdb")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read" in err[0] and "truncated or corrupt" in err[0]


@pytest.mark.parametrize("family", ["native", "gpt_oss"])
def test_batched_decode_reductions_equal_per_step_reductions(tmp_path, monkeypatch, family):
    """Decode steps reduced together at a flush (the default) store exactly the rows that reducing every step
    on its own stores, on every signal table: batching changes the cost, never a value. gpt-oss covers
    sliding-window layers (rows whose key 0 moves) mixed with full ones."""
    import workbench.capture.recorder as recorder

    if family == "native":
        model, kw = tiny(), {}
    else:
        from workbench.capture.tiny import make_folder
        folder = make_folder("gpt_oss", tmp_path / "gpt_oss")
        model, kw = str(folder), {}
    stores = {}
    for name, every in (("batched", 32), ("per_step", 1)):
        monkeypatch.setattr(recorder, "FLUSH_STEPS", every)
        store = Store(tmp_path / f"{name}.duckdb")
        workbench.record([5, 6, 7, 8, 9], model=model, max_new_tokens=24, db=store, run_id="rsame", detect=False,
                         **kw)
        stores[name] = store
    for table in SIGNAL_TABLES.values():
        if table.name == "steps":
            continue  # wall times differ
        q = f"SELECT * EXCLUDE (run_id) FROM {table.name} ORDER BY {table.order}"
        a, b = stores["batched"].sql(q), stores["per_step"].sql(q)
        assert a.height > 0, table.name
        for c in table.names():
            if c in table.names("tol"):  # float sums over zero-padded rows may round in another order
                np.testing.assert_allclose(a[c].to_numpy().astype(float), b[c].to_numpy().astype(float), rtol=1e-6,
                                           atol=1e-7, equal_nan=True, err_msg=f"{table.name}.{c}")
            else:
                assert a[c].equals(b[c]), f"{table.name}.{c}"


def test_run_fields_are_in_the_first_runs_row(tmp_path):
    """``run_fields`` (a prompt set's batch_id) are stored with the run row itself: a reader sees them while the
    run is still recording, so a run killed mid-way keeps them; the recorder's own columns cannot be set."""
    store = Store(tmp_path / "w.duckdb")
    seen = []

    def on_token(pos, text):
        seen.append(store.sql("SELECT status, batch_id FROM runs").row(0))

    workbench.record([1, 2, 3], model=tiny(), max_new_tokens=3, db=store, on_token=on_token,
                     run_fields={"batch_id": "b1", "batch_item": "p0"})
    assert seen[0] == ("running", "b1")
    with pytest.raises(ValueError, match="run_fields"):
        workbench.record([1, 2, 3], model=tiny(), max_new_tokens=3, db=store, run_fields={"status": "complete"})


# -- RecordSettings: one value for every recording setting ------------------------------------------------

def test_the_same_run_from_keywords_and_from_settings(tmp_path):
    """``workbench.record``'s keywords, ``settings=RecordSettings(...)`` and ``record_run`` with the settings
    record the same generation and store the same params."""
    from workbench.capture.recorder import record_run
    from workbench.capture.settings import RecordSettings

    model, store = tiny(), Store(tmp_path / "w.duckdb")
    kw = dict(max_new_tokens=6, temperature=0.9, top_p=0.8, seed=7, topk=3, probes=["tokens", "routing", "tokens"])
    a = workbench.record([5, 6, 7], model=model, db=store, detect=False, **kw)
    s = RecordSettings(**kw)
    assert s.probes == ("tokens", "routing", "tokens") and s.probe_names == ["tokens", "routing"]
    b = workbench.record([5, 6, 7], model=model, db=store, detect=False, settings=s)
    c = record_run([5, 6, 7], s, model=model, db=store)[0]
    ids = [query_tokens(store, r) for r in (a.run_id, b.run_id, c)]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 3 + 6
    params = [json.loads(store.sql("SELECT params FROM runs WHERE run_id = ?", [r])["params"][0])
              for r in (a.run_id, b.run_id, c)]
    assert params[0] == params[1] == params[2]
    assert params[0]["probes"] == ["routing", "tokens"] and params[0]["temperature"] == 0.9 and params[0]["topk"] == 3
    # sampling at temperature 0.9 with another seed gives another text: the seed did reach the generation
    d = record_run([5, 6, 7], RecordSettings.of(s, seed=8), model=model, db=store)[0]
    assert query_tokens(store, d) != ids[0]
    # record_run's keyword fields override the settings given
    e = record_run([5, 6, 7], s, model=model, db=store, max_new_tokens=2)[0]
    assert query_tokens(store, e) == ids[0][:3 + 2]


def query_tokens(store: Store, run_id: str) -> list[int]:
    return store.sql("SELECT token_id FROM tokens WHERE run_id = ? ORDER BY pos", [run_id])["token_id"].to_list()


def test_settings_and_keywords_together_or_unknown_fields_are_refused(tmp_path):
    from workbench.capture.settings import RecordSettings

    with pytest.raises(TypeError, match="not both"):
        workbench.record([1, 2], model=tiny(), db=tmp_path / "w.duckdb", max_new_tokens=3,
                         settings=RecordSettings(max_new_tokens=3))
    with pytest.raises(TypeError, match="unknown recording settings"):
        RecordSettings.of(max_tokens=3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        RecordSettings(dtype="int3").check()
    with pytest.raises(ValueError, match="top_p"):
        workbench.record([1, 2], model=tiny(), db=tmp_path / "w.duckdb", settings=RecordSettings(top_p=0.0))
    assert not (tmp_path / "w.duckdb").exists()  # refused before any row (or file) was written
    # a prompt set's item overrides exactly its own three settings
    s = RecordSettings(max_new_tokens=9, top_p=0.5)
    assert s.for_item({"prompt": "x", "key": "k", "seed": 4}) == RecordSettings(max_new_tokens=9, top_p=0.5, seed=4)
    assert s.for_item({"prompt": "x", "key": "k"}) is s


def test_prompt_set_batch_ids_are_unchanged():
    """The default batch id hashes the same settings dict as before RecordSettings: literal ids computed on the
    code before it (commit e84b37c), so existing shard folders resume under the same id."""
    from workbench.capture.prompt_sets import prepare
    from workbench.capture.settings import RecordSettings

    items, settings, bid = prepare(["def f():", {"prompt": "x = 1", "id": "a", "max_new_tokens": 3}],
                                   model="/tmp/ckpt", max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3,
                                   dtype="bf16", probes=["tokens", "routing"], topk=4, backend="native")
    assert bid == "bbc34097abef"
    assert settings.batch_dict() == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                     "dtype": "bf16", "probes": ["routing", "tokens"], "topk": 4, "backend": "native"}
    same = RecordSettings(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, dtype="bf16",
                          probes=("routing", "tokens"), topk=4, backend="native")
    assert prepare(["def f():", {"prompt": "x = 1", "id": "a", "max_new_tokens": 3}], model="/tmp/ckpt",
                   settings=same)[2] == bid
    assert prepare(["hello"])[2] == "bbaa159ee965"
    assert prepare(["hello"], model="/some/folder")[2] == "b38aafc3058b"
    assert prepare(["hello"], settings=RecordSettings(seed=1))[2] != "bbaa159ee965"


def test_cli_flags_build_the_settings():
    from workbench.capture.settings import RecordSettings
    from workbench.cli import build_parser
    from workbench.commands.record import settings

    args = build_parser().parse_args(["record", "--prompt", "x", "--max-new-tokens", "3", "--temperature", "0.5", "--top-p",
                                      "0.9", "--seed", "2", "--dtype", "bfloat16", "--backend", "native"])
    assert settings(args) == RecordSettings(max_new_tokens=3, temperature=0.5, top_p=0.9, seed=2, dtype="bfloat16",
                                            backend="native")


def test_one_tokenizer_rule(tmp_path, checkpoint):
    """``capture.resolve.tokenizer_for``: the tokenizer given; else the folder's; a folder without one is an error;
    else the bundled demo's (with a warning for a live module, silently for a stored run's label)."""
    import warnings

    from workbench.capture.adapters import adapter_for
    from workbench.capture.resolve import tokenizer_for
    from workbench.model import load_tokenizer
    from workbench.model.tokenizer import train_tokenizer

    bundled = load_tokenizer(None).to_str()
    given = load_tokenizer(DEFAULT_TOKENIZER)
    assert tokenizer_for(checkpoint, given) is given
    assert tokenizer_for(None, DEFAULT_TOKENIZER).to_str() == given.to_str()
    own = tmp_path / "own"
    own.mkdir()
    small = train_tokenizer(["def f(x):\n    return x\n"] * 10, vocab_size=300)
    small.save(str(own / "tokenizer.json"))
    n = small.get_vocab_size()
    assert n != given.get_vocab_size()
    for model in (own, str(own)):  # a folder, or a run's label naming it
        assert tokenizer_for(model).get_vocab_size() == n and tokenizer_for(model).to_str() != bundled
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        tokenizer_for(empty)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tokenizer_for(None).to_str() == bundled
        assert tokenizer_for("Transformer").to_str() == bundled  # a stored run's label naming no folder here
    with pytest.warns(UserWarning, match="in-memory Transformer"):
        assert tokenizer_for(tiny()).to_str() == bundled
    adapter = adapter_for(tiny())
    adapter.checkpoint_path = str(own)  # a module loaded from a folder: the folder's
    assert tokenizer_for(adapter).get_vocab_size() == n
    # Run.tokenizer() of a stored run follows the same rule: the folder's tokenizer
    run = workbench.record("def f(x):", model=checkpoint, max_new_tokens=2, db=tmp_path / "w.duckdb", detect=False)
    fresh = workbench.open(run.store).run(run.run_id)
    assert fresh.tokenizer().to_str() == load_tokenizer(checkpoint / "tokenizer.json").to_str()
