"""A prompt that fills the context records with max_new_tokens=1: the last new token is produced, never fed,
so it needs no slot (prompt + max_new_tokens <= context + 1), on our model and through transformers."""
from __future__ import annotations

import polars as pl
import pytest
import torch
from helpers import tiny_model

import workbench
from workbench.model import generate


def _full_argmax(forward, ids: list[int]) -> int:
    with torch.no_grad():
        return int(forward(torch.tensor([ids]))[0, -1].argmax())


def _check_filled(run, ids: list[int], expected: int) -> None:
    info = run.refresh().info
    assert info["status"] == "complete"
    assert info["n_tokens"] == len(ids) + 1
    t = run.tokens()
    assert t.height == len(ids) + 1
    assert t["token_id"].to_list()[:-1] == ids
    new = t.filter(~pl.col("is_prompt"))
    assert new["pos"].to_list() == [len(ids)] and new["token_id"].to_list() == [expected]
    assert new["rank"].to_list() == [1]  # greedy: the argmax of the full forward's last row
    assert run.attention()["pos"].max() == len(ids) - 1  # the new token was never fed


def test_native_prompt_filling_the_context(tmp_path):
    model = tiny_model(max_seq_len=64)
    ids = [int(x) for x in torch.randint(1, 256, (64,), generator=torch.Generator().manual_seed(0))]
    expected = _full_argmax(model, ids)
    assert generate(model, ids, max_new_tokens=1) == [expected]
    assert generate(model, ids[:-1], max_new_tokens=2)[0] == _full_argmax(model, ids[:-1])
    run = workbench.record(ids, model=model, max_new_tokens=1, db=tmp_path / "w.duckdb", detect=False)
    _check_filled(run, ids, expected)
    for prompt, n in ((ids, 2), (ids[:-1], 3), (ids + [1], 1)):
        with pytest.raises(ValueError, match="exceeds the model's context of 64 tokens") as e:
            workbench.record(prompt, model=model, max_new_tokens=n, db=tmp_path / "w.duckdb", detect=False)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="exceeds max_seq_len 64") as e:
            generate(model, prompt, max_new_tokens=n)
        assert "\n" not in str(e.value)


def test_transformers_prompt_filling_the_context(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from workbench.capture.tiny import make_folder

    folder = make_folder("llama", tmp_path / "llama")
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    limit = hf.config.max_position_embeddings
    ids = [int(x) for x in torch.randint(3, hf.config.vocab_size, (limit,), generator=torch.Generator().manual_seed(1))]
    expected = _full_argmax(lambda x: hf(x).logits, ids)
    run = workbench.record(ids, model=folder, max_new_tokens=1, db=tmp_path / "w.duckdb", detect=False)
    assert run.model_summary.max_seq_len == limit
    _check_filled(run, ids, expected)
    with pytest.raises(ValueError, match=f"exceeds the model's context of {limit} tokens") as e:
        workbench.record(ids, model=folder, max_new_tokens=2, db=tmp_path / "w.duckdb", detect=False)
    assert "\n" not in str(e.value)
