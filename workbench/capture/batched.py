"""Probes of a batched generation that take the batch's ``[B, ...]`` tensors (issue 29).

A batch's rows used to keep one probe per row, each handed its row's slice at every seam (``recorder.fan_out``):
some 13k Python calls per 1,000 tokens at x8. Here one probe per signal listens for the whole batch: a seam call
keeps the batch's tensors as they come (one call per seam and forward), and a flush reduces every kept forward of
every row in one pass, then splits the result by row: rows are split only when written.

The rows of one batched generation are fed the same positions in every forward (``model.generate.BatchStep``); a
row whose prompt is longer than the shortest spends several forwards in its prefill, and a finished row is still
fed (its values are never kept). So each kept forward is one entry ``(forward, start position, tokens fed,
values)``, and row ``b`` owns the entries from its first forward to the last one its steps have collected
(``BatchTape``): a flush writes, for each row flushed, the entries it collected since its last flush, never what a
forward that failed half-way left (that never becomes an entry).

Each run's tables equal its single recording (tests/test_batch.py, tests/test_batched_probes.py).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np
import torch

from workbench.capture.adapters.base import Adapter, Route
from workbench.capture.experts import expert_internals
from workbench.capture.probes import (
    StepInfo,
    _extremes,
    _grouped_internals,
    _on_cpu,
    _own_extremes,
    _padded_cat,
    _stack,
    dispatch,
    expert_call,
)
from workbench.capture.rows import attention_rows, kv_rows, kv_token_cols
from workbench.data.rows import Rows
from workbench.data.store import merge_batches
from workbench.probes.signals import attention_row_stats, kv_token_norms, reduced_row_stats, routing_records


class BatchTape:
    """Which kept forwards belong to which row: ``done[b]``, the last forward row b's finished steps cover;
    ``flushed[b]``, the last one written; ``live[b]``, whether the row still records."""

    def __init__(self, n_rows: int):
        self.n = n_rows
        self.forward = -1  # the last forward that ran to its end
        self.done = [-1] * n_rows
        self.flushed = [-1] * n_rows
        self.live = [True] * n_rows

    def span(self, rows: list[int]) -> tuple[int, int]:
        """(lo, hi]: the forwards some row of ``rows`` has collected and not yet written."""
        return min(self.flushed[b] for b in rows), max(self.done[b] for b in rows)

    def keep_from(self) -> int:
        """Entries up to this forward are written for every live row (and the others never will be)."""
        live = [self.flushed[b] for b in range(self.n) if self.live[b]]
        return min(live) if live else self.forward


class BatchProbe:
    """One signal's probe over all rows of a batch (``run_ids[b]``: row b's run)."""

    def __init__(self, adapter: Adapter, run_ids: list[str], tape: BatchTape):
        self.adapter, self.run_ids, self.tape = adapter, run_ids, tape
        self.entries: list[tuple[int, int, int, object]] = []  # (forward, start position, tokens fed, values)
        self.kept_bytes = 0

    def listeners(self) -> dict[str, Callable]:
        return {}

    def seen(self) -> object | None:
        """What this forward's seam calls left (then emptied), or None."""
        return None

    def end_forward(self, start_pos: int, n_fed: int) -> None:
        got = self.seen()
        if got is not None:
            self.entries.append((self.tape.forward, start_pos, n_fed, got))

    def collect(self, b: int, s: StepInfo) -> dict:
        """Row b's rows of one finished step that are written with it (most probes keep everything for the flush)."""
        return {}

    def flush(self, rows: list[int]) -> list[dict]:
        """Each of ``rows``' rows of the forwards it collected since its last flush (the tape is advanced by the
        caller, once every probe has flushed)."""
        return [{} for _ in rows]

    def ranges(self, rows: list[int]) -> tuple[list, list[np.ndarray]]:
        """(the entries some row of ``rows`` is to write, per row a bool mask over those entries)."""
        lo, hi = self.tape.span(rows)
        got = [e for e in self.entries if lo < e[0] <= hi]
        f = np.array([e[0] for e in got], np.int64)
        return got, [(f > self.tape.flushed[b]) & (f <= self.tape.done[b]) for b in rows]

    def prune(self) -> None:
        """Drop the entries every live row has written (after a flush has advanced the tape)."""
        keep = self.tape.keep_from()
        if self.entries and self.entries[0][0] <= keep:
            self.entries = [e for e in self.entries if e[0] > keep]
        self.kept_bytes = self.entry_bytes()

    def entry_bytes(self) -> int:
        return 0

    def pending_bytes(self) -> int:
        return self.kept_bytes


