"""Tiny random ``transformers`` folders of every family the adapters cover (hidden 64, 2 layers, 8 experts
top-2, with a small byte-level BPE tokenizer): for the tests, the benchmarks, and trying the workbench on a
family without downloading anything. Needs ``transformers``.

    python -m workbench.capture.tiny mixtral /tmp/mixtral      # then: workbench record --model /tmp/mixtral ...
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

import torch
from torch import nn

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
    default init so routing, attention and the next token depend visibly on the input. A family of ``FAMILIES`` is
    built from its hand-picked config, any other MoE family of the installed transformers (``moe_families``) by
    ``tiny_family``, its own default config shrunk."""
    import transformers  # optional: tiny folders need transformers, importing this module does not

    if family not in FAMILIES and family not in moe_families():
        raise ValueError(f"unknown family {family!r}: one of {sorted(FAMILIES)} or of moe_families()")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(folder) if tokenizer else 300
    if family in FAMILIES:
        cfg_name, lm_name, kw = FAMILIES[family]
        torch.manual_seed(seed)
        cfg = getattr(transformers, cfg_name)(vocab_size=vocab, **kw)
        hf = getattr(transformers, lm_name)(cfg).eval()
        _scale(hf, std)
    else:
        hf = tiny_family(family, seed=seed, std=std)
    hf.save_pretrained(folder)
    (folder / "tiny.json").write_text(json.dumps({"family": family, "seed": seed, "std": std}) + "\n")  # provenance
    return folder


# -- every MoE family of the installed transformers ------------------------------------------------------------
MOE_CLASS = ("Moe", "MoE", "Expert", "Router", "SparseMoe")
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts")
TINY_LAYERS = 4
# size keys of a config, shrunk to these values wherever a family's config has them (None stays None)
SIZES = {"hidden_size": 64, "d_model": 64, "num_attention_heads": 4, "n_heads": 4, "head_dim": 16,
         "kv_channels": 16, "intermediate_size": 96, "moe_intermediate_size": 32, "ffn_hidden_size": 96,
         "expert_ffn_hidden_size": 32, "shared_expert_intermediate_size": 48, "shared_intermediate_size": 48,
         "shared_experts_intermediate_size": 48, "intermediate_size_mlp": 96, "dense_intermediate_size": 96,
         "prefix_dense_intermediate_size": 96, "ffn_dim_divisor": None,
         "vocab_size": 300, "vocab_size_per_layer_input": 300, "hidden_size_per_layer_input": 16,
         "max_position_embeddings": 128, "max_seq_len": 128, "model_max_length": 128,
         "kv_lora_rank": 32, "q_lora_rank": 16, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
         "v_head_dim": 16, "qk_head_dim": 24, "index_topk": 8, "index_head_dim": 16, "index_n_heads": 2,
         "index_block_size": 4, "index_topk_blocks": 2, "sliding_window": 8, "sliding_window_size": 8,
         "attention_chunk_size": 8, "block_size": 8, "rel_extent": 16, "log_scaling_n_floor": 16,
         "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16, "rotary_dim": 8,
         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_dt_rank": 8,
         "linear_num_heads": 4, "linear_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 16, "linear_value_head_dim": 16, "router_hidden_size": 16, "loop_gate_rank": 8,
         "hc_lowrank": 8, "ple_embed_dim": 16, "gated_norm_rank": 4, "unpadded_vocab_size": 300,
         "zero_expert_num": 2, "mamba_expand": 2, "keep_window_size": 16,
         # Kolibri 1.1's sparse attention (its pool a multiple of its compression) and its dense layers' MLP
         "index_num_heads": 2, "index_pool_size": 4, "index_compression": 2, "index_num_local_tokens": 2,
         "index_num_sink_tokens": 1, "mlp_only_intermediate_size": 96}

# per-layer overrides (a layer unlike the others) shrunk to these
PER_LAYER = {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
             "head_dim": 32, "v_head_dim": 8}


