"""Checks before expensive work on a model folder (issue 26, items 1 and 4): a missing or oversized tokenizer and a
hostile config.json are refused in one line before a weight is read or the database created; a folder that needs
its own Python code is refused and its code never runs; a folder whose safetensors do not cover the model is
refused instead of running with random weights."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors.torch import load_file, save_file

import workbench
from workbench import cli
from workbench.capture import preflight, recorder
from workbench.capture.adapters import load_adapter
from workbench.data.store import Store
from workbench.model import ModelArgs, Transformer, save_checkpoint
from workbench.model.tokenizer import DEFAULT_TOKENIZER

pytest.importorskip("transformers")
from workbench.capture.tiny import make_folder  # noqa: E402 - needs transformers


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    return {"mixtral": make_folder("mixtral", root / "mixtral"),
            "bare": make_folder("mixtral", root / "bare", tokenizer=False),
            "native": save_checkpoint(tiny_model(), root / "native", tokenizer=DEFAULT_TOKENIZER),
            "root": root}


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if any weight loading starts."""
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the check")
    monkeypatch.setattr(recorder, "load_adapter", boom)


def refused(argv: list[str], capsys, db: Path) -> str:
    """Run the CLI; assert exit 2, one line on stderr, fast, and no database created; return the line."""
    t0 = time.monotonic()
    code = cli.main(argv + ["--db", str(db)])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "<" not in err
    assert elapsed < 2.0, elapsed
    assert not db.exists()
    return err


def test_missing_tokenizer_is_refused_before_the_weights(folders, tmp_path, capsys, no_loading):
    err = refused(["record", "--model", str(folders["bare"]), "--prompt", "def f(x):"], capsys, tmp_path / "w.duckdb")
    assert "no tokenizer.json" in err and "--tokenizer" in err


def test_tokenizer_larger_than_the_vocabulary_is_refused(folders, tmp_path, capsys, no_loading):
    vocab = json.loads((folders["mixtral"] / "config.json").read_text())["vocab_size"]
    err = refused(["record", "--model", str(folders["mixtral"]), "--tokenizer", str(DEFAULT_TOKENIZER),
                   "--prompt", "def f(x):"], capsys, tmp_path / "w.duckdb")
    assert f"vocabulary of {vocab}" in err and "4096 tokens" in err
    # the same folder with a bare model folder and the oversized tokenizer
    err = refused(["record", "--model", str(folders["bare"]), "--tokenizer", str(DEFAULT_TOKENIZER),
                   "--prompt", "x"], capsys, tmp_path / "w2.duckdb")
    assert "4096 tokens" in err
    # ours: a 256-token model saved with the 4096-token demo tokenizer cannot encode text ...
    err = refused(["record", "--model", str(folders["native"]), "--prompt", "def f(x):"], capsys,
                  tmp_path / "w3.duckdb")
    assert "vocabulary of 256" in err


def test_token_id_prompts_only_decode_and_the_model_own_tokenizer_works(folders, tmp_path):
    # ... but token ids (checked against the vocabulary themselves) only need decoding: recorded
    run = workbench.record([5, 6, 7], model=str(folders["native"]), max_new_tokens=2, db=tmp_path / "a.duckdb",
                           detect=False)
    assert run.info["status"] == "complete"
    run = workbench.record("def f(x):", model=str(folders["mixtral"]), max_new_tokens=2, db=tmp_path / "b.duckdb",
                           detect=False)
    assert run.info["status"] == "complete"


def test_a_module_with_a_larger_tokenizer_is_refused_before_its_run_exists(tmp_path):
    """A module passed in (no config.json to read first): the encoded prompt is checked against its vocabulary."""
    db = Store(tmp_path / "w.duckdb")
    with pytest.raises(ValueError, match="past the model's vocabulary of 256"):
        workbench.record("def fibonacci(n):", model=tiny_model(), tokenizer=DEFAULT_TOKENIZER, db=db, detect=False)
    assert db.sql("SELECT count(*) AS n FROM runs")["n"][0] == 0


def _native_cfg(**kw) -> dict:
    return ModelArgs.preset("tiny").to_dict() | kw


def _hf_cfg(folders, **kw) -> dict:
    return json.loads((folders["mixtral"] / "config.json").read_text()) | kw


HOSTILE = {
    "200k layers (ours)": lambda f: _native_cfg(n_layers=200_000),
    "200k layers (transformers)": lambda f: _hf_cfg(f, num_hidden_layers=200_000),
    "negative size": lambda f: _hf_cfg(f, hidden_size=-64),
    "string size": lambda f: _native_cfg(dim="64"),
    "float size": lambda f: _hf_cfg(f, intermediate_size=96.5),
    "bool size": lambda f: _hf_cfg(f, vocab_size=True),
    "list size": lambda f: _native_cfg(n_heads=[4]),
    "huge max_seq_len (ours)": lambda f: _native_cfg(max_seq_len=1 << 24),
    "huge within ranges (transformers)": lambda f: _hf_cfg(f, hidden_size=1 << 16, num_hidden_layers=4000,
                                                          num_local_experts=4096, intermediate_size=1 << 16),
    "huge vocab": lambda f: _native_cfg(vocab_size=1 << 24, dim=1 << 16),
    "unknown field (ours)": lambda f: _native_cfg(n_layerz=3),
    "float for a string (ours)": lambda f: _native_cfg(score_func=1.5),
    "not an object": lambda f: [1, 2, 3],
    "nested text config": lambda f: _hf_cfg(f, text_config={"num_hidden_layers": 10**9}),
}