def _positions(got: list, mask: np.ndarray) -> np.ndarray:
    """The positions of the masked entries, in order."""
    parts = [np.arange(p0, p0 + n, dtype=np.int32) for (_, p0, n, _), m in zip(got, mask) if m]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _batched(fn: Callable) -> Callable:
    fn.batched = True  # type: ignore[attr-defined]  # the adapter hands every row ([B, ...])
    return fn


class _NormBatch(BatchProbe):
    """resid_norm / head_norm: each forward's ``[B, T, ...]`` values; a decode forward's kept as they are and
    normed at the flush with every other kept forward, a longer forward's normed at once."""

    seam, table = "", ""

    def __init__(self, adapter, run_ids, tape):
        super().__init__(adapter, run_ids, tape)
        self._seen: dict[int, torch.Tensor] = {}
        self.kept_bytes = 0

    def listeners(self) -> dict:
        def on_value(layer: int, x: torch.Tensor) -> None:
            x = x.detach()
            self._seen[layer] = x[:, 0] if x.size(1) == 1 else x.float().norm(dim=-1)  # [B, ...] or [B, T(, H)]
        return {self.seam: on_value}

    def seen(self):
        if not self._seen:
            return None
        got, self._seen = self._seen, {}
        self.kept_bytes += sum(x.numel() * x.element_size() for x in got.values())
        return got

    def flush(self, rows: list[int]) -> list[dict]:
        got, masks = self.ranges(rows)
        if not got:
            return [{} for _ in rows]
        layers = sorted(got[0][3])
        dec = [j for j, e in enumerate(got) if e[2] == 1]
        # per layer: every entry's norms [B, T(, H)] (decode entries normed together: one call per layer)
        per_layer = []
        for layer in layers:
            vals: list = [None] * len(got)
            if dec:
                normed = torch.stack([got[j][3][layer] for j in dec]).float().norm(dim=-1).cpu()  # [nD, B(, H)]
                for k, j in enumerate(dec):
                    vals[j] = normed[k][:, None]  # [B, 1(, H)]
            for j, e in enumerate(got):
                if vals[j] is None:
                    vals[j] = e[3][layer].cpu()
            per_layer.append(torch.cat(vals, 1).numpy())  # [B, T_all(, H)]
        lens = np.array([e[2] for e in got])
        out = []
        for b, mask in zip(rows, masks):
            if not mask.any():
                out.append({})
                continue
            cols = np.repeat(mask, lens)  # the entries' token columns of this row
            pos = _positions(got, mask)
            norms = np.stack([v[b][cols] for v in per_layer])  # [L, T(, H)]
            out.append({self.table: self._rows(self.run_ids[b], layers, pos, norms)})
        return out

    def _rows(self, run_id: str, layers: list[int], pos: np.ndarray, norms: np.ndarray) -> Rows:
        raise NotImplementedError

    def entry_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for e in self.entries for x in e[3].values())

    def pending_bytes(self) -> int:
        return self.kept_bytes


class ResidNormBatch(_NormBatch):
    seam, table = "resid_post", "resid_norm"

    def _rows(self, run_id, layers, pos, norms):
        return Rows(run_id, {"pos": np.tile(pos, len(layers)), "layer": np.repeat(np.array(layers, np.int32), pos.size),
                             "norm": norms.ravel().astype(np.float64)})


class HeadNormBatch(_NormBatch):
    seam, table = "head_out", "head_norm"

    def _rows(self, run_id, layers, pos, norms):
        _, t, h = norms.shape
        return Rows(run_id, {
            "pos": np.tile(np.repeat(pos, h), len(layers)), "layer": np.repeat(np.array(layers, np.int32), t * h),
            "head": np.tile(np.arange(h, dtype=np.int32), len(layers) * t), "norm": norms.ravel().astype(np.float64)})


