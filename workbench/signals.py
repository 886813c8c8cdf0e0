"""The signal registry: every recorded signal declared once.

A ``Signal`` names its probe (the name ``record(probes=...)`` takes), the tables it writes (columns with
SQL types, docs, and how replay compares them), the adapter seams it listens to, and its ``Probe``:
the object that reduces what the seams hand over (with the pure functions of ``workbench.probes``)
into one step's ``Rows``. The schema (``workbench.schema``), the recorder, replay's comparison, the
query layer, ``Run``'s accessors and docs/schema.md all derive from ``REGISTRY``. Adding a signal is
one entry here, its probe class, and a test.

Step conventions: step 0 is the prefill (feeds the prompt, produces the first new token); decode step
s >= 1 feeds one token. ``StepInfo`` is what the recorder knows of a step when it collects.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from workbench.probes.signals import (attention_received, attention_stats, kv_token_norms, routing_records)

from .adapters.base import Adapter, Route
from .rows import Rows, add_received, attention_rows, kv_rows, kv_token_cols, steps_rows, token_frame


@dataclass(frozen=True)
class Column:
    """A column of a signal table. ``compare``: how replay compares two runs on it: "key" (aligns rows),
    "exact" (must be equal), "tol" (within a tolerance) or "" (not compared: timings, ids)."""

    name: str
    sql: str
    doc: str = ""
    compare: str = ""


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    order: str  # ORDER BY of a run's rows
    doc: str = ""

    def ddl(self) -> str:
        cols = ["run_id VARCHAR"] + [f"{c.name} {c.sql}" for c in self.columns]
        return ",\n".join(cols)

    def names(self, compare: str | None = None) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if compare is None or c.compare == compare)


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
    """Reduces what one signal's seams see during a step; ``collect`` returns the step's rows per table."""

    def __init__(self, adapter: Adapter, run_id: str):
        self.adapter, self.run_id = adapter, run_id

    def listeners(self) -> dict:
        return {}

    def collect(self, step: StepInfo) -> dict[str, Rows | list]:
        raise NotImplementedError


class TokensProbe(Probe):
    def collect(self, s: StepInfo) -> dict:
        frames = []
        n = len(s.input_ids)
        if s.index == 0:
            ids, texts = s.input_ids, s.prompt_texts
            frames.append(token_frame(s.run_id, 0, [0], ids[:1], texts[:1], [True], None, s.topk))
            if n > 1:
                frames.append(token_frame(s.run_id, 0, list(range(1, n)), ids[1:], texts[1:], [True] * (n - 1),
                                          s.logits[:-1].cpu(), s.topk))
        frames.append(token_frame(s.run_id, s.index, [s.start_pos + n], [s.next_token], [s.next_text], [False],
                                  s.logits[-1:].cpu(), s.topk))
        return {"tokens": frames}


class AttentionProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.blocks: list[dict] = []
        self.single: list[tuple[int, int, torch.Tensor, int | None]] = []  # decode rows (layer, pos, [H, S], window)

    def listeners(self) -> dict:
        return {"attn_probs": self.on_probs}

    def on_probs(self, layer: int, p: torch.Tensor, q_start: int, window: int | None = None) -> None:
        if p.size(0) == 1:  # a decode step: reduced for all layers at once in collect (cheaper)
            self.single.append((layer, q_start, p[0].detach(), window))
        else:
            self.blocks.append({"layer": layer, **attention_stats(p.detach(), q_start, window)})

    def collect(self, s: StepInfo) -> dict:
        # one query row per layer, same position: one [1, layers*H, S] reduction per cache length and window
        # instead of one per layer
        groups: dict[tuple, list] = defaultdict(list)
        for row in self.single:
            groups[(row[2].size(-1), row[3])].append(row)
        for (_, window), rows in groups.items():
            h = rows[0][2].size(0)
            st = attention_stats(torch.cat([r[2] for r in rows])[None], rows[0][1], window)
            for i, (layer, q, _, _) in enumerate(rows):
                self.blocks.append({"layer": layer, "pos": np.array([q], np.int32),
                                    **{c: st[c][:, i * h:(i + 1) * h] for c in st if c != "pos"}})
        self.blocks.sort(key=lambda b: (int(b["pos"][0]), b["layer"]))
        out = {"attention": attention_rows(s.run_id, self.blocks)} if self.blocks else {}
        self.blocks, self.single = [], []
        return out


class RoutingProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.seen: dict[int, list[Route]] = defaultdict(list)

    def listeners(self) -> dict:
        return {"routed": self.on_route}

    def on_route(self, layer: int, r: Route) -> None:
        self.seen[layer].append(r)

    def collect(self, s: StepInfo) -> dict:
        if not self.seen:
            return {}
        layers = sorted(self.seen)
        parts = [self.seen[i] for i in layers]
        idx = [torch.cat([r.indices for r in p]).detach() for p in parts]
        n, k = idx[0].shape
        logits = [torch.cat([r.logits for r in p]).detach().float() for p in parts]
        math = [p[0].math for p in parts]
        # all MoE layers in one call: per-layer calls cost more than the reductions themselves
        rec = routing_records(torch.cat(idx), torch.cat([torch.cat([r.weights for r in p]).detach() for p in parts]),
                              torch.cat([m.scores(lg) for m, lg in zip(math, logits)]),
                              torch.cat([m.basis(lg) for m, lg in zip(math, logits)]))
        pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int32)
        self.seen = defaultdict(list)
        return {"routing": Rows(s.run_id, {
            "pos": np.tile(np.repeat(pos, k), len(layers)),
            "layer": np.repeat(np.array(layers, np.int32), n * k), "slot": rec["slot"].ravel(),
            "expert": rec["expert"].ravel(), "weight": rec["weight"].ravel(), "score": rec["score"].ravel(),
            "margin": np.repeat(rec["margin"], k)})}


class _NormProbe(Probe):
    """L2 norms over the last dim of what one seam hands over, per layer: decode rows wait for ``collect``
    (one reduction over all layers is cheaper); a prefill block is reduced at once, so nothing O(T x D) per
    layer is held at long context."""

    seam = ""

    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.seen: dict[int, list[torch.Tensor]] = defaultdict(list)

    def listeners(self) -> dict:
        return {self.seam: self.on_value}

    def on_value(self, layer: int, x: torch.Tensor) -> None:
        self.seen[layer].append(x[0].detach() if x.size(1) == 1 else x[0].detach().float().norm(dim=-1, keepdim=True))

    def norms(self) -> tuple[list[int], torch.Tensor]:
        """(layers, norms [L, T, ...]) of this step, and the buffer emptied."""
        layers = sorted(self.seen)
        norms = torch.stack([torch.cat([x if x.size(-1) == 1 else x.float().norm(dim=-1, keepdim=True)
                                        for x in self.seen[i]]) for i in layers])[..., 0]
        self.seen = defaultdict(list)
        return layers, norms


class ResidNormProbe(_NormProbe):
    seam = "resid_post"

    def collect(self, s: StepInfo) -> dict:
        if not self.seen:
            return {}
        layers, norms = self.norms()  # [L, T]
        t = norms.size(1)
        return {"resid_norm": Rows(s.run_id, {
            "pos": np.tile(np.arange(s.start_pos, s.start_pos + t, dtype=np.int32), len(layers)),
            "layer": np.repeat(np.array(layers, np.int32), t), "norm": norms.cpu().numpy().ravel().astype(np.float64)})}


class HeadNormProbe(_NormProbe):
    seam = "head_out"

    def collect(self, s: StepInfo) -> dict:
        if not self.seen:
            return {}
        layers, norms = self.norms()  # [L, T, H]
        _, t, h = norms.shape
        pos = np.arange(s.start_pos, s.start_pos + t, dtype=np.int32)
        return {"head_norm": Rows(s.run_id, {
            "pos": np.tile(np.repeat(pos, h), len(layers)), "layer": np.repeat(np.array(layers, np.int32), t * h),
            "head": np.tile(np.arange(h, dtype=np.int32), len(layers) * t),
            "norm": norms.cpu().numpy().ravel().astype(np.float64)})}


class KVProbe(Probe):
    def __init__(self, adapter: Adapter, run_id: str):
        super().__init__(adapter, run_id)
        self.received: dict[int, torch.Tensor] = {}  # by absolute position

    def listeners(self) -> dict:
        return {"attn_probs": self.on_probs}

    def on_probs(self, layer: int, p: torch.Tensor, q_start: int, window: int | None = None) -> None:
        # key j is position j, or q_end - S + j once a sliding-window cache holds only the newest S
        add_received(self.received, layer, attention_received(p.detach()), max(0, q_start + p.size(0) - p.size(-1)))

    def collect(self, s: StepInfo) -> dict:
        rows, tok = [], []
        for layer, n, nbytes, first, second, first_pos in self.adapter.kv_state():
            rows.append((layer, n, nbytes))
            if s.final or s.index == 0:
                tok.append(kv_token_cols(layer, n, kv_token_norms(first, second), self.received, first_pos))
        return kv_rows(s.run_id, s.index, rows, tok)


class StepsProbe(Probe):
    def collect(self, s: StepInfo) -> dict:
        return {"steps": steps_rows(s.run_id, s.index, len(s.input_ids), s.wall_ms)}


@dataclass(frozen=True)
class Signal:
    name: str
    tables: tuple[Table, ...]
    seams: tuple[str, ...]
    probe: type[Probe]
    doc: str = ""


def _c(name: str, sql: str, doc: str = "", compare: str = "") -> Column:
    return Column(name, sql, doc, compare)


POS, LAYER = _c("pos", "INTEGER", "", "key"), _c("layer", "INTEGER", "", "key")

REGISTRY: tuple[Signal, ...] = (
    Signal("tokens", (Table("tokens", (
        _c("pos", "INTEGER", "", "key"),
        _c("step", "INTEGER", "step that produced (or, for the prompt, fed) this token"),
        _c("token_id", "INTEGER", "", "exact"),
        _c("text", "VARCHAR"),
        _c("is_prompt", "BOOLEAN"),
        _c("prob", "DOUBLE", "p(token) under the distribution at pos-1; NULL at pos 0", "tol"),
        _c("logprob", "DOUBLE", "", "tol"),
        _c("confidence", "DOUBLE", "max prob of that distribution", "tol"),
        _c("entropy", "DOUBLE", "nats", "tol"),
        _c("rank", "INTEGER", "1 = the argmax", "exact"),
        _c("topk_ids", "INTEGER[]"),
        _c("topk_probs", "DOUBLE[]")), "pos", "one row per token, prompt included"),),
        (), TokensProbe, "token confidence from the step's logits"),
    Signal("kv", (
        Table("kv", (_c("step", "INTEGER", "", "key"), LAYER, _c("cached_tokens", "INTEGER", "", "exact"),
                     _c("bytes", "BIGINT", "", "exact")), "step, layer", "cache size per step x layer"),
        Table("kv_tokens", (
            _c("step", "INTEGER", "", "key"), LAYER, _c("pos", "INTEGER", "cached token", "key"),
            _c("latent_norm", "DOUBLE", "L2 norm of its cached kv latent (transformers models: of its values)", "tol"),
            _c("rope_norm", "DOUBLE", "L2 norm of its cached rope key (transformers models: of its keys)", "tol"),
            _c("attn_received", "DOUBLE", "attention it has received so far, summed over heads and queries", "tol")),
            "step, layer, pos", "per cached token, at the prefill and the final step")),
        ("attn_probs",), KVProbe, "KV-cache state"),
    Signal("attention", (Table("attention", (
        _c("pos", "INTEGER", "query position", "key"), LAYER, _c("head", "INTEGER", "", "key"),
        _c("entropy", "DOUBLE", "nats, over the keys 0..pos", "tol"),
        _c("norm_entropy", "DOUBLE", "entropy / log(pos + 1); NULL at pos 0", "tol"),
        _c("max_weight", "DOUBLE", "", "tol"),
        _c("sink_weight", "DOUBLE", "weight on position 0", "tol")), "pos, layer, head",
        "per query position x layer x head"),), ("attn_probs",), AttentionProbe, "attention entropy"),
    Signal("routing", (Table("routing", (
        POS, LAYER, _c("slot", "INTEGER", "0..K-1, by decreasing gate weight", "key"),
        _c("expert", "INTEGER", "", "exact"),
        _c("weight", "DOUBLE", "gate weight the expert's output is mixed with (what the experts received)", "tol"),
        _c("score", "DOUBLE", "raw score (softmax or sigmoid of the router logit)", "tol"),
        _c("margin", "DOUBLE", "last chosen minus best unchosen selection score (score + bias)", "tol")),
        "pos, layer, slot",
        "per position x MoE layer x slot: the router's actual selection"),), ("routed",), RoutingProbe,
        "expert routing"),
    Signal("resid_norm", (Table("resid_norm", (
        POS, LAYER, _c("norm", "DOUBLE", "L2 norm of the residual stream after the block", "tol")),
        "pos, layer", "per position x layer"),), ("resid_post",), ResidNormProbe, "residual-stream norm"),
    Signal("head_norm", (Table("head_norm", (
        POS, LAYER, _c("head", "INTEGER", "", "key"),
        _c("norm", "DOUBLE", "L2 norm of the head's output (its slice of the attention output projection's input)",
           "tol")), "pos, layer, head", "per position x layer x head"),), ("head_out",), HeadNormProbe,
        "attention-head output norm"),
    Signal("steps", (Table("steps", (
        _c("step", "INTEGER"), _c("kind", "VARCHAR", "prefill | decode"), _c("n_tokens", "INTEGER"),
        _c("wall_ms", "DOUBLE")), "step", "one row per generation step"),), (), StepsProbe, "step timing"),
)

SIGNALS: dict[str, Signal] = {s.name: s for s in REGISTRY}
TABLES: dict[str, Table] = {t.name: t for s in REGISTRY for t in s.tables}
PROBES: tuple[str, ...] = tuple(SIGNALS)
