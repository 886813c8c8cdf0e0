"""Attaching functions to a model's ``hook_*`` points, temporarily by construction.

    with attach(model, {"layers.1.ffn.gate.hook_indices": fn}):
        model(tokens)

``fn(tensor, **info)`` sees the value flowing through the point (``info`` holds keyword arguments such
as ``q_start``); returning a tensor replaces the value (an intervention), returning None observes.
Hooks are removed when the block exits, whatever happens inside it.
"""
from __future__ import annotations

import contextlib
import fnmatch
from typing import Callable, Iterator

from torch import nn


def hook_points(model: nn.Module, pattern: str = "*") -> dict[str, nn.Module]:
    """Module paths of the model's hook points matching a glob, e.g. ``layers.*.attn.hook_attn_probs``."""
    return {name: mod for name, mod in model.named_modules()
            if name.rsplit(".", 1)[-1].startswith("hook_") and fnmatch.fnmatchcase(name, pattern)}


@contextlib.contextmanager
def attach(model: nn.Module, hooks: dict[str, Callable]) -> Iterator[None]:
    """Register ``{path or glob: fn}`` on matching hook points for the duration of the block."""
    handles = []
    try:
        for pattern, fn in hooks.items():
            points = hook_points(model, pattern)
            if not points:
                raise KeyError(f"no hook point matches {pattern!r}")
            for name, mod in points.items():
                def hook(_mod, args, kwargs, output, fn=fn, name=name):
                    return fn(output, name=name, **kwargs)
                handles.append(mod.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
