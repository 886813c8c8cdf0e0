"""Checks of a model folder before anything expensive is done with it: each failure is one line (a ValueError or
FileNotFoundError), raised before a weight is read or a tensor allocated.

- ``check_config``: config.json is a JSON object whose size fields are integers in a plausible range, and the
  model it describes fits in memory: its parameter bytes (and, for our own ``Transformer``, which allocates them
  when it is built, the RoPE table and the KV cache for ``max_seq_len``) estimated from the numbers alone, against
  half of the available RAM (``WORKBENCH_MAX_MODEL_BYTES`` overrides the limit). A ``transformers`` cache grows
  with the tokens actually fed, so only its parameters count.
- ``check_tokenizer``: the folder has a tokenizer (or one is given), and its vocabulary is not larger than the
  model's (a token id past the embedding would fail deep inside the forward).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from workbench.model import ModelArgs

try:
    import psutil  # optional: not a dependency; /proc/meminfo or os.sysconf below without it
except ImportError:
    psutil = None

# integer fields of a model config and their plausible range (largest real models are far below the upper ends)
INT_FIELDS = {
    # ours (ModelArgs)
    "vocab_size": (1, 1 << 24), "dim": (1, 1 << 20), "inter_dim": (1, 1 << 22), "n_layers": (1, 4096),
    "n_dense_layers": (0, 4096), "n_heads": (1, 1 << 14), "max_seq_len": (1, 1 << 24), "moe_inter_dim": (0, 1 << 22),
    "n_routed_experts": (1, 1 << 16), "n_shared_experts": (0, 1 << 10), "n_activated_experts": (1, 1 << 12),
    "n_expert_groups": (1, 1 << 12), "n_limited_groups": (1, 1 << 12), "q_lora_rank": (0, 1 << 20),
    "kv_lora_rank": (0, 1 << 20), "qk_nope_head_dim": (0, 1 << 14), "qk_rope_head_dim": (0, 1 << 14),
    "v_head_dim": (0, 1 << 14), "original_seq_len": (1, 1 << 24),
    # transformers
    "hidden_size": (1, 1 << 20), "intermediate_size": (1, 1 << 22), "num_hidden_layers": (1, 4096),
    "num_attention_heads": (1, 1 << 14), "num_key_value_heads": (1, 1 << 14), "head_dim": (1, 1 << 14),
    "moe_intermediate_size": (0, 1 << 22), "shared_expert_intermediate_size": (0, 1 << 22),
    "num_experts": (0, 1 << 16), "num_local_experts": (0, 1 << 16), "num_experts_per_tok": (0, 1 << 12),
    "max_position_embeddings": (1, 1 << 30), "first_k_dense_replace": (0, 4096),
}
DTYPE_BYTES = {None: 4, "float32": 4, "bfloat16": 2, "float16": 2}


class ConfigError(ValueError):
    """A config.json that is not a model this machine can build (one line)."""


def read_config(folder: str | Path) -> dict:
    """config.json of a model folder as a dict; one-line errors for a missing, unreadable or non-object file."""
    path = Path(folder) / "config.json"
    if not Path(folder).exists():
        raise FileNotFoundError(f"no model at {folder}: pass a checkpoint folder (config.json + *.safetensors)")
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder (no config.json)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return cfg


def _sections(cfg: dict) -> list[dict]:
    """The config and its nested text config (multimodal configs keep the language model's sizes there)."""
    return [cfg] + [cfg[k] for k in ("text_config",) if isinstance(cfg.get(k), dict)]


def check_fields(cfg: dict, path) -> None:
    """Integer size fields in range; for our own config (``dim`` + ``n_layers``), only ``ModelArgs`` fields, each of
    its default's type (a config that would fail inside the model's constructor fails here, in one line)."""
    if "dim" in cfg and "n_layers" in cfg and "model_type" not in cfg:
        fields = {f.name: f for f in dataclasses.fields(ModelArgs)}
        unknown = sorted(set(cfg) - set(fields))
        if unknown:
            raise ConfigError(f"{path}: unknown ModelArgs fields {unknown[:5]}")
        defaults = ModelArgs()
        for k, v in cfg.items():
            want = type(getattr(defaults, k))
            ok = isinstance(v, want) and not (isinstance(v, bool) and want is not bool)
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                ok = True
            if not ok:
                raise ConfigError(f"{path}: {k} must be {want.__name__}, got {json.dumps(v)[:40]}")
    for sec in _sections(cfg):
        for key, (lo, hi) in INT_FIELDS.items():
            v = sec.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{path}: {key} must be an integer, got {json.dumps(v)[:40]}")
            if not lo <= v <= hi:
                raise ConfigError(f"{path}: {key} = {v} is outside the plausible range {lo}..{hi}")


def _g(sec: dict, *keys, default: int = 0) -> int:
    for k in keys:
        v = sec.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def estimate_bytes(cfg: dict, dtype: str | None = None) -> tuple[int, int]:
    """(parameter bytes, bytes allocated with the model beyond its parameters) from config.json's numbers.

    Ours (``ModelArgs``: ``dim``, ``n_layers``): embeddings, MLA attention, dense / MoE MLPs, and the RoPE table
    and KV cache ``Transformer`` allocates for ``max_seq_len``. A transformers config: embeddings, attention
    and MLP (every layer counted as MoE when experts are declared), no cache."""
    b = DTYPE_BYTES.get(dtype, 4)
    if "dim" in cfg and "n_layers" in cfg and "hidden_size" not in cfg:
        d, L, V = _g(cfg, "dim", default=256), _g(cfg, "n_layers", default=6), _g(cfg, "vocab_size", default=4096)
        H = _g(cfg, "n_heads", default=4)
        nope, rope, vd = (_g(cfg, "qk_nope_head_dim", default=32), _g(cfg, "qk_rope_head_dim", default=16),
                          _g(cfg, "v_head_dim", default=32))
        kv, ql = _g(cfg, "kv_lora_rank", default=64), _g(cfg, "q_lora_rank")
        q = d * ql + ql * H * (nope + rope) if ql else d * H * (nope + rope)
        attn = q + d * (kv + rope) + kv * H * (nope + vd) + H * vd * d
        dense = _g(cfg, "n_dense_layers", default=1)
        E, S = _g(cfg, "n_routed_experts", default=16), _g(cfg, "n_shared_experts", default=1)
        moe = 3 * d * _g(cfg, "moe_inter_dim", default=128) * (E + S) + E * d
        mlp = dense * 3 * d * _g(cfg, "inter_dim", default=512) + max(L - dense, 0) * moe
        params = V * d * 2 + L * (attn + 2 * d) + mlp + d
        seq = _g(cfg, "max_seq_len", default=2048)
        extra = seq * max(rope // 2, 1) * 8 + L * seq * (kv + rope) * b
        return params * b, extra
    total = 0
    for sec in _sections(cfg)[-1:]:  # the language model's sizes (the nested text config when there is one)
        h, L, V = _g(sec, "hidden_size"), _g(sec, "num_hidden_layers"), _g(sec, "vocab_size")
        H = _g(sec, "num_attention_heads", default=1)
        kvh = _g(sec, "num_key_value_heads", default=H)
        hd = _g(sec, "head_dim", default=h // max(H, 1))
        inter = _g(sec, "intermediate_size", default=4 * h)
        E = _g(sec, "num_experts", "num_local_experts", "n_routed_experts")
        if E:
            mi = _g(sec, "moe_intermediate_size", default=inter)
            shared = 3 * h * (_g(sec, "shared_expert_intermediate_size")
                              or _g(sec, "n_shared_experts") * mi)
            mlp = 3 * h * mi * E + shared + E * h
        else:
            mlp = 3 * h * inter
        attn = h * H * hd * 2 + 2 * h * kvh * hd
        tied = sec.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)) is True
        total += V * h * (1 if tied else 2) + L * (attn + mlp + 2 * h) + h
    return total * b, 0


def memory_limit() -> int:
    """Bytes a model may take: ``WORKBENCH_MAX_MODEL_BYTES``, else half of the available RAM."""
    env = os.environ.get("WORKBENCH_MAX_MODEL_BYTES")
    if env:
        try:
            return int(float(env))
        except ValueError:
            raise ValueError(f"WORKBENCH_MAX_MODEL_BYTES must be a number of bytes, got {env!r}") from None
    if psutil is not None:
        return psutil.virtual_memory().available // 2
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_config(folder: str | Path, dtype: str | None = None, device_map=None) -> dict:
    """config.json of ``folder``, checked (types, ranges, estimated size against ``memory_limit``); returns it.

    ``device_map``: the model is placed by accelerate (offloaded as needed), so only the fields are checked."""
    cfg = read_config(folder)
    path = Path(folder) / "config.json"
    check_fields(cfg, path)
    if device_map is not None:
        return cfg
    params, extra = estimate_bytes(cfg, dtype)
    limit = memory_limit()
    if params + extra > limit:
        what = f"{_gb(params)} of parameters" + (f" + {_gb(extra)} of RoPE table and KV cache" if extra else "")
        raise ConfigError(f"{path} describes a model of about {what} ({dtype or 'float32'}), more than the "
                          f"{_gb(limit)} allowed here (half the available memory; set WORKBENCH_MAX_MODEL_BYTES "
                          "to change it)")
    return cfg


def check_no_remote_code(folder: str | Path, cfg: dict) -> None:
    """A transformers folder whose ``model_type`` transformers does not know would need its own Python code
    (``auto_map``): refused, in one line, before transformers sees it (which would ask "run the custom code?" in
    a terminal). A known type loads transformers' own class and any ``auto_map`` is ignored
    (``load_hf`` passes ``trust_remote_code=False``). Our own configs (no ``model_type``) pass."""
    if "model_type" not in cfg and "dim" in cfg and "n_layers" in cfg:
        return
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # optional: transformers
    except ImportError:
        CONFIG_MAPPING = {}  # noqa: N806 - nothing is known without it
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        code = " and ships its own code (auto_map)" if cfg.get("auto_map") else ""
        raise ConfigError(f"{folder}: model_type {mt if isinstance(mt, str) else json.dumps(mt)[:40]} is not one "
                          f"transformers knows{code}; the workbench never runs a model folder's own Python "
                          "(trust_remote_code is off)")


def config_vocab(cfg: dict) -> int | None:
    """The model's vocabulary size as config.json declares it (None: not declared)."""
    for sec in reversed(_sections(cfg)):
        v = sec.get("vocab_size")
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def check_vocab(tokenizer, vocab_size: int | None, where: str) -> None:
    """A tokenizer whose ids can go past the model's embedding is refused (one line)."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and n > vocab_size:
        raise ValueError(f"the tokenizer has {n} tokens but {where} has a vocabulary of {vocab_size}: ids "
                         f"{vocab_size}..{n - 1} would be past its embedding; pass the model's own tokenizer "
                         "(--tokenizer PATH)")
