"""Smoke test of model.train: a few steps of the tiny preset on a small synthetic corpus.

Checks the loss is finite and falls, the checkpoint loads back equal to the saved training state, the
aux-loss-free rule moved the gate bias, and resuming (after a finished shorter run, or after a crash
right behind a save) continues at the saved step and ends bitwise where an uninterrupted run ends.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench.model.train as mt
from workbench.model import MoE, load_checkpoint, load_tokenizer

# warmup longer than every run here: the learning rate then depends on the step only, not on the total
# number of steps, so a 4-step run extended to 6 follows the same schedule as a 6-step run.
KW = dict(preset="tiny", batch=4, seq_len=32, lr=3e-3, warmup=10, balance_rate=1e-2, seed=3, vocab_size=300,
          progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("corpus")
    files = []
    for i in range(6):
        body = "".join(f"def f{i}_{j}(x, y):\n    if x > {j}:\n        return x + y * {j}\n    return None\n\n\n"
                       for j in range(40))
        p = root / f"mod{i}.py"
        p.write_text(f'"""Module {i}."""\nimport os\n\n\n{body}')
        files.append(p)
    return files


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run: the reference for the resume tests."""
    return mt.train(tmp_path_factory.mktemp("straight"), steps=6, save_every=2, files=corpus, **KW)


def test_smoke_loss_checkpoint_balancing(corpus, straight):
    log = _log(straight)
    assert [r["step"] for r in log] == list(range(1, 7))
    losses = [r["loss"] for r in log]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
    assert log[-1]["tokens"] == 6 * KW["batch"] * KW["seq_len"]

    m = load_checkpoint(straight)
    tok = load_tokenizer(straight)
    assert m.args.vocab_size == tok.get_vocab_size() <= KW["vocab_size"]
    state = load_file(str(straight / "train_state" / "state.safetensors"))
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[f"model.{k}"]), k  # the checkpoint is the final training state
    moe = [layer.ffn for layer in m.layers if isinstance(layer.ffn, MoE)]
    assert moe and all(g.gate.bias.abs().sum() > 0 for g in moe)  # balancing ran
    # each update is +-rate per expert, so after 6 steps every bias is a multiple of the rate
    for g in moe:
        steps_worth = g.gate.bias / KW["balance_rate"]
        assert torch.allclose(steps_worth, steps_worth.round(), atol=1e-3)
        assert steps_worth.abs().max() <= 6
    with torch.inference_mode():
        ids = torch.tensor([tok.encode("def f0_1(x, y):\n").ids])
        assert torch.isfinite(m(ids)).all()
    meta = json.loads((straight / "train_meta.json").read_text())
    assert meta["steps"] == "6" and meta["tokens_seen"] == str(log[-1]["tokens"])


def test_resume_extends_a_finished_run(corpus, straight, tmp_path):
    mt.train(tmp_path, steps=4, save_every=2, files=corpus, **KW)
    assert json.loads((tmp_path / "train_state" / "state.json").read_text())["step"] == 4
    mt.train(tmp_path, steps=6, save_every=2, files=corpus, **KW)
    assert [r["step"] for r in _log(tmp_path)] == [1, 2, 3, 4, 5, 6]  # the second call started at 4
    a, b = _weights(tmp_path), _weights(straight)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_after_crash(corpus, straight, tmp_path, monkeypatch):
    save = mt._save_state

    def save_then_crash(folder, model, opt, step, gen, meta):
        save(folder, model, opt, step, gen, meta)
        if step == 4:
            raise KeyboardInterrupt  # killed right after the step-4 save of a 6-step run

    monkeypatch.setattr(mt, "_save_state", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        mt.train(tmp_path, steps=6, save_every=2, files=corpus, **KW)
    assert not (tmp_path / "model.safetensors").exists()
    monkeypatch.setattr(mt, "_save_state", save)
    mt.train(tmp_path, steps=6, save_every=2, files=corpus, **KW)
    assert [r["step"] for r in _log(tmp_path)] == [1, 2, 3, 4, 5, 6]
    a, b = _weights(tmp_path), _weights(straight)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_train_refuses_the_bundled_demo_and_finished_checkpoints(tmp_path, capsys):
    from workbench import cli
    from workbench.model import DEFAULT_CHECKPOINT

    tok_before = (DEFAULT_CHECKPOINT / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="bundled demo"):
        mt.train(DEFAULT_CHECKPOINT, steps=1, files=[])
    assert cli.main(["train", "--out", str(DEFAULT_CHECKPOINT), "--steps", "1"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (DEFAULT_CHECKPOINT / "tokenizer.json").read_bytes() == tok_before  # nothing written
    done = tmp_path / "done"
    done.mkdir()
    (done / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="finished checkpoint"):
        mt.train(done, steps=1, files=[])
    assert cli.build_parser().parse_args(["train"]).out == "models/demo"  # a new folder by default


def test_resume_refuses_other_data(corpus, tmp_path):
    mt.train(tmp_path, steps=2, save_every=2, files=corpus, **KW)
    with pytest.raises(ValueError, match="other files"):
        mt.train(tmp_path, steps=4, save_every=2, files=corpus[:-1], **KW)  # a package gone since
    assert json.loads((tmp_path / "train_state" / "state.json").read_text())["step"] == 2  # nothing trained
    meta = mt.train(tmp_path, steps=4, save_every=2, files=corpus, **KW) / "train_meta.json"
    assert {"lr", "warmup", "balance_rate", "threads", "corpus"} <= json.loads(meta.read_text()).keys()