def _row_index(got: list, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """For the entries' routed rows laid end to end (each entry's B * T rows, batch-major): each one's batch row
    and entry."""
    row = np.concatenate([np.repeat(np.arange(n_rows), e[2]) for e in got])
    ent = np.concatenate([np.full(n_rows * e[2], j) for j, e in enumerate(got)])
    return row, ent


class RoutingBatch(BatchProbe):
    def __init__(self, adapter, run_ids, tape):
        super().__init__(adapter, run_ids, tape)
        self._seen: dict[int, Route] = {}

    def listeners(self) -> dict:
        def on_route(layer: int, r: Route) -> None:
            self._seen[layer] = r
        return {"routed": on_route}

    def seen(self):
        got, self._seen = self._seen, {}
        return got or None

    def flush(self, rows: list[int]) -> list[dict]:
        got, masks = self.ranges(rows)
        if not got:
            return [{} for _ in rows]
        layers = sorted(got[0][3])
        cat = torch.cat
        routes = {i: [e[3][i] for e in got] for i in layers}
        math = [_on_cpu(routes[i][0].math) for i in layers]
        logits = [cat([r.logits.cpu() for r in routes[i]]).detach().float() for i in layers]
        rec = routing_records(cat([r.indices.cpu() for i in layers for r in routes[i]]).detach(),
                              cat([r.weights.cpu() for i in layers for r in routes[i]]).detach(),
                              cat([m.scores(lg) for m, lg in zip(math, logits)]),
                              cat([m.basis(lg) for m, lg in zip(math, logits)]))
        row, ent = _row_index(got, self.tape.n)
        n_all, k = row.size, rec["expert"].shape[1]
        out = []
        for b, mask in zip(rows, masks):
            if not mask.any():
                out.append({})
                continue
            sel = np.flatnonzero((row == b) & mask[ent])  # this row's routed rows, in position order
            pos = _positions(got, mask)
            idx = (np.arange(len(layers))[:, None] * n_all + sel[None]).ravel()  # layer-major
            out.append({"routing": Rows(self.run_ids[b], {
                "pos": np.tile(np.repeat(pos, k), len(layers)),
                "layer": np.repeat(np.array(layers, np.int32), pos.size * k),
                "slot": rec["slot"][idx].ravel(), "expert": rec["expert"][idx].ravel(),
                "weight": rec["weight"][idx].ravel(), "score": rec["score"][idx].ravel(),
                "margin": np.repeat(rec["margin"][idx], k)})})
        return out


class ExpertExtremesBatch(BatchProbe):
    """expert_extremes from the model's own expert calls (the ``expert_out`` seam): each call holds every row's
    tokens of that expert; reduced per layer over all kept forwards, then split by row."""

    def __init__(self, adapter, run_ids, tape):
        super().__init__(adapter, run_ids, tape)
        self._idx: dict[int, torch.Tensor] = {}
        self._calls: dict[int, list] = {}
        self.kept_bytes = 0

    def listeners(self) -> dict:
        def on_route(layer: int, r: Route) -> None:
            self._idx[layer] = r.indices.detach()
            self._calls[layer] = []

        def on_out(layer: int, expert: int, y: torch.Tensor, act: torch.Tensor | None) -> None:
            calls = self._calls.get(layer)
            if calls is not None:
                calls.append(expert_call(expert, y, act))
        return {"routed": on_route, "expert_out": on_out}

    def seen(self):
        idxs, calls = self._idx, self._calls
        self._idx, self._calls = {}, {}
        got = {layer: (idx, calls[layer]) for layer, idx in idxs.items()
               if all(a is not None for _, _, a in calls[layer])}
        self.kept_bytes += sum(t.numel() * t.element_size() for _, c in got.values() for _, y, a in c for t in (y, a))
        return got or None

    def flush(self, rows: list[int]) -> list[dict]:
        got, masks = self.ranges(rows)
        if not got:
            return [{} for _ in rows]
        n_e = self.adapter.summary.n_routed_experts
        row, ent = _row_index(got, self.tape.n)
        starts = np.concatenate([[0], np.cumsum([self.tape.n * e[2] for e in got])])
        per_layer = []  # (routed rows laid end to end [n], the extremes columns)
        for layer in sorted({layer for e in got for layer in e[3]}):
            fwd = [(j, e[3][layer]) for j, e in enumerate(got) if layer in e[3]]
            every, where = _own_extremes([idx for _, (idx, _) in fwd], [c for _, (_, c) in fwd], n_e)
            if every is None:
                continue
            g = np.concatenate([starts[fwd[f][0]] + np.arange(fwd[f][1][0].size(0)) for f in where])
            per_layer.append((layer, g, every))
        return _split_extremes(self, got, rows, masks, row, ent, starts, per_layer)

    def pending_bytes(self) -> int:
        return self.kept_bytes

    def entry_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.entries for _, c in e[3].values() for _, y, a in c
                   for t in (y, a))


