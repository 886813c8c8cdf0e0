"""Activation patching: which component, taken from a known-good reference, gives the target token back.

Two forwards of one architecture: this run's model on its tokens ("run") and a reference ("ref": a
known-good model on the same tokens, or the same model on another prompt of the same length). For a
component c, the *restoring* patch runs the run's forward with c's output taken from the reference's
forward (an interchange intervention) and measures how much of the target's logprob gap
``f(ref) - f(run)`` it closes; the *breaking* patch runs the reference with the run's c and measures how
much of the gap it opens. A component's score is the mean of the two, in nats (positive: towards the
reference), and ``restored`` is the restoring fraction (1: the patch alone gives the reference's logprob).
The ``resid`` rows are marginal: the stream after layer L taken from the reference closes every gap made up to
L, so a ``resid`` row scores (and restores) what patching after L gives beyond patching after L - 1; their
scores and fractions add up over the layers.

Components, hierarchically (``patch_causes``): first every layer (its attention block output, its MLP or
MoE block output, the residual stream after it), the embedding (``embed``), the output projection
(``unembed``, the reference's weights on the run's final hidden state) and every source token (its
embedding at that position); then, inside the ``top_layers`` layers that scored highest, the heads, the
input norms' outputs, the KV latent (MLA's latent norm output, else the value projection's), the rotary
part (the rotation the layer's attention uses), the shared experts, the router's choice (the layer's
final (experts, weights), taken whole) and each routed expert (its weights and its part of the routing:
its weight where both forwards choose it; where only one does, it takes or gives up the slot of an expert
only the other chose). A residual row scores the layer *marginally*:
patching the stream after block L closes every gap made up to L, so its score is that of L minus that
of L - 1 (what block L itself changed), and a layer-wide fault stands out at its own layer only.

Cost: the two capture forwards, then (levels 1 and 2) one batched forward per ``batch_size`` patched
components in each direction; the rotary part and each expert of a descended layer need a forward of
their own (a weight swap or a table is not per batch row), except an expert where the reference is the run's
own module on another prompt (its part of the routing alone: batched). ``PatchStats`` counts them.

Every model goes through its adapter (``parts``, ``rotary``, and the ``head_out``, ``route`` and
``routed`` seams), so this works on our ``Transformer`` and the ``transformers`` families alike.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from workbench.capture.adapters import Adapter, Route, adapter_for
from workbench.capture.adapters.base import first_output, replace_first_output

Key = tuple  # (kind, layer, head, expert, source_pos)

BLOCK_KINDS = ("attn_block", "mlp_block", "dense_mlp", "resid")
MODULE_KINDS = {"resid": "block", "attn_block": "attn", "mlp_block": "mlp", "dense_mlp": "mlp",
                "attn_norm": "attn_norm", "mlp_norm": "mlp_norm", "kv_latent": "kv", "shared_expert": "shared"}


@dataclass
class PatchStats:
    """What one patching root cause cost."""

    forwards: int = 0  # model forwards (a batched forward counts once)
    rows: int = 0  # patched forward rows
    seconds: float = 0.0
    layers: list[int] = field(default_factory=list)  # the layers descended into


class _Taps:
    """Hooks on one adapter that capture every site of a batch-1 forward, or patch chosen batch rows from a cache."""

    def __init__(self, a: Adapter):
        self.a = a
        self.capture = False
        self.cache: dict = {}  # filled while capturing
        self.src: dict = {}  # the other forward's cache, read while patching
        self.rows: dict[Key, list[int]] = {}  # site -> batch rows that take it from src
        self.expert: tuple[int, int] | None = None  # (layer, expert) patched in this (batch-1) forward
        self.batch = 1
        self.unembed_src = None  # the other model's output projection

    # -- module outputs ------------------------------------------------------------------------------
    def _module_hook(self, kind: str, layer: int | None):
        def hook(_m, _a, out):
            x = first_output(out)
            if self.capture:
                self.cache[(kind, layer)] = x.detach().reshape(1, -1, x.size(-1))[0].clone()
                return None
            rows = self.rows.get((kind, layer, None, None, None))
            tok = self._token_rows() if kind == "embed" else []
            if not rows and not tok:
                return None
            src = self.src[(kind, layer)]
            y = x.reshape(self.batch, -1, x.size(-1)).clone()
            if rows:
                y[rows] = src.to(y)
            for b, p in tok:
                y[b, p] = src[p].to(y)
            return replace_first_output(out, y.reshape(x.shape))
        return hook

    def _token_rows(self) -> list[tuple[int, int]]:
        return [(b, k[4]) for k, rs in self.rows.items() if k[0] == "token" for b in rs]

    def _unembed_hook(self, _m, args, out):
        rows = self.rows.get(("unembed", None, None, None, None))
        if self.capture or not rows:
            return None
        y = out.clone()
        w, bias = self.unembed_src.weight, getattr(self.unembed_src, "bias", None)
        # F.linear, not the module: the source may be this very module (another prompt), hooked
        y[rows] = torch.nn.functional.linear(args[0][rows].to(w.device, w.dtype), w, bias).to(y)
        return y

    # -- seams -------------------------------------------------------------------------------------
    def _heads(self, layer: int, z: torch.Tensor):  # [B, T, H, d]
        if self.capture:
            self.cache[("z", layer)] = z.detach()[0].clone()
            return None
        todo = [(k[2], rs) for k, rs in self.rows.items() if k[0] == "head" and k[1] == layer]
        if not todo:
            return None
        z = z.clone()
        src = self.src[("z", layer)].to(z)
        for h, rs in todo:
            z[rs, :, h] = src[:, h]
        return z

    def _routed(self, layer: int, r: Route) -> None:
        if self.capture:
            self.cache[("route", layer)] = (r.indices.detach().clone(), r.weights.detach().clone())

    def _route(self, layer: int, r: Route) -> None:
        if self.capture:
            return
        n = r.indices.size(0)
        t = n // self.batch
        src_i, src_w = self.src[("route", layer)]
        mask = torch.zeros(n, dtype=torch.bool, device=r.indices.device)
        for b in self.rows.get(("router", layer, None, None, None), []):
            mask[b * t:(b + 1) * t] = True
        if mask.any():
            r.force(mask, src_i.repeat(self.batch, 1), src_w.repeat(self.batch, 1))
        if self.expert is not None and self.expert[0] == layer and self.batch == 1:
            rows, idx, w = _expert_slot(self.expert[1], *self.cache[("route", layer)], src_i, src_w)
            if rows.any():
                r.force(rows, idx, w)
        # batch rows that take one expert's part of the routing (the same module on both sides: no weights to swap;
        # upstream of its layer every row is this forward's own, so its routing there is the captured one)
        for k, rs in self.rows.items():
            if k[0] != "expert" or k[1] != layer:
                continue
            rows, idx, w = _expert_slot(k[3], *self.cache[("route", layer)], src_i, src_w)
            if rows.any():
                mask = torch.zeros(n, dtype=torch.bool, device=r.indices.device)
                for b in rs:
                    mask[b * t:(b + 1) * t] = rows.to(mask.device)
                r.force(mask, idx.repeat(self.batch, 1), w.repeat(self.batch, 1))

    def _rotary(self, layer: int):
        def fn(rot, _start):
            if self.capture:
                self.cache[("rot", layer)] = rot
                return None
            if self.rows.get(("rotary", layer, None, None, None)):
                return self.src[("rot", layer)]
            return None
        return fn

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        a, s = self.a, self.a.summary
        handles = [a.embedding().register_forward_hook(self._module_hook("embed", None)),
                   a.unembedding().register_forward_hook(self._unembed_hook)]
        try:
            for i in range(s.n_layers):
                parts = a.parts(i)
                for kind, part in MODULE_KINDS.items():
                    if kind == "dense_mlp":
                        continue
                    mod = parts.get(part)
                    if mod is not None:
                        handles.append(mod.register_forward_hook(self._module_hook(kind, i)))
                try:
                    handles += a.rotary(i, self._rotary(i))
                except (NotImplementedError, ValueError):
                    pass
            with a.seams({"head_out": self._heads, "route": self._route, "routed": self._routed}):
                yield
        finally:
            for h in handles:
                h.remove()


@contextlib.contextmanager
def last_position_only(model) -> Iterator[None]:
    """Within the block, the output projection runs on the last position only (logits [B, 1, V]): the target is
    read there, and the other positions' logits are a third of a small model's forward. Nothing upstream of the
    projection changes, so ``target_fn``'s value is the same (to fp32 rounding)."""
    adapter = adapter_for(model)
    head = adapter.unembedding()
    if head is adapter.embedding():  # one module both ways: its input would be the token ids too
        yield
        return

    def last(_m, args, kwargs):
        if args and isinstance(args[0], torch.Tensor) and args[0].ndim == 3:
            return (args[0][:, -1:], *args[1:]), kwargs
        return None

    handle = head.register_forward_pre_hook(last, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _expert_slot(j: int, own_i: torch.Tensor, own_w: torch.Tensor, src_i: torch.Tensor, src_w: torch.Tensor):
    """Routing [T, K] that is this forward's except for expert ``j``'s part, which is the source's: where both
    choose j, its weight is the source's; where only this forward does, j gives its slot to an expert only the
    source chose (with the source's weight); where only the source does, j takes the slot of an expert only
    this forward chose. Returns (rows changed [T] bool, indices, weights)."""
    idx, w = own_i.clone(), own_w.clone()
    mine, theirs = (own_i == j), (src_i == j)
    rows = mine.any(-1) | theirs.any(-1)
    for t in torch.nonzero(rows).flatten().tolist():
        a, b = own_i[t].tolist(), src_i[t].tolist()
        if j in a and j in b:
            w[t, a.index(j)] = src_w[t, b.index(j)]
        elif j in a:  # j leaves: the slot goes to what the source chose instead
            alt = [e for e in b if e not in a]
            s = a.index(j)
            if alt:
                idx[t, s], w[t, s] = alt[0], src_w[t, b.index(alt[0])]
            else:
                w[t, s] = 0.0
        else:  # j comes in, in place of an expert the source did not choose
            out = [e for e in a if e not in b]
            if out:
                s = a.index(out[0])
                idx[t, s], w[t, s] = j, src_w[t, b.index(j)]
    return rows, idx, w


def _logprob(a: Adapter, ids: torch.Tensor, target: int) -> torch.Tensor:
    return torch.log_softmax(a.forward(ids)[:, -1].float(), -1)[:, target]


def _expert_params(a: Adapter, layer: int, expert: int) -> list[torch.Tensor]:
    """Views of every parameter of one routed expert (a module per expert, or a slice of fused tensors)."""
    experts = a.parts(layer)["experts"]
    e = a.summary.n_routed_experts
    if isinstance(experts, torch.nn.ModuleList):
        return list(experts[expert].parameters())
    return [p[expert] for p in experts.parameters() if p.ndim >= 1 and p.size(0) == e]


@contextlib.contextmanager
def _swapped(dst: Adapter, src: Adapter, layer: int, expert: int) -> Iterator[None]:
    if dst.module is src.module:
        yield
        return
    mine, theirs = _expert_params(dst, layer, expert), _expert_params(src, layer, expert)
    saved = [p.detach().clone() for p in mine]
    try:
        with torch.no_grad():
            for p, q in zip(mine, theirs):
                p.copy_(q.to(p))
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(mine, saved):
                p.copy_(v)


class _Side:
    """One direction's forward: ``dst`` runs on its ids and takes sites from the other side's capture."""

    def __init__(self, a: Adapter, ids: torch.Tensor, target: int, stats: PatchStats,
                 tick: Callable[[], None] | None = None):
        self.a, self.ids, self.target, self.stats = a, ids.to(a.device), target, stats
        self.taps = _Taps(a)
        self.tick = tick or (lambda: None)  # after each forward (progress)

    def capture(self) -> float:
        self.taps.capture = True
        self.taps.batch = 1
        try:
            with self.taps.attached():
                f = float(_logprob(self.a, self.ids, self.target)[0])
        finally:
            self.taps.capture = False
        self.stats.forwards += 1
        self.tick()
        return f

    def batched(self, sites: list[Key], src: "_Side", batch_size: int) -> np.ndarray:
        """The target logprob with each site (one per batch row) taken from ``src``."""
        out = []
        self.taps.src = src.taps.cache
        self.taps.unembed_src = src.a.unembedding()
        with self.taps.attached():
            for k in range(0, len(sites), batch_size):
                chunk = sites[k:k + batch_size]
                self.taps.rows = {}
                for b, site in enumerate(chunk):
                    self.taps.rows.setdefault(site, []).append(b)
                self.taps.batch = len(chunk)
                out.append(_logprob(self.a, self.ids.expand(len(chunk), -1), self.target).double().cpu().numpy())
                self.stats.forwards += 1
                self.stats.rows += len(chunk)
                self.tick()
        self.taps.rows = {}
        return np.concatenate(out) if out else np.zeros(0)

    def single(self, site: Key, src: "_Side") -> float:
        """The target logprob with one unbatchable site (rotary, an expert) taken from ``src``."""
        self.taps.src = src.taps.cache
        self.taps.batch = 1
        self.taps.rows = {site: [0]} if site[0] == "rotary" else {}
        self.taps.expert = (site[1], site[3]) if site[0] == "expert" else None
        swap = _swapped(self.a, src.a, site[1], site[3]) if site[0] == "expert" else contextlib.nullcontext()
        try:
            with swap, self.taps.attached():
                f = float(_logprob(self.a, self.ids, self.target)[0])
        finally:
            self.taps.rows, self.taps.expert = {}, None
        self.stats.forwards += 1
        self.stats.rows += 1
        self.tick()
        return f


def level_one(a: Adapter, n_tokens: int) -> list[Key]:
    s = a.summary
    out: list[Key] = [("embed", None, None, None, None), ("unembed", None, None, None, None)]
    for i in range(s.n_layers):
        out += [("attn_block", i, None, None, None),
                ("mlp_block" if i in s.moe_layers else "dense_mlp", i, None, None, None),
                ("resid", i, None, None, None)]
    out += [("token", None, None, None, p) for p in range(n_tokens)]
    return out


def level_two(a: Adapter, layer: int) -> tuple[list[Key], list[Key]]:
    """(batched sites, single-forward sites) inside one layer."""
    s = a.summary
    parts = a.parts(layer)
    batched: list[Key] = [("head", layer, h, None, None) for h in range(s.n_heads)]
    batched += [(k, layer, None, None, None) for k in ("attn_norm", "mlp_norm", "kv_latent")
                if parts.get(MODULE_KINDS[k]) is not None]
    single: list[Key] = [("rotary", layer, None, None, None)]
    if layer in s.moe_layers:
        if parts.get("shared") is not None:
            batched.append(("shared_expert", layer, None, None, None))
        batched.append(("router", layer, None, None, None))
        single += [("expert", layer, None, j, None) for j in range(s.n_routed_experts)]
    return batched, single


def patch_causes(model: Adapter, ids: torch.Tensor, target: int, reference: Adapter, ref_ids: torch.Tensor, *,
                 batch_size: int = 16, top_layers: int = 2,
                 progress: Callable[[str, int, int], None] | None = None
                 ) -> tuple[list[Key], np.ndarray, np.ndarray, float, PatchStats]:
    """Activation patching of every component kind, layers first, then inside the ``top_layers`` best layers.

    Args:
        ids, ref_ids: [1, T] input tokens of the run and of the reference (the same length).
        target: the token whose logprob after the last position is explained.
        progress: called as ``progress("patching", forwards done, forwards planned)`` after each forward (the plan
            grows once the layers to descend into are known).
    Returns: (sites (kind, layer, head, expert, source_pos), score [S] in nats (mean of restoring and breaking),
        restored [S] (the restoring fraction of the gap; NaN when the gap is below 1e-6 nats), the gap
        f(ref) - f(run), PatchStats).
    """
    if ids.shape != ref_ids.shape:
        raise ValueError(f"patching needs the reference on as many tokens as the run ({ids.size(1)}), got "
                         f"{ref_ids.size(1)}")
    t0 = time.perf_counter()
    stats = PatchStats()
    plan = [2 + 2 * -(-len(level_one(model, ids.size(1))) // max(1, batch_size))]

    def tick() -> None:
        if progress is not None:
            progress("patching", stats.forwards, max(plan[0], stats.forwards))

    run, ref = _Side(model, ids, target, stats, tick), _Side(reference, ref_ids, target, stats, tick)
    # (the output projection stays on every position here: a layer row and its part that both give the reference's
    # logprob back tie to the last bit, and the order of such ties is the forward's rounding; keeping it keeps
    # the rankings root cause gave before)
    with model.analysis(), reference.analysis(), torch.no_grad():
        f_run, f_ref = run.capture(), ref.capture()
        gap = f_ref - f_run
        sign = 1.0 if gap >= 0 else -1.0

        def patched(dst: _Side, src: _Side, sites_b: list[Key], sites_s: list[Key]) -> np.ndarray:
            # an expert's part is a routing edit alone when both sides are one module: batched with the rest
            along = [k for k in sites_s if k[0] == "expert" and dst.a.module is src.a.module]
            got = dict(zip(sites_b + along, dst.batched(sites_b + along, src, batch_size)))
            return np.array([got[k] if k in got else dst.single(k, src) for k in sites_b + sites_s])

        def score(sites_b: list[Key], sites_s: list[Key]) -> tuple[np.ndarray, np.ndarray]:
            fixed, broken = patched(run, ref, sites_b, sites_s), patched(ref, run, sites_b, sites_s)
            return (fixed - f_run) * sign, (f_ref - broken) * sign

        sites = level_one(model, ids.size(1))
        fix, brk = score(sites, [])
        # the residual stream after L closes every gap made up to L: score each layer by what it adds
        res = {k[1]: n for n, k in enumerate(sites) if k[0] == "resid"}
        for arr in (fix, brk):
            prev = 0.0
            for layer in sorted(res):
                here = arr[res[layer]]
                arr[res[layer]] = here - prev
                prev = here
        layer_score: dict[int, float] = {}
        for n, k in enumerate(sites):
            if k[0] in BLOCK_KINDS:
                layer_score[k[1]] = max(layer_score.get(k[1], 0.0), abs(fix[n] + brk[n]) / 2)
        stats.layers = sorted(layer_score, key=lambda i: -layer_score[i])[:max(0, top_layers)]
        more_b: list[Key] = []
        more_s: list[Key] = []
        for layer in stats.layers:
            b, s = level_two(model, layer)
            more_b += b
            more_s += [k for k in s if k[0] != "expert" or _routed_somewhere(run, ref, k[1], k[3])]
        along = [k for k in more_s if k[0] == "expert" and model.module is reference.module]
        plan[0] = stats.forwards + 2 * (-(-len(more_b + along) // max(1, batch_size)) + len(more_s) - len(along))
        fix2, brk2 = score(more_b, more_s)
    sites += more_b + more_s
    fix, brk = np.concatenate([fix, fix2]), np.concatenate([brk, brk2])
    restored = fix / abs(gap) if abs(gap) > 1e-6 else np.full(len(sites), np.nan)
    stats.seconds = time.perf_counter() - t0
    return sites, (fix + brk) / 2, restored, gap, stats


def _routed_somewhere(run: _Side, ref: _Side, layer: int, expert: int) -> bool:
    """Whether either forward sends a token to the expert (patching it otherwise changes nothing but its weights,
    which no token reaches: its score is 0 without a forward)."""
    a = run.taps.cache.get(("route", layer))
    b = ref.taps.cache.get(("route", layer))
    return any(r is not None and bool((r[0] == expert).any()) for r in (a, b))