@pytest.mark.timeout(120)  # a regression would build the model: fail, not hang
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_configs_are_refused_in_one_line_before_anything_is_built(folders, tmp_path, capsys, no_loading,
                                                                          monkeypatch, name):
    monkeypatch.setenv("WORKBENCH_MAX_MODEL_BYTES", str(4 << 30))  # a 4 GB machine, whatever this one has
    folder = tmp_path / "hostile"
    shutil.copytree(folders["mixtral"], folder)
    (folder / "config.json").write_text(json.dumps(HOSTILE[name](folders)))
    err = refused(["record", "--model", str(folder), "--prompt", "x"], capsys, tmp_path / "w.duckdb")
    assert "config.json" in err
    # the loader refuses it too (prompt sets, replay, explain and Python callers do not go through record)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="config.json"):
        load_adapter(str(folder))
    assert time.monotonic() - t0 < 2.0


def test_oversized_models_are_refused_against_the_memory_limit(folders, tmp_path, monkeypatch):
    folder = tmp_path / "big"
    shutil.copytree(folders["mixtral"], folder)
    (folder / "config.json").write_text(json.dumps(_hf_cfg(folders, hidden_size=8192, num_hidden_layers=64,
                                                           intermediate_size=28672)))
    monkeypatch.setenv("WORKBENCH_MAX_MODEL_BYTES", str(1 << 30))
    with pytest.raises(ValueError, match=r"more than the 1\.1 GB allowed here"):
        load_adapter(str(folder))
    monkeypatch.delenv("WORKBENCH_MAX_MODEL_BYTES")
    assert preflight.memory_limit() > 0


def test_size_estimates_are_close_to_the_real_models(folders):
    """The estimate is what the refusal rests on: within a factor of 1.5 of the real parameter bytes."""
    for f in ("mixtral", "native"):
        cfg = json.loads((folders[f] / "config.json").read_text())
        params, _ = preflight.estimate_bytes(cfg)
        real = sum(t.numel() * 4 for t in load_file(next(folders[f].glob("*.safetensors"))).values())
        assert real / 1.5 < params < real * 1.5, (f, params, real)
    demo = ModelArgs.preset("demo")
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(demo).parameters())
    params, extra = preflight.estimate_bytes(demo.to_dict())
    assert n * 4 / 1.5 < params < n * 4 * 1.5 and extra > 0


def _evil(root: Path, model_type: str, base: Path | None = None) -> tuple[Path, Path]:
    folder = root / f"evil_{model_type}"
    marker = root / f"RAN_{model_type}"
    if base is not None:
        shutil.copytree(base, folder)
        cfg = json.loads((folder / "config.json").read_text())
    else:
        folder.mkdir()
        cfg = {"vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2}
        shutil.copy(DEFAULT_TOKENIZER, folder / "tokenizer.json")
    cfg |= {"model_type": model_type, "auto_map": {"AutoConfig": "evil_code.EvilConfig",
                                                   "AutoModelForCausalLM": "evil_code.EvilModel"}}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "evil_code.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder, marker


def test_a_folder_that_needs_its_own_code_is_refused_and_never_run(folders, tmp_path, capsys, monkeypatch):
    folder, marker = _evil(tmp_path, "evil")
    monkeypatch.setattr("sys.stdin", open("/dev/null"))  # a prompt would read here; there must be none
    with pytest.raises(ValueError, match="never runs a model folder's own Python") as e:
        load_adapter(str(folder))
    assert len(str(e.value).splitlines()) == 1
    code = cli.main(["record", "--model", str(folder), "--prompt", "x", "--max-new-tokens", "2",
                     "--db", str(tmp_path / "w.duckdb")])
    err = capsys.readouterr()
    assert code == 2 and "auto_map" in err.err and len(err.err.strip().splitlines()) == 1
    assert "custom code" not in err.out + err.err  # transformers never asked
    # a model_type transformers knows, with an auto_map and code beside it: transformers' own class, code ignored
    known, known_marker = _evil(tmp_path, "mixtral", base=folders["mixtral"])
    run = workbench.record("x = 1", model=str(known), max_new_tokens=2, db=tmp_path / "k.duckdb", detect=False)
    assert run.info["status"] == "complete" and type(run.model()).__module__.startswith("transformers.")
    assert not marker.exists() and not known_marker.exists()


@pytest.mark.parametrize("which", ["none", "some"])
def test_weights_that_do_not_cover_the_model_are_refused(folders, tmp_path, capsys, which):
    folder = tmp_path / f"renamed_{which}"
    shutil.copytree(folders["mixtral"], folder)
    f = next(folder.glob("*.safetensors"))
    tensors = load_file(f)
    f.unlink()
    rename = (lambda k: "old." + k) if which == "none" else (lambda k: "old." + k if ".layers.1." in k else k)
    save_file({rename(k): v for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="are not in its safetensors"):
        load_adapter(str(folder))
    db = tmp_path / "w.duckdb"
    assert cli.main(["record", "--model", str(folder), "--prompt", "x", "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip()
    # transformers' progress bar may show above it; its table of missing keys does not
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("Loading weights", "\rLoading"))]
    assert len(lines) == 1 and "random values" in lines[0] and "MISSING" not in err, err
    assert not db.exists() or Store(db).sql("SELECT count(*) AS n FROM runs")["n"][0] == 0
