"""Hugging Face folders recorded through the same probes, checked against transformers' own outputs.

A saved ``DeepseekV3ForCausalLM`` loads into our Transformer; its recorded tokens, attention and routing
must equal what transformers itself computes. A dense ``LlamaForCausalLM`` runs through transformers
(workbench/hf.py): tokens and attention rows, no routing rows.
"""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)

import workbench  # noqa: E402
from workbench.model.tokenizer import train_tokenizer  # noqa: E402
from workbench.hf import HFModel, is_foreign_folder, load_hf  # noqa: E402

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"] * 20
PROMPT = "def add(a, b):\n    return"
NEW = 5


def save_tokenizer(folder) -> int:
    tok = train_tokenizer(TEXTS, vocab_size=300)
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dsv3")
    vocab = save_tokenizer(folder)
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                           n_routed_experts=8, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                           qk_nope_head_dim=16, num_experts_per_tok=2, norm_topk_prob=True,
                           max_position_embeddings=128, q_lora_rank=16, n_group=4, topk_group=2,
                           first_k_dense_replace=1, routed_scaling_factor=2.0)
    hf = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.rand(8) * 0.2)
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    vocab = save_tokenizer(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    hf.save_pretrained(folder)
    return folder


def hf_reference(folder, seq: list[int], capture_mid: bool = False):
    """transformers' own forward of the final sequence: logits, attentions, and each layer's resid_mid."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    mids: dict[int, torch.Tensor] = {}
    handles = []
    if capture_mid:
        for i, layer in enumerate(hf.model.layers):
            handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
                lambda mod, args, i=i: mids.__setitem__(i, args[0][0].detach())))
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_attentions=True)
    for h in handles:
        h.remove()
    return hf, out, mids


def check_tokens(run, seq, logits):
    tok = run.tokens()
    p = logits[:-1].softmax(-1)
    nxt = torch.tensor(seq[1:])
    np.testing.assert_allclose(tok["prob"].to_numpy()[1:], p.gather(1, nxt[:, None])[:, 0].numpy(), rtol=1e-3,
                               atol=1e-6)
    np.testing.assert_allclose(tok["confidence"].to_numpy()[1:], p.amax(-1).numpy(), rtol=1e-3)
    np.testing.assert_allclose(tok["entropy"].to_numpy()[1:], (-(p * p.log()).sum(-1)).numpy(), atol=1e-3)
    assert tok.filter(~pl.col("is_prompt"))["rank"].to_list() == [1] * NEW  # greedy


def check_attention(run, attentions, n_rows):
    att = run.attention()
    for layer, a in enumerate(attentions):
        probs = a[0, :, :n_rows, :n_rows].float()  # [H, T, T]
        ent = -(torch.special.xlogy(probs, probs)).sum(-1).T.ravel().numpy()  # by (pos, head)
        got = att.filter(pl.col("layer") == layer).sort("pos", "head")
        assert got.height == n_rows * probs.size(0)
        np.testing.assert_allclose(got["entropy"].to_numpy(), ent, atol=1e-4)
        np.testing.assert_allclose(got["max_weight"].to_numpy(), probs.amax(-1).T.ravel().numpy(), atol=1e-4)
        np.testing.assert_allclose(got["sink_weight"].to_numpy(), probs[..., 0].T.ravel().numpy(), atol=1e-4)


def test_deepseek_folder_equals_transformers(deepseek_folder, tmp_path):
    assert not is_foreign_folder(deepseek_folder)  # loads into our own Transformer
    run = workbench.record(PROMPT, model=deepseek_folder, max_new_tokens=NEW, db=tmp_path / "w.duckdb")
    assert run.status == "complete" and run.info["model"] == str(deepseek_folder)
    tok = run.tokens()
    assert tok.filter(pl.col("is_prompt"))["text"].str.join("").item() == PROMPT  # the folder's tokenizer
    seq = tok["token_id"].to_list()
    n_rows = len(seq) - 1
    hf, out, mids = hf_reference(deepseek_folder, seq, capture_mid=True)
    check_tokens(run, seq, out.logits[0])
    check_attention(run, out.attentions, n_rows)
    # routing: transformers' router on its own post-attention-normed hidden states
    rt = run.routing()
    layer = hf.model.layers[1]
    with torch.no_grad():
        _, w_ref, idx_ref = layer.mlp.gate(layer.post_attention_layernorm(mids[1][:n_rows]))
    got = rt.filter(pl.col("layer") == 1).sort("pos", "slot")
    k = idx_ref.size(1)
    assert got.height == n_rows * k
    assert rt["layer"].unique().to_list() == [1]  # layer 0 is dense
    g_exp = got["expert"].to_numpy().reshape(n_rows, k)
    assert [set(r) for r in g_exp.tolist()] == [set(r) for r in idx_ref.tolist()]
    order = w_ref.argsort(-1, descending=True)
    np.testing.assert_allclose(got["weight"].to_numpy().reshape(n_rows, k), w_ref.gather(1, order).numpy(),
                               atol=1e-4)


def test_llama_folder_records_through_transformers(llama_folder, tmp_path):
    assert is_foreign_folder(llama_folder)
    db = tmp_path / "w.duckdb"
    run = workbench.record(PROMPT, model=llama_folder, max_new_tokens=NEW, db=db)
    assert run.status == "complete"
    assert run.routing().height == 0  # dense: no router
    seq = run.tokens()["token_id"].to_list()
    n_rows = len(seq) - 1
    _, out, _ = hf_reference(llama_folder, seq)
    check_tokens(run, seq, out.logits[0])
    check_attention(run, out.attentions, n_rows)
    # the prompt prefilled in blocks of 3 query rows gives the same rows
    chunked = load_hf(llama_folder, attn_chunk=3)
    assert isinstance(chunked, HFModel)
    run2 = workbench.record(PROMPT, model=chunked, max_new_tokens=NEW, db=db)
    a1, a2 = run.attention(), run2.attention()
    np.testing.assert_allclose(a2["entropy"].to_numpy(), a1["entropy"].to_numpy(), atol=1e-5)
    assert run2.tokens()["token_id"].to_list() == seq
    # kv rows from transformers' cache: keys + values, 2 kv heads x 8 dims, fp32
    kv = run.kv()
    assert (kv["bytes"] == kv["cached_tokens"] * 2 * 2 * 8 * 4).all()
    kt = run.kv_tokens()
    final = kt.filter(pl.col("step") == kt["step"].max())
    for layer in (0, 1):
        rows = final.filter(pl.col("layer") == layer)
        assert rows["attn_received"].sum() == pytest.approx(n_rows * 4, rel=1e-5)  # queries x heads
    assert run.steps()["kind"].to_list() == ["prefill"] + ["decode"] * (NEW - 1)