def moe_families() -> list[str]:
    """The model types of the installed ``transformers`` that have a causal LM and are mixtures of experts: their
    modeling module defines an expert / router / MoE class, or their default config counts experts."""
    import transformers  # optional: tiny folders need transformers, importing this module does not
    from transformers.models.auto import configuration_auto, modeling_auto  # optional: as above

    CONFIG_MAPPING_NAMES, model_type_to_module_name = (configuration_auto.CONFIG_MAPPING_NAMES,
                                                       configuration_auto.model_type_to_module_name)
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if mt not in CONFIG_MAPPING_NAMES:
            continue
        mod = model_type_to_module_name(mt)
        try:
            m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
            names = [n for n, o in vars(m).items() if inspect.isclass(o) and o.__module__ == m.__name__]
        except Exception:  # noqa: BLE001 - a module that does not import is not a family we can build
            names = []
        hit = any(k in n for n in names for k in MOE_CLASS)
        if not hit:
            try:
                cfg = getattr(transformers, CONFIG_MAPPING_NAMES[mt])()
                hit = any(getattr(cfg, k, None) for k in EXPERT_KEYS)
            except Exception:  # noqa: BLE001 - a config without defaults (gemma4_assistant) is no MoE here
                hit = False
        if hit:
            out.append(mt)
    return sorted(out)


def _pick(values: list, n: int) -> list:
    """``n`` entries of a per-layer list keeping every distinct kind it has (hybrid models keep each layer kind);
    the most common kind fills the rest, the first kind keeps its place."""
    kinds = list(dict.fromkeys(values))
    if len(kinds) >= n:
        return kinds[:n]
    common = max(kinds, key=values.count)
    out = [values[0]] + [k for k in kinds if k != values[0]]
    while len(out) < n:
        out.insert(1, common)
    return out[:n]


def _shrink(d: dict, n_layers: int) -> dict:
    """A config dict with every known size key made tiny (nested sub-configs too)."""
    orig, d = d, dict(d)
    orig_types = d.get("layer_types")
    orig_layers = next((d[k] for k in ("num_hidden_layers", "n_layers", "num_layers") if isinstance(d.get(k), int)),
                       None)
    for k, v in list(d.items()):
        if isinstance(v, dict) and ("model_type" in v or k.endswith("_config")):
            d[k] = _shrink(v, n_layers)
        elif k in SIZES and isinstance(v, int) and not isinstance(v, bool) and SIZES[k] is not None:
            d[k] = SIZES[k] if v > 0 else v
        elif k in EXPERT_KEYS and isinstance(v, int) and v > 1:
            d[k] = 8
        elif k in TOPK_KEYS and isinstance(v, int):
            d[k] = min(v, 2) if v > 0 else v
        elif k in ("num_hidden_layers", "n_layers", "num_layers") and isinstance(v, int):
            d[k] = n_layers
        elif k == "num_key_value_heads" and isinstance(v, int):
            # MLA and plain multi-head attention keep one kv head per head
            d[k] = 1 if v == 1 else SIZES["num_attention_heads"] if v == orig.get("num_attention_heads") else 2
        elif k in ("n_group", "num_expert_group") and isinstance(v, int) and v > 1:
            d[k] = 4
        elif k == "topk_group" and isinstance(v, int) and v > 1:
            d[k] = 2
        elif k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index") and isinstance(v, int):
            d[k] = min(v, 1)
        elif k == "moe_layer_end_index" and isinstance(v, int):
            d[k] = n_layers - 1
        elif k == "mlp_only_layers" and isinstance(v, list):
            d[k] = [0] if v else []
        elif k in ("expert_layer_period", "attn_layer_period") and isinstance(v, int):
            d[k] = 2
        elif k in ("expert_layer_offset", "attn_layer_offset") and isinstance(v, int):
            d[k] = 1
        elif isinstance(v, list) and orig_layers and len(v) == orig_layers and k != "moe_layers":
            d[k] = _pick(v, n_layers)
    if isinstance(d.get("moe_layers"), list) and orig_layers:
        d["moe_layers"] = list(range(n_layers))
    if isinstance(d.get("qk_rope_head_dim"), int) and "head_dim" in d:
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: the rotary part is the head dim transformers rotates
    for k, v in list(d.items()):  # special tokens inside the tiny vocabulary
        if (k.endswith("token_id") or k.endswith("token_index")) and isinstance(v, int) and v >= 300:
            d[k] = None if k.startswith("pad") else 299 - hash(k) % 8
    per = d.get("per_layer_config")
    if isinstance(per, dict) and per and orig_layers:
        # a layer that differs (its own head count, head dim): kept, at the last tiny layer
        key = sorted(per)[0]
        new = {k: PER_LAYER.get(k, v) for k, v in per[key].items()}
        types = d.get("layer_types")
        if isinstance(orig_types, list) and isinstance(types, list) and orig_types[int(key)] in types:
            # every layer of that layer kind (a kind's layers share their shapes)
            d["per_layer_config"] = {f"{i:02d}": new for i, t in enumerate(types) if t == orig_types[int(key)]}
        else:
            d["per_layer_config"] = {f"{n_layers - 1:02d}": new}
    return d


