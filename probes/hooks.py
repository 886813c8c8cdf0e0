"""Attaching functions to a model's modules, temporarily by construction.

    with attach(model, {"layers.1.ffn.gate.hook_indices": fn}):
        model(tokens)
    with attach(hf_model, {"model.layers.*.mlp": fn}):   # any module path or glob, of any nn.Module
        hf_model(tokens)

A pattern is matched against the model's ``hook_*`` points first (our ``Transformer``); a pattern that matches
none of them is matched against every module path (``named_modules``), so a ``transformers`` model's
``model.layers.3.mlp`` or ``model.layers.*.self_attn`` works the same way.

``fn(tensor, **info)`` sees the value flowing out of the module: at a hook point the value itself (``info``
holds keyword arguments such as ``q_start``), at a plain module its main output (the tensor, or the first of
the tuple a ``transformers`` layer returns); ``info`` always holds ``name``, the module's path. Returning a
tensor replaces the value (an intervention), returning None observes. Hooks are removed when the block exits,
whatever happens inside it.
"""
from __future__ import annotations

import contextlib
import fnmatch
from typing import Callable, Iterator

import torch
from torch import nn


def _is_point(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("hook_")


def hook_points(model: nn.Module, pattern: str = "*", modules: bool | None = None) -> dict[str, nn.Module]:
    """Module paths matching a glob, e.g. ``layers.*.attn.hook_attn_probs``: the model's ``hook_*`` points; a
    model that has none (a ``transformers`` model) lists every module path (``model.layers.0.mlp``, ...).

    ``modules``: True lists every module path whatever the model; False only ``hook_*`` points."""
    named = [(name, mod) for name, mod in model.named_modules() if name]
    if modules is None:
        modules = not any(_is_point(name) for name, _ in named)
    return {name: mod for name, mod in named
            if (modules or _is_point(name)) and fnmatch.fnmatchcase(name, pattern)}


def resolve(model: nn.Module, pattern: str) -> dict[str, nn.Module]:
    """What ``pattern`` names in ``model``: its matching ``hook_*`` points, else every module path it matches."""
    return hook_points(model, pattern, modules=False) or hook_points(model, pattern, modules=True)


def main_output(out) -> torch.Tensor | None:
    """A module's main output: the tensor itself, or the first tensor of a tuple / list / model output."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):  # a transformers ModelOutput
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


def _replace_main(out, new: torch.Tensor):
    if isinstance(out, torch.Tensor):
        return new
    if isinstance(out, (tuple, list)):
        i = next(i for i, o in enumerate(out) if isinstance(o, torch.Tensor))
        return type(out)((*out[:i], new, *out[i + 1:])) if isinstance(out, tuple) else [*out[:i], new, *out[i + 1:]]
    raise TypeError(f"cannot replace the output of type {type(out).__name__}")


@contextlib.contextmanager
def attach(model: nn.Module, hooks: dict[str, Callable]) -> Iterator[None]:
    """Register ``{path or glob: fn}`` on matching hook points (or, for a pattern matching none, on the modules
    whose path it matches) for the duration of the block. A pattern that matches nothing is a KeyError."""
    handles = []
    try:
        for pattern, fn in hooks.items():
            points = hook_points(model, pattern, modules=False)
            plain = not points
            if plain:
                points = hook_points(model, pattern, modules=True)
            if not points:
                raise KeyError(f"no hook point or module path matches {pattern!r}")
            for name, mod in points.items():
                if plain:
                    def hook(_mod, _args, output, fn=fn, name=name):
                        main = main_output(output)
                        if main is None:
                            return None
                        new = fn(main, name=name)
                        return None if new is None else _replace_main(output, new)
                    handles.append(mod.register_forward_hook(hook))
                else:
                    def point(_mod, args, kwargs, output, fn=fn, name=name):
                        return fn(output, name=name, **kwargs)
                    handles.append(mod.register_forward_hook(point, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
