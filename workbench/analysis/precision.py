"""What-if: precision sensitivity of a recorded run (``Run.precision_probe``).

**Precision sensitivity** (``precision_probe``): the run's recorded tokens re-run teacher-forced with
one layer's weights, activations and KV cache fake-quantized (per-tensor max-abs scaling), one layer
at a time (and all layers together), against the unquantized forward. The fake-quantization
functions are pure and live in ``FAKE_QUANT`` below.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import polars as pl
import torch
from torch import nn

from workbench.capture.adapters import adapter_for

# -- precision sensitivity: fake quantization (pure) -----------------------------------------------

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448 (the seeds round it to 440)
INT8_MAX = 127


def _amax(x: torch.Tensor) -> torch.Tensor:
    """Largest finite |x| (0 when there is none)."""
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax() if a.numel() else torch.zeros(())


def fake_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 round trip with a per-tensor max-abs scale: ``x * s`` -> float8_e4m3fn -> ``/ s``,
    ``s = 448 / max|x|`` (the largest |x| maps to the format's largest value). Exact for tensors whose
    scaled values are E4M3 numbers (3 mantissa bits), e.g. ones whose max-abs is 448."""
    xf = x.float()
    amax = _amax(xf)
    if amax == 0:
        return x.clone()
    s = FP8_E4M3_MAX / amax
    q = (xf * s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q / s).to(x.dtype)


def fake_int8(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 round trip with a per-tensor max-abs scale: ``q = clamp(round(x / s), -127, 127)``,
    ``s = max|x| / 127``, back to ``q * s``. Exact for integer multiples of ``max|x| / 127``."""
    xf = x.float()
    amax = _amax(xf)
    if amax == 0:
        return x.clone()
    s = amax / INT8_MAX
    q = torch.clamp(torch.round(xf / s), -INT8_MAX, INT8_MAX)
    return (q * s).to(x.dtype)


def fake_bf16(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 round trip (round to nearest even; 8 bits of mantissa, fp32's range: no scale needed)."""
    return x.to(torch.bfloat16).to(x.dtype)


def fake_fp32(x: torch.Tensor) -> torch.Tensor:
    """float32 round trip: exact for fp32, bf16 and fp16 models (the control: changes nothing)."""
    return x.to(torch.float32).to(x.dtype)


FAKE_QUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp8_e4m3": fake_fp8_e4m3, "int8": fake_int8, "bf16": fake_bf16, "fp32": fake_fp32}
PARTS = ("weights", "activations", "kv")
PRECISION_COLUMNS = {"layer": pl.Int64, "format": pl.String, "rel_l2": pl.Float64, "delta_nll": pl.Float64,
                     "top1_agreement": pl.Float64}


@contextlib.contextmanager
def quantized(adapter, layer: int, fq: Callable[[torch.Tensor], torch.Tensor],
              parts: Sequence[str] = PARTS) -> Iterator[None]:
    """Fake-quantize block ``layer`` for the duration: its weights (every >= 2-D parameter but the router's;
    stacked 3-D expert weights per expert), the inputs of its linear layers (and of fused expert modules),
    and what it caches (``adapter.quantize_kv``: our MLA's latent and rope key, a transformers model's keys
    and values, as the attention reads them back). Weights are restored on exit. What the block holds comes
    from ``adapter.quantization_points``; the KV part needs ``adapter.teacher_forcing``'s forwards."""
    bad = set(parts) - set(PARTS)
    if bad:
        raise ValueError(f"unknown parts {sorted(bad)}; choose from {PARTS}")
    pts = adapter.quantization_points(layer)
    skip = {id(p) for r in pts.full_precision for p in r.parameters()}
    skip_mods = {id(m) for r in pts.full_precision for m in r.modules()}
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = []
    with contextlib.ExitStack() as stack:
        try:
            if "weights" in parts:
                with torch.no_grad():
                    for p in pts.block.parameters():
                        if p.ndim < 2 or id(p) in skip:
                            continue
                        saved.append((p, p.detach().clone()))
                        q = torch.stack([fq(w) for w in p.detach()]) if p.ndim == 3 else fq(p.detach())
                        p.copy_(q)
            if "activations" in parts:
                def pre(_m, args, kwargs):
                    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                        return (fq(args[0]), *args[1:]), kwargs
                    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
                        return args, {**kwargs, "hidden_states": fq(kwargs["hidden_states"])}
                    return None
                mods = [m for m in pts.block.modules() if isinstance(m, nn.Linear) and id(m) not in skip_mods]
                mods += pts.fused_experts
                handles += [m.register_forward_pre_hook(pre, with_kwargs=True) for m in mods]
            if "kv" in parts:
                stack.enter_context(adapter.quantize_kv(layer, fq))
            yield
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for p, old in saved:
                    p.copy_(old)


def _compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor, ref_nll: torch.Tensor) -> tuple:
    """(relative L2 of the logits, mean NLL change, top-1 agreement) over the predicting positions."""
    rel = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-30))
    nll = -torch.log_softmax(got, -1).gather(-1, targets[:, None])[:, 0]
    return rel, float((nll - ref_nll).mean()), float((got.argmax(-1) == ref.argmax(-1)).double().mean())