class ExpertRerunBatch(BatchProbe):
    """expert_extremes where the model's expert calls are not handed over (transformers models): each forward's
    expert input rows (``expert_in``) and choice (``routed``) kept, and at the flush every kept row of a layer run
    through its experts once (``_grouped_internals`` or ``expert_internals``, as ``ExpertExtremesProbe``), the
    results split by row."""

    def __init__(self, adapter, run_ids, tape):
        super().__init__(adapter, run_ids, tape)
        self._x: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._idx: dict[int, list[torch.Tensor]] = defaultdict(list)

    def listeners(self) -> dict:
        def on_in(layer: int, x: torch.Tensor) -> None:
            self._x[layer].append(x.detach().reshape(-1, x.size(-1)))

        def on_route(layer: int, r: Route) -> None:
            self._idx[layer].append(r.indices.detach())
        return {"routed": on_route, "expert_in": on_in}

    def seen(self):
        xs, idxs = self._x, self._idx
        self._x, self._idx = defaultdict(list), defaultdict(list)
        got = {}
        for layer in sorted(xs):
            if len(xs[layer]) != 1 or len(idxs.get(layer, ())) != 1:  # a forward we cannot pair up: no rows
                continue
            x, idx = xs[layer][0], idxs[layer][0].to(xs[layer][0].device)
            if x.size(0) == idx.size(0):
                got[layer] = (x, idx)
                self.kept_bytes += x.numel() * x.element_size()
        return got or None

    def entry_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for e in self.entries for x, _ in e[3].values())

    def flush(self, rows: list[int]) -> list[dict]:
        got, masks = self.ranges(rows)
        if not got:
            return [{} for _ in rows]
        row, ent = _row_index(got, self.tape.n)
        starts = np.concatenate([[0], np.cumsum([self.tape.n * e[2] for e in got])])
        per_layer = []
        for layer in sorted({layer for e in got for layer in e[3]}):
            fwd = [j for j, e in enumerate(got) if layer in e[3]]
            xs = [got[j][3][layer][0] for j in fwd]
            x = torch.cat([xi.to(xs[0].device) for xi in xs])
            idx = torch.cat([got[j][3][layer][1].to(xs[0].device) for j in fwd])
            try:
                experts = self.adapter.parts(layer).get("experts")
                res = _grouped_internals(experts, x, idx) or expert_internals(experts, x, idx)
            except Exception:  # noqa: BLE001 - an experts module we cannot run: nothing, never a wrong row
                res = None
            if res is None:
                continue
            g = np.concatenate([starts[j] + np.arange(got[j][3][layer][0].size(0)) for j in fwd])
            per_layer.append((layer, g, _extremes(*res, idx)))
        return _split_extremes(self, got, rows, masks, row, ent, starts, per_layer)


def _split_extremes(probe: BatchProbe, got: list, rows: list[int], masks: list, row: np.ndarray, ent: np.ndarray,
                    starts: np.ndarray, per_layer: list) -> list[dict]:
    """Each row's expert_extremes rows of the layers' columns over the entries' routed rows ``g``."""
    p0 = np.array([e[1] for e in got], np.int64)
    t = np.array([e[2] for e in got], np.int64)
    out = []
    for b, mask in zip(rows, masks):
        cols = []
        for layer, g, every in per_layer:
            sel = np.flatnonzero((row[g] == b) & mask[ent[g]])
            if sel.size:
                e = ent[g[sel]]
                pos = p0[e] + (g[sel] - starts[e] - b * t[e])  # routed row b * T + i of its forward: position p0 + i
                cols.append({"pos": pos.astype(np.int32), "layer": np.full(sel.size, layer, np.int32),
                             **{k: v[sel] for k, v in every.items()}})
        out.append({"expert_extremes": Rows(probe.run_ids[b], {k: np.concatenate([c[k] for c in cols])
                                                                 for k in cols[0]})} if cols else {})
    return out


