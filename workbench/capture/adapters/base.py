"""The adapter interface: what the recorder, root cause, replay, diff and fault injection ask of a model.

An adapter wraps one loaded model and offers:

- ``summary``: the neutral ``ModelSummary`` stored with every run (no family-specific config keys);
- ``stream(...)``: generation with the model's KV cache, yielding ``model.generate.Step`` objects;
- ``stream_batch(...)`` (where ``supports_batch``): several prompts at once, yielding ``model.generate.BatchStep``;
- ``forward(ids)``: logits [B, T, V] of a full forward without cache (differentiable; root cause);
- ``embedding()``: the input-embedding module (captum's ``LayerIntegratedGradients`` target);
- ``seams(listeners)``: a context manager that attaches listeners to the model's seams for the block;
- ``kv_state()``: the KV cache after a step, per layer (``kv_sizes()``: only its sizes, cheap);
- ``router(layer)``: the layer's ``RouterMath`` (checked against the router module when loaded);
- ``blocks()``, ``quantization_points(layer)``, ``teacher_forcing(length)`` and ``quantize_kv(layer, fn)``: what a
  what-if on a full forward asks (``workbench.analysis.precision``), so it never tests the model's class.

Seams and what a listener receives (``layer`` is the 0-based block; a listener may return a
replacement where noted, which is how ablations and faults intervene):

- ``attn_probs(layer, probs [Tc, H, S], q_start, window)``: one block of query rows of batch row 0
  (recording); the S keys end at the last query; ``window`` is the layer's sliding window or None.
  A listener with the attribute ``batched = True`` gets every row, ``[B, Tc, H, S]`` (batched recording).
- ``attn_stats(layer, stats [Tc, H, 3], received [S], q_start, window)`` (adapters with ``stats_seam``): the
  same block reduced by the model itself, without probabilities: per row and head the entropy, max weight and
  weight on key 0, and per key the attention the block's rows and heads gave it. A model offering it computes
  these in about its plain attention's time; the recorder's probes listen here when the adapter offers it.
  Batched: ``[B, Tc, H, 3]`` and ``[B, S]``.
- ``attn_row(layer, probs [1, H, S], q_start)`` (adapters with ``row_seam``, listened to with ``attn_stats``): a decode
  step's probabilities of batch row 0 (``batched``: ``[B, 1, H, S]``), handed over instead of that step's
  ``attn_stats`` call, so a listener keeps them and reduces many steps at once.
- ``head_out(layer, z [B, T, H, d]) -> z | None``: each head's output before the output projection.
- ``route(layer, Route)``: an intervention on one MoE layer's routing. The listener edits the ``Route``
  (``remove`` experts from the choice, ``unbias`` the selection, ``add_selection``, ``freeze`` the choice,
  ``scale_expert`` outputs); every listener's edits combine, and the adapter computes the final
  (indices, weights) once with the layer's ``RouterMath``, so a fault and an ablation compose.
- ``routed(layer, Route)``: observation of what the experts finally receive (after every edit).
- ``shared_out(layer, out [N, D]) -> out | None``: the shared experts' output (batch-major rows).
- ``resid_post(layer, h [B, T, D])``: the residual stream after the block.
- ``expert_in(layer, x [B, T, D])``: what one MoE layer's routed experts receive (their rows are ``routed``'s rows,
  batch-major); adapters hand it over only where that is exactly the experts' input.
- ``expert_out(layer, expert, out [n, D], act [n, I] | None)`` (adapters with ``expert_out_seam``): one routed
  expert as the model itself ran it in this forward: its output before the gate weight and its down projection's
  input (None where the down projection was not called), for its rows of the layer's final choice in the order
  ``torch.where(indices == expert)`` gives (batch-major); a forward's experts come in increasing expert order, after
  the ``routed`` call of that layer. The super-expert signal reads it instead of running the experts again.

Dimension letters: B batch, T tokens, S cached keys, H heads, d head dim, N = B*T routed rows,
E routed experts, K experts per token.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from workbench.data.signals import SEAMS
from workbench.data.summary import ModelSummary

from .routing import RouterMath

__all__ = ["ATTN_MAPS", "SEAMS", "Adapter", "ModelSummary", "QuantPoints", "Route", "Listener", "attention_map",
           "first_output", "replace_first_output"]


# an attention module's linear maps by their leaf names, as families name them (ours: wq / wq_b, wkv_a, wkv_b, wo):
# known answers (workbench.analysis.activations) hold them head by head, fault kinds (faults) edit them
ATTN_MAPS = {
    "out": ("o_proj", "out_proj", "wo", "dense"),  # the output projection: its input columns are per head
    "query": ("q_proj", "wq", "wq_b", "q_b_proj", "query"),  # a query projection (low-rank: the last): rows per head
    "kv_up": ("wkv_b", "kv_b_proj"),  # MLA's key/value up-projection from the latent: rows per head
    "kv_latent": ("wkv_a", "kv_a_proj_with_mqa"),  # MLA's shared KV latent projection
    "value": ("v_proj", "value"),  # GQA's value projection
}


def attention_map(attn: nn.Module | None, *roles: str) -> nn.Linear | None:
    """The first ``nn.Linear`` child of ``attn`` named as one of ``roles`` (keys of ``ATTN_MAPS``, in order), or None."""
    for role in roles:
        for name in ATTN_MAPS[role]:
            m = getattr(attn, name, None)
            if isinstance(m, nn.Linear):
                return m
    return None


def first_output(out):
    """A module's main output: the tensor itself, or the first of the tuple transformers' blocks return."""
    return out[0] if isinstance(out, tuple) else out


def replace_first_output(out, new):
    """``out`` with its main output (``first_output``) replaced by ``new``, in the same shape of return."""
    return (new, *out[1:]) if isinstance(out, tuple) else new


@dataclass
class Route:
    """One MoE layer's routing in one forward: the router's logits and choice, and the edits listeners ask for.

    Edits (all optional, combined across listeners): ``keep`` [N, E] (False removes an expert from a row's
    choice: its tokens go to the next best expert), ``bias_scale`` [N] (multiplies the layer's selection
    bias per row: 0 removes it), ``extra`` [E] or [N, E] (added to the selection scores), ``frozen`` [N, K]
    (the choice, fixed), ``scale`` [E] (multiplies each expert's output, i.e. its mixing weight).
    """

    layer: int
    logits: torch.Tensor  # [N, E]
    indices: torch.Tensor  # [N, K]
    weights: torch.Tensor  # [N, K]
    math: RouterMath
    keep: torch.Tensor | None = None
    bias_scale: torch.Tensor | None = None
    extra: torch.Tensor | None = None
    frozen: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    forced: tuple | None = None  # (rows [N] bool, indices [N, K], weights [N, K]): the final choice of those rows

    def force(self, rows: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> None:
        """Set the final (indices, weights) of ``rows`` ([N] bool), after every other edit (activation patching:
        another forward's routing, taken as it was)."""
        rows = rows.to(self.indices.device).bool()
        if self.forced is not None:
            old, i0, w0 = self.forced
            indices = torch.where(rows[:, None], indices.to(i0.device), i0)
            weights = torch.where(rows[:, None], weights.to(w0), w0)
            rows = rows | old
        self.forced = (rows, indices.to(self.indices.device), weights)

    def remove(self, keep: torch.Tensor) -> None:
        keep = keep.to(self.logits.device).bool()
        self.keep = keep if self.keep is None else self.keep & keep

    def unbias(self, factor: torch.Tensor) -> None:
        factor = factor.to(self.logits.device, torch.float32)
        self.bias_scale = factor if self.bias_scale is None else self.bias_scale * factor

    def add_selection(self, extra: torch.Tensor) -> None:
        extra = extra.to(self.logits.device, torch.float32)
        self.extra = extra if self.extra is None else self.extra + extra

    def freeze(self, indices: torch.Tensor) -> None:
        self.frozen = indices.to(self.indices.device)

    def scale_expert(self, expert: int, factor: float) -> None:
        if self.scale is None:
            self.scale = torch.ones(self.math.n_experts, device=self.weights.device)
        self.scale[expert] *= factor

    def result(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The final (indices, weights) after every edit; None when nothing was edited."""
        if all(e is None for e in (self.keep, self.bias_scale, self.extra, self.frozen, self.scale, self.forced)):
            return None
        idx, w = self.indices, self.weights
        if self.frozen is not None:
            idx = self.frozen
            w = self.math.weights_for(self.logits, idx)
        elif self.keep is not None or self.bias_scale is not None or self.extra is not None:
            m = self.math
            bias = m.bias.float().to(self.logits.device) if m.bias is not None else None
            touched = torch.zeros(idx.size(0), dtype=torch.bool, device=self.logits.device)
            if self.keep is not None:
                touched |= ~self.keep.all(-1)
            if self.bias_scale is not None and bias is not None:
                touched |= self.bias_scale != 1
                bias = bias[None] * self.bias_scale[:, None]
            if self.extra is not None:
                touched = torch.ones_like(touched)
                bias = self.extra if bias is None else bias + self.extra
            new = m.select(self.logits, bias=bias, keep=self.keep)
            # rows no edit touched keep the router's own output exactly
            t = touched.to(idx.device)[:, None]
            idx = torch.where(t, new.to(idx.device), idx)
            w = torch.where(t, m.weights_for(self.logits, new).to(w), w)
        if self.scale is not None:
            w = w * self.scale.to(w)[idx]
        if self.forced is not None:
            rows, fi, fw = self.forced
            idx = torch.where(rows.to(idx.device)[:, None], fi.to(idx.device), idx)
            w = torch.where(rows.to(w.device)[:, None], fw.to(w), w)
        return idx, w


Listener = Callable[..., object]


@dataclass
class QuantPoints:
    """What fake quantization of one block touches (``Adapter.quantization_points``): the ``block`` (its >= 2-D
    parameters and the inputs of its ``nn.Linear`` layers), the modules inside it kept in full precision (the
    router, as DeepSeek-V3's FP8 recipe keeps its gate), and the expert modules that hold their weights as
    stacked 3-D tensors without any ``nn.Linear`` (their inputs are quantized at the module)."""

    block: nn.Module
    full_precision: list[nn.Module]
    fused_experts: list[nn.Module]


class Adapter:
    """Base class: the seams are dispatched here; subclasses attach them to their model's modules."""

    summary: ModelSummary
    module: nn.Module
    checkpoint_path: str | None = None
    supports_batch = False  # has stream_batch, kv_state(row=) and batched attn_probs listeners
    stats_seam = False  # offers the attn_stats seam (the model reduces attention rows itself)
    row_seam = False  # offers the attn_row seam (a decode step's probabilities instead of its attn_stats)
    # a decode step through the KV cache computes what a forward of the whole sequence computes (to rounding): a
    # recorded run can be held against one (``anomalies.cache_rows``)
    cache_exact = True
    cache_exact_len: int | None = None  # ... up to this many tokens only (a rotary embedding depending on the length)
    expert_out_seam = False  # offers the expert_out seam (each routed expert's output as the model ran it)

    # -- subclasses -------------------------------------------------------------------------------
    def stream(self, prompt: Sequence[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
               eos_id: int | None) -> Iterator:
        raise NotImplementedError

    def stream_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                     temperature: Sequence[float], top_p: Sequence[float], seed: Sequence[int],
                     eos_id: int | None) -> Iterator:
        raise NotImplementedError(f"{type(self).__name__} records one prompt at a time")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embedding(self) -> nn.Module:
        raise NotImplementedError

    def kv_state(self) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor, int]]:
        """(layer, cached tokens, bytes, first cached tensor [S, *], second [S, *], position of the first
        cached token) per cached layer (the position is > 0 once a sliding-window cache drops old tokens)."""
        raise NotImplementedError

    def kv_sizes(self) -> list[tuple[int, int, int]]:
        """(layer, cached tokens, bytes) per cached layer: ``kv_state`` without the tensors (every step)."""
        return [(layer, n, nbytes) for layer, n, nbytes, *_ in self.kv_state()]

    def router(self, layer: int) -> RouterMath:
        raise NotImplementedError

    def _attach(self, seam: str, fn: Listener) -> list:
        """Register ``fn`` on the model's modules for one seam; returns removable handles."""
        raise NotImplementedError

    # -- the parts of a layer (activation patching and fault injection, workbench.analysis) ---------------
    def parts(self, layer: int) -> dict[str, nn.Module | None]:
        """The modules of block ``layer`` whose outputs root cause patches and faults edit: "block" (its output is
        the residual stream after it), "attn" and "mlp" (the attention and MLP or MoE block, outputs added to the
        residual), "attn_norm" and "mlp_norm" (the input norms), "kv" (whose output is the cached KV latent: MLA's
        latent norm, else the value projection), "shared" (the shared experts, or None), "router" (the module
        holding the router weight [E, D], or None) and "experts" (the routed experts, or None)."""
        raise NotImplementedError

    def expert_down(self, layer: int, expert: int) -> torch.Tensor:
        """The down projection weight [D, I] of one routed expert (a view: in-place edits change the model)."""
        raise NotImplementedError

    def unembedding(self) -> nn.Module:
        """The output projection (its output is the logits before any softcap)."""
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        """The norm applied to the residual stream after the last block, before ``unembedding`` (the logit lens)."""
        raise NotImplementedError

    def lens_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) the model would output if ``h`` [..., D] were the residual stream after its last block:
        ``final_norm``, ``unembedding`` and what the model does to the logits after it (a softcap, a scale)."""
        norm, head = self.final_norm(), self.unembedding()
        w, hw = next(norm.parameters(), None), next(head.parameters(), None)
        x = norm(h.to(w.device) if w is not None else h)
        return head(x.to(hw.device) if hw is not None else x).float()  # placed across devices: each on its own

    def rotary(self, layer: int, fn: Callable) -> list:
        """Register ``fn(rotation) -> rotation | None`` on what block ``layer``'s attention rotates queries and keys
        by (ours: the complex table [T, R/2]; transformers: the (cos, sin) pair [B, T, d]); removable handles."""
        raise NotImplementedError

    def start_positions(self, layer: int, fn: Callable[[int], None]) -> list:
        """Register ``fn(start)``, called as block ``layer`` runs, with the position of the first token it is fed
        (faults that hit one position); removable handles."""
        raise NotImplementedError

    def scaled_rotation(self, rotation, factor: float, start: int = 0):
        """``rotation`` with every angle multiplied by ``factor`` (positions from ``start``)."""
        raise NotImplementedError

    def state_sha256(self) -> str:
        raise NotImplementedError

    def _without_cache(self) -> contextlib.AbstractContextManager:
        """Detach the generation cache while full forwards run (a model that keeps one overrides this)."""
        return contextlib.nullcontext()

    # -- what-ifs on a full forward (workbench.analysis.precision) -------------------------------------------
    def blocks(self) -> nn.ModuleList:
        """The decoder blocks in order (block ``i`` is layer ``i`` of every seam)."""
        raise NotImplementedError

    def quantization_points(self, layer: int) -> QuantPoints:
        """What fake-quantizing block ``layer`` touches (``QuantPoints``)."""
        raise NotImplementedError

    def teacher_forcing(self, length: int) -> contextlib.AbstractContextManager:
        """Full forwards of at most ``length`` tokens from position 0, without gradients, through a fresh KV cache
        (the generation's own cache, if any, put back afterwards); yields ``forward(ids [1, T]) -> logits
        [1, T, V]`` (fp32), whose cache writes pass through the functions ``quantize_kv`` set."""
        raise NotImplementedError

    def cache_writes(self, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> contextlib.AbstractContextManager:
        """For the duration, what block ``layer`` writes into a generation's KV cache (``stream``, ``stream_batch``) is
        ``fn(tensor)`` as attention reads it back (MLA: the latent; otherwise the values); a forward without the cache
        is unchanged (a cache-only fault: ``faults.corrupt_cache``)."""
        raise NotImplementedError

    def quantize_kv(self, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> contextlib.AbstractContextManager:
        """For the duration, what block ``layer`` writes into a ``teacher_forcing`` forward's KV cache is
        ``fn(tensor)`` (MLA: the latent and the rope key; otherwise the keys and values), as attention reads it."""
        raise NotImplementedError

    # -- the KV what-if (workbench.analysis.kv_policies): a cache the caller edits between decode steps ----------
    def kv_session(self, max_len: int) -> contextlib.AbstractContextManager:
        """A fresh KV cache for the block, under ``torch.inference_mode``; yields ``forward(ids, start_pos)
        -> logits [len(ids), V]`` (fp32) that feeds tokens through it. Inside: ``kv_entries()`` and
        ``kv_keep(masks)``; the ``attn_probs`` seam sees the evicted keys with probability 0."""
        raise NotImplementedError

    def kv_entries(self) -> list[tuple[int, list[torch.Tensor]]]:
        """Per layer: (position of the first cached token, the cached tensors as views [S, ...], position
        first, that may be edited in place: the latent and rope key for MLA, keys and values otherwise)."""
        raise NotImplementedError

    def kv_keep(self, masks: list[torch.Tensor | None]) -> None:
        """Evict cached tokens from the next forwards of the session: per layer a bool mask over the cached
        positions (False: masked out of attention, as a -inf score; positions past the mask are kept), or
        None to keep every token. The session's attention hook reads ``_kv_keep``."""
        self._kv_keep = [None if k is None or bool(k.all()) else k.to(self.device, torch.bool) for k in masks]

    # -- shared -----------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @contextlib.contextmanager
    def seams(self, listeners: dict[str, Listener]) -> Iterator[None]:
        """Attach ``{seam: fn}`` for the duration of the block (removed whatever happens inside)."""
        unknown = set(listeners) - set(SEAMS)
        if unknown:
            raise KeyError(f"unknown seams {sorted(unknown)}; an adapter offers {SEAMS}")
        handles: list = []
        routing: list[tuple[str, Listener]] = []
        try:
            for seam, fn in listeners.items():
                if seam in ("route", "routed"):
                    if self.summary.moe_layers:
                        self._routing_listeners()[seam].append(fn)
                        routing.append((seam, fn))
                    continue
                if seam == "shared_out" and not self.summary.n_shared_experts:
                    continue
                handles += self._attach(seam, fn)
            if routing and not getattr(self, "_route_handles", None):
                self._route_handles = self._attach_routing()
            yield
        finally:
            for h in handles:
                h.remove()
            lists = self._routing_listeners()
            for seam, fn in routing:
                lists[seam].remove(fn)
            if routing and not (lists["route"] or lists["routed"]):
                for h in getattr(self, "_route_handles", None) or []:  # a failed attach must not hide its error
                    h.remove()
                self._route_handles = []

    def _routing_listeners(self) -> dict[str, list[Listener]]:
        if not hasattr(self, "_route_lists"):
            self._route_lists = {"route": [], "routed": []}
        return self._route_lists

    def _dispatch_route(self, layer: int, logits: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                        math: RouterMath | None = None):
        """Called by the adapter's routing hook: edits, then observers; (indices, weights) to use, or None.
        ``math``: the layer's ``router(layer)`` where the hook has it at hand."""
        lists = self._routing_listeners()
        if not lists["route"]:  # observers only (a recording): one Route, nothing to edit
            if lists["routed"]:
                final = Route(layer, logits, indices, weights, math or self.router(layer))
                for fn in lists["routed"]:
                    fn(layer, final)
            return None
        r = Route(layer, logits, indices, weights, math or self.router(layer))
        for fn in lists["route"]:
            fn(layer, r)
        new = r.result()
        if lists["routed"]:
            final = Route(layer, logits, *(new or (indices, weights)), r.math)
            for fn in lists["routed"]:
                fn(layer, final)
        return new

    def _attach_routing(self) -> list:
        """Hooks that call ``_dispatch_route`` for every MoE layer; returns removable handles."""
        raise NotImplementedError

    @contextlib.contextmanager
    def analysis(self) -> Iterator[None]:
        """Full forwards from position 0, gradients on, no parameter gradients (root cause)."""
        flags = [p.requires_grad for p in self.module.parameters()]
        try:
            for p in self.module.parameters():
                p.requires_grad_(False)
            with self._without_cache(), torch.inference_mode(False), torch.enable_grad():
                yield
        finally:
            for p, f in zip(self.module.parameters(), flags):
                p.requires_grad_(f)

    def components(self) -> list[tuple[str, int, int | None, int | None]]:
        """(kind, layer, head, expert) for every head, routed expert, shared-expert block and router."""
        s = self.summary
        out: list[tuple[str, int, int | None, int | None]] = []
        for i in range(s.n_layers):
            out += [("head", i, h, None) for h in range(s.n_heads)]
            if i in s.moe_layers:
                out += [("expert", i, None, j) for j in range(s.n_routed_experts)]
                if s.n_shared_experts:
                    out.append(("shared_expert", i, None, None))
                if self.router(i).has_bias:
                    out.append(("router", i, None, None))
        return out

    def routing_of(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """The expert indices [T, K] every MoE layer chooses on ``ids`` [1, T] (a full forward)."""
        got: dict[int, torch.Tensor] = {}

        def keep(layer: int, r: Route) -> None:
            got[layer] = r.indices.detach().clone()

        with self.analysis(), torch.no_grad(), self.seams({"routed": keep}):
            self.forward(ids)
        return got

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.summary.describe()})"
