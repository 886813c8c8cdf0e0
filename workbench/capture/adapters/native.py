"""The adapter for our own ``Transformer`` (workbench.model), DeepseekV3 folders loaded natively included.

Its seams are the model's ``hook_*`` points: attention probabilities (``attn.hook_attn_probs``, which
switches MLA to the explicit-softmax path only while listened to), per-head outputs (``attn.hook_z``),
the gate (its logits at ``gate.hook_logits``, its ``(weights, indices)`` output, replaceable), the shared
experts' output and the residual stream after each block. The KV state is the latent cache itself.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Sequence

import torch
from torch import nn

from workbench.model import MLP, MoE, Transformer, state_sha256, stream, stream_batch

from .base import Adapter, Listener, ModelSummary, QuantPoints
from .routing import RouterMath


class _KernelSet:
    """``MLA.stats_kernel`` set while a stats listener is attached (``remove`` unsets it, as a hook handle)."""

    def __init__(self, attn: nn.Module, kernel):
        self.attn, attn.stats_kernel = attn, kernel

    def remove(self) -> None:
        self.attn.stats_kernel = None


def _stats_kernel(module: nn.Module):
    """The Triton forward with row statistics and received attention for a model on CUDA, else None."""
    p = next(module.parameters(), None)
    if p is None or not p.is_cuda:
        return None
    from workbench.probes import triton_attention  # optional: triton, imported only for a model on CUDA
    return triton_attention.mla_stats if triton_attention.available() else None


def _bare_expert(ex: nn.Module) -> bool:
    """An expert whose output and down projection input are what its ``hook_out`` hands over (its value, after any
    hook there, and its keyword ``act``): ``MLP.forward`` with no hook on the expert itself (a fault's output hook
    there is seen only by a hook on the expert) nor one changing its down projection's input."""
    return (isinstance(ex, MLP) and type(ex).forward is MLP.forward and "forward" not in ex.__dict__
            and not (ex._forward_hooks or ex._forward_pre_hooks or ex.w2._forward_pre_hooks))


