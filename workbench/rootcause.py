"""Root cause of one token: which earlier tokens, heads and experts made the model produce it.

The target is ``log p(token[pos] | tokens[:pos])`` under the run's model (the in-memory module a run
was recorded with, else its checkpoint), recomputed with a full forward pass without the KV cache.

- Source tokens: captum ``LayerIntegratedGradients`` over ``model.embed`` from a baseline of
  ``<|endoftext|>`` tokens (id 0), Gauss-Legendre quadrature, with captum's convergence delta
  (``sum(attr) - (f(x) - f(baseline))``) stored beside every token score.
  MoE caveat: top-k routing is piecewise constant along the integration path, so plain IG ("plain")
  integrates a discontinuous function and its completeness breaks, whatever the number of steps.
  Routing-frozen IG ("frozen") fixes every gate's expert choice to the one it made on the real input
  (a hook on ``layers.*.ffn.gate.hook_indices``); the gate weights are still computed from the scores
  of the interpolated input (``scores.gather(indices)``), so they stay differentiable and the frozen
  function is smooth: completeness holds to quadrature accuracy. At the real input the frozen and the
  real model agree exactly, so f(x) is the real target. "auto" = frozen for MoE models, plain for
  dense ones.
- Components: captum ``FeatureAblation`` over a mask with one entry per attention head, routed expert
  and shared-expert block; each perturbation is one row of a batched forward. A head is ablated by
  zeroing its output (``layers.{i}.attn.hook_z``), the shared experts likewise
  (``layers.{i}.ffn.shared_experts.hook_out``). A routed expert is ablated the MoE way: removed from
  the router's choice (its score set to -inf at ``layers.{i}.ffn.gate.hook_scores``, before the
  biased, group-limited top-k), so the router sends its tokens to the next-best expert, as if the
  expert did not exist. Zeroing its output instead would leave a hole that no trained MoE ever sees
  and would not undo a router that is biased toward it. A layer's router (kind ``router``) is ablated
  by removing its selection bias (DeepSeek-V3's aux-loss-free balancing term): the experts are chosen
  by raw affinity (``Gate.selection(scores, 0)``), the gate weights are unchanged (they always come
  from the raw scores); its score says how much the balancing bias, or a bias gone wrong, shaped the
  token (0 for a router without one). Routing is otherwise free, so an ablation's effect includes the
  re-routing it causes downstream.

Scores share one unit, nats of the target logprob, so one ranking covers every kind: a token's score
is its IG attribution (the token rows of a frozen run add up to f(x) - f(baseline)), a component's is
f(x) - f(x without it), the drop in the target's logprob when it is removed (negative: removing it
would make the token more likely). Rows are ranked by absolute score (rank 1 = most responsible).

Against a reference (``reference=``: a known-good run, module or checkpoint of the same architecture,
e.g. the model before a fine-tune, quantisation or routing change): the same attributions are computed
under the reference model on this run's tokens and subtracted, so a score says how much more (or
less) that token or component pushes the target here than in the reference. Components that matter
as much in both (the model's ordinary machinery) cancel; what changed stands out, even when the
change is small next to the ordinary effects (a router biased toward one expert moves a token by
well under a nat on the demo model). Methods get a ``_vs_reference`` suffix.
"""
from __future__ import annotations

import contextlib
from datetime import datetime, timezone
from typing import Callable, Iterator

import numpy as np
import polars as pl
import torch
from torch import nn

from workbench.model import MoE
from workbench.probes import attach

MODES = ("auto", "frozen", "plain")
METHOD = {"frozen": "ig_routing_frozen", "plain": "ig_plain"}
COLUMNS = ["target_pos", "kind", "layer", "head", "expert", "source_pos", "score", "rank", "method", "delta"]


def moe_layers(model: nn.Module) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]


@contextlib.contextmanager
def _analysis_mode(model: nn.Module) -> Iterator[None]:
    """No KV cache (full forward from position 0), no parameter gradients, gradients enabled."""
    caches = [layer.attn.cache for layer in model.layers]
    flags = [p.requires_grad for p in model.parameters()]
    try:
        for layer in model.layers:
            layer.attn.cache = None
        for p in model.parameters():
            p.requires_grad_(False)
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for layer, c in zip(model.layers, caches):
            layer.attn.cache = c
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)


