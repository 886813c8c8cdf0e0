"""Fault injection: context managers that break one head, one expert or one router, temporarily.

They exist to prove that root cause finds real culprits (``benchmarks/root_cause_eval.py``): break a
known component, record, and check that the ranking names it. Each fault is a hook on the model's
``hook_*`` points (or, for the router, a temporary change of the gate's selection bias) and is undone
when the block exits, whatever happens inside it.

    with break_head(model, layer=2, head=1):
        run = workbench.record("def f(x):", model=model)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from workbench.model import MoE
from workbench.probes import attach


def _check_layer(model: nn.Module, layer: int) -> None:
    n = len(model.layers)
    if not 0 <= layer < n:
        raise ValueError(f"layer {layer} out of range: the model has layers 0..{n - 1}")


def _moe(model: nn.Module, layer: int) -> MoE:
    _check_layer(model, layer)
    ffn = model.layers[layer].ffn
    if not isinstance(ffn, MoE):
        raise ValueError(f"layer {layer} is a dense layer (no experts, no router); "
                         f"MoE layers are {[i for i, l in enumerate(model.layers) if isinstance(l.ffn, MoE)]}")
    return ffn


def _check_expert(ffn: MoE, expert: int) -> None:
    if not 0 <= expert < ffn.n_routed_experts:
        raise ValueError(f"expert {expert} out of range: the layer has experts 0..{ffn.n_routed_experts - 1}")


@contextlib.contextmanager
def break_head(model: nn.Module, layer: int, head: int, scale: float = 30.0, noise: float = 0.0,
               seed: int = 0) -> Iterator[None]:
    """Multiply one attention head's output (``hook_z``, before ``wo``) by ``scale`` and add noise.

    Args:
        scale: factor on the head's per-token output; large values make it swamp the residual stream.
        noise: standard deviation of Gaussian noise added to it (relative to the head output's RMS).
    """
    _check_layer(model, layer)
    n_heads = model.layers[layer].attn.n_heads
    if not 0 <= head < n_heads:
        raise ValueError(f"head {head} out of range: layer {layer} has heads 0..{n_heads - 1}")
    gen = torch.Generator().manual_seed(seed)

    def fn(z: torch.Tensor, **_) -> torch.Tensor:  # [B, T, H, v]
        z = z.clone()
        h = z[:, :, head] * scale
        if noise:
            rms = h.pow(2).mean().sqrt().clamp(min=1e-6)
            h = h + noise * rms * torch.randn(h.shape, generator=gen).to(h)
        z[:, :, head] = h
        return z

    with attach(model, {f"layers.{layer}.attn.hook_z": fn}):
        yield


@contextlib.contextmanager
def break_expert(model: nn.Module, layer: int, expert: int, scale: float = 30.0) -> Iterator[None]:
    """Multiply one routed expert's output (``experts.{j}.hook_out``, [N_j, D]) by ``scale``."""
    _check_expert(_moe(model, layer), expert)

    def fn(out: torch.Tensor, **_) -> torch.Tensor:
        return out * scale

    with attach(model, {f"layers.{layer}.ffn.experts.{expert}.hook_out": fn}):
        yield


@contextlib.contextmanager
def bias_router(model: nn.Module, layer: int, expert: int, amount: float = 1.0) -> Iterator[None]:
    """Add ``amount`` to one expert's selection bias, so the router sends (nearly) every token to it.

    The gate's own ``bias`` buffer is changed (and restored on exit) rather than ``hook_selection``:
    the bias acts before group-limited routing, so the favoured expert's group is chosen too. Gate
    weights still come from the raw scores, exactly as with a mis-trained balancing bias.
    """
    ffn = _moe(model, layer)
    _check_expert(ffn, expert)
    bias = ffn.gate.bias
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            bias[expert] += amount
        yield
    finally:
        with torch.no_grad():
            bias.copy_(saved)
