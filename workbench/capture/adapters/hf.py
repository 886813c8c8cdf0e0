"""The adapter for ``transformers`` causal LMs: dense ones, and every MoE family that follows the
``transformers`` 5.x router convention, with no family code.

The convention: a router module (``*TopKRouter`` / ``*TopkRouter``) whose forward returns
``(router_logits, router_weights, router_indices)``, and beside it an ``experts`` module called as
``experts(hidden, top_k_index, top_k_weights)``. Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss and
DeepSeek-V2/V3 all follow it. The seams:

- routing: a forward hook on the router keeps its logits; a forward pre-hook on ``experts`` sees the
  indices and weights the experts actually receive (and may replace them: ablation, frozen routing,
  faults). The layer's ``RouterMath`` (softmax / sigmoid, selection bias, groups,
  renormalisation, scale) is found by matching candidate rules against the router's own output on
  random inputs when the model loads, so the margin and re-routing use the router's real arithmetic;
  a router no rule reproduces is recorded without routing, with a warning and a note on the run;
- attention probabilities: a forward hook on each ``self_attn`` (eager attention returns them), the
  prompt prefilled in blocks of ``attn_chunk`` query rows so at most [H, chunk, S] exist at once;
- head outputs: a forward pre-hook on ``self_attn.o_proj`` (its input is the heads' outputs side by side);
- shared experts (``shared_experts`` / Qwen2-MoE's ``shared_expert``, before its sigmoid gate) and the
  residual stream (each decoder layer's output): forward hooks;
- KV state: the ``transformers`` cache's keys and values (``latent_norm`` holds a token's value norm
  over all kv heads, ``rope_norm`` its rotated keys').
A layer that holds experts but no such router (an older or custom MoE) is recorded without routing.
"""
from __future__ import annotations

import contextlib
import json
import re
import tempfile
import warnings
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from workbench.capture.preflight import check_config, check_no_remote_code
from workbench.model import state_sha256
from workbench.model.generate import check_prompt, decode

from .base import Adapter, Listener, ModelSummary, QuantPoints, first_output
from .routing import RouterMath

ROUTER_CLASS = re.compile(r"Top[Kk]Router$")
MOE_HINT = re.compile(r"(moe|sparse|expert)", re.IGNORECASE)
SELECTION_BIAS = ("e_score_correction_bias",)


def folder_model_type(path: str | Path) -> str | None:
    """``model_type`` of a Hugging Face folder's config.json; None for our own checkpoints or non-folders."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _decoder_layers(hf: nn.Module) -> nn.ModuleList:
    n = int(hf.config.num_hidden_layers)
    for _, mod in hf.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and all(hasattr(m, "self_attn") for m in mod):
            return mod
    raise ValueError(f"cannot find the {n} decoder layers (modules with self_attn) of {type(hf).__name__}")


def _find_router(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """(block, router, experts) of a layer that follows the router convention, else None."""
    for _, mod in layer.named_modules():
        for rname, router in mod.named_children():
            if ROUTER_CLASS.search(type(router).__name__) and isinstance(getattr(mod, "experts", None), nn.Module):
                return mod, router, mod.experts
    return None


def _router_output(router: nn.Module, hidden: torch.Tensor):
    out = router(hidden)
    if not (isinstance(out, tuple) and len(out) == 3):
        return None
    return out


def infer_router_math(router: nn.Module, hidden_size: int, seed: int = 0) -> RouterMath | None:
    """The ``RouterMath`` that reproduces ``router``'s own output on random inputs, or None."""
    top_k = int(getattr(router, "top_k"))
    n_exp = int(getattr(router, "num_experts", 0) or router.weight.size(0))
    bias = next((getattr(router, b) for b in SELECTION_BIAS if isinstance(getattr(router, b, None), torch.Tensor)),
                None)
    n_group = int(getattr(router, "num_group", None) or getattr(router, "n_group", None) or 1)
    topk_group = int(getattr(router, "topk_group", None) or 1)
    if getattr(router, "topk_method", None) == "greedy":
        n_group = topk_group = 1
    scale = float(getattr(router, "routed_scaling_factor", None) or 1.0)
    norm_attr = getattr(router, "norm_topk_prob", None)
    p = next(router.parameters())
    # an offloaded layer (accelerate device map) keeps meta weights and runs where its hook says
    hook = getattr(router, "_hf_hook", None)
    device = p.device if p.device.type != "meta" else getattr(hook, "execution_device", None) or "cpu"
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(64, hidden_size, generator=g).to(device, p.dtype)
    with torch.no_grad():
        out = _router_output(router, hidden)
        if out is None:
            return None
        logits, weights, indices = out
        candidates = product(("softmax", "sigmoid"), ("max", "top2"),
                             (bool(norm_attr),) if norm_attr is not None else (True, False))
        for score, group_score, norm in candidates:
            if n_group == 1 and group_score == "top2":
                continue
            math = RouterMath(n_experts=n_exp, top_k=top_k, score=score, bias=bias, n_group=n_group,
                              topk_group=topk_group, group_score=group_score, norm=norm,
                              eps=1e-20 if score == "sigmoid" else 0.0, scale=scale)
            if math.matches(logits, indices, weights, atol=1e-3 if p.dtype != torch.float32 else 1e-5):
                return math
    return None