def tiny_family(name: str, seed: int = 0, n_layers: int = TINY_LAYERS, std: float = 0.15):
    """A tiny random causal LM of the installed ``transformers``' family ``name`` (one of ``moe_families()``):
    its default config shrunk (hidden 64, ``n_layers`` layers keeping every layer kind, 8 experts top-2, a
    300-token vocabulary), weights scaled up as ``make_folder``'s so routing depends visibly on the input."""
    import transformers  # optional: tiny folders need transformers, importing this module does not
    from transformers.models.auto import configuration_auto, modeling_auto  # optional: as above

    cfg_cls = getattr(transformers, configuration_auto.CONFIG_MAPPING_NAMES[name])
    d = _shrink(cfg_cls().to_dict(), n_layers)
    d.update(FAMILY_FIXES.get(name, {}))
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = {**d["text_config"], **FAMILY_FIXES.get(d["text_config"].get("model_type"), {})}
    for k in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(k, None)
    lm_cls = getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name])
    text_cls = getattr(lm_cls, "config_class", None)
    if text_cls not in (None, cfg_cls) and isinstance(d.get("text_config"), dict):
        cfg = text_cls.from_dict(d["text_config"])  # a multimodal config whose causal LM is its text model
    else:
        cfg = cfg_cls.from_dict(d)
    torch.manual_seed(seed)
    hf = lm_cls._from_config(
        cfg, attn_implementation="eager").eval()
    _scale(hf, std)
    return hf


def _scale(hf, std: float) -> None:
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, std if p.ndim > 1 else 0.1)
        for name, b in hf.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.rand(b.shape) * 0.2)


# config keys a family needs beyond the generic shrinking
_MOE_TEXT = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}
FAMILY_FIXES: dict[str, dict] = {
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": 64, "ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2}},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots3_note_text": {"head_dim": 16},  # its sliding layers' head: their qk_nope_head_dim + qk_rope_head_dim
    "doge": {"is_moe": True},
    # transformers 5.25: indexer layers must be indexed-attention layers, and a layer reads the K/V of an earlier one of
    # its kind (the default 50-layer layout's do not fit 4 layers): a sliding layer, an indexer, a sliding layer, and a
    # reindexer reading the indexer's K/V; a top-k of 2 so the 12-token tests select keys (beyond sinks and local ones)
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
                   "index_layers": [1], "kv_source_layers": [0, 1, 2, 1], "index_topk": 2},
    "inkling2_loop_text": {"loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2, "n_layers_per_attn_res_block": 2},
    "dots1": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "gemma4_text": _MOE_TEXT,
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2, "head_dim": 16},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention", "linear_attention", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
}


