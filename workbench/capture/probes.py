"""The probes: one class per signal of ``workbench.data.signals.REGISTRY``, found by the signal's name.

A ``Probe`` reduces what its signal's adapter seams hand over (with the pure functions of
``workbench.probes``) into one step's ``Rows``. Adding a signal is its declaration in
``workbench.data.signals``, its class here (in ``PROBE_CLASSES``), and a test.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Callable

import numpy as np
import torch
from torch import nn

from workbench.capture.adapters.base import Adapter, Route
from workbench.capture.experts import act_max, expert_internals, out_norm
from workbench.capture.rows import add_received, attention_rows, kv_rows, kv_token_cols, steps_rows, token_frame
from workbench.data.rows import Rows
from workbench.data.signals import SIGNALS
from workbench.model import MLP
from workbench.probes.signals import (
    attention_received,
    attention_row_stats,
    attention_stats,
    kv_token_norms,
    reduced_row_stats,
    reduced_stats,
    routing_records,
    token_confidence,
)


@dataclass
class StepInfo:
    """One generation step as the recorder hands it to the probes."""

    run_id: str
    index: int
    start_pos: int
    input_ids: list[int]
    logits: torch.Tensor  # [T, V]: the distributions computed at the fed positions
    next_token: int
    next_text: str
    prompt_texts: list[str]
    final: bool
    wall_ms: float
    topk: int


class Probe:
    """Reduces what one signal's seams see during a generation into rows.

    ``collect(step)`` is called once a step has finished; it returns that step's rows, or keeps what the step
    left (cheap references, no reduction) and returns nothing. ``flush()`` reduces everything kept since the
    last flush in one batch and returns those rows: one reduction over many decode steps costs about what
    one step's reduction cost, because a small model's decode step is dominated by per-call overheads. The
    recorder flushes every probe together, so each write to the store still holds whole steps; what a
    forward that failed half-way left in a listener's buffer is never collected, so never written.
    """

    def __init__(self, adapter: Adapter, run_id: str):
        self.adapter, self.run_id = adapter, run_id

    def listeners(self) -> dict:
        return {}

    def collect(self, step: StepInfo) -> dict[str, Rows | list]:
        raise NotImplementedError

    def flush(self) -> dict[str, Rows | list]:
        return {}

    @classmethod
    def flush_many(cls, probes: list["Probe"]) -> list[dict[str, Rows | list]]:
        """``flush()`` of several probes of this class (the rows of one batched generation), in order; a class
        whose reduction costs per call overrides it with one reduction across all of them."""
        return [p.flush() for p in probes]

    def pending_bytes(self) -> int:
        """Bytes of tensors kept for the next flush (the recorder flushes early when they grow)."""
        return 0


class TokensProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.kept: list[tuple[int, int, int, str, torch.Tensor]] = []  # (step, pos, token, text, logits [1, V])
        self.topk = 5

    def collect(self, s: StepInfo) -> dict:
        frames = []
        n = len(s.input_ids)
        if s.index == 0:
            ids, texts = s.input_ids, s.prompt_texts
            frames.append(token_frame(s.run_id, 0, [0], ids[:1], texts[:1], [True], None, s.topk))
            if n > 1:
                frames.append(token_frame(s.run_id, 0, list(range(1, n)), ids[1:], texts[1:], [True] * (n - 1),
                                          s.logits[:-1].cpu(), s.topk))
        self.kept.append((s.index, s.start_pos + n, s.next_token, s.next_text, s.logits[-1:]))
        self.topk = s.topk
        return {"tokens": frames} if frames else {}

    def flush(self) -> dict:
        return self.flush_many([self])[0]

    @classmethod
    def flush_many(cls, probes: list["TokensProbe"]) -> list[dict]:
        """The kept decode rows of every probe (the runs of one batched generation) through one
        ``token_confidence`` call (its cost is mostly per call at a few rows), the columns split back per run."""
        kept = []
        for p in probes:
            kept.append(p.kept)
            p.kept = []
        rows = [r for k in kept for r in k]
        topk = {p.topk for p, k in zip(probes, kept) if k}
        if not rows:
            return [{} for _ in probes]
        if len(topk) > 1:  # one top-k for all (a batch shares it): else each run on its own
            return [p._frame(k) if k else {} for p, k in zip(probes, kept)]
        logits = (rows[0][4] if len(rows) == 1 else torch.cat([r[4] for r in rows])).cpu()
        sig = token_confidence(logits, torch.tensor([r[2] for r in rows]), topk.pop())
        out, off = [], 0
        for p, k in zip(probes, kept):
            if not k:
                out.append({})
                continue
            part = {c: v[off:off + len(k)] for c, v in sig.items()}
            off += len(k)
            out.append(p._frame(k, part))
        return out

    def _frame(self, k: list, sig: dict | None = None) -> dict:
        logits = None if sig is not None else (k[0][4] if len(k) == 1 else torch.cat([r[4] for r in k])).cpu()
        return {"tokens": [token_frame(self.run_id, [r[0] for r in k], [r[1] for r in k], [r[2] for r in k],
                                       [r[3] for r in k], [False] * len(k), logits, self.topk, sig)]}

    def pending_bytes(self) -> int:
        return sum(r[4].numel() * 4 for r in self.kept)


class AttentionProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.blocks: list[dict] = []  # reduced query blocks (a prefill), per step
        self.single: list[tuple[int, int, torch.Tensor, int | None]] = []  # decode rows (layer, pos, [H, S], window)
        self.kept_blocks: list[dict] = []
        self.kept_single: list[tuple[int, int, torch.Tensor, int | None]] = []
        self.kept_bytes = 0
        # decode rows the model reduced itself (the attn_stats seam): (layer, pos, [H, 3], key 0's position)
        self.reduced: list[tuple[int, int, torch.Tensor, int]] = []
        self.kept_reduced: list[tuple[int, int, torch.Tensor, int]] = []

    def listeners(self) -> dict:
        return _attention_seams(self)

    def on_probs(self, layer: int, p: torch.Tensor, q_start: int, window: int | None = None) -> None:
        if p.size(0) == 1:  # a decode row: kept, reduced with many others at the next flush
            self.single.append((layer, q_start, _kept(p[0]), window))
        else:  # a block of prefill rows: reduced at once, so nothing O(T x S) outlives it
            self.blocks.append({"layer": layer, **attention_stats(p.detach(), q_start, window)})

    def on_stats(self, layer: int, st: torch.Tensor, received: torch.Tensor, q_start: int,
                 window: int | None = None) -> None:
        if window is not None:
            raise ValueError("the attn_stats seam has no sliding windows (the native model has none)")
        if st.size(0) == 1:
            self.reduced.append((layer, q_start, st[0].detach(), max(0, q_start + 1 - received.size(-1))))
        else:
            self.blocks.append({"layer": layer, **reduced_stats(st.detach(), received.size(-1), q_start)})

    def collect(self, s: StepInfo) -> dict:
        self.kept_blocks += self.blocks
        self.kept_single += self.single
        self.kept_reduced += self.reduced
        self.kept_bytes += sum(r[2].numel() * r[2].element_size() for r in self.single + self.reduced)
        self.blocks, self.single, self.reduced = [], [], []
        return {}

    def flush(self) -> dict:
        blocks, single, reduced = self.kept_blocks, self.kept_single, self.kept_reduced
        self.kept_blocks, self.kept_single, self.kept_reduced, self.kept_bytes = [], [], [], 0
        recs = [{**b, "layer": np.full(b["pos"].size, b["layer"], np.int32)} for b in blocks]
        if reduced:  # one conversion for every kept decode row
            pos = np.array([r[1] for r in reduced], np.int32)
            recs.append({"pos": pos, "layer": np.array([r[0] for r in reduced], np.int32),
                         **reduced_row_stats(_stack([r[2] for r in reduced]), pos,
                                             np.array([r[3] for r in reduced]))})
        by_window: dict = defaultdict(list)
        for row in single:
            by_window[row[3]].append(row)
        for window, rows in by_window.items():
            # rows of consecutive (layer) calls share a key count: stack those, pad every run of them to the
            # longest, one reduction for all
            probs = _padded_cat([_stack([r[2] for r in run]) for _, run in groupby(rows, key=lambda r: r[2].shape)])
            pos = np.array([r[1] for r in rows], np.int32)
            key0 = np.maximum(0, pos + 1 - np.array([r[2].size(-1) for r in rows]))
            recs.append({"pos": pos, "layer": np.array([r[0] for r in rows], np.int32),
                         **attention_row_stats(probs, pos, key0, window)})
        return {"attention": attention_rows(self.run_id, recs)} if recs else {}

    def pending_bytes(self) -> int:
        return self.kept_bytes


class RoutingProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.seen: dict[int, list[Route]] = defaultdict(list)
        self.kept: list[tuple[int, dict[int, list[Route]]]] = []  # (start_pos, routes by layer) per step

    def listeners(self) -> dict:
        return {"routed": self.on_route}

    def on_route(self, layer: int, r: Route) -> None:
        self.seen[layer].append(r)

    def collect(self, s: StepInfo) -> dict:
        if self.seen:
            self.kept.append((s.start_pos, self.seen))
            self.seen = defaultdict(list)
        return {}

    def flush(self) -> dict:
        if not self.kept:
            return {}
        kept, self.kept = self.kept, []
        layers = sorted(kept[0][1])
        # every step's rows of one layer together, then all MoE layers in one call: per-call costs dominate
        routes = {i: [r for _, seen in kept for r in seen[i]] for i in layers}
        pos = np.concatenate([np.arange(p0, p0 + sum(r.indices.size(0) for r in seen[layers[0]]), dtype=np.int32)
                              for p0, seen in kept])
        cat = torch.cat
        math = [routes[i][0].math for i in layers]
        # on the CPU: routing rows are small, and a device-mapped model's layers live on several devices
        logits = [cat([r.logits.cpu() for r in routes[i]]).detach().float() for i in layers]
        rec = routing_records(cat([r.indices.cpu() for i in layers for r in routes[i]]).detach(),
                              cat([r.weights.cpu() for i in layers for r in routes[i]]).detach(),
                              cat([m.scores(lg) for m, lg in zip([_on_cpu(m) for m in math], logits)]),
                              cat([m.basis(lg) for m, lg in zip([_on_cpu(m) for m in math], logits)]))
        n, k = pos.size, rec["expert"].shape[1]
        return {"routing": Rows(self.run_id, {
            "pos": np.tile(np.repeat(pos, k), len(layers)),
            "layer": np.repeat(np.array(layers, np.int32), n * k), "slot": rec["slot"].ravel(),
            "expert": rec["expert"].ravel(), "weight": rec["weight"].ravel(), "score": rec["score"].ravel(),
            "margin": np.repeat(rec["margin"], k)})}


def _attention_seams(probe) -> dict:
    """The attention and KV probes' listeners: the model's own reductions (``attn_stats``) where the adapter offers
    them, a decode step's probabilities kept and reduced at the flush with many others (``attn_row``) where it offers
    that too, else the probabilities of every row (``attn_probs``)."""
    a = probe.adapter
    if not a.stats_seam:
        return {"attn_probs": probe.on_probs}
    return {"attn_stats": probe.on_stats, **({"attn_row": probe.on_probs} if getattr(a, "row_seam", False) else {})}


# an expert call of at least this many rows (a prefill's) is reduced when it happens: its output [N, D] and activation
# [N, I] would otherwise be held until the flush, several times what the forward itself holds at a long prompt
REDUCE_ROWS = 64


def expert_call(expert: int, y: torch.Tensor, act: torch.Tensor | None) -> tuple:
    """(expert, output, down projection input) of one expert call as the expert_extremes probes keep it: a few rows
    (a decode step's) as they are, reduced with many others at the flush; a call of ``REDUCE_ROWS`` rows or more
    reduced now, to each row's output norm [N] and largest |activation| [N] (``_own_extremes`` takes either)."""
    if act is not None and y.size(0) >= REDUCE_ROWS:
        return expert, out_norm(y.detach()), act_max(act.detach())
    return expert, _kept(y), None if act is None else _kept(act)


def _row_values(ts: list[torch.Tensor], reduce) -> torch.Tensor:
    """``reduce`` (a per-row reduction over the last dim) of every row of ``ts`` in order: 2-D tensors are reduced here
    in one call, 1-D ones were reduced already (``expert_call``)."""
    raw = [t for t in ts if t.dim() > 1]
    if len(raw) == len(ts):
        return reduce(torch.cat(ts))
    done = iter(reduce(torch.cat(raw)).split([t.size(0) for t in raw]) if raw else ())
    return torch.cat([next(done) if t.dim() > 1 else t.float() for t in ts])


def _kept(x: torch.Tensor) -> torch.Tensor:
    """``x`` to keep past its forward: detached where autograd tracks it (a decode step under inference mode is not:
    a listener called tens of times a step saves the detach's call)."""
    return x.detach() if x.requires_grad else x


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` on the first tensor's device (a device-mapped model spreads layers over several)."""
    return torch.stack([x.to(xs[0].device) for x in xs])


def _padded_cat(xs: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` (first dim) of tensors whose last dims differ (decode rows over a growing cache), each zero-padded
    to the longest, on the first tensor's device."""
    s_max = max(x.size(-1) for x in xs)
    return torch.cat([torch.nn.functional.pad(x, (0, s_max - x.size(-1))).to(xs[0].device) for x in xs])


def _on_cpu(math):
    """A ``RouterMath`` whose selection bias is on the CPU (where routing rows are reduced)."""
    if math.bias is None or math.bias.device.type == "cpu":
        return math
    return replace(math, bias=math.bias.cpu())


class _NormProbe(Probe):
    """L2 norms over the last dim of what one seam hands over, per layer: decode rows are kept for the next
    flush (one reduction over all layers and steps is cheaper); a prefill block is reduced at once, so nothing
    O(T x D) per layer is held at long context."""

    seam = ""

    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.seen: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.kept: list[tuple[int, dict[int, list[torch.Tensor]]]] = []  # (start_pos, values by layer) per step

    def listeners(self) -> dict:
        return {self.seam: self.on_value}

    def on_value(self, layer: int, x: torch.Tensor) -> None:
        self.seen[layer].append(_kept(x[0]) if x.size(1) == 1 else x[0].detach().float().norm(dim=-1, keepdim=True))

    def collect(self, s: StepInfo) -> dict:
        if self.seen:
            self.kept.append((s.start_pos, self.seen))
            self.seen = defaultdict(list)
        return {}

    def norms(self) -> tuple[list[int], np.ndarray, torch.Tensor]:
        """(layers, positions [T], norms [L, T, ...]) of the kept steps, and the buffer emptied."""
        kept, self.kept = self.kept, []
        layers = sorted(kept[0][1])
        per_layer = []
        for i in layers:
            xs = [x for _, seen in kept for x in seen[i]]
            if all(x.size(-1) != 1 for x in xs):  # decode rows only: one norm over all of them
                per_layer.append(torch.cat(xs).float().norm(dim=-1))
            else:
                per_layer.append(torch.cat([x if x.size(-1) == 1 else x.float().norm(dim=-1, keepdim=True)
                                            for x in xs])[..., 0])
        pos = np.concatenate([np.arange(p0, p0 + sum(x.size(0) for x in seen[layers[0]]), dtype=np.int32)
                              for p0, seen in kept])
        return layers, pos, torch.stack([x.cpu() for x in per_layer])


class ResidNormProbe(_NormProbe):
    seam = "resid_post"

    def flush(self) -> dict:
        if not self.kept:
            return {}
        layers, pos, norms = self.norms()  # [L, T]
        return {"resid_norm": Rows(self.run_id, {
            "pos": np.tile(pos, len(layers)), "layer": np.repeat(np.array(layers, np.int32), pos.size),
            "norm": norms.cpu().numpy().ravel().astype(np.float64)})}


class HeadNormProbe(_NormProbe):
    seam = "head_out"

    def flush(self) -> dict:
        if not self.kept:
            return {}
        layers, pos, norms = self.norms()  # [L, T, H]
        _, t, h = norms.shape
        return {"head_norm": Rows(self.run_id, {
            "pos": np.tile(np.repeat(pos, h), len(layers)), "layer": np.repeat(np.array(layers, np.int32), t * h),
            "head": np.tile(np.arange(h, dtype=np.int32), len(layers) * t),
            "norm": norms.cpu().numpy().ravel().astype(np.float64)})}


class KVProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.received: dict[int, torch.Tensor] = {}  # by absolute position
        self.single: list[tuple[int, int, torch.Tensor]] = []  # decode rows (layer, key 0's position, [H, S])
        self.kept_single: list[tuple[int, int, torch.Tensor]] = []
        self.kept_bytes = 0
        self.sizes: list[tuple[int, list]] = []  # (step, [(layer, cached tokens, bytes)]) per kept step

    def listeners(self) -> dict:
        return _attention_seams(self)

    def on_probs(self, layer: int, p: torch.Tensor, q_start: int, window: int | None = None) -> None:
        # key j is position j, or q_end - S + j once a sliding-window cache holds only the newest S
        offset = max(0, q_start + p.size(0) - p.size(-1))
        if p.size(0) == 1:
            self.single.append((layer, offset, _kept(p[0])))
        else:
            add_received(self.received, layer, attention_received(p.detach()), offset)

    def on_stats(self, layer: int, st: torch.Tensor, received: torch.Tensor, q_start: int,
                 window: int | None = None) -> None:
        offset = max(0, q_start + st.size(0) - received.size(-1))
        if st.size(0) == 1:  # kept as one "head" summed already: [1, S]
            self.single.append((layer, offset, received.detach()[None]))
        else:
            add_received(self.received, layer, received.detach().float(), offset)

    def _add_kept(self) -> None:
        """Add the kept decode rows to the running totals: the rows of one key offset summed over heads (one sum
        per run of same-shaped rows), padded to the longest, and one sum per layer."""
        rows, self.kept_single, self.kept_bytes = self.kept_single, [], 0
        by_offset: dict[int, list] = defaultdict(list)
        for row in rows:
            by_offset[row[1]].append(row)
        for offset, group in by_offset.items():
            got = _padded_cat([_stack([r[2] for r in run]).float().sum(1)
                               for _, run in groupby(group, key=lambda r: r[2].shape)])  # [n, S] over heads
            layers = torch.tensor([r[0] for r in group], device=got.device)
            for layer in dict.fromkeys(r[0] for r in group):
                add_received(self.received, layer, got[layers == layer].sum(0), offset)

    def collect(self, s: StepInfo) -> dict:
        self.kept_single += self.single
        self.kept_bytes += sum(r[2].numel() * r[2].element_size() for r in self.single)
        self.single = []
        self.sizes.append((s.index, self.adapter.kv_sizes()))
        if not (s.final or s.index == 0):
            return {}
        self._add_kept()
        tok = [kv_token_cols(layer, n, kv_token_norms(first, second), self.received, first_pos)
               for layer, n, _, first, second, first_pos in self.adapter.kv_state()]
        return kv_rows(s.run_id, s.index, [], tok)

    def flush(self) -> dict:
        self._add_kept()
        sizes, self.sizes = self.sizes, []
        return kv_rows(self.run_id, [step for step, rows in sizes for _ in rows], [r for _, rows in sizes for r in rows],
                       [])

    def pending_bytes(self) -> int:
        return self.kept_bytes


class ExpertExtremesProbe(Probe):
    """Per position x MoE layer, the chosen experts' largest output norm and largest activation inside them.

    Where the adapter offers the ``expert_out`` seam (our model), each chosen expert's output and its down
    projection's input are read as the model computed them in its own expert calls: references kept per forward,
    reduced at the flush in one norm and one max per layer. Elsewhere ``workbench.capture.experts.expert_internals``
    runs the experts again on their input rows (the ``expert_in`` seam) for the choice the ``routed`` seam names,
    all kept steps of a layer in one call (per-expert calls dominate a decode step's cost); a layer whose experts the
    workbench cannot run exactly has no ``expert_in`` and records nothing."""

    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.own = bool(getattr(adapter, "expert_out_seam", False))
        self.x: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.idx: dict[int, list[torch.Tensor]] = defaultdict(list)
        # expert_out: per layer, per forward, the (expert, output, down projection input) calls in the model's order
        self.calls: dict[int, list[list[tuple]]] = defaultdict(list)
        self.kept: list[tuple[int, dict[int, tuple]]] = []  # (start_pos, by layer)
        self.kept_bytes = 0

    def listeners(self) -> dict:
        if self.own:
            return {"routed": self.on_route, "expert_out": self.on_out}
        return {"routed": self.on_route, "expert_in": self.on_in}

    def on_in(self, layer: int, x: torch.Tensor) -> None:
        self.x[layer].append(x.detach().reshape(-1, x.size(-1)))

    def on_route(self, layer: int, r: Route) -> None:
        self.idx[layer].append(_kept(r.indices))
        if self.own:
            self.calls[layer].append([])

    def on_out(self, layer: int, expert: int, y: torch.Tensor, act: torch.Tensor | None) -> None:
        forwards = self.calls.get(layer)
        if forwards:  # a call before its layer's routing (none in our model) is never paired up
            forwards[-1].append(expert_call(expert, y, act))

    def collect(self, s: StepInfo) -> dict:
        if self.own:
            return self._collect_own(s)
        xs, idxs = self.x, self.idx
        self.x, self.idx = defaultdict(list), defaultdict(list)
        step = {}
        for layer in sorted(xs):
            if len(xs[layer]) != len(idxs.get(layer, ())):  # a forward we cannot pair up: no rows, never wrong ones
                continue
            x, idx = torch.cat(xs[layer]), torch.cat([i.to(xs[layer][0].device) for i in idxs[layer]])
            if x.size(0) == idx.size(0):
                step[layer] = (x, idx)
                self.kept_bytes += x.numel() * x.element_size()
        if step:
            self.kept.append((s.start_pos, step))
        return {}

    def _collect_own(self, s: StepInfo) -> dict:
        calls, idxs = self.calls, self.idx
        self.calls, self.idx = defaultdict(list), defaultdict(list)
        step = {}
        for layer in sorted(idxs):
            forwards = calls.get(layer, [])
            if len(forwards) != len(idxs[layer]) or any(a is None for f in forwards for _, _, a in f):
                continue  # a forward we cannot pair up: no rows, never wrong ones
            step[layer] = (idxs[layer], forwards)
            self.kept_bytes += sum(t.numel() * t.element_size() for f in forwards for _, y, a in f for t in (y, a))
        if step:
            self.kept.append((s.start_pos, step))
        return {}

    def flush(self) -> dict:
        return self.flush_many([self])[0]

    @classmethod
    def flush_many(cls, probes: list["ExpertExtremesProbe"]) -> list[dict]:
        """Every probe's kept rows of a layer through the experts in one ``expert_internals`` call (per-expert
        calls dominate: the rows of a batched generation share them), the results split back per probe; rows
        read from the model's own expert calls (``expert_out``) are reduced per probe, nothing runs again."""
        if probes and probes[0].own:
            return [p._flush_own() for p in probes]
        kept = []
        for p in probes:
            kept.append(p.kept)
            p.kept, p.kept_bytes = [], 0
        cols: list[list[dict[str, np.ndarray]]] = [[] for _ in probes]
        for layer in sorted({layer for k in kept for _, step in k for layer in step}):
            parts = [(j, [(p0, step[layer]) for p0, step in k if layer in step]) for j, k in enumerate(kept)]
            parts = [(j, steps) for j, steps in parts if steps]
            xs = [xi for _, steps in parts for _, (xi, _) in steps]
            x = torch.cat([xi.to(xs[0].device) for xi in xs])
            idx = torch.cat([ii.to(xs[0].device) for _, steps in parts for _, (_, ii) in steps])
            try:
                experts = probes[parts[0][0]].adapter.parts(layer).get("experts")
                got = _grouped_internals(experts, x, idx) or expert_internals(experts, x, idx)
            except Exception:  # noqa: BLE001 - an experts module we cannot run: nothing, never a wrong row
                got = None
            if got is None:
                continue
            every = _extremes(*got, idx)
            off = 0
            for j, steps in parts:
                n = sum(xi.size(0) for _, (xi, _) in steps)
                cols[j].append({"pos": np.concatenate([np.arange(p0, p0 + xi.size(0), dtype=np.int32)
                                                       for p0, (xi, _) in steps]),
                                "layer": np.full(n, layer, np.int32),
                                **{k: v[off:off + n] for k, v in every.items()}})
                off += n
        return [{"expert_extremes": Rows(p.run_id, {k: np.concatenate([c[k] for c in cs]) for k in cs[0]})}
                if cs else {} for p, cs in zip(probes, cols)]

    def _flush_own(self) -> dict:
        """The kept expert calls of every step, per layer: one norm over every output and one max over every down
        projection input, each placed at its (row, slot) of the layer's choice (an expert's rows come in row order,
        the experts in increasing order, as ``MoE.forward`` calls them). A forward whose calls are not its choice's
        (an expert's row count differs) gives no rows, never wrong ones."""
        kept, self.kept, self.kept_bytes = self.kept, [], 0
        n_e = self.adapter.summary.n_routed_experts
        cols = []
        for layer in sorted({layer for _, step in kept for layer in step}):
            pos, idxs, calls = [], [], []  # per forward
            for p0, step in kept:
                for idx, fwd in zip(*step.get(layer, ((), ()))):
                    pos.append(np.arange(p0, p0 + idx.size(0), dtype=np.int32))
                    p0 += idx.size(0)
                    idxs.append(idx)
                    calls.append(fwd)
            if not idxs:
                continue
            every, where = _own_extremes(idxs, calls, n_e)
            if every is None:
                continue
            pos = np.concatenate([pos[f] for f in where])  # only the forwards whose calls match
            cols.append({"pos": pos, "layer": np.full(pos.size, layer, np.int32), **every})
        if not cols:
            return {}
        return {"expert_extremes": Rows(self.run_id, {k: np.concatenate([c[k] for c in cols]) for k in cols[0]})}

    def pending_bytes(self) -> int:
        return self.kept_bytes


def dispatch(probes, batched: bool = False) -> dict[str, Callable]:
    """One dispatching listener per seam, calling every probe that listens there (a seam one probe listens on gets
    that probe's own listener). ``batched``: the dispatcher takes the batch's every row (``batched = True``, as a
    batch-wide probe's listeners do)."""
    by_seam: dict[str, list[Callable]] = defaultdict(list)
    for probe in probes:
        for seam, fn in probe.listeners().items():
            by_seam[seam].append(fn)

    def fan(fns: list[Callable]) -> Callable:
        if len(fns) == 1:
            return fns[0]

        def call(*a) -> None:
            for f in fns:
                f(*a)
        if batched:
            call.batched = True  # type: ignore[attr-defined]
        return call
    return {seam: fan(fns) for seam, fns in by_seam.items()}


_LAST = torch.iinfo(torch.int64).max


def _extremes(norm: torch.Tensor, act: torch.Tensor, idx: torch.Tensor) -> dict[str, np.ndarray]:
    """The expert_extremes columns of per-(row, slot) output norms and activations [N, K] (NaN: no expert)."""
    norm, act = (t.nan_to_num(float("-inf")) for t in (norm, act))
    ie, ia = norm.argmax(1), act.argmax(1)
    rows, idx = torch.arange(idx.size(0)), idx.cpu()
    return {"max_out_norm": norm[rows, ie].double().numpy(), "max_out_expert": idx[rows, ie].numpy().astype(np.int32),
            "max_act": act[rows, ia].double().numpy(), "max_act_expert": idx[rows, ia].numpy().astype(np.int32)}


def _own_extremes(idxs: list[torch.Tensor], calls: list[list], n_e: int):
    """One layer's expert_extremes from the expert calls its forwards kept (their choices [N, K] and, per forward,
    the calls (expert, output, down projection input) in ``MoE.forward``'s order): (the columns over the forwards
    whose calls hold their choice's rows, those forwards' numbers), or (None, []) when none does. Each output's
    norm and each input's max are placed at their (row, slot): an expert's rows come in row order, the experts in
    increasing order, so a stable sort of (forward, expert) keys gives every call row its slot."""
    dev = idxs[0].device
    n_f = len(idxs)
    flat = torch.cat([i.reshape(-1).to(dev) for i in idxs])
    fid = torch.repeat_interleave(torch.arange(n_f, device=dev), torch.tensor([i.numel() for i in idxs], device=dev))
    valid = (flat >= 0) & (flat < n_e)
    key = torch.where(valid, fid * n_e + flat, _LAST)
    want = torch.bincount(key[valid], minlength=n_f * n_e).view(n_f, n_e)
    have = torch.zeros(n_f * n_e, dtype=want.dtype)
    slots = [f * n_e + e for f, fwd in enumerate(calls) for e, _, _ in fwd]
    have[slots] = torch.tensor([y.size(0) for fwd in calls for _, y, _ in fwd], dtype=want.dtype)
    good = (want.cpu() == have.view(n_f, n_e)).all(1)
    where = list(range(n_f))
    if not bool(good.all()):
        where = good.nonzero().squeeze(1).tolist()
        if not where:
            return None, []
        idxs, calls = [idxs[f] for f in where], [calls[f] for f in where]
        keep = good.to(dev)[fid]
        key, valid = key[keep], valid[keep]
    idx = torch.cat([i.to(dev) for i in idxs])
    ys = [y for fwd in calls for _, y, _ in fwd]
    acts = [a for fwd in calls for _, _, a in fwd]
    norm = torch.full((key.numel(),), float("nan"), device=dev)
    act = torch.full((key.numel(),), float("nan"), device=dev)
    if ys:
        order = torch.argsort(key, stable=True)[:int(valid.sum())]
        norm[order] = _row_values(ys, out_norm).to(dev)
        act[order] = _row_values(acts, act_max).to(dev)
    return _extremes(norm.view(idx.shape).cpu(), act.view(idx.shape).cpu(), idx), where



def _plain_mlp(m: nn.Module) -> bool:
    """Our SwiGLU expert, run as ``MLP.forward`` with nothing hooked on it or its projections (a hook, e.g. a
    fault's, is what ``expert_internals`` runs by calling the expert)."""
    return (isinstance(m, MLP) and type(m).forward is MLP.forward and "forward" not in m.__dict__
            and all(not (x._forward_hooks or x._forward_pre_hooks) and getattr(x, "bias", None) is None
                    for x in (m, m.w1, m.w2, m.w3, m.hook_out)))


GROUPED_BYTES = 256 << 20  # the grouped rows' largest buffer; past it, one call per expert
# the stacked copy of one layer's expert weights lives as long as the model: past this size (a large model, where
# the copy would add its experts' memory again) the experts are called one by one instead
STACKED_BYTES = 64 << 20


def _grouped_internals(experts, x: torch.Tensor, indices: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``expert_internals`` of a ModuleList of our plain experts in three batched matmuls over all experts at once
    (each expert's rows zero-padded to the busiest one's; the experts' weights stacked once per weight version),
    instead of one call per expert; None where it does not apply (then ``expert_internals``). Equal to it within
    fp32 summation order (tests/test_record_speed.py)."""
    if not (isinstance(experts, nn.ModuleList) and len(experts) and all(_plain_mlp(m) for m in experts)):
        return None
    n, k = indices.shape
    ws = [(m.w1.weight, m.w3.weight, m.w2.weight) for m in experts]
    if sum(w.numel() * w.element_size() for t in ws for w in t) > STACKED_BYTES:
        return None
    key = tuple((w.data_ptr(), w._version) for t in ws for w in t)
    cached = experts.__dict__.get("_workbench_stacked")  # on the module: it goes when the model goes
    if cached is None or cached[0] != key:
        # transposed and contiguous, as bmm reads them: [E, D, I] x2, [E, I, D]
        cached = (key, tuple(torch.stack([t[j] for t in ws]).mT.contiguous() for j in range(3)))
        experts.__dict__["_workbench_stacked"] = cached
    w1, w3, w2 = cached[1]
    e_n, d, inter = w1.shape
    flat = indices.reshape(-1).to(w1.device)
    valid = (flat >= 0) & (flat < e_n)
    pairs = valid.nonzero().squeeze(1)  # (row, slot) pairs naming a real expert, row-major
    ex = flat[pairs]
    order = torch.argsort(ex, stable=True)
    ex, pairs = ex[order], pairs[order]
    counts = torch.bincount(ex, minlength=e_n)
    n_max = int(counts.max()) if ex.numel() else 0
    if n_max == 0:
        return torch.full((n, k), float("nan")), torch.full((n, k), float("nan"))
    # padding past twice the real rows (few rows over many experts: a prefill of a few tokens) costs more than
    # the per-expert calls it saves; so does a buffer past GROUPED_BYTES
    if e_n * n_max > 2 * ex.numel() or e_n * n_max * max(inter, d) * 4 > GROUPED_BYTES:
        return None
    rank = torch.arange(ex.numel(), device=ex.device) - (torch.cumsum(counts, 0) - counts)[ex]
    xg = x.new_zeros(e_n, n_max, d, dtype=w1.dtype)
    xg[ex, rank] = x[pairs // k].to(w1.device, w1.dtype)
    with torch.no_grad():
        h = torch.nn.functional.silu(torch.bmm(xg, w1)) * torch.bmm(xg, w3)  # [E, n_max, I]
        y = torch.bmm(h, w2)  # [E, n_max, D]
        norm = torch.full((n * k,), float("nan"), device=w1.device)
        act = torch.full((n * k,), float("nan"), device=w1.device)
        norm[pairs] = out_norm(y[ex, rank])
        act[pairs] = act_max(h[ex, rank])
    return norm.view(n, k).cpu(), act.view(n, k).cpu()


class StepsProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.kept: list[tuple[int, int, float]] = []  # (step, tokens fed, wall ms)

    def collect(self, s: StepInfo) -> dict:
        self.kept.append((s.index, len(s.input_ids), s.wall_ms))
        return {}

    def flush(self) -> dict:
        if not self.kept:
            return {}
        kept, self.kept = self.kept, []
        return {"steps": steps_rows(self.run_id, *zip(*kept))}



PROBE_CLASSES: dict[str, type[Probe]] = {"tokens": TokensProbe, "kv": KVProbe, "attention": AttentionProbe,
                                  "routing": RoutingProbe, "resid_norm": ResidNormProbe, "head_norm": HeadNormProbe,
                                  "expert_extremes": ExpertExtremesProbe, "steps": StepsProbe}
assert set(PROBE_CLASSES) == set(SIGNALS), "every declared signal has its probe class here, and nothing else"
