"""MoE observability workbench: record a Mixture-of-Experts model's signals into DuckDB, then look.

    import workbench
    run = workbench.record("def fibonacci(n):", max_new_tokens=32)
    run.tokens()            # polars frame: confidence of every token
    wb = workbench.open()   # the default database
    wb.runs()

The rooms (docs/architecture.md): ``workbench.data`` (declarations, schema, store, query: no torch),
``workbench.capture`` (adapters, probes, recorder), ``workbench.analysis``, ``workbench.views``, and
``workbench.run`` on top. Re-exports what a notebook needs from ``model`` and ``probes`` too.
"""
from __future__ import annotations

import importlib

from workbench.data.query import RunNotFound
from workbench.data.signals import PROBES, REGISTRY
from workbench.data.store import Store, StoreError, TraceStore, default_db
from workbench.data.summary import ModelSummary
from workbench.run import Batch, Run, Workbench, open, record, record_many

# Names whose modules import torch are loaded on first use (PEP 562): reading a stored run needs no torch.
_LAZY = {
    "ModelArgs": "workbench.model", "Transformer": "workbench.model", "generate": "workbench.model",
    "load_checkpoint": "workbench.model", "load_tokenizer": "workbench.model",
    "attach": "workbench.probes", "hook_points": "workbench.probes",
    "Adapter": "workbench.capture.adapters", "load_adapter": "workbench.capture.adapters",
    "profile": "workbench.analysis.baseline",
}
_MODULES = {"faults": "workbench.analysis.faults", "tiny": "workbench.capture.tiny",
            "interventions": "workbench.interventions", "model": "workbench.model", "probes": "workbench.probes"}
# ``workbench.capture(model, inputs, names, max_bytes=...)``: the capture room's package is itself callable (its
# name is the function's; workbench/capture/__init__.py), so it needs no entry here and loads torch only when called

__all__ = ["Adapter", "Batch", "ModelArgs", "ModelSummary", "PROBES", "REGISTRY", "Run", "RunNotFound", "Store",
           "StoreError", "Transformer", "Workbench", "attach", "capture", "default_db", "generate", "hook_points", "load_adapter",
           "load_checkpoint", "load_tokenizer", "open", "profile", "record", "record_many", "TraceStore"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    globals()[name] = value
    return value
