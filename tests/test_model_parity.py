"""Our Transformer against transformers' DeepseekV3ForCausalLM: same weights in, same logits out."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from workbench.model import ModelArgs, Transformer, export_hf, generate, load_checkpoint  # noqa: E402
from workbench.model.generate import stream  # noqa: E402

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=256, attention_bias=False)

CASES = {
    "sigmoid_bias_groups_qlora": dict(q_lora_rank=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                      routed_scaling_factor=2.5),
    "plain_wq_two_dense": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=2,
                               routed_scaling_factor=1.0),
    "yarn_long_context": dict(q_lora_rank=16, n_group=2, topk_group=1, first_k_dense_replace=1,
                              routed_scaling_factor=1.7,
                              rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 32, "beta_fast": 32,
                                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "yarn_mscale_ratio": dict(q_lora_rank=16, n_group=4, topk_group=3, first_k_dense_replace=0,
                              routed_scaling_factor=1.0,
                              rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 32, "beta_fast": 32,
                                               "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}),
}


def make_hf(case: str, seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**BASE, **CASES[case])
    cfg._attn_implementation = "eager"
    hf = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                # a non-zero selection bias, kept small enough that no biased score drops below 0
                layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(cfg.n_routed_experts) * 0.3)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = make_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = load_checkpoint(folder)
    return request.param, hf, ours


def test_logits_match_transformers(pair):
    case, hf, ours = pair
    seqlen = 100 if "yarn" in case else 40  # yarn cases run past original_max_position_embeddings (32)
    tokens = torch.randint(0, BASE["vocab_size"], (2, seqlen), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_routing_matches_transformers(pair):
    """The gate picks the same experts with the same weights as transformers' router."""
    case, hf, ours = pair
    moe_layers = [i for i, l in enumerate(ours.layers) if hasattr(l.ffn, "gate")]
    i = moe_layers[0]
    x = torch.randn(50, BASE["hidden_size"])
    with torch.no_grad():
        _, w_ref, idx_ref = hf.model.layers[i].mlp.gate(x)
        w, idx = ours.layers[i].ffn.gate(x)
    order_ref, order = idx_ref.sort(-1), idx.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), atol=1e-6, rtol=1e-5)


def test_kv_cache_decoding_equals_full_forward(pair):
    """Greedy decoding over the latent cache gives the tokens and logits of a full recompute per step."""
    _, _, ours = pair
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    steps = list(stream(ours, prompt, max_new_tokens=12))
    seq = list(prompt)
    with torch.no_grad():
        for st in steps:
            full = ours(torch.tensor([seq]))[0, -1]
            torch.testing.assert_close(st.logits[-1], full, atol=1e-4, rtol=1e-4)
            assert st.next_token == int(full.argmax())
            seq.append(st.next_token)
    assert generate(ours, prompt, max_new_tokens=12) == seq[len(prompt):]


def test_export_loads_back_in_transformers(tmp_path):
    args = ModelArgs.preset("tiny")
    ours = Transformer(args).init_weights(seed=3, std=0.2).eval()
    with torch.no_grad():
        for layer in ours.layers:
            if hasattr(layer.ffn, "gate"):
                layer.ffn.gate.bias.copy_(torch.linspace(0, 0.2, args.n_routed_experts))
    export_hf(ours, tmp_path)
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.randint(0, args.vocab_size, (1, 120))  # past original_seq_len (64): YaRN on
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    again = load_checkpoint(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), ours(tokens), atol=0, rtol=0)