def target_fn(model: nn.Module, target_id: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(ids[B, T]) -> [B]``: logprob of ``target_id`` after the last position."""
    def f(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids)[:, -1].float()  # [B, V]
        return torch.log_softmax(logits, dim=-1)[:, target_id]
    return f


def real_routing(model: nn.Module, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The expert indices [T, K] every MoE layer chooses on ``ids`` [1, T]."""
    got: dict[int, torch.Tensor] = {}

    def keep(t: torch.Tensor, name: str, **_) -> None:
        got[int(name.split(".")[1])] = t.detach().clone()

    if moe_layers(model):
        with attach(model, {"layers.*.ffn.gate.hook_indices": keep}), torch.no_grad():
            model(ids)
    return got


@contextlib.contextmanager
def frozen_routing(model: nn.Module, indices: dict[int, torch.Tensor]) -> Iterator[None]:
    """Force every MoE gate to choose the experts in ``indices`` ({layer: [T, K]}) for any batch size.

    The gate flattens [B, T, D] to [B*T, D] (batch-major), so the recorded [T, K] are tiled B times.
    """
    def force(t: torch.Tensor, name: str, **_) -> torch.Tensor:
        real = indices[int(name.split(".")[1])]
        n = t.size(0)
        if n % real.size(0):
            raise ValueError(f"routing-frozen forward: {n} routed rows are not a multiple of the "
                             f"{real.size(0)} recorded tokens")
        return real.to(t.device).repeat(n // real.size(0), 1)

    if not indices:
        yield
        return
    with attach(model, {f"layers.{i}.ffn.gate.hook_indices": force for i in indices}):
        yield


def integrated_gradients(model: nn.Module, ids: torch.Tensor, target_id: int, *, steps: int = 32,
                         mode: str = "frozen", batch_size: int | None = 16,
                         baseline_token: int = 0) -> tuple[np.ndarray, float, float]:
    """IG of the target over ``model.embed`` for each input token.

    Args:
        ids: [1, T] input tokens (the target token follows them).
        mode: "frozen" (routing-frozen) or "plain".
    Returns: (attribution per token [T], captum's convergence delta, f(x) - f(baseline)).
    """
    from captum.attr import LayerIntegratedGradients

    if mode not in ("frozen", "plain"):
        raise ValueError(f"mode must be 'frozen' or 'plain' here, got {mode!r}")
    f = target_fn(model, target_id)
    base = torch.full_like(ids, baseline_token)
    with _analysis_mode(model):
        frozen = real_routing(model, ids) if mode == "frozen" else {}
    with _analysis_mode(model), frozen_routing(model, frozen):
        lig = LayerIntegratedGradients(f, model.embed)
        attr, delta = lig.attribute(ids, baselines=base, n_steps=steps, method="gausslegendre",
                                    internal_batch_size=batch_size, return_convergence_delta=True)
        with torch.no_grad():
            gap = float(f(ids)[0] - f(base)[0])
    return attr.sum(-1)[0].detach().double().numpy(), float(delta.reshape(-1)[0]), gap


def components(model: nn.Module) -> list[tuple[str, int, int | None, int | None]]:
    """(kind, layer, head, expert) for every head, routed expert, shared-expert block and router."""
    out: list[tuple[str, int, int | None, int | None]] = []
    for i, layer in enumerate(model.layers):
        out += [("head", i, h, None) for h in range(layer.attn.n_heads)]
        if isinstance(layer.ffn, MoE):
            out += [("expert", i, None, j) for j in range(layer.ffn.n_routed_experts)]
            out += [("shared_expert", i, None, None), ("router", i, None, None)]
    return out


def component_ablation(model: nn.Module, ids: torch.Tensor, target_id: int,
                       batch_size: int = 16) -> tuple[list[tuple], np.ndarray]:
    """Effect on the target of removing each component, f(x) - f(x without it), via captum FeatureAblation.

    Returns: (components(model), effects [C] in nats).
    """
    from captum.attr import FeatureAblation

    comps = components(model)
    col = {c: k for k, c in enumerate(comps)}
    seq = ids.size(1)
    state: dict = {"mask": None}
    scores_of: dict[int, torch.Tensor] = {}  # layer -> this forward's gate scores (after expert ablation)

    def heads(z: torch.Tensor, name: str, **_) -> torch.Tensor:  # z: [B, T, H, v]
        i = int(name.split(".")[1])
        cols = [col[("head", i, h, None)] for h in range(z.size(2))]
        return z * state["mask"][:, cols].to(z)[:, None, :, None]

    def experts(scores: torch.Tensor, name: str, **_) -> torch.Tensor:  # scores: [B*T, E]
        i = int(name.split(".")[1])
        cols = [col[("expert", i, None, j)] for j in range(scores.size(1))]
        keep = state["mask"][:, cols][torch.arange(scores.size(0), device=scores.device) // seq]  # [B*T, E]
        scores_of[i] = scores.masked_fill(keep.to(scores.device) < 0.5, float("-inf"))
        return scores_of[i]

    def router(sel: torch.Tensor, name: str, **_) -> torch.Tensor:  # sel: [B*T, E], scores + bias, grouped
        i = int(name.split(".")[1])
        gate = model.layers[i].ffn.gate
        keep = state["mask"][torch.arange(sel.size(0)) // seq, col[("router", i, None, None)]].to(sel.device)
        raw = gate.selection(scores_of[i], torch.zeros_like(gate.bias))  # no balancing bias
        return torch.where(keep[:, None] < 0.5, raw, sel)

    def shared(out: torch.Tensor, name: str, **_) -> torch.Tensor:  # out: [B*T, D]
        i = int(name.split(".")[1])
        rows = torch.arange(out.size(0), device=out.device)
        return out * state["mask"][rows // seq, col[("shared_expert", i, None, None)]].to(out)[:, None]

    hooks: dict[str, Callable] = {"layers.*.attn.hook_z": heads}
    if moe_layers(model):
        hooks.update({"layers.*.ffn.gate.hook_scores": experts, "layers.*.ffn.gate.hook_selection": router,
                      "layers.*.ffn.shared_experts.hook_out": shared})
    f = target_fn(model, target_id)

    def forward(mask: torch.Tensor) -> torch.Tensor:  # mask [B, C] -> [B]
        state["mask"] = mask
        return f(ids.expand(mask.size(0), -1))

    ones = torch.ones(1, len(comps))
    with _analysis_mode(model), torch.no_grad(), attach(model, hooks):
        attr = FeatureAblation(forward).attribute(ones, baselines=0.0, perturbations_per_eval=max(1, batch_size))
    return comps, attr[0].double().numpy()


def rank_causes(token_scores: np.ndarray, token_method: str, delta: float, comps: list[tuple],
                effects: np.ndarray, target_pos: int, component_method: str = "ablation") -> pl.DataFrame:
    """One frame ranked by |score| across source tokens and components (NaN scores rank last)."""
    n = len(token_scores)
    frame = pl.DataFrame({
        "target_pos": [target_pos] * (n + len(comps)),
        "kind": ["token"] * n + [c[0] for c in comps],
        "layer": [None] * n + [c[1] for c in comps],
        "head": [None] * n + [c[2] for c in comps],
        "expert": [None] * n + [c[3] for c in comps],
        "source_pos": list(range(n)) + [None] * len(comps),
        "score": np.concatenate([token_scores, effects]).astype(np.float64),
        "method": [token_method] * n + [component_method] * len(comps),
        "delta": [delta] * n + [None] * len(comps),
    }, schema={"target_pos": pl.Int32, "kind": pl.Utf8, "layer": pl.Int32, "head": pl.Int32, "expert": pl.Int32,
               "source_pos": pl.Int32, "score": pl.Float64, "method": pl.Utf8, "delta": pl.Float64})
    key = pl.col("score").fill_nan(None).abs()
    frame = frame.sort(key, descending=True, nulls_last=True, maintain_order=True)
    return frame.with_columns(pl.arange(1, frame.height + 1, dtype=pl.Int32).alias("rank")).select(COLUMNS)


def reference_model(reference, run) -> nn.Module:
    """The known-good module to compare ``run`` with, checked against the run's model.

    Args:
        reference: a ``Run``, a run id of ``run``'s database, a module, or a checkpoint folder.
    """
    from pathlib import Path

    like = run.model()
    if isinstance(reference, (str, Path)) and not (Path(reference) / "config.json").exists():
        from .query import RunNotFound
        from .run import Run
        try:
            reference = Run(run.store, str(reference))
        except RunNotFound:
            raise ValueError(f"reference {str(reference)!r} is neither a run in {run.store.path} nor a checkpoint "
                             "folder (config.json + model.safetensors)") from None
    if isinstance(reference, nn.Module):
        ref = reference
    elif hasattr(reference, "run_id"):
        if reference.info.get("checkpoint_sha256") == run.info.get("checkpoint_sha256"):
            raise ValueError(f"reference run {reference.run_id} was recorded with the same weights as run "
                             f"{run.run_id} (same checkpoint hash): every score would be 0; pick a run of a "
                             "different model")
        ref = reference.model()
    else:
        from workbench.model import load_checkpoint
        ref = load_checkpoint(reference)
    if ref is like:
        raise ValueError("the reference is the run's own model: pass a different (known-good) model or run")
    if not hasattr(ref, "embed") or ref.embed.num_embeddings != like.embed.num_embeddings:
        raise ValueError("the reference model has a different vocabulary; root cause compares two models of one "
                         "architecture on the same tokens")
    if components(ref) != components(like):
        raise ValueError("the reference model has different layers, heads or experts than the run's model")
    return ref


def root_cause(run, pos: int, *, steps: int = 32, mode: str = "auto", batch_size: int = 16,
               baseline_token: int = 0, store: bool = True, reference=None) -> pl.DataFrame:
    """Ranked causes of the token at ``pos`` of ``run``: source tokens (IG), heads and experts (ablation).

    Args:
        run: a ``workbench.Run``; its ``model()`` is used (the module it was recorded with, if any).
        pos: position of the explained token, 1 <= pos < number of tokens.
        steps: IG integration steps (Gauss-Legendre points).
        mode: "auto" (frozen for MoE, plain for dense), "frozen" or "plain".
        batch_size: forward rows per IG / ablation batch.
        baseline_token: token id of the IG baseline sequence.
        store: replace the run's ``attributions`` rows for this position with the result.
        reference: a known-good ``Run`` (or its id), module or checkpoint folder of the same architecture: scores
            become this model's attributions minus the reference's on the same tokens (see the module doc).
    Returns: columns target_pos, kind (token|head|expert|shared_expert|router), layer, head, expert,
        source_pos, score (nats of the target logprob), rank (1 = most responsible), method, delta.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1 (got steps={steps}, batch_size={batch_size})")
    ids_all = run.tokens()["token_id"].to_list()
    if len(ids_all) < 2:
        raise ValueError(f"run {run.run_id} has {len(ids_all)} tokens: nothing to explain")
    if not 1 <= pos < len(ids_all):
        raise ValueError(f"pos must be in 1..{len(ids_all) - 1} for run {run.run_id} (position 0 has no "
                         f"preceding context), got {pos}")
    model = run.model()
    vocab = model.embed.num_embeddings
    if not 0 <= baseline_token < vocab:
        raise ValueError(f"baseline_token {baseline_token} is outside the vocabulary of {vocab}")
    device = next(model.parameters()).device
    ids = torch.tensor([ids_all[:pos]], device=device)
    target = int(ids_all[pos])
    has_moe = bool(moe_layers(model))
    ig_mode = ("frozen" if has_moe else "plain") if mode == "auto" else mode
    if not has_moe:
        ig_mode = "plain"  # nothing to freeze
    ref = None if reference is None else reference_model(reference, run)
    scores, delta, _ = integrated_gradients(model, ids, target, steps=steps, mode=ig_mode, batch_size=batch_size,
                                            baseline_token=baseline_token)
    comps, effects = component_ablation(model, ids, target, batch_size=batch_size)
    token_method, suffix = METHOD[ig_mode], ""
    if ref is not None:
        ref_ids = ids.to(next(ref.parameters()).device)
        r_scores, r_delta, _ = integrated_gradients(ref, ref_ids, target, steps=steps, mode=ig_mode,
                                                    batch_size=batch_size, baseline_token=baseline_token)
        effects = effects - component_ablation(ref, ref_ids, target, batch_size=batch_size)[1]
        scores, delta, suffix = scores - r_scores, delta - r_delta, "_vs_reference"
    df = rank_causes(scores, token_method + suffix, delta, comps, effects, pos, "ablation" + suffix)
    if store:
        stamp = datetime.now(timezone.utc).replace(tzinfo=None)
        run.store.replace("attributions", run.run_id,
                          df.with_columns(pl.lit(run.run_id).alias("run_id"), pl.lit(stamp).alias("created_at")),
                          where="AND target_pos = ?", params=[pos])
    return df
