"""``workbench.capture(model, inputs, names, max_bytes=...)``: the named modules' outputs of one forward, as
tensors, without a store (TransformerLens' ``run_with_cache``, nnsight's ``.save()``).

    acts = workbench.capture(folder, "def f(x):", ["model.layers.*.mlp", "model.layers.1.self_attn"])
    acts["model.layers.0.mlp"]          # [1, T, D], detached

Names are module paths or globs, resolved as ``workbench.probes.attach`` resolves them (the ``hook_*`` points of
our ``Transformer`` first, else any module path of any ``nn.Module``). Each module's main output is kept (the
tensor, or the first tensor of a tuple), detached. A module run more than once in the forward (a chunked
attention hook point, a looped layer) keeps every call: the first under its path, the k-th under
``path#k``. The outputs kept are counted as they arrive: past ``max_bytes`` the forward stops with
``CaptureTooLarge``, one line naming the bytes and the cap.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from workbench.capture.adapters import Adapter, adapter_for, load_adapter
from workbench.capture.resolve import tokenizer_for
from workbench.probes.hooks import hook_points, main_output, resolve

MAX_BYTES = 1 << 30  # 1 GiB of kept outputs by default


class CaptureTooLarge(MemoryError):
    """The outputs asked for would hold more bytes than the cap (``max_bytes``)."""


def _size(n: int) -> str:
    return f"{n:,} bytes" + (f" ({n / 2**20:.1f} MiB)" if n >= 2**20 else "")


def _model(model) -> tuple[nn.Module, Adapter | None]:
    """The module to run and its adapter (None for a module no adapter knows: it is called as ``module(ids)``)."""
    if model is None or isinstance(model, (str, Path)):
        adapter = load_adapter(model)
        return adapter.module, adapter
    if isinstance(model, Adapter):
        return model.module, model
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture takes a module, an adapter or a checkpoint folder, not a {type(model).__name__}")
    try:
        return model, adapter_for(model)
    except TypeError:  # a module of the user's own: called as it is
        return model, None


def _ids(inputs, model, adapter: Adapter | None, tokenizer) -> torch.Tensor:
    """``inputs`` as token ids [B, T]: a string (encoded with the model's tokenizer), ids, or a tensor."""
    text = isinstance(inputs, str)
    if text:
        if adapter is None and tokenizer is None:
            raise TypeError("a string needs a tokenizer: pass tokenizer= (or token ids) for a module no adapter knows")
        inputs = tokenizer_for(adapter, tokenizer).encode(inputs).ids
    ids = inputs if isinstance(inputs, torch.Tensor) else torch.tensor(inputs)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise ValueError(f"inputs must be a string or token ids [T] / [B, T], got shape {tuple(ids.shape)} "
                         f"of {ids.dtype}")
    vocab = adapter.summary.vocab_size if adapter is not None else None
    if vocab is not None and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise ValueError(f"token ids {int(ids.min())}..{int(ids.max())} do not fit the model's vocabulary of {vocab}"
                         + (" (the text was encoded with a tokenizer larger than the model's: pass tokenizer=)"
                            if isinstance(inputs, list) and text else ""))
    return ids.long()


def capture(model, inputs, names: str | Iterable[str] | None = None, *, max_bytes: int | None = MAX_BYTES,
            tokenizer=None) -> dict[str, torch.Tensor]:
    """The outputs of the modules ``names`` match during one forward of ``inputs`` (no gradients, no store).

    Args:
        model: a loaded module (ours, a ``transformers`` model, or any ``nn.Module`` taking ids), an adapter, a
            checkpoint folder, or None for the bundled demo.
        inputs: text (encoded with the model's tokenizer, ``tokenizer=`` to choose it), token ids, or a tensor
            [T] or [B, T].
        names: module paths or globs (``"model.layers.*.mlp"``), one or several; None: every hook point (for a
            model without any, every module).
        max_bytes: the most bytes the kept outputs may hold; None: no cap. Past it: ``CaptureTooLarge``.
    Returns: ``{module path: output}``, detached, in the order the modules ran.
    Raises:
        KeyError: a name matches no module. CaptureTooLarge: the outputs would pass ``max_bytes``.
    """
    module, adapter = _model(model)
    ids = _ids(inputs, module, adapter, tokenizer)
    patterns = ["*"] if names is None else [names] if isinstance(names, str) else list(names)
    targets: dict[str, nn.Module] = {}
    for p in patterns:
        got = hook_points(module, p) if names is None else resolve(module, p)
        if not got:
            raise KeyError(f"no hook point or module path of {type(module).__name__} matches {p!r} "
                           "(workbench.hook_points(model) lists them)")
        targets.update(got)
    out: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    held = [0]

    def keep(name: str, value) -> None:
        t = main_output(value)
        if t is None:
            return
        k = calls.get(name, 0)
        calls[name] = k + 1
        held[0] += t.numel() * t.element_size()
        if max_bytes is not None and held[0] > max_bytes:
            raise CaptureTooLarge(f"capture would hold {_size(held[0])}, over max_bytes={max_bytes:,}, at {name}: "
                                  "name fewer modules or pass a larger max_bytes")
        out[name if k == 0 else f"{name}#{k}"] = t.detach()

    handles = [m.register_forward_hook(lambda _m, _a, o, name=name: keep(name, o)) for name, m in targets.items()]
    try:
        with torch.no_grad():
            if adapter is None:
                p = next(module.parameters(), None)
                module(ids if p is None else ids.to(p.device))
            else:
                with adapter._without_cache():
                    adapter.forward(ids.to(adapter.device))
    finally:
        for h in handles:
            h.remove()
    return out