def precision_probe(adapter, ids: Sequence[int], formats: Sequence = ("fp8_e4m3", "int8", "bf16"),
                    layers: Sequence[int] | None = None, parts: Sequence[str] = PARTS,
                    all_layers: bool = True) -> pl.DataFrame:
    """How much each layer's output suffers when it runs in a lower precision, on the recorded tokens.

    Teacher-forced: one forward over ``ids`` (the run's tokens, prompt and generated) as the reference,
    then per format and per layer the same forward with that layer fake-quantized (``quantized``), and,
    with ``all_layers``, every layer at once (``layer`` null).

    Args:
        adapter: the model (``run.adapter()``; a loaded module is taken through its adapter).
        formats: names in ``FAKE_QUANT`` or callables ``tensor -> tensor`` (named by ``__name__``).
        layers: blocks to probe (default all).
        parts: any of ``"weights"``, ``"activations"``, ``"kv"``.

    Returns ``layer, format, rel_l2, delta_nll, top1_agreement``: the relative L2 distance of the final
    logits from the reference's (all predicting positions 0..T-2), the mean change of the recorded tokens'
    negative log-likelihood in nats (positive: the format hurts), and the share of positions whose argmax
    stays the reference's.
    """
    adapter = adapter_for(adapter)
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise ValueError("the precision probe needs at least 2 tokens (one predicted)")
    fns: list[tuple[str, Callable]] = []
    for f in formats:
        if callable(f):
            fns.append((getattr(f, "__name__", "custom"), f))
        elif f in FAKE_QUANT:
            fns.append((f, FAKE_QUANT[f]))
        else:
            raise ValueError(f"unknown format {f!r}; choose from {', '.join(FAKE_QUANT)} or pass a function")
    n_layers = len(adapter.blocks())
    layers = list(range(n_layers)) if layers is None else [int(i) for i in layers]
    for i in layers:
        if not 0 <= i < n_layers:
            raise ValueError(f"layer {i} out of range: the model has layers 0..{n_layers - 1}")
    x = torch.tensor([ids], device=adapter.device)
    targets = x[0, 1:]
    rows = []
    with adapter.teacher_forcing(len(ids)) as forward:
        ref = forward(x)[0, :-1]
        ref_nll = -torch.log_softmax(ref, -1).gather(-1, targets[:, None])[:, 0]
        for name, fq in fns:
            for i in layers:
                with quantized(adapter, i, fq, parts):
                    got = forward(x)[0, :-1]
                rows.append((i, name, *_compare(ref, got, targets, ref_nll)))
            if all_layers:
                with contextlib.ExitStack() as stack:
                    for i in layers:
                        stack.enter_context(quantized(adapter, i, fq, parts))
                    got = forward(x)[0, :-1]
                rows.append((None, name, *_compare(ref, got, targets, ref_nll)))
    return pl.DataFrame(rows, schema=PRECISION_COLUMNS, orient="row")
