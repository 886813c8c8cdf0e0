"""MoE observability workbench: record a DeepSeek-V3-style model's signals into DuckDB, then look.

    import workbench
    run = workbench.record("def fibonacci(n):", max_new_tokens=32)
    run.tokens()            # polars frame: confidence of every token
    wb = workbench.open()   # the default database
    wb.runs()

Re-exports what a notebook needs from ``model`` and ``probes`` too.
"""
from workbench.model import (ModelArgs, Transformer, generate, load_checkpoint, load_tokenizer)  # noqa: F401
from workbench.probes import attach, hook_points  # noqa: F401

from .query import RunNotFound
from .recorder import PROBES, record
from .run import Run, Workbench, open
from .store import Store, StoreError, default_db

__all__ = ["ModelArgs", "PROBES", "Run", "RunNotFound", "Store", "StoreError", "Transformer", "Workbench",
           "attach", "default_db", "generate", "hook_points", "load_checkpoint", "load_tokenizer", "open",
           "record"]
