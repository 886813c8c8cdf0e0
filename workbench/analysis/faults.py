"""Fault injection: context managers that break one head, one expert or one router, temporarily.

They exist to prove that root cause finds real culprits (``benchmarks/root_cause_eval.py``): break a
known component, record, and check that the ranking names it. Each fault works through the model's
adapter seams, so it applies to our ``Transformer`` and to every ``transformers`` family the adapters
cover, and is undone when the block exits, whatever happens inside it.

    with break_head(model, layer=2, head=1):
        run = workbench.record("def f(x):", model=model)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from workbench.capture.adapters import Adapter, Route, adapter_for
from workbench.model import Transformer
from workbench.probes import attach


def _check_layer(a: Adapter, layer: int) -> None:
    n = a.summary.n_layers
    if not 0 <= layer < n:
        raise ValueError(f"layer {layer} out of range: the model has layers 0..{n - 1}")


def _check_moe(a: Adapter, layer: int, expert: int) -> None:
    _check_layer(a, layer)
    if layer not in a.summary.moe_layers:
        raise ValueError(f"layer {layer} is a dense layer (no experts, no router); "
                         f"MoE layers are {a.summary.moe_layers}")
    e = a.summary.n_routed_experts
    if not 0 <= expert < e:
        raise ValueError(f"expert {expert} out of range: the layer has experts 0..{e - 1}")


@contextlib.contextmanager
def break_head(model, layer: int, head: int, scale: float = 30.0, noise: float = 0.0,
               seed: int = 0) -> Iterator[None]:
    """Multiply one attention head's output (before the output projection) by ``scale`` and add noise.

    Args:
        scale: factor on the head's per-token output; large values make it swamp the residual stream.
        noise: standard deviation of Gaussian noise added to it (relative to the head output's RMS).
    """
    a = adapter_for(model)
    _check_layer(a, layer)
    if not 0 <= head < a.summary.n_heads:
        raise ValueError(f"head {head} out of range: layer {layer} has heads 0..{a.summary.n_heads - 1}")
    gen = torch.Generator().manual_seed(seed)

    def fn(i: int, z: torch.Tensor):  # [B, T, H, d]
        if i != layer:
            return None
        z = z.clone()
        h = z[:, :, head] * scale
        if noise:
            rms = h.pow(2).mean().sqrt().clamp(min=1e-6)
            h = h + noise * rms * torch.randn(h.shape, generator=gen).to(h)
        z[:, :, head] = h
        return z

    with a.seams({"head_out": fn}):
        yield


@contextlib.contextmanager
def break_expert(model, layer: int, expert: int, scale: float = 30.0) -> Iterator[None]:
    """Multiply one routed expert's output by ``scale`` (its mixing weight, wherever it is chosen: the
    layer's output is linear in each expert's weight, so this scales exactly that expert's contribution)."""
    a = adapter_for(model)
    _check_moe(a, layer, expert)

    def fn(i: int, r: Route) -> None:
        if i == layer:
            r.scale_expert(expert, scale)

    with a.seams({"route": fn}):
        yield


@contextlib.contextmanager
def bias_router(model, layer: int, expert: int, amount: float = 1.0) -> Iterator[None]:
    """Add ``amount`` to one expert's selection score, so the router sends (nearly) every token to it.

    Where the family has a selection bias (DeepSeek-V3's balancing term) the bias itself is changed (and
    restored on exit): it acts before group-limited routing, so the favoured expert's group is chosen
    too, and gate weights still come from the raw scores, exactly as with a mis-trained balancing bias.
    Elsewhere the router's choice is recomputed with the extra selection score.
    """
    a = adapter_for(model)
    _check_moe(a, layer, expert)
    bias = a.router(layer).bias
    if bias is not None:
        saved = bias.detach().clone()
        try:
            with torch.no_grad():
                bias[expert] += amount
            yield
        finally:
            with torch.no_grad():
                bias.copy_(saved)
        return
    extra = torch.zeros(a.summary.n_routed_experts)
    extra[expert] = amount

    def fn(i: int, r: Route) -> None:
        if i == layer:
            r.add_selection(extra)

    with a.seams({"route": fn}):
        yield


@contextlib.contextmanager
def break_shared(model, layer: int, scale: float = 30.0) -> Iterator[None]:
    """Multiply one MoE layer's shared-expert output by ``scale``."""
    a = adapter_for(model)
    _check_layer(a, layer)
    if layer not in a.summary.moe_layers or not a.summary.n_shared_experts:
        raise ValueError(f"layer {layer} has no shared experts")

    def fn(i: int, out: torch.Tensor):
        return out * scale if i == layer else None

    with a.seams({"shared_out": fn}):
        yield


def _native(model, what: str):

    a = adapter_for(model)
    if not isinstance(a.module, Transformer):
        raise ValueError(f"{what} is implemented for the workbench's own Transformer only, not {a.summary.family}")
    return a


@contextlib.contextmanager
def inject_nan(model, layer: int, pos: int) -> Iterator[None]:
    """Make the residual stream after block ``layer`` NaN at position ``pos`` (our Transformer)."""

    a = _native(model, "inject_nan")
    _check_layer(a, layer)

    state = {"start": 0}

    def start(_m, args):
        state["start"] = int(args[1]) if len(args) > 1 else 0

    def poison(h: torch.Tensor, **_) -> torch.Tensor | None:
        i = pos - state["start"]
        if not 0 <= i < h.size(1):
            return None
        h = h.clone()
        h[:, i] = float("nan")
        return h

    block = a.module.layers[layer]
    handle = block.register_forward_pre_hook(start)
    try:
        with attach(a.module, {f"layers.{layer}.hook_resid_post": poison}):
            yield
    finally:
        handle.remove()


@contextlib.contextmanager
def corrupt_kv(model, layer: int, pos: int, scale: float = 30.0) -> Iterator[None]:
    """Multiply the KV latent that layer ``layer`` caches for position ``pos`` by ``scale`` (our Transformer):
    every later query attends to a corrupted entry."""
    a = _native(model, "corrupt_kv")
    _check_layer(a, layer)
    attn = a.module.layers[layer].attn
    state = {"start": 0}

    def start(_m, args):
        state["start"] = int(args[1])

    def scale_row(_m, _args, kv: torch.Tensor):  # kv_norm's output [B, T, C]: the latent to be cached
        i = pos - state["start"]
        if not 0 <= i < kv.size(1):
            return None
        kv = kv.clone()
        kv[:, i] = kv[:, i] * scale
        return kv

    handles = [attn.register_forward_pre_hook(start), attn.kv_norm.register_forward_hook(scale_row)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