class RouterReference:
    """What each decoder layer's experts receive, captured by hooks of its own (independent of the adapters): the
    indices and weights passed to an ``*Experts`` module, or for a router that hands out a dense score matrix
    (Llama 4) or experts sorted by expert (JetMoE) its top-k. A block that runs zero-compute (identity) experts itself
    (``zero_expert_num``: LongCat-Flash from transformers 5.25; its experts module receives those slots as a real
    expert with weight 0, the block adds the identity's share) is read at its router's output, the (indices, weights)
    the block splits between the two. Attach after the adapter is made (its load-time probe of the routers is not a
    forward); a looped layer's first pass per forward is kept. ``close()`` -> {layer: (indices [N, K], weights [N, K])}.
    """

    def __init__(self, hf):
        lists = [m for _, m in hf.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
        layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        self.got: dict[int, list] = {}
        self.calls: dict[int, int] = {}
        self.handles = [hf.register_forward_pre_hook(lambda _m, _a: self.calls.clear())]
        for i, layer in enumerate(layers):
            experts = [m for m in layer.modules() if type(m).__name__.endswith("Experts")]
            zero = [m for m in layer.modules() if isinstance(getattr(m, "zero_expert_num", None), int)
                    and m.zero_expert_num > 0 and isinstance(getattr(m, "router", None), nn.Module)
                    and getattr(m, "experts", None) in experts]
            for m in zero:
                self.handles.append(m.router.register_forward_hook(lambda _m, _a, o, i=i: self._received(i, list(o))))
            for m in experts:
                if any(m is z.experts for z in zero):
                    continue
                self.handles.append(m.register_forward_pre_hook(
                    lambda _m, a, kw, i=i: self._received(i, [*a, *kw.values()]), with_kwargs=True))
            if not any("top_k_index" in m.forward.__code__.co_varnames for m in experts):
                for n, m in layer.named_modules():
                    if type(m).__name__.endswith(("Router", "Gating")) and hasattr(m, "top_k") and "att" not in n:
                        self.handles.append(m.register_forward_hook(lambda mod, _a, o, i=i: self._dense(i, mod, o)))

    def _first(self, i: int) -> bool:
        self.calls[i] = self.calls.get(i, 0) + 1
        return self.calls[i] == 1

    def _received(self, i: int, values: list) -> None:
        ints = [v for v in values if isinstance(v, torch.Tensor) and v.ndim == 2 and not v.is_floating_point()]
        if ints and self._first(i):
            idx = ints[0]
            w = next((v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()
                      and v.shape == idx.shape), None)
            self.got.setdefault(i, []).append((idx.detach().clone(), None if w is None else w.detach().float().clone()))

    def _dense(self, i: int, router, out) -> None:
        if isinstance(out, tuple) and len(out) == 5 and self._first(i):
            # JetMoE: slot order sorted by expert, tokens per expert, and the gate of each sorted slot
            order, _, gates, sizes, logits = out
            flat = torch.repeat_interleave(torch.arange(logits.size(-1)), torch.tensor(sizes))
            idx, w = torch.empty_like(order), torch.empty_like(gates)
            idx[order], w[order] = flat.to(order.device), gates
            k = router.top_k
            self.got.setdefault(i, []).append((idx.view(-1, k).clone(), w.view(-1, k).detach().float().clone()))
        elif isinstance(out, tuple) and len(out) == 2 and self._first(i):
            scores = out[0].reshape(-1, out[0].size(-1))
            idx = scores.topk(router.top_k, dim=-1)[1]
            self.got.setdefault(i, []).append((idx.detach().clone(), scores.gather(1, idx).detach().float().clone()))

    def close(self) -> dict:
        for h in self.handles:
            h.remove()
        out = {}
        for i, parts in self.got.items():
            idx = torch.cat([p[0].reshape(-1, p[0].size(-1)) for p in parts])
            ws = [p[1] for p in parts]
            out[i] = (idx, None if any(w is None for w in ws) else torch.cat([w.reshape(-1, idx.size(-1)) for w in ws]))
        return out


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
