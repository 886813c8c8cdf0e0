"""The neutral model summary: what every consumer knows of a run's model (no family-specific config keys)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ModelSummary:
    """The facts about a model that every consumer reads (stored as JSON in ``runs.summary``).

    ``moe_layers`` lists the blocks whose routing is recorded; ``unrouted_layers`` those that hold
    experts no adapter recognised (recorded without routing, and said so in ``notes``).
    """

    family: str
    backend: str  # native | transformers
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    moe_layers: list[int] = field(default_factory=list)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    top_k: int = 0
    selection_bias: bool = False
    unrouted_layers: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers or self.unrouted_layers)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSummary":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def describe(self) -> str:
        """One line for a header: "mixtral, 2 layers x 4 heads, MoE in 2 layers: 8 experts top-2"."""
        s = f"{self.family}, {self.n_layers} layers x {self.n_heads} heads"
        if self.moe_layers:
            s += f", MoE in {len(self.moe_layers)} layers: {self.n_routed_experts} experts top-{self.top_k}"
            if self.n_shared_experts:
                s += f" + {self.n_shared_experts} shared"
        if self.unrouted_layers:
            s += f", unrecognised MoE blocks in layers {self.unrouted_layers} (no routing recorded)"
        elif not self.moe_layers:
            s += ", dense"
        return s
