"""Provenance and nothing deleted (issue 26, items 3 and 4): a run stores the absolute model folder, its
tokenizer file and a fingerprint of the weights it ran with; replay and explain find them from any folder and
take --model / --tokenizer overrides; export never touches files it did not write; a traces folder is read
literally, never as a glob."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors.torch import load_file, save_file

import workbench
from workbench import cli
from workbench.apps.shared import AppContext
from workbench.analysis import faults
from workbench.commands import replay as replay_cmd
from workbench.data.export import MARKER, export_parquet
from workbench.data.store import Store, TraceStore
from workbench.model import load_checkpoint, load_tokenizer, save_checkpoint, state_sha256
from workbench.model.tokenizer import DEFAULT_TOKENIZER
from workbench.views.figures import token_label

PROMPT = "def f(x):"


@pytest.fixture
def ckpt(tmp_path):
    """A tiny checkpoint of ours (vocabulary 4096, the demo tokenizer's) in tmp/models/tiny."""
    return save_checkpoint(tiny_model(vocab_size=4096), tmp_path / "models" / "tiny", tokenizer=DEFAULT_TOKENIZER)


def ns(cmd: str, run_id: str, db, **kw) -> argparse.Namespace:
    base = {"run_id": run_id, "db": str(db), "json": True, "model": None, "tokenizer": None}
    if cmd == "explain":
        base |= {"pos": 3, "steps": 4, "mode": "auto", "reference": None, "method": None}
    return argparse.Namespace(**(base | kw))


def test_a_run_stores_absolute_paths_and_replays_from_another_folder(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "w.duckdb"
    run = workbench.record(PROMPT, model="models/tiny", max_new_tokens=4, db=db, detect=False)  # relative
    info = run.info
    assert info["model"] == str(ckpt.absolute())
    assert info["tokenizer"] == str((ckpt / "tokenizer.json").absolute())
    assert info["weights_sha256"] == state_sha256(load_checkpoint(ckpt))
    run.store.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["replay", run.run_id, "--json", "--db", str(db)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["match"] is True


def test_replay_and_explain_take_model_and_tokenizer_overrides(tmp_path, capsys):
    # a model folder without a tokenizer, recorded with --tokenizer
    bare = save_checkpoint(tiny_model(vocab_size=4096), tmp_path / "bare")
    tok = tmp_path / "tokens" / "tok.json"
    tok.parent.mkdir()
    shutil.copy(DEFAULT_TOKENIZER, tok)
    db = tmp_path / "w.duckdb"
    assert cli.main(["record", "--model", str(bare), "--tokenizer", str(tok), "--prompt", PROMPT,
                     "--max-new-tokens", "4", "--json", "--db", str(db)]) == 0
    rid = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    info = workbench.open(db).run(rid).info
    assert info["tokenizer"] == str(tok) and info["model"] == str(bare)
    # the recorded tokenizer is found without a flag
    assert replay_cmd.main(ns("replay", rid, db)) == 0
    capsys.readouterr()
    # both moved: the error names the path looked for, in one line, without Python syntax
    moved, moved_tok = tmp_path / "moved", tmp_path / "moved_tok.json"
    shutil.move(bare, moved)
    shutil.move(tok, moved_tok)
    assert cli.main(["replay", rid, "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bare / "config.json") in err and "=<" not in err, err
    assert "--model" in err
    # the model given, the tokenizer still missing: the recorded tokenizer's path is named
    with pytest.raises(FileNotFoundError, match=str(tok)):
        replay_cmd.main(ns("replay", rid, db, model=str(moved)))
    # both given on the command line: replayed, same tokens
    assert cli.main(["replay", rid, "--model", str(moved), "--tokenizer", str(moved_tok), "--json",
                     "--db", str(db)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["match"] is True and out["tokens_match"] is True
    # explain: the recorded folder is gone, --model finds the weights (hash-checked)
    assert cli.main(["explain", rid, "3", "--json", "--steps", "4", "--db", str(db)]) == 2
    assert str(bare) in capsys.readouterr().err
    assert cli.main(["explain", rid, "3", "--json", "--steps", "4", "--model", str(moved), "--tokenizer",
                     str(moved_tok), "--db", str(db)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["run_id"] == rid and got["causes"]
    # a folder with other weights is refused, not silently used
    other = save_checkpoint(tiny_model(seed=9, vocab_size=4096), tmp_path / "other", tokenizer=DEFAULT_TOKENIZER)
    with pytest.raises(ValueError, match="weights changed"):
        replay_cmd.main(ns("replay", rid, db, model=str(other)))


def test_the_fingerprint_follows_in_place_edits_and_faults(ckpt, tmp_path):
    db = Store(tmp_path / "w.duckdb")
    clean = workbench.record(PROMPT, model=str(ckpt), max_new_tokens=2, db=db, detect=False).info
    model = load_checkpoint(ckpt)
    same = workbench.record(PROMPT, model=model, max_new_tokens=2, db=db, detect=False).info
    assert same["weights_sha256"] == clean["weights_sha256"]
    # a weight fault active while recording: the weights the run used differ (the folder's files do not)
    kind = faults.KINDS["norm"]
    with kind(model, layer=0):
        faulty = workbench.record(PROMPT, model=model, max_new_tokens=2, db=db, detect=False).info
    assert faulty["checkpoint_sha256"] == clean["checkpoint_sha256"]  # loaded from the same folder
    assert faulty["weights_sha256"] != clean["weights_sha256"]
    after = workbench.record(PROMPT, model=model, max_new_tokens=2, db=db, detect=False).info
    assert after["weights_sha256"] == clean["weights_sha256"]  # the fault undone on leaving its block
    # an in-place edit of the module
    with torch.no_grad():
        model.layers[0].attn_norm.weight[0] += 1.0
    edited = workbench.record(PROMPT, model=model, max_new_tokens=2, db=db, detect=False).info
    assert edited["weights_sha256"] not in (clean["weights_sha256"], faulty["weights_sha256"])
    # an edit through .data (no tensor's version counter moves): the hash is computed again, not remembered
    model.layers[1].ffn.experts[0].w2.weight.data.mul_(-1)
    flipped = workbench.record(PROMPT, model=model, max_new_tokens=2, db=db, detect=False).info
    assert flipped["weights_sha256"] == state_sha256(model)
    assert flipped["weights_sha256"] not in (clean["weights_sha256"], edited["weights_sha256"])
    model.layers[1].ffn.experts[0].w2.weight.data.mul_(-1)  # undone: the edited run's weights again
    assert workbench.record(PROMPT, model=model, max_new_tokens=2, db=db, detect=False).info["weights_sha256"] == \
        edited["weights_sha256"]
    # an in-place edit of the folder's weights file: both fingerprints change, computed at record time
    f = ckpt / "model.safetensors"
    t = load_file(f)
    t["norm.weight"] = t["norm.weight"] * 2
    save_file(t, str(f), metadata={"format": "pt"})
    refiled = workbench.record(PROMPT, model=str(ckpt), max_new_tokens=2, db=db, detect=False).info
    assert refiled["checkpoint_sha256"] != clean["checkpoint_sha256"]
    assert refiled["weights_sha256"] not in (clean["weights_sha256"], edited["weights_sha256"])


FOREIGN = {".editor.swp.tmp": "swap", "tmp_results.parquet": "not ours", "proj/sub/.cache.tmp": "cache",
           "runs/.notes.tmp": "notes", "meta/.x.1.tmp": "x", "runs/run_id=zz/.data.parquet.tmp": "almost ours"}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_export_leaves_files_it_did_not_write(ckpt, tmp_path, capsys):
    db = Store(tmp_path / "w.duckdb")
    rid = workbench.record([5, 6, 7], model=str(ckpt), max_new_tokens=2, db=db, detect=False).run_id
    out = tmp_path / "out"
    for rel, text in FOREIGN.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    before = _snapshot(out)
    files = export_parquet(db, out)
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before  # every foreign file as it was
    assert (out / MARKER).exists() and all(f.exists() for f in files)
    # an export's own leftover (a killed one's temporary file) is still cleaned up
    stray = out / "runs" / f"run_id={rid}" / ".data.parquet.12345.tmp"
    stray.write_text("partial")
    export_parquet(db, out)
    assert not stray.exists() and {k: v for k, v in _snapshot(out).items() if k in before} == before
    # a _SUCCESS that is not ours: refused, nothing written or removed
    theirs = tmp_path / "spark"
    theirs.mkdir()
    (theirs / MARKER).write_text("")
    (theirs / "part-0000.parquet").write_text("theirs")
    before = _snapshot(theirs)
    db.close()
    assert cli.main(["export", "--parquet", str(theirs), "--db", str(tmp_path / "w.duckdb")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a workbench export marker" in err
    assert _snapshot(theirs) == before


def test_a_traces_folder_is_read_literally_not_as_a_glob(ckpt, tmp_path):
    db = Store(tmp_path / "w.duckdb")
    mine = workbench.record([5, 6, 7], model=str(ckpt), max_new_tokens=2, db=db, detect=False).run_id
    other = workbench.record([8, 9], model=str(ckpt), max_new_tokens=2, db=db, detect=False).run_id
    base = tmp_path / "t"
    for name, rid in (("s*", mine), ("sibling", other), ("s[i]", other), ("s?", other)):
        export_parquet(db, base / name, rid)
    db.close()
    for name, rid in (("s*", mine), ("s[i]", other), ("s?", other)):
        got = TraceStore(base / name).sql("SELECT run_id FROM runs")["run_id"].to_list()
        assert got == [rid], (name, got)
    assert workbench.open(base / "s*").runs()["run_id"].to_list() == [mine]
    assert os.path.isdir(base / "sibling")


def test_a_run_recorded_with_a_tokenizer_elsewhere_reads_its_texts_with_it(tmp_path):
    """``record --tokenizer PATH`` for a folder without tokenizer.json: ``Run.tokenizer()`` and the app's
    ``tokenizer_for`` use the stored ``runs.tokenizer``, so the top-k texts are token text, not ``#id``."""
    bare = save_checkpoint(tiny_model(vocab_size=4096), tmp_path / "bare")
    assert not (bare / "tokenizer.json").exists()
    tok_file = tmp_path / "tokens" / "tok.json"
    tok_file.parent.mkdir()
    shutil.copy(DEFAULT_TOKENIZER, tok_file)
    db = tmp_path / "w.duckdb"
    rid = workbench.record(PROMPT, model=str(bare), tokenizer=str(tok_file), max_new_tokens=4, db=db,
                           detect=False).run_id
    want = load_tokenizer(tok_file)
    run = workbench.open(db).run(rid)  # a fresh Run: no tokenizer passed, its model folder has none
    assert run.info["tokenizer"] == str(tok_file.absolute())
    ids = run.tokens()["token_id"].to_list()
    assert run.tokenizer().to_str() == want.to_str()
    assert run.tokenizer().decode(ids) == want.decode(ids) and run.tokenizer().decode(ids).startswith(PROMPT)
    # the UI: the app's tokenizer_for, and the top-k labels of the Run view are the tokens' text
    app = AppContext(Store(db))
    assert app.tokenizer_for(run.info).to_str() == want.to_str()
    frames = app.session().pick(rid)
    pos = run.info["n_prompt_tokens"] + 1
    labels = [y.split(". ", 1)[1] for y in list(frames.fig_topk(pos).data[0].y)[::-1]]
    assert labels == [token_label(want.decode([i]), 20) for i in run.tokens()["topk_ids"][pos]]
    assert not any(label.startswith("#") for label in labels), labels
    # the tokenizer moved away: no tokenizer fits (the run's own texts, else #id), no exception
    shutil.move(tok_file, tmp_path / "gone.json")
    assert AppContext(Store(db)).tokenizer_for(run.info) is None


def test_run_replay_in_python_uses_the_recorded_tokenizer(tmp_path, capsys):
    """``Run.replay()`` (not only the CLI) finds the tokenizer the run was recorded with."""
    bare = save_checkpoint(tiny_model(vocab_size=4096), tmp_path / "bare")
    tok = tmp_path / "tok.json"
    shutil.copy(DEFAULT_TOKENIZER, tok)
    db = tmp_path / "w.duckdb"
    assert cli.main(["record", "--model", str(bare), "--tokenizer", str(tok), "--prompt", PROMPT,
                     "--max-new-tokens", "4", "--json", "--db", str(db)]) == 0
    rid = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    out = workbench.open(db).run(rid).replay()
    assert out["match"] is True and out["tokens_match"] is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.bool])
def test_the_weights_checksum_changes_with_any_one_element(dtype):
    from workbench.capture.recorder import _checksums
    g = torch.Generator().manual_seed(0)
    # sizes whose bytes are and are not whole int64 words, a view at an odd offset, a transposed (copied) one
    base = {"a": torch.randint(0, 2, (7, 5), generator=g), "b": torch.randint(0, 2, (16,), generator=g),
            "c": torch.randint(0, 2, (9,), generator=g)}
    state = {k: (v.bool() if dtype == torch.bool else (v * 3 + 1).to(dtype)) for k, v in base.items()}
    state["d"] = state["b"][1:]  # storage offset of one element
    state["e"] = state["a"].t()
    before = _checksums(state)
    assert before is not None and before == _checksums({k: v.clone() for k, v in state.items()})
    for name in ("a", "b", "c"):
        for i in (0, state[name].numel() - 1):
            flat = state[name].view(-1)
            old = flat[i].clone()
            flat[i] = ~old if dtype == torch.bool else old + 1  # through .data-like in-place writes: no versions read
            assert _checksums(state) != before, (name, i)
            flat[i] = old
    assert _checksums(state) == before