class _AttentionSeams(BatchProbe):
    """What the attention and KV probes keep: a longer forward's blocks as the model reduced them (``attn_stats``),
    a decode forward's probabilities (``attn_row``) or its reduced rows (``attn_stats`` with one query)."""

    def __init__(self, adapter, run_ids, tape):
        super().__init__(adapter, run_ids, tape)
        # a longer forward's blocks: (layer, Tc, stats: [B, Tc, H, 3] as the model reduced them, the statistics
        # already reduced from probabilities, or None, received [B, S] or None, q_start)
        self._blocks: list = []
        self._rows: list = []  # decode rows: (layer, probabilities [B, H, S], q_start, window)
        self._reduced: list = []  # decode rows the model reduced: (layer, stats [B, H, 3], received [B, S], q_start)
        self.kept_bytes = 0

    def listeners(self) -> dict:
        a = self.adapter

        @_batched
        def on_stats(layer: int, st: torch.Tensor, received: torch.Tensor, q_start: int, window=None) -> None:
            if window is not None:
                raise ValueError("the attn_stats seam has no sliding windows (the native model has none)")
            if st.size(1) == 1:
                self._reduced.append((layer, st[:, 0].detach(), received.detach(), q_start))
            else:
                self._blocks.append((layer, st.size(1), st.detach(), received.detach(), q_start))

        @_batched
        def on_row(layer: int, p: torch.Tensor, q_start: int) -> None:
            self._rows.append((layer, p[:, 0].detach(), q_start, None))

        @_batched
        def on_probs(layer: int, p: torch.Tensor, q_start: int, window: int | None = None) -> None:
            if p.size(1) == 1:  # a decode row: kept, reduced with many others at the flush
                self._rows.append((layer, p[:, 0].detach(), q_start, window))
            else:  # a block of prefill rows: reduced at once, so nothing O(T x S) outlives it
                self._blocks.append((layer, p.size(1), *self.block(p.detach(), q_start, window), q_start))
        if not a.stats_seam:
            return {"attn_probs": on_probs}
        return {"attn_stats": on_stats, **({"attn_row": on_row} if getattr(a, "row_seam", False) else {})}

    def block(self, p: torch.Tensor, q_start: int, window: int | None) -> tuple:
        """(statistics, received) this probe keeps of a block of probabilities [B, Tc, H, S]."""
        raise NotImplementedError

    def seen(self):
        if not (self._blocks or self._rows or self._reduced):
            return None
        got = (self._blocks, self._rows, self._reduced)
        self._blocks, self._rows, self._reduced = [], [], []
        self.kept_bytes += sum(x.numel() * x.element_size() for part in got[1:] for r in part for x in r[1:2])
        return got

    def pending_bytes(self) -> int:
        return self.kept_bytes

    def entry_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for e in self.entries for part in e[3][1:] for r in part
                   for x in r[1:2])