class NativeAdapter(Adapter):
    """Adapter over ``workbench.model.Transformer``."""

    supports_batch = True
    stats_seam = True
    row_seam = True
    expert_out_seam = True

    def __init__(self, model: Transformer, family: str = "deepseek_v3"):
        self.module = model
        self.module._workbench_adapter = self  # adapter_for(module) finds it again
        self.checkpoint_path = getattr(model, "checkpoint_path", None)
        a = model.args
        moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
        self.summary = ModelSummary(
            family=family, backend="native", n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=1,
            vocab_size=a.vocab_size, max_seq_len=a.max_seq_len, moe_layers=moe,
            n_routed_experts=a.n_routed_experts if moe else 0, n_shared_experts=a.n_shared_experts if moe else 0,
            top_k=a.n_activated_experts if moe else 0, selection_bias=bool(moe))

    def router(self, layer: int) -> RouterMath:
        """The layer's ``RouterMath``, remembered while the gate's settings and bias tensor stay the same
        (routing hooks ask for it at every step; a fault changes the bias in place, which it sees)."""
        return self._router_of(self.module.layers[layer].ffn.gate, layer)

    def _router_of(self, g: nn.Module, layer: int) -> RouterMath:
        """``router(layer)`` of the layer's gate ``g`` (the routing hook has it at hand: no module lookups)."""
        bias = g.bias
        key = (id(g), id(bias), bias.device if bias is not None else None, g.topk, g.score_func, g.n_groups,
               g.topk_groups, g.norm_topk_prob, g.route_scale)
        cache = self.__dict__.setdefault("_routers", {})
        hit = cache.get(layer)
        if hit is None or hit[0] != key:
            hit = cache[layer] = (key, self._router_math(g))
        return hit[1]

    @staticmethod
    def _router_math(g) -> RouterMath:
        return RouterMath(n_experts=g.weight.size(0), top_k=g.topk, score=g.score_func, bias=g.bias,
                          n_group=g.n_groups, topk_group=g.topk_groups,
                          group_score="top2" if g.score_func == "sigmoid" else "max",
                          norm=g.norm_topk_prob and (g.score_func == "sigmoid" or g.topk > 1), eps=1e-20,
                          scale=g.route_scale)

    def stream(self, prompt: Sequence[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
               eos_id: int | None) -> Iterator:
        return stream(self.module, prompt, max_new_tokens, temperature, top_p, seed, eos_id)

    def stream_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                     temperature: Sequence[float], top_p: Sequence[float], seed: Sequence[int],
                     eos_id: int | None) -> Iterator:
        return stream_batch(self.module, prompts, max_new_tokens, temperature, top_p, seed, eos_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(ids)

    def embedding(self) -> nn.Module:
        return self.module.embed

    @contextlib.contextmanager
    def _without_cache(self) -> Iterator[None]:
        caches = [layer.attn.cache for layer in self.module.layers]
        try:
            for layer in self.module.layers:
                layer.attn.cache = None
            yield
        finally:
            for layer, c in zip(self.module.layers, caches):
                layer.attn.cache = c

    def kv_state(self, row: int = 0) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor, int]]:
        out = []
        for i, layer in enumerate(self.module.layers):
            c = layer.attn.cache
            if c is not None:
                n = c.length
                out.append((i, n, n * c.bytes_per_token(), c.kv[row, :n], c.pe[row, :n], 0))
        return out

    def kv_sizes(self) -> list[tuple[int, int, int]]:
        # every step of a recording asks: the layers' attention modules are looked up once, and each cache's bytes
        # per token once (kept on the cache: a new generation makes new ones)
        attns = self.__dict__.get("_attns")
        if attns is None or len(attns) != len(self.module.layers):
            attns = self.__dict__["_attns"] = [layer.attn for layer in self.module.layers]
        out = []
        for i, attn in enumerate(attns):
            c = attn.cache
            if c is None:
                continue
            bpt = c.__dict__.get("_workbench_bpt")
            if bpt is None:
                bpt = c.__dict__["_workbench_bpt"] = c.bytes_per_token()
            out.append((i, c.length, c.length * bpt))
        return out

    # -- the KV what-if seam: eviction renormalises attention over the kept keys (hook_attn_probs) --------
    @contextlib.contextmanager
    def kv_session(self, max_len: int) -> Iterator:
        m = self.module
        self._kv_keep: list[torch.Tensor | None] = [None] * len(m.layers)

        def evict(i: int, probs: torch.Tensor) -> torch.Tensor | None:
            # probs [B, Tc, H, S]; zeroing evicted keys and renormalising is a softmax with their scores at -inf
            keep = self._kv_keep[i]
            if keep is None:
                return None
            full = torch.ones(probs.size(-1), dtype=probs.dtype, device=probs.device)
            full[: keep.numel()] = keep.to(probs.dtype)
            p = probs * full
            return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)

        # prepended, so listeners of the attn_probs seam see the probabilities actually used
        handles = [l.attn.hook_attn_probs.register_forward_hook(lambda _m, _a, out, i=i: evict(i, out), prepend=True)
                   for i, l in enumerate(m.layers)]
        device = self.device
        m.setup_cache(1, max_len)
        try:
            with torch.inference_mode():
                yield lambda ids, pos: m(torch.tensor([list(ids)], device=device), start_pos=pos)[0]
        finally:
            for h in handles:
                h.remove()
            m.clear_cache()
            self._kv_keep = [None] * len(m.layers)

    # -- what-ifs on a full forward (precision) ----------------------------------------------------------
    def blocks(self) -> nn.ModuleList:
        return self.module.layers

    def quantization_points(self, layer: int) -> QuantPoints:
        b = self.module.layers[layer]
        return QuantPoints(b, [b.ffn.gate] if isinstance(b.ffn, MoE) else [], [])

    @contextlib.contextmanager
    def teacher_forcing(self, length: int) -> Iterator:
        m = self.module
        caches = [layer.attn.cache for layer in m.layers]
        try:
            with torch.no_grad():
                m.setup_cache(batch=1, max_len=length)  # a fresh latent cache: the thing quantize_kv edits
                yield lambda ids: m(ids, start_pos=0).float()
        finally:
            for layer, c in zip(m.layers, caches):
                layer.attn.cache = c

    @contextlib.contextmanager
    def cache_writes(self, layer: int, fn) -> Iterator[None]:
        attn = self.module.layers[layer].attn
        hooked: dict = {}  # id(cache) -> (a weak reference to it, its handle): each generation sets up a fresh cache

        def pre(_m, _args) -> None:
            c = attn.cache
            if c is None:
                return
            got = hooked.get(id(c))
            if got is None or got[0]() is not c:  # a new cache (an id a freed cache had is no match)
                hooked[id(c)] = (weakref.ref(c), c.hook_latent.register_forward_hook(
                    lambda _m, _a, out: fn(out) if isinstance(out, torch.Tensor) else None))
        handle = attn.register_forward_pre_hook(pre)
        try:
            yield
        finally:
            handle.remove()
            for _, h in hooked.values():
                h.remove()

    @contextlib.contextmanager
    def quantize_kv(self, layer: int, fn) -> Iterator[None]:
        cache = self.module.layers[layer].attn.cache
        if cache is None:
            raise RuntimeError("quantize_kv needs the cache of a teacher_forcing block")
        # the cache's hook points: their outputs are what the layer caches (and attention reads back)
        handles = [p.register_forward_hook(lambda _m, _a, out: fn(out) if isinstance(out, torch.Tensor) else None)
                   for p in (cache.hook_latent, cache.hook_rope)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def kv_entries(self) -> list[tuple[int, list[torch.Tensor]]]:
        out = []
        for layer in self.module.layers:
            c = layer.attn.cache
            n = c.length if c is not None else 0
            out.append((0, [c.kv[0, :n], c.pe[0, :n]] if c is not None else []))
        return out


    def state_sha256(self) -> str:
        return state_sha256(self.module)

    # -- the parts of a layer (activation patching, fault injection) ---------------------------------
    def parts(self, layer: int) -> dict[str, nn.Module | None]:
        b = self.module.layers[layer]
        moe = isinstance(b.ffn, MoE)
        return {"block": b, "attn": b.attn, "mlp": b.ffn, "attn_norm": b.attn_norm, "mlp_norm": b.ffn_norm,
                "kv": b.attn.kv_norm, "shared": b.ffn.shared_experts if moe else None,
                "router": b.ffn.gate if moe else None, "experts": b.ffn.experts if moe else None}

    def expert_down(self, layer: int, expert: int) -> torch.Tensor:
        return self.module.layers[layer].ffn.experts[expert].w2.weight  # [D, I]

    def unembedding(self) -> nn.Module:
        return self.module.head

    def final_norm(self) -> nn.Module:
        return self.module.norm

    def rotary(self, layer: int, fn) -> list:
        def pre(_m, args):  # Block.forward(x, start_pos, freqs_cis)
            new = fn(args[2], int(args[1]))
            return None if new is None else (args[0], args[1], new)
        return [self.module.layers[layer].register_forward_pre_hook(pre)]

    def start_positions(self, layer: int, fn) -> list:
        # Block.forward(x, start_pos, freqs_cis)
        return [self.module.layers[layer].register_forward_pre_hook(lambda _m, args: fn(int(args[1])))]

    def scaled_rotation(self, rotation: torch.Tensor, factor: float, start: int = 0) -> torch.Tensor:
        table = self.module.freqs_cis
        freqs = table[1].angle().to(rotation.device)  # each pair's angle per position (all below pi)
        t = torch.arange(start, start + rotation.size(0), device=rotation.device, dtype=torch.float32)
        return torch.polar(rotation.abs(), torch.outer(t, freqs * factor))

    def _attach(self, seam: str, fn: Listener) -> list:
        layers = self.module.layers
        if seam == "attn_probs":
            rows = slice(None) if getattr(fn, "batched", False) else 0  # a batch fan-out takes every row
            return [l.attn.hook_attn_probs.tap(lambda out, kw, i=i: fn(i, out[rows], kw["q_start"]))
                    for i, l in enumerate(layers)]
        if seam == "attn_stats":
            rows = slice(None) if getattr(fn, "batched", False) else 0
            handles = [l.attn.hook_attn_stats.tap(
                lambda out, kw, i=i: fn(i, out[rows], kw["received"][rows], kw["q_start"])) for i, l in enumerate(layers)]
            kernel = _stats_kernel(self.module)  # on CUDA: a prefill's statistics from the fused Triton kernel
            return handles + ([_KernelSet(l.attn, kernel) for l in layers] if kernel is not None else [])
        if seam == "attn_row":
            rows = slice(None) if getattr(fn, "batched", False) else 0
            return [l.attn.hook_attn_row.tap(lambda out, kw, i=i: fn(i, out[rows], kw["q_start"]))
                    for i, l in enumerate(layers)]
        if seam == "head_out":
            return [l.attn.hook_z.tap(lambda z, _kw, i=i: fn(i, z)) for i, l in enumerate(layers)]
        if seam == "resid_post":
            return [l.hook_resid_post.tap(lambda h, _kw, i=i: fn(i, h)) for i, l in enumerate(layers)]
        if seam == "expert_in":  # MoE.forward runs its experts on its input's rows
            return [layers[i].ffn.register_forward_pre_hook(lambda _m, a, i=i: fn(i, a[0]))
                    for i in self.summary.moe_layers]
        if seam == "expert_out":  # MoE.forward calls each chosen expert once, in expert order
            handles = []
            for i in self.summary.moe_layers:
                for e, ex in enumerate(layers[i].ffn.experts):
                    if _bare_expert(ex):  # its hook_out hands over both: one tap, no hook machinery
                        handles.append(ex.hook_out.tap(lambda y, kw, i=i, e=e: fn(i, e, y, kw["act"])))
                        continue
                    seen: dict = {}  # the down projection's input of the call under way (registered last: as used)

                    def out(_m, _a, y, i=i, e=e, seen=seen) -> None:  # observes only: the output is never replaced
                        fn(i, e, y, seen.pop(0, None))
                    handles.append(ex.w2.register_forward_pre_hook(lambda _m, a, seen=seen: seen.__setitem__(0, a[0])))
                    handles.append(ex.register_forward_hook(out))
            return handles
        if seam == "shared_out":
            return [layers[i].ffn.shared_experts.hook_out.tap(lambda o, _kw, i=i: fn(i, o))
                    for i in self.summary.moe_layers]
        raise KeyError(seam)

    def _attach_routing(self) -> list:
        handles = []
        for i in self.summary.moe_layers:
            gate = self.module.layers[i].ffn.gate
            seen: dict = {}
            handles.append(gate.hook_logits.tap(lambda lg, _kw, seen=seen: seen.__setitem__("l", lg)))

            def on_gate(g, _a, out, i=i, seen=seen):
                weights, indices = out
                new = self._dispatch_route(i, seen["l"], indices, weights, self._router_of(g, i))
                return None if new is None else (new[1].type_as(weights), new[0])
            handles.append(gate.register_forward_hook(on_gate))
        return handles
