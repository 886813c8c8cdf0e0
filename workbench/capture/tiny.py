"""Tiny random ``transformers`` folders of every family the adapters cover (hidden 64, 2 layers, 8 experts
top-2, with a small byte-level BPE tokenizer): for the tests, the benchmarks, and trying the workbench on a
family without downloading anything. Needs ``transformers``.

    python -m workbench.capture.tiny mixtral /tmp/mixtral      # then: workbench record --model /tmp/mixtral ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from workbench.model.tokenizer import train_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"] * 20

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
MOE = dict(num_experts_per_tok=2, intermediate_size=96)

# family -> (config class name, causal LM class name, config kwargs); MoE families first
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**COMMON, **MOE, "num_local_experts": 8}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**COMMON, **MOE, "num_experts": 8, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**COMMON, **MOE, "num_experts": 8, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                   "norm_topk_prob": True, "head_dim": 16}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**COMMON, **MOE, "num_experts": 8, "norm_topk_prob": False}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {**COMMON, **MOE, "num_local_experts": 8, "head_dim": 16, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {**COMMON, **MOE, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
                     "moe_intermediate_size": 32, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
                     "v_head_dim": 16, "qk_nope_head_dim": 16, "first_k_dense_replace": 0, "n_group": 4,
                     "topk_group": 2, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**COMMON, **MOE, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
                     "moe_intermediate_size": 24, "kv_lora_rank": 32, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 16, "qk_nope_head_dim": 16, "first_k_dense_replace": 1, "n_group": 4,
                     "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.0}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**COMMON, "intermediate_size": 96}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**COMMON, "intermediate_size": 96}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**COMMON, "intermediate_size": 96}),
}
MOE_FAMILIES = [f for f, (_, _, kw) in FAMILIES.items() if "num_experts_per_tok" in kw]
DENSE_FAMILIES = [f for f in FAMILIES if f not in MOE_FAMILIES]


def save_tokenizer(folder: Path) -> int:

    tok = train_tokenizer(TEXTS, vocab_size=300)
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def make_folder(family: str, folder: str | Path, seed: int = 0, tokenizer: bool = True, std: float = 0.15) -> Path:
    """Save a tiny random ``family`` model (and a tokenizer) to ``folder``; weights are scaled up from the
    default init so routing, attention and the next token depend visibly on the input."""
    import transformers  # optional: tiny folders need transformers, importing this module does not

    cfg_name, lm_name, kw = FAMILIES[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(folder) if tokenizer else 300
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab, **kw)
    hf = getattr(transformers, lm_name)(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, std if p.ndim > 1 else 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) * 0.2)
    hf.save_pretrained(folder)
    (folder / "tiny.json").write_text(json.dumps({"family": family, "seed": seed, "std": std}) + "\n")  # provenance
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="save a tiny random transformers model folder of one family")
    ap.add_argument("family", choices=list(FAMILIES))
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_folder(args.family, Path(args.out), seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