class AttentionBatch(_AttentionSeams):
    def flush(self, rows: list[int]) -> list[dict]:
        got, masks = self.ranges(rows)
        if not got:
            return [{} for _ in rows]
        n_b = self.tape.n
        recs: list[list[dict]] = [[] for _ in rows]
        # longer forwards' blocks: every row's in one call per block
        for j, (_, _, _, (blocks, _, _)) in enumerate(got):
            for layer, tc, stats, received, q_start in blocks:
                pos = np.arange(q_start, q_start + tc, dtype=np.int32)
                if isinstance(stats, torch.Tensor):  # as the model reduced them
                    stats = reduced_row_stats(stats.flatten(0, 1), np.tile(pos, n_b),
                                              max(0, q_start + tc - received.size(-1)))
                for r, (b, mask) in enumerate(zip(rows, masks)):
                    if mask[j]:
                        recs[r].append({"pos": pos, "layer": np.full(tc, layer, np.int32),
                                        **{k: v[b * tc:(b + 1) * tc] for k, v in stats.items()}})
        # decode forwards: every kept row of every row and layer in one reduction (per sliding window)
        groups: dict = defaultdict(list)
        for j, e in enumerate(got):
            for item in e[3][1]:
                groups[(self._probs, item[3])].append((j, item))
            for item in e[3][2]:
                groups[(self._reduced_rows, None)].append((j, item))
        for (reduce, _), items in groups.items():
            stats, pos, layer = reduce([item for _, item in items])  # [n * B, H] each, n items x B rows
            ent = np.array([j for j, _ in items])
            for r, (b, mask) in enumerate(zip(rows, masks)):
                sel = np.flatnonzero(mask[ent])
                if sel.size:
                    at = sel * n_b + b
                    recs[r].append({"pos": pos[sel], "layer": layer[sel], **{k: v[at] for k, v in stats.items()}})
        return [{"attention": attention_rows(self.run_ids[b], rec)} if rec else {} for b, rec in zip(rows, recs)]

    def block(self, p: torch.Tensor, q_start: int, window: int | None) -> tuple:
        tc, s = p.size(1), p.size(-1)
        pos = np.arange(q_start, q_start + tc, dtype=np.int32)
        return attention_row_stats(p.flatten(0, 1), np.tile(pos, p.size(0)), max(0, q_start + tc - s), window), None

    def _probs(self, items: list) -> tuple[dict, np.ndarray, np.ndarray]:
        probs = _padded_cat([p for _, p, _, _ in items])  # [n * B, H, S]
        pos = np.array([q for _, _, q, _ in items], np.int32)
        key0 = np.maximum(0, pos + 1 - np.array([p.size(-1) for _, p, _, _ in items]))
        n_b = items[0][1].size(0)
        return (attention_row_stats(probs, np.repeat(pos, n_b), np.repeat(key0, n_b), items[0][3]), pos,
                np.array([lay for lay, _, _, _ in items], np.int32))

    def _reduced_rows(self, items: list) -> tuple[dict, np.ndarray, np.ndarray]:
        pos = np.array([q for _, _, _, q in items], np.int32)
        key0 = np.maximum(0, pos + 1 - np.array([rc.size(-1) for _, _, rc, _ in items]))
        n_b = items[0][1].size(0)
        return (reduced_row_stats(_stack([st for _, st, _, _ in items]).flatten(0, 1), np.repeat(pos, n_b),
                                  np.repeat(key0, n_b)), pos, np.array([lay for lay, _, _, _ in items], np.int32))