class HFAdapter(Adapter):
    """Adapter over a ``transformers`` causal LM (eager attention)."""

    def __init__(self, hf: nn.Module, folder: str | Path | None = None, attn_chunk: int = 512):
        impl = getattr(hf.config, "_attn_implementation", None)
        if impl not in (None, "eager") and hasattr(hf, "set_attn_implementation"):
            # fused kernels (sdpa, flash) never hand out the probabilities: the attention signals need eager
            warnings.warn(f"{type(hf).__name__} was loaded with attn_implementation={impl!r}, which exposes no "
                          "attention probabilities: switched to 'eager' so attention and KV signals are recorded",
                          stacklevel=3)
            hf.set_attn_implementation("eager")
        self.module = hf.eval()
        self.module._workbench_adapter = self  # adapter_for(module) finds it again
        self.checkpoint_path = str(folder) if folder is not None else None
        self.attn_chunk = attn_chunk
        cfg = hf.config
        self.layers = _decoder_layers(hf)
        self.moe: dict[int, tuple[nn.Module, nn.Module, nn.Module, RouterMath]] = {}
        unrouted: list[int] = []
        for i, layer in enumerate(self.layers):
            found = _find_router(layer)
            math = infer_router_math(found[1], int(cfg.hidden_size)) if found else None
            if found and math is not None:
                self.moe[i] = (*found, math)
            elif found or any(MOE_HINT.search(type(m).__name__) or MOE_HINT.search(n.rsplit(".", 1)[-1])
                              for n, m in layer.named_modules() if n):
                unrouted.append(i)
        maths = [m[3] for m in self.moe.values()]
        n_shared = 0
        if self.moe:
            block = next(iter(self.moe.values()))[0]
            if getattr(block, "shared_experts", None) is not None:
                n_shared = int(getattr(cfg, "n_shared_experts", None) or 1)
            elif getattr(block, "shared_expert", None) is not None:
                n_shared = 1
        notes = []
        if unrouted:
            notes.append(f"layers {unrouted} hold experts that no adapter recognises (no router following the "
                         "transformers TopKRouter convention, or one whose arithmetic could not be matched): "
                         "routing is not recorded for them")
        n_heads = int(cfg.num_attention_heads)
        self.summary = ModelSummary(
            family=str(cfg.model_type), backend="transformers", n_layers=len(self.layers), n_heads=n_heads,
            n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or n_heads), vocab_size=int(cfg.vocab_size),
            max_seq_len=int(getattr(cfg, "max_position_embeddings", None) or 2048), moe_layers=sorted(self.moe),
            n_routed_experts=maths[0].n_experts if maths else 0, n_shared_experts=n_shared,
            top_k=maths[0].top_k if maths else 0, selection_bias=any(m.has_bias for m in maths),
            unrouted_layers=unrouted, notes=notes)
        self._pos = 0
        self._cache = None
        self._attn_listeners = 0

    def router(self, layer: int) -> RouterMath:
        _, router, _, math = self.moe[layer]
        if math.bias is None:
            return math
        # the live buffer (a dtype or device move replaces it; a fault changes it in place)
        return replace(math, bias=next(getattr(router, b) for b in SELECTION_BIAS if hasattr(router, b)))

    # -- running --------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._pos = 0
        return self.module(ids, use_cache=False).logits.float()

    def embedding(self) -> nn.Module:
        return self.module.get_input_embeddings()

    def stream(self, prompt: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> Iterator:
        """The prefill step (in query blocks while attention is observed), then one step per token."""
        from transformers import DynamicCache  # lazy: transformers is optional; only its models get here

        prompt = check_prompt(prompt, max_new_tokens, self.summary.max_seq_len)
        cache = DynamicCache(config=self.module.config)

        def forward(ids: list[int], pos: int, index: int) -> torch.Tensor:
            nonlocal cache
            logits, cache = self._feed(cache, ids, pos, self.attn_chunk if self._attn_listeners and index == 0
                                       else len(ids))
            return logits

        try:
            with torch.inference_mode():
                yield from decode(forward, prompt, max_new_tokens, temperature, top_p, seed, eos_id)
        finally:
            self._cache = None

    def _feed(self, cache, ids: list[int], pos: int, chunk: int) -> tuple[torch.Tensor, object]:
        """Feed ``ids`` from position ``pos`` through ``cache`` in blocks of ``chunk`` tokens: (logits [T, V] fp32,
        the cache)."""
        parts = []
        for c0 in range(0, len(ids), chunk):
            self._pos = pos + c0
            out = self.module(torch.tensor([ids[c0:c0 + chunk]], device=self.device), cache=cache, use_cache=True)
            cache = out.cache
            parts.append(out.logits[0].float())
        self._cache = cache
        return (torch.cat(parts) if len(parts) > 1 else parts[0]), cache

    def kv_state(self) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor, int]]:
        out = []
        for i, layer in enumerate(getattr(self._cache, "layers", None) or []):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.numel() == 0:
                continue
            n = keys.size(-2)
            nbytes = keys.numel() * keys.element_size() + values.numel() * values.element_size()
            # [B, Hkv, S, d] -> [S, Hkv*d]: a token's cached vectors over all kv heads (values first, as the
            # latent is for our model)
            seen = int(getattr(layer, "cumulative_length", n))  # a sliding-window layer keeps the newest n
            out.append((i, n, nbytes, values[0].transpose(0, 1).flatten(1), keys[0].transpose(0, 1).flatten(1),
                        seen - n))
        return out

    # -- the KV what-if seam: eviction adds -inf to each layer's 4D attention mask (eager attention) --------
    @contextlib.contextmanager
    def kv_session(self, max_len: int) -> Iterator:
        from transformers import DynamicCache  # lazy: transformers is optional; only its models get here

        cache = DynamicCache(config=self.module.config)
        self._kv_keep: list[torch.Tensor | None] = [None] * len(self.layers)

        def evict(_m, args, kwargs, i):
            keep = self._kv_keep[i]
            if keep is None:
                return None
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            t = h.size(1)
            mask = kwargs.get("attention_mask")
            if mask is None:  # built here: causal over the cached keys and the t new ones
                s = cache.get_seq_length(i) + t
                q = torch.arange(s - t, s, device=h.device)[:, None]
                mask = torch.zeros(t, s, dtype=h.dtype, device=h.device).masked_fill(
                    torch.arange(s, device=h.device)[None] > q, float("-inf"))[None, None]
            s = mask.size(-1)
            if keep.numel() > s:
                raise ValueError(f"layer {i}'s attention sees {s} keys but {keep.numel()} are cached: the KV "
                                 "what-if does not support sliding-window caches")
            add = torch.zeros(s, dtype=mask.dtype, device=mask.device)
            add[: keep.numel()].masked_fill_(~keep, float("-inf"))
            kwargs["attention_mask"] = mask + add
            return args, kwargs

        handles = [l.self_attn.register_forward_pre_hook(lambda m, a, kw, i=i: evict(m, a, kw, i), with_kwargs=True)
                   for i, l in enumerate(self.layers)]

        def forward(ids, pos: int) -> torch.Tensor:
            nonlocal cache
            # always in blocks: the same arithmetic, observed or not
            logits, cache = self._feed(cache, list(ids), pos, self.attn_chunk)
            return logits

        try:
            with torch.inference_mode():
                yield forward
        finally:
            for hd in handles:
                hd.remove()
            self._cache = None
            self._kv_keep = [None] * len(self.layers)

    # -- what-ifs on a full forward (precision) ----------------------------------------------------------
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def quantization_points(self, layer: int) -> QuantPoints:
        moe = self.moe.get(layer)
        if moe is None:
            return QuantPoints(self.layers[layer], [], [])
        experts = moe[2]
        fused = [] if any(isinstance(m, nn.Linear) for m in experts.modules()) else [experts]
        return QuantPoints(self.layers[layer], [moe[1]], fused)

    @contextlib.contextmanager
    def teacher_forcing(self, length: int) -> Iterator:
        from transformers import DynamicCache  # lazy: transformers is optional; only its models get here

        m = self.module
        quant = self.__dict__.setdefault("_kv_quant", {})

        def forward(ids: torch.Tensor) -> torch.Tensor:
            cache = DynamicCache(config=m.config)  # a fresh cache whose update passes through quantize_kv's fns
            update = cache.update

            def quantized_update(key, value, layer_idx, *args, **kwargs):
                fn = quant.get(layer_idx)
                if fn is not None:
                    key, value = fn(key), fn(value)
                return update(key, value, layer_idx, *args, **kwargs)

            cache.update = quantized_update
            self._pos = 0  # the attention probe's position counter
            return m(ids, cache=cache, use_cache=True).logits.float()

        with torch.no_grad():
            yield forward

    @contextlib.contextmanager
    def quantize_kv(self, layer: int, fn) -> Iterator[None]:
        quant = self.__dict__.setdefault("_kv_quant", {})
        quant[layer] = fn
        try:
            yield
        finally:
            if quant.get(layer) is fn:
                del quant[layer]

    def kv_entries(self) -> list[tuple[int, list[torch.Tensor]]]:
        out = []
        for layer in getattr(self._cache, "layers", None) or []:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.numel() == 0:
                out.append((0, []))
                continue
            n = keys.size(-2)
            seen = int(getattr(layer, "cumulative_length", n))
            # [B, Hkv, S, d] -> [S, Hkv, d] views of batch row 0 (edits write through); values first, as kv_state
            out.append((seen - n, [values[0].transpose(0, 1), keys[0].transpose(0, 1)]))
        return out


    def state_sha256(self) -> str:
        return state_sha256(self.module)

    # -- the parts of a layer (activation patching, fault injection) ---------------------------------
    def parts(self, layer: int) -> dict[str, nn.Module | None]:
        b = self.layers[layer]
        attn = b.self_attn
        moe = self.moe.get(layer)
        block = moe[0] if moe else None
        shared = None if block is None else (getattr(block, "shared_experts", None)
                                             or getattr(block, "shared_expert", None))
        return {"block": b, "attn": attn, "mlp": getattr(b, "mlp", None) or block,
                "attn_norm": getattr(b, "input_layernorm", None), "mlp_norm": getattr(b, "post_attention_layernorm", None),
                "kv": getattr(attn, "kv_a_layernorm", None) or getattr(attn, "v_proj", None), "shared": shared,
                "router": moe[1] if moe else None, "experts": moe[2] if moe else None}

    def expert_down(self, layer: int, expert: int) -> torch.Tensor:
        experts = self.moe[layer][2]
        down = getattr(experts, "down_proj", None)
        if isinstance(down, torch.Tensor) and down.ndim == 3:  # fused [E, D, I] (or [E, I, D])
            w = down[expert]
            return w if w.size(0) == self.module.config.hidden_size else w.transpose(0, 1)
        mods = list(experts) if isinstance(experts, nn.ModuleList) else []
        if mods and hasattr(mods[expert], "down_proj"):
            return mods[expert].down_proj.weight
        raise ValueError(f"cannot find expert {expert}'s down projection in layer {layer} of {self.summary.family}")

    def unembedding(self) -> nn.Module:
        return self.module.get_output_embeddings()

    def _rotary_emb(self) -> nn.Module:
        for _, m in self.module.named_modules():
            if type(m).__name__.endswith("RotaryEmbedding") and isinstance(getattr(m, "inv_freq", None), torch.Tensor):
                return m
        raise ValueError(f"{self.summary.family} has no rotary embedding module with inv_freq")

    def rotary(self, layer: int, fn) -> list:
        def pre(_m, args, kwargs):
            pe = kwargs.get("position_embeddings")
            if pe is None:
                return None
            new = fn(pe, self._pos)
            if new is None:
                return None
            kwargs["position_embeddings"] = new
            return args, kwargs
        return [self.layers[layer].self_attn.register_forward_pre_hook(pre, with_kwargs=True)]

    def start_positions(self, layer: int, fn) -> list:
        return [self.layers[layer].register_forward_pre_hook(lambda _m, _args: fn(self._pos))]

    def scaled_rotation(self, rotation, factor: float, start: int = 0):
        cos, sin = rotation
        rot = self._rotary_emb()
        inv = rot.inv_freq.float().to(cos.device)
        t = torch.arange(start, start + cos.size(-2), device=cos.device, dtype=torch.float32)
        emb = torch.outer(t, inv * factor)
        emb = torch.cat([emb, emb], -1)
        if emb.size(-1) != cos.size(-1):
            raise ValueError(f"the rotary embedding of {self.summary.family} is not the rotate-half layout")
        a = float(getattr(rot, "attention_scaling", 1.0))
        return ((emb.cos() * a).to(cos).expand_as(cos), (emb.sin() * a).to(sin).expand_as(sin))

    # -- seams ----------------------------------------------------------------------------------------
    def _attach(self, seam: str, fn: Listener) -> list:
        if seam == "attn_probs":
            def on_attn(m, _a, out, i):
                probs = out[1] if isinstance(out, tuple) and len(out) > 1 else None
                if probs is not None:  # [H, Tc, S] -> [Tc, H, S]
                    fn(i, probs[0].detach().transpose(0, 1), self._pos, getattr(m, "sliding_window", None))
            handles = [l.self_attn.register_forward_hook(lambda m, a, o, i=i: on_attn(m, a, o, i))
                       for i, l in enumerate(self.layers)]
            self._attn_listeners += 1
            return handles + [_Undo(self._attn_done)]
        if seam == "head_out":
            h = self.summary.n_heads

            def on_o(_m, args, i):
                x = args[0]
                z = x.view(*x.shape[:-1], h, x.size(-1) // h)  # [B, T, H, d]
                new = fn(i, z)
                return None if new is None else (new.reshape(x.shape), *args[1:])
            return [l.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: on_o(m, a, i))
                    for i, l in enumerate(self.layers)]
        if seam == "resid_post":
            def on_layer(_m, _a, out, i):
                fn(i, first_output(out))
            return [l.register_forward_hook(lambda m, a, o, i=i: on_layer(m, a, o, i)) for i, l in enumerate(self.layers)]
        if seam == "shared_out":
            handles = []
            for i, (block, _, _, _) in self.moe.items():
                shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert")

                def on_shared(_m, _a, out, i=i):
                    new = fn(i, out.reshape(-1, out.size(-1)))
                    return None if new is None else new.reshape(out.shape)
                handles.append(shared.register_forward_hook(on_shared))
            return handles
        raise KeyError(seam)

    def _attach_routing(self) -> list:
        handles = []
        for i, (_, router, experts, _) in self.moe.items():
            seen: dict = {}
            handles.append(router.register_forward_hook(lambda _m, _a, out, seen=seen: seen.__setitem__("logits", out[0])))

            def on_experts(_m, args, kwargs, i=i, seen=seen):
                hidden, idx, w = args[0], args[1], args[2]
                new = self._dispatch_route(i, seen["logits"], idx, w)
                return None if new is None else ((hidden, new[0], new[1].to(w.dtype), *args[3:]), kwargs)
            handles.append(experts.register_forward_pre_hook(on_experts, with_kwargs=True))
        return handles

    def _attn_done(self) -> None:
        self._attn_listeners -= 1


