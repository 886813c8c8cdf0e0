"""Model adapters: the one interface through which the workbench runs and opens up a model.

``load_adapter`` turns what a user passes as ``model=`` (None for the bundled demo, a checkpoint folder,
a loaded module, or an adapter) into an ``Adapter``: ``NativeAdapter`` for our ``Transformer`` (and
DeepseekV3 folders, which load into it unless ``backend="transformers"``), ``HFAdapter`` for any
``transformers`` causal LM.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from workbench.capture.preflight import check_config
from workbench.model import Transformer, load_checkpoint

from .base import SEAMS, Adapter, ModelSummary, Route
from .hf import HFAdapter, folder_model_type, load_hf
from .native import NativeAdapter
from .routing import RouterMath

BACKENDS = ("auto", "native", "transformers")
NATIVE_TYPES = ("deepseek_v3",)  # transformers model types that load into our own Transformer

__all__ = ["BACKENDS", "SEAMS", "Adapter", "HFAdapter", "ModelSummary", "NativeAdapter", "Route", "RouterMath",
           "adapter_for", "load_adapter", "uses_transformers"]


def uses_transformers(path: str | Path, backend: str = "auto") -> bool:
    """True when the folder at ``path`` runs through ``transformers`` under ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    mt = folder_model_type(path)
    if backend == "transformers":
        if mt is None:
            raise ValueError(f"{path} is a workbench checkpoint, not a transformers folder (no model_type in "
                             "config.json): use backend='native'")
        return True
    if backend == "native":
        if mt is not None and mt not in NATIVE_TYPES:
            raise ValueError(f"model_type {mt!r} cannot load into the native Transformer (only {NATIVE_TYPES})")
        return False
    return mt is not None and mt not in NATIVE_TYPES


def adapter_for(module) -> Adapter:
    """The adapter of an already loaded model (an ``Adapter`` is returned as it is)."""

    if isinstance(module, Adapter):
        return module
    cached = getattr(module, "_workbench_adapter", None)  # set by the adapter: one per module
    if isinstance(cached, Adapter) and cached.module is module:
        return cached
    if isinstance(module, Transformer):
        return NativeAdapter(module)
    if isinstance(module, nn.Module) and hasattr(module, "config") and hasattr(module.config, "model_type"):
        path = getattr(module, "name_or_path", None)
        return HFAdapter(module, path if path and Path(path).is_dir() else None)
    raise TypeError(f"cannot record a {type(module).__name__}: pass a workbench Transformer, a transformers "
                    "causal LM, or a checkpoint folder")


def load_adapter(model=None, dtype: torch.dtype | None = None, device: str = "cpu", backend: str = "auto",
                 device_map=None) -> Adapter:
    """An adapter for None (bundled demo), a checkpoint folder (ours or Hugging Face), a module or an adapter.

    Args:
        dtype: load (or cast an in-memory module) to this dtype.
        backend: "auto" (DeepseekV3 folders natively, other model types through transformers),
            "native" or "transformers".
        device_map: a transformers folder placed across devices by accelerate ("auto", or {module: device});
            such a folder always runs through transformers.
    """

    if device_map is not None and (model is None or not isinstance(model, (str, Path)) or backend == "native"):
        raise ValueError("device_map applies to a transformers checkpoint folder (backend auto or transformers); "
                         "place an in-memory module yourself")
    if model is None or isinstance(model, (str, Path)):
        if model is not None and not Path(model).exists():
            raise FileNotFoundError(f"no model at {model}: pass a checkpoint folder (config.json + *.safetensors)")
        if model is not None:  # types, ranges and size against memory, before anything is built
            check_config(model, str(dtype).removeprefix("torch.") if dtype is not None else None, device_map)
        if model is not None and (device_map is not None or uses_transformers(model, backend)):
            return load_hf(model, dtype=dtype, device=device, device_map=device_map)
        return NativeAdapter(load_checkpoint(Path(model) if model else None, dtype=dtype or torch.float32,
                                             device=device))
    adapter = adapter_for(model)
    if dtype is not None and adapter.dtype != dtype:
        adapter.module.to(dtype)
    return adapter