class KVBatch(_AttentionSeams):
    """kv and kv_tokens: the cache sizes at every step of a row (one ``kv_sizes`` per forward), and at a row's
    first and last step its cached tokens' norms and the attention each received (running totals ``[B, S]`` per
    layer, the kept decode forwards added in at those steps and at each flush)."""

    def __init__(self, adapter, run_ids, tape):
        super().__init__(adapter, run_ids, tape)
        self.received: dict[int, torch.Tensor] = {}  # layer -> [B, positions]
        self.sizes: list[list] = [[] for _ in run_ids]  # per row: (step, [(layer, cached tokens, bytes)])
        self._sizes: tuple[int, list] | None = None

    def _add(self, layer: int, got: torch.Tensor, offset: int) -> None:
        acc = self.received.get(layer)
        end = offset + got.size(-1)
        if acc is None or acc.size(1) < end:
            grown = torch.zeros(got.size(0), max(end, 2 * (acc.size(1) if acc is not None else 0), 64))
            if acc is not None:
                grown[:, :acc.size(1)] = acc
            acc = grown
        acc[:, offset:end] += got.float().cpu()
        self.received[layer] = acc

    def _add_kept(self) -> None:
        """Every kept forward not yet in the running totals, added in (longer blocks one by one, decode rows summed
        per run of the same key count)."""
        new, self.entries, self.kept_bytes = self.entries, [], 0
        for _, _, _, (blocks, _, _) in new:
            for layer, tc, _, received, q_start in blocks:
                self._add(layer, received, max(0, q_start + tc - received.size(-1)))
        items = [(lay, x, q) for e in new for lay, x, q, _ in e[3][1]]
        items += [(lay, rc[:, None], q) for e in new for lay, _, rc, q in e[3][2]]
        by: dict = defaultdict(list)
        for lay, x, q in items:
            by[(x.size(-1), max(0, q + 1 - x.size(-1)))].append((lay, x))
        for (_, offset), group in by.items():
            got = _stack([x for _, x in group]).float().sum(2)  # [n, B, S] over heads
            lays = np.array([lay for lay, _ in group])
            for layer in dict.fromkeys(lays.tolist()):
                self._add(layer, got[torch.from_numpy(np.flatnonzero(lays == layer))].sum(0), offset)

    def block(self, p: torch.Tensor, q_start: int, window: int | None) -> tuple:
        return None, p.float().sum(dim=(1, 2))  # [B, S]: what each key received from the block's rows and heads

    def end_forward(self, start_pos: int, n_fed: int) -> None:
        super().end_forward(start_pos, n_fed)
        self._sizes = None

    def collect(self, b: int, s: StepInfo) -> dict:
        if self._sizes is None or self._sizes[0] != self.tape.forward:  # the cache is the batch's: once a forward
            self._sizes = (self.tape.forward, self.adapter.kv_sizes())
        self.sizes[b].append((s.index, self._sizes[1]))
        if not (s.final or s.index == 0):
            return {}
        self._add_kept()
        got = {layer: acc[b] for layer, acc in self.received.items()}
        tok = [kv_token_cols(layer, n, kv_token_norms(first, second), got, first_pos)
               for layer, n, _, first, second, first_pos in self.adapter.kv_state(row=b)]
        return kv_rows(s.run_id, s.index, [], tok)

    def flush(self, rows: list[int]) -> list[dict]:
        self._add_kept()
        out = []
        for b in rows:
            sizes, self.sizes[b] = self.sizes[b], []
            out.append(kv_rows(self.run_ids[b], [step for step, rs in sizes for _ in rs], [r for _, rs in sizes
                                                                                        for r in rs], []))
        return out


BATCH_CLASSES: dict[str, type[BatchProbe]] = {"attention": AttentionBatch, "kv": KVBatch, "routing": RoutingBatch,
                                              "resid_norm": ResidNormBatch, "head_norm": HeadNormBatch,
                                              "expert_extremes": ExpertExtremesBatch}


def batch_probe_names(adapter: Adapter, names: list[str]) -> list[str]:
    """The probes of ``names`` that record a batch of this adapter as one object: every signal (a model's seams hand
    the batch over batch-major: ``[B, T, ...]``, a route's B * T rows)."""
    return [n for n in names if n in BATCH_CLASSES]


def _class(adapter: Adapter, name: str) -> type[BatchProbe]:
    if name == "expert_extremes" and not getattr(adapter, "expert_out_seam", False):
        return ExpertRerunBatch
    return BATCH_CLASSES[name]


class BatchRecorder:
    """The batch-wide probes of one batched generation."""

    def __init__(self, adapter: Adapter, run_ids: list[str], names: list[str]):
        self.tape = BatchTape(len(run_ids))
        self.probes = [_class(adapter, n)(adapter, run_ids, self.tape) for n in names]

    def listeners(self) -> dict[str, Callable]:
        return dispatch(self.probes, batched=True)

    def end_forward(self, start_pos: int, n_fed: int) -> None:
        """A forward ran to its end: what its seams handed over becomes one kept entry per probe."""
        self.tape.forward += 1
        for p in self.probes:
            p.end_forward(start_pos, n_fed)

    def collect(self, b: int, s: StepInfo) -> dict:
        """Row b finished a step in the last forward: everything kept up to it is the row's."""
        self.tape.done[b] = self.tape.forward
        return merge_batches([p.collect(b, s) for p in self.probes])

    def flush(self, rows: list[int]) -> list[dict]:
        got = [p.flush(rows) for p in self.probes]
        for b in rows:
            self.tape.flushed[b] = self.tape.done[b]
        for p in self.probes:
            p.prune()
        return [merge_batches([g[r] for g in got]) for r in range(len(rows))]

    def stop(self, b: int) -> None:
        self.tape.live[b] = False

    def pending_bytes(self) -> int:
        return sum(p.pending_bytes() for p in self.probes)
