"""Probes: hook attachment and pure reductions of captured tensors into small columnar records."""
from .hooks import attach, hook_points
from .signals import (
                      attention_received,
                      attention_row_stats,
                      attention_stats,
                      kv_token_norms,
                      routing_records,
                      token_confidence,
)

__all__ = ["attach", "attention_received", "attention_row_stats", "attention_stats", "hook_points", "kv_token_norms",
           "routing_records", "token_confidence"]
