"""MoE observability workbench: record a Mixture-of-Experts model's signals into DuckDB, then look.

    import workbench
    run = workbench.record("def fibonacci(n):", max_new_tokens=32)
    run.tokens()            # polars frame: confidence of every token
    wb = workbench.open()   # the default database
    wb.runs()

Re-exports what a notebook needs from ``model`` and ``probes`` too.
"""
from workbench.model import (ModelArgs, Transformer, generate, load_checkpoint, load_tokenizer)  # noqa: F401
from workbench.probes import attach, hook_points  # noqa: F401

from workbench.capture.adapters import Adapter, ModelSummary, load_adapter
from workbench.analysis.baseline import profile
from workbench.data.query import RunNotFound
from workbench.run import Batch, Run, Workbench, open, record, record_many
from workbench.data.signals import PROBES, REGISTRY
from workbench.data.store import Store, StoreError, TraceStore, default_db

__all__ = ["Adapter", "Batch", "ModelArgs", "ModelSummary", "PROBES", "REGISTRY", "Run", "RunNotFound", "Store",
           "StoreError", "Transformer", "Workbench", "attach", "default_db", "generate", "hook_points", "load_adapter",
           "load_checkpoint", "load_tokenizer", "open", "profile", "record", "record_many", "TraceStore"]
