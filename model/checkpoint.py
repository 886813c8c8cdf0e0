"""Checkpoints, read and written with safetensors only (no pickle anywhere).

Two layouts load into the same ``Transformer``:
- ours: ``config.json`` (``ModelArgs``) + ``model.safetensors`` (+ ``tokenizer.json``);
- Hugging Face's ``DeepseekV3ForCausalLM.save_pretrained``: ``config.json`` with
  ``model_type: deepseek_v3`` + ``*.safetensors`` (per-expert or fused-expert tensors).
``export_hf`` writes ours in the second layout so ``transformers`` can load it back.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .model import ModelArgs, Transformer, yarn_mscale

DATA = Path(__file__).resolve().parent.parent / "data"
DEFAULT_CHECKPOINT = DATA / "demo"

# ours -> Hugging Face, per module suffix
_HF_NAMES = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^head\.", "lm_head."),
    (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.attn\.wq\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^layers\.(\d+)\.attn\.wq_a\.", r"model.layers.\1.self_attn.q_a_proj."),
    (r"^layers\.(\d+)\.attn\.q_norm\.", r"model.layers.\1.self_attn.q_a_layernorm."),
    (r"^layers\.(\d+)\.attn\.wq_b\.", r"model.layers.\1.self_attn.q_b_proj."),
    (r"^layers\.(\d+)\.attn\.wkv_a\.", r"model.layers.\1.self_attn.kv_a_proj_with_mqa."),
    (r"^layers\.(\d+)\.attn\.kv_norm\.", r"model.layers.\1.self_attn.kv_a_layernorm."),
    (r"^layers\.(\d+)\.attn\.wkv_b\.", r"model.layers.\1.self_attn.kv_b_proj."),
    (r"^layers\.(\d+)\.attn\.wo\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^layers\.(\d+)\.ffn\.gate\.bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (r"^layers\.(\d+)\.ffn\.gate\.weight$", r"model.layers.\1.mlp.gate.weight"),
    (r"^layers\.(\d+)\.ffn\.", r"model.layers.\1.mlp."),
]
_HF_MLP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def to_hf_name(name: str) -> str:
    for pat, rep in _HF_NAMES:
        if re.search(pat, name):
            name = re.sub(pat, rep, name)
            break
    return re.sub(r"\.(w[123])\.", lambda m: f".{_HF_MLP[m.group(1)]}.", name)


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """Translate a ``DeepseekV3Config`` dict into ``ModelArgs``."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    factor = float(rope.get("factor", 1.0)) if yarn else 1.0
    mscale, mscale_all = float(rope.get("mscale", 0) or 0), float(rope.get("mscale_all_dim", 0) or 0)
    attn_factor = rope.get("attention_factor")
    if attn_factor is None:  # transformers' YaRN rule for the cos/sin factor
        if mscale and mscale_all:
            attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attn_factor = yarn_mscale(factor)
    if cfg.get("rope_interleave") is False:
        raise ValueError("rope_interleave=False checkpoints are not supported (DeepSeek-V3 uses interleaved RoPE)")
    n_routed = cfg.get("n_routed_experts") or 0
    return ModelArgs(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], inter_dim=cfg["intermediate_size"],
        n_layers=cfg["num_hidden_layers"],
        n_dense_layers=cfg.get("first_k_dense_replace", 0) if n_routed else cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"], max_seq_len=cfg.get("max_position_embeddings", 4096),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), moe_inter_dim=cfg.get("moe_intermediate_size", 0),
        n_routed_experts=max(n_routed, 1), n_shared_experts=cfg.get("n_shared_experts") or 0,
        n_activated_experts=cfg.get("num_experts_per_tok", 1),
        n_expert_groups=cfg.get("n_group") or 1, n_limited_groups=cfg.get("topk_group") or 1,
        score_func="sigmoid", route_scale=cfg.get("routed_scaling_factor", 1.0),
        norm_topk_prob=cfg.get("norm_topk_prob", True),
        q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        original_seq_len=rope.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), rope_factor=factor,
        beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
        mscale=mscale_all if yarn else 1.0, rope_attn_factor=float(attn_factor),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
    )