class _Undo:
    """A handle whose ``remove()`` runs a function (bookkeeping undone with the hooks)."""

    def __init__(self, fn):
        self.fn = fn

    def remove(self) -> None:
        self.fn()


def _placement(device_map) -> dict:
    """from_pretrained's keyword arguments for a device map (a map that offloads to "disk" gets a folder)."""
    if device_map is None:
        return {}
    out = {"device_map": device_map}
    if isinstance(device_map, dict) and "disk" in device_map.values():
        out["offload_folder"] = tempfile.mkdtemp(prefix="workbench-offload-")
    return out


def load_hf(folder: str | Path, dtype: torch.dtype | None = None, device: str = "cpu",
            attn_chunk: int = 512, device_map=None) -> HFAdapter:
    """Load a local Hugging Face causal-LM folder (never downloads; safetensors only) with eager attention.

    ``device_map`` ("auto", "balanced", a device, or {module path: device}) places the model across devices with
    accelerate, for a model larger than one device; inputs then go to the embedding's device and transformers'
    dispatch hooks move activations between devices."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is optional; only its folders get here
    from transformers.utils import logging as hf_logging  # lazy: as above

    folder = Path(folder)
    cfg = check_config(folder, str(dtype).removeprefix("torch.") if dtype is not None else None, device_map)
    check_no_remote_code(folder, cfg)
    try:
        # use_safetensors: a folder holding only pickled *.bin weights is refused, never unpickled;
        # trust_remote_code=False: a folder's own Python is never run, and transformers never asks
        with warnings.catch_warnings(), _quiet(hf_logging):  # missing weights are told in one line below
            warnings.simplefilter("ignore")
            hf, info = AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, attn_implementation="eager", dtype=dtype or torch.float32,
                use_safetensors=True, trust_remote_code=False, output_loading_info=True, **_placement(device_map))
    except ImportError as e:
        raise ValueError(f"device_map needs accelerate (pip install 'moe-workbench[devicemap]'): {e}") from None
    except Exception as e:  # noqa: BLE001 - transformers and safetensors raise many types; one line for all
        raise ValueError(f"cannot load {folder} with transformers: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}") from None
    check_loaded(folder, hf, info)
    return HFAdapter(hf if device_map is not None else hf.to(device), folder, attn_chunk)


@contextlib.contextmanager
def _quiet(hf_logging) -> Iterator[None]:
    """transformers' own loading report (a table of missing keys on stderr) off while a folder loads."""
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def check_loaded(folder: Path, hf: nn.Module, info: dict) -> None:
    """Weights the model has but the folder's safetensors do not (transformers would leave them random and only
    warn) or tensors whose shape does not fit: refused, in one line."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = [m if isinstance(m, str) else m[0] for m in (info.get("mismatched_keys") or [])]
    if missing or mismatched:
        n = len(hf.state_dict())
        what = (f"{len(missing)} of the model's {n} weights are not in its safetensors (e.g. {missing[:3]})"
                if missing else f"{len(mismatched)} weights have another shape than the config's (e.g. "
                f"{mismatched[:3]})")
        raise ValueError(f"{folder}: {what}; they would run with random values. Is the folder complete, and "
                         "saved for this model_type?")
