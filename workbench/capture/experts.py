"""Inside the routed experts: each chosen expert's output and the activations its down projection reads.

``expert_internals`` runs a layer's routed experts again on their input rows, for the (row, slot) pairs the
router chose, and returns per pair the L2 norm of the expert's own output (before its gate weight) and the
largest absolute value of its down projection's input (``act(gate x) * up x`` for a gated expert): the
"super expert" signal (arXiv 2507.23279). Two layouts are exact:

- one module per expert (``nn.ModuleList``: ours, older families): the expert is called as the model calls it,
  and a forward pre-hook on its down projection (``w2`` or ``down_proj``) reads the activation;
- fused transformers-5 experts (``@use_experts_implementation``: ``gate_up_proj`` / ``up_proj`` and
  ``down_proj`` as 3-D parameters, with the flags ``has_gate``, ``has_bias``, ``is_transposed`` and the class's
  own ``_apply_gate``): the math of transformers' generic implementation, one expert at a time.

Any other experts module gives None (``supported``), never a guessed number.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["expert_internals", "expert_outputs", "supported"]


def out_norm(y: torch.Tensor) -> torch.Tensor:
    """The super-expert signal's output side: each row's L2 norm of an expert's output [..., D] (float32)."""
    return y.float().norm(dim=-1)


def act_max(h: torch.Tensor) -> torch.Tensor:
    """Its activation side: each row's largest |value| of the down projection's input [..., I] (float32)."""
    return h.float().abs().amax(dim=-1)


def _down(module: nn.Module) -> nn.Module | None:
    for name in ("down_proj", "w2"):
        m = getattr(module, name, None)
        if isinstance(m, nn.Module):
            return m
    return None


def _fused(experts: nn.Module) -> bool:
    w = getattr(experts, "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj", None)
    return (hasattr(experts, "has_gate") and hasattr(experts, "_apply_gate") and isinstance(w, torch.Tensor)
            and w.ndim == 3 and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
            and experts.down_proj.ndim == 3 and not getattr(experts, "_is_expert_parallel", False))


def supported(experts: nn.Module | None) -> bool:
    """Whether ``expert_internals`` can compute this experts module exactly."""
    if experts is None:
        return False
    if isinstance(experts, nn.ModuleList):
        return len(experts) > 0 and all(_down(m) is not None for m in experts)
    return _fused(experts)


def _linear(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = h @ w if transposed else nn.functional.linear(h, w)
    return out if b is None else out + b


def _fused_expert(ex: nn.Module, e: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [n, D], down projection's input [n, I]) of fused expert ``e`` on rows ``x`` [n, D]."""
    tr, bias = getattr(ex, "is_transposed", False), getattr(ex, "has_bias", False)
    if ex.has_gate:
        h = _linear(x, ex.gate_up_proj[e], ex.gate_up_proj_bias[e] if bias else None, tr)
        h = ex._apply_gate(h)
    else:
        h = ex.act_fn(_linear(x, ex.up_proj[e], ex.up_proj_bias[e] if bias else None, tr))
    y = _linear(h, ex.down_proj[e], ex.down_proj_bias[e] if bias else None, tr)
    if getattr(ex, "has_post_expert_norm", False):
        y = ex.post_expert_norm(y)
    return y, h


@torch.no_grad()
def expert_internals(experts: nn.Module, x: torch.Tensor, indices: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per (row, slot) of ``indices`` [N, K]: (L2 norm of the chosen expert's output before its gate weight,
    largest |activation| of its down projection's input), both [N, K] float32 on the CPU, from the experts'
    input rows ``x`` [N, D]. Slots naming no real expert (a skip expert) are NaN. None when the experts module
    is not one ``supported`` knows."""
    got = _each(experts, x, indices, keep=False)
    return None if got is None else (got[0], got[1])


@torch.no_grad()
def expert_outputs(experts: nn.Module, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
    """Per (row, slot) of ``indices`` [N, K]: the chosen expert's output before its gate weight, [N, K, D]
    float32 on the CPU (NaN for a slot naming no real expert); None when the module is not ``supported``."""
    got = _each(experts, x, indices, keep=True)
    return None if got is None else got[2]


def _each(experts: nn.Module, x: torch.Tensor, indices: torch.Tensor, keep: bool):
    """(output norms [N, K], largest down-projection inputs [N, K], outputs [N, K, D] or None)."""
    if not supported(experts):
        return None
    n_e = len(experts) if isinstance(experts, nn.ModuleList) else experts.down_proj.size(0)
    p = next(experts.parameters())
    x = x.to(p.device, p.dtype)
    idx = indices.to(p.device)
    norm = torch.full(idx.shape, float("nan"), device=p.device)
    act = torch.full(idx.shape, float("nan"), device=p.device)
    outs = torch.full((*idx.shape, x.size(-1)), float("nan"), device=p.device) if keep else None
    for e in idx.unique().tolist():
        if not 0 <= e < n_e:
            continue
        rows, slot = torch.where(idx == e)
        if isinstance(experts, nn.ModuleList):
            seen: list[torch.Tensor] = []
            h = _down(experts[e]).register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
            try:
                y = experts[e](x[rows])
                y = y[0] if isinstance(y, tuple) else y
            finally:
                h.remove()
            a = seen[0]
        else:
            y, a = _fused_expert(experts, e, x[rows])
        norm[rows, slot] = out_norm(y)
        act[rows, slot] = act_max(a)
        if keep:
            outs[rows, slot] = y.float()
    return norm.cpu(), act.cpu(), None if outs is None else outs.cpu()