def hf_config_from_args(args: ModelArgs) -> dict:
    """The ``config.json`` a ``DeepseekV3ForCausalLM`` needs to hold our weights."""
    if args.score_func != "sigmoid":
        raise ValueError("transformers' DeepseekV3 only scores with sigmoid")
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.n_shared_experts, "n_routed_experts": args.n_routed_experts,
        "routed_scaling_factor": args.route_scale, "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "qk_nope_head_dim": args.qk_nope_head_dim,
        "n_group": args.n_expert_groups, "topk_group": args.n_limited_groups,
        "num_experts_per_tok": args.n_activated_experts, "first_k_dense_replace": args.n_dense_layers,
        "norm_topk_prob": args.norm_topk_prob, "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings, "rope_interleave": True, "attention_bias": False,
        "rope_theta": args.rope_theta,
    }
    if args.rope_factor > 1:
        cfg["rope_parameters"] = {
            "rope_type": "yarn", "factor": args.rope_factor, "rope_theta": args.rope_theta,
            "original_max_position_embeddings": args.original_seq_len, "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow, "mscale": args.mscale, "mscale_all_dim": args.mscale,
        }
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": args.rope_theta}
    return cfg


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    out[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises its own error type for a truncated or corrupt file
            raise ValueError(f"cannot read {f}: {str(e).splitlines()[0]} (truncated or corrupt?)") from None
    return out


def _from_hf_state(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict to ours, unfusing 3-D expert tensors if present."""
    inverse: dict[str, torch.Tensor] = {}
    for name in _param_names(args):
        hf_name = to_hf_name(name)
        if hf_name in hf:
            inverse[name] = hf[hf_name]
    for k, v in hf.items():  # fused experts (transformers >= 5 in-memory layout)
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", k)
        if not m:
            continue
        layer, kind = m.groups()
        for j in range(v.size(0)):
            if kind == "gate_up_proj":
                w1, w3 = v[j].chunk(2, dim=0)
                inverse[f"layers.{layer}.ffn.experts.{j}.w1.weight"] = w1
                inverse[f"layers.{layer}.ffn.experts.{j}.w3.weight"] = w3
            else:
                inverse[f"layers.{layer}.ffn.experts.{j}.w2.weight"] = v[j]
    if args.tie_embeddings and "head.weight" not in inverse:
        inverse["head.weight"] = inverse["embed.weight"]
    return inverse


def _param_names(args: ModelArgs) -> list[str]:
    with torch.device("meta"):
        m = Transformer(args)
    return list(m.state_dict().keys())


_FILE_SHA: dict[tuple, str] = {}  # (path, device, inode, size, mtime_ns) of every file -> hash


def file_sha256(folder: str | Path) -> str:
    """SHA-256 over the checkpoint's safetensors files (sorted by name): a run's model identity.

    Remembered per process while every file keeps its inode, size and modification time, so recording
    from the same folder again does not re-read gigabytes; a file replaced or rewritten is hashed anew."""
    files = sorted(Path(folder).glob("*.safetensors"))
    key = tuple((str(f.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for f in files
                for st in [f.stat()])
    if key in _FILE_SHA:
        return _FILE_SHA[key]
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    _FILE_SHA[key] = h.hexdigest()
    return _FILE_SHA[key]


def state_sha256(model: Transformer) -> str:
    """SHA-256 of an in-memory model's weights (names, shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(str(tuple(v.shape)).encode() + str(v.dtype).encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_checkpoint(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", max_seq_len: int | None = None) -> Transformer:
    """Load our checkpoint folder or a Hugging Face DeepseekV3 folder; returns a model in eval mode.

    Args:
        path: folder (default: the bundled demo checkpoint in ``data/demo``).
        dtype: parameter dtype (logits are always fp32).
        max_seq_len: override the context the RoPE table is built for (e.g. longer YaRN contexts).
    """
    folder = Path(path) if path else DEFAULT_CHECKPOINT
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder (no config.json)")
    cfg = json.loads(cfg_path.read_text())
    tensors = _read_safetensors(folder)
    if cfg.get("model_type") == "deepseek_v3":
        args = args_from_hf_config(cfg)
    elif "dim" in cfg and "n_layers" in cfg:
        args = ModelArgs(**cfg)
    else:
        raise ValueError(f"{cfg_path}: neither a workbench ModelArgs config nor a deepseek_v3 config "
                         f"(model_type={cfg.get('model_type')!r})")
    if max_seq_len:
        args.max_seq_len = max_seq_len
    if cfg.get("model_type") == "deepseek_v3":
        tensors = _from_hf_state(tensors, args)
    model = Transformer(args)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (args.tie_embeddings and k == "head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not fit the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.checkpoint_path = str(folder)  # type: ignore[attr-defined]
    return model.to(device=device, dtype=dtype).eval()


def save_checkpoint(model: Transformer, folder: str | Path, extra: dict | None = None, tokenizer=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (fp32 unless the model is in another dtype), and
    ``tokenizer.json`` when ``tokenizer`` (a ``tokenizers.Tokenizer`` or a tokenizer.json path) is given."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        if isinstance(tokenizer, (str, Path)):
            shutil.copyfile(tokenizer, folder / "tokenizer.json")
        else:
            tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps(model.args.to_dict(), indent=2) + "\n")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt", **(extra or {})})
    return folder


def export_hf(model: Transformer, folder: str | Path) -> Path:
    """Write our model in the layout ``DeepseekV3ForCausalLM.from_pretrained`` reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_from_args(model.args), indent=2) + "\n")
    state = {to_hf_name(k): v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
