"""Router arithmetic shared by every adapter: scores, the selection top-k chooses by, and mixing weights.

Every top-k MoE router in the families we read is one point of this small space: a score function
over the router logits (softmax or sigmoid; gpt-oss's softmax over the top-k logits is the same rule as a
softmax over all experts renormalised over the chosen ones), an optional selection bias
(DeepSeek-V3's aux-loss-free balancing term) that moves the choice but not the weights, optional
group-limited routing (DeepSeek-V2/V3), optional renormalisation of the chosen weights, and a scale.
Adapters describe their routers with a ``RouterMath`` and *check* it against the router module's own
output when they load (``matches``), so the margin we record and the re-routing that root cause and
fault injection do are the router's real arithmetic, not a guess.

Dimension letters: N routed rows (tokens), E routed experts, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# identity: the router hands out probabilities itself; sqrtsoftplus: DeepSeek-V4's sqrt(softplus(logits))
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus", "identity")


@dataclass
class RouterMath:
    """One layer's routing rule.

    Attributes:
        n_experts, top_k: E and K.
        score: "softmax" or "sigmoid" of the logits.
        bias: selection bias [E] added to the scores for the choice only (None: no bias).
        n_group, topk_group, group_score: group-limited routing; a group's score is its best expert
            ("max", DeepSeek-V2) or the sum of its two best ("top2", DeepSeek-V3).
        norm: renormalise the chosen weights to sum to 1; eps is added to that denominator.
        scale: multiplies the weights (routed_scaling_factor / route_scale).
        bias_on: "scores" (the bias is added to the scores) or "logits" (added to the logits before the score
            function: the choice ranks score(logits + bias)).
        expert_scale: [E] multiplies each chosen expert's weight (Gemma 4's per-expert scale), or None.
        exact: False when no rule of this space reproduced the router (its selection is observed as the experts
            receive it; scores and margins then use this rule as an approximation, and re-routing is not the
            router's own).
    """

    n_experts: int
    top_k: int
    score: str = "softmax"
    bias: torch.Tensor | None = None
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    norm: bool = True
    eps: float = 0.0
    scale: float = 1.0
    bias_on: str = "scores"
    expert_scale: torch.Tensor | None = None
    exact: bool = True

    def __post_init__(self) -> None:
        if self.score not in SCORE_FUNCS:
            raise ValueError(f"unknown router score function {self.score!r}; known: {SCORE_FUNCS}")

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw per-expert scores [N, E]."""
        logits = logits.float()
        if self.score == "identity":
            return logits
        if self.score == "sqrtsoftplus":
            return torch.nn.functional.softplus(logits).sqrt()
        return logits.sigmoid() if self.score == "sigmoid" else logits.softmax(dim=-1)

    def basis(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """What the top-k ranks by, before groups: scores + selection bias."""
        b = self.bias if bias is None else bias
        if b is not None and self.bias_on == "logits":
            return self.scores(logits.float() + b.to(logits.device, torch.float32))
        base = self.scores(logits)
        return base if b is None else base + b.to(base.device, base.dtype)

    def selection(self, logits: torch.Tensor, bias: torch.Tensor | None = None,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
        """Selection scores [N, E]: ``basis``, -inf for experts outside the chosen groups or not in ``keep``.

        Args:
            bias: replaces the layer's selection bias ([E] or [N, E]); zeros remove it.
            keep: [N, E] bool (or 0/1), False removes an expert from the choice (it no longer exists).
        """
        sel = self.basis(logits, bias)
        if keep is not None:
            sel = sel.masked_fill(~keep.to(sel.device).bool(), float("-inf"))
        if self.n_group > 1:
            grouped = sel.view(sel.size(0), self.n_group, -1)  # [N, G, E/G]
            if self.group_score == "top2":
                g = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                g = grouped.amax(dim=-1)
            chosen = g.topk(self.topk_group, dim=-1)[1]  # [N, topk_group]
            outside = torch.ones_like(g, dtype=torch.bool).scatter_(1, chosen, False)
            sel = grouped.masked_fill(outside.unsqueeze(-1), float("-inf")).flatten(1)
        return sel

    def select(self, logits: torch.Tensor, bias: torch.Tensor | None = None,
               keep: torch.Tensor | None = None) -> torch.Tensor:
        """The experts chosen [N, K]."""
        return self.selection(logits, bias, keep).topk(self.top_k, dim=-1)[1]

    def weights_for(self, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Mixing weights [N, K] of the experts ``indices`` (differentiable in ``logits``)."""
        w = self.scores(logits).gather(1, indices)
        if self.norm:
            w = w / (w.sum(dim=-1, keepdim=True) + self.eps)
        if self.expert_scale is not None:
            w = w * self.expert_scale.to(w.device, w.dtype)[indices]
        return w * self.scale

    def route(self, logits: torch.Tensor, bias: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [N, K], weights [N, K]) as the router would produce them."""
        idx = self.select(logits, bias, keep)
        return idx, self.weights_for(logits, idx)

    def matches(self, logits: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, atol: float = 1e-5) -> bool:
        """True when this rule reproduces a router's own (indices, weights) on ``logits`` (as sets per row)."""
        idx, w = self.route(logits)
        mine = _by_expert(idx, w, self.n_experts)
        theirs = _by_expert(indices, weights.float(), self.n_experts)
        return bool(torch.allclose(mine, theirs, atol=atol, rtol=1e-4))


def _by_expert(indices: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[N, E] weight per expert (0 where not chosen): compares two selections whatever their slot order."""
    out = torch.zeros(indices.size(0), n_experts, dtype=torch.float32, device=indices.device)
    return out.scatter_add_(1, indices.long(), weights.float().to(out.device))
