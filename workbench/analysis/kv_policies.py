"""KV-cache policy what-if: re-run a recorded run teacher-forced with a cache policy, and say what it costs.

The recorded tokens (prompt + generated, from the ``tokens`` table) are fed again through the run's model:
the prompt in one prefill, then one token per step. After every forward the policy looks at the cache and
evicts or quantises entries before the next step reads them. Each policy's run is compared with the
full-cache run, position by position, on the generated tokens:

- ``delta_nll``: the mean, over generated positions, of the change in negative log-likelihood of the
  recorded token (nats; > 0: the policy made the recorded text less likely);
- ``top1_agreement``: share of generated positions whose argmax is the full cache's;
- ``first_divergence``: the first position (``tokens.pos`` of the predicted token) whose argmax differs,
  None if none does;
- ``bytes_kept`` / ``bytes_full``: the cache at the end of the run (after the policy's last step: the
  N - 1 fed tokens), all layers: kept entries at the model's precision, quantised ones at their bits
  (plus a 4-byte scale per quantised group), evicted ones 0; ``bytes_full`` is the same cache unpruned;
- ``events``: what the policy did, per policy (``POLICIES``): entries evicted (a layer x token pair
  counts once), entries held in INT8 at the end (topk_int8), entries at 4 bits at the end
  (quant_tree), recompute triggers (recompute).

The prediction of the first generated token comes from the prefill, before any policy acts, so it always
agrees with the full cache. Eviction masks a cached token out of attention in that layer from the next
step on (as a -inf score) and is permanent; quantisation is simulated ("fake quantisation") from a
full-precision copy of the cache at every step, so which entries are held in low precision may change
from step to step. Evictions and bits are per layer (MLA caches one latent per token and layer, shared
by all heads; a transformers model's entry is its keys and values over all kv heads).

Policy specs (``parse_policy``): ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE``:

- ``full``: the cache as is.
- ``window:sink=4,recent=64`` (StreamingLLM): keep the first ``sink`` and the last ``recent`` cached tokens.
- ``heavy_hitters:budget=64,recent=B/2`` (H2O): at most ``budget`` tokens per layer: the ``recent`` newest
  plus the ``budget - recent`` with the most attention received so far (summed over heads and queries).
- ``entropy:ratio=0.5,max_entropy=0.8,sink=1,recent=8`` (token-wise pruning by attention entropy and access
  frequency): in a layer whose newest attention row is focused (normalised entropy, mean over heads, <
  ``max_entropy``), evict the tokens whose access frequency (attention received per query and head, in
  units of uniform attention 1 / visible keys) is below ``ratio``; the first ``sink`` and last ``recent``
  tokens are always kept.
- ``confidence:threshold=0.85,sink=0,smooth=1`` (output-confidence pruning): after a step whose
  next-token confidence (max probability; the mean of the last ``smooth`` steps) is below ``threshold``,
  evict the oldest cached token (after the first ``sink``); per layer:
  ``confidence:shallow=0.80,deep=0.92,split=L/2`` (layers below ``split`` use ``shallow``).
- ``topk_int8:k=512`` (top-k in full precision): per layer the ``k`` tokens with the most attention
  received so far stay at the model's precision, the rest are INT8 (symmetric, per-tensor max-abs scale
  over the INT8 entries of that tensor).
- ``quant_tree:entropy=0.3,position=0.7,variance=0.5,near=4`` (4/6/8-bit decision tree): per layer and
  token, 4 bits if its attention entropy < ``entropy`` and its positional sensitivity > ``position``,
  else 8 bits if its layer variance > ``variance``, else 6 bits (symmetric, per-tensor max-abs scale per
  bit group). Attention entropy: the normalised entropy of the token's own attention row (when it was
  fed; mean over heads; 1 for position 0). Positional sensitivity: the share of the attention it received
  that came from queries at most ``near`` positions after it. Layer variance: the standard deviation over
  layers of its first cached vector's L2 norm (latent / values), each layer's norms divided by their mean.
- ``recompute:delta=0.012,window=3`` (recompute trigger; the cache is kept whole): an event when the L2
  distance between consecutive steps' next-token probability distributions exceeds ``delta`` for
  ``window`` steps in a row (the count then restarts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import polars as pl
import torch

from workbench.capture.resolve import load_for_run
from workbench.data import query
from workbench.data.store import Store

COLUMNS = ["policy", "bytes_kept", "bytes_full", "delta_nll", "top1_agreement", "first_divergence", "events"]
SCHEMA = {"policy": pl.String, "bytes_kept": pl.Int64, "bytes_full": pl.Int64, "delta_nll": pl.Float64,
          "top1_agreement": pl.Float64, "first_divergence": pl.Int32, "events": pl.Int64}
SCALE_BYTES = 4  # one fp32 scale per quantised group (layer x tensor x bit width)


# -- quantisation -------------------------------------------------------------------------------------

def fake_quant(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Symmetric ``bits``-bit quantisation of ``x`` with one max-abs scale, and back (same dtype and shape).

    The scale is ``max|x| / (2**(bits-1) - 1)``; values are rounded to the nearest multiple of it. Values
    that are exact multiples of a power-of-two scale (e.g. integers in [-127, 127] for 8 bits, max 127)
    come back unchanged."""
    qmax = 2 ** (bits - 1) - 1
    xf = x.float()
    scale = xf.abs().max()
    if x.numel() == 0 or not torch.isfinite(scale) or scale == 0:
        return x.clone()
    scale = scale / qmax
    return ((xf / scale).round().clamp(-qmax, qmax) * scale).to(x.dtype)


# -- what a policy sees ---------------------------------------------------------------------------------

class Stats:
    """Attention statistics per layer and cached position, from the ``attn_probs`` seam (masked probabilities).

    ``received`` attention received (sum over heads and queries); ``relative`` the same with each weight
    times the query's number of visible keys (uniform attention = 1 per head and query); ``seen`` the
    (head, query) pairs that could see the token; ``near`` attention received from queries at most
    ``near_d`` positions after the token; ``row_entropy`` the token's own attention row's normalised
    entropy, mean over heads; ``last_entropy`` that of the newest row of the layer.
    """

    def __init__(self, n_layers: int, max_len: int, keep: list[torch.Tensor], near_d: int = 4):
        z = lambda: torch.zeros(max_len, dtype=torch.float64)  # noqa: E731
        self.received = [z() for _ in range(n_layers)]
        self.relative = [z() for _ in range(n_layers)]
        self.seen = [z() for _ in range(n_layers)]
        self.near = [z() for _ in range(n_layers)]
        self.row_entropy = [torch.full((max_len,), float("nan"), dtype=torch.float64) for _ in range(n_layers)]
        self.last_entropy = [float("nan")] * n_layers
        self.keep = keep  # the engine's masks (the ones in force for the forward being observed)
        self.near_d = near_d

    def observe(self, layer: int, probs: torch.Tensor, q_start: int, *_rest) -> None:
        p = probs.detach().to("cpu", torch.float64)  # [Tc, H, S]
        tc, n_heads, s = p.shape
        q = torch.arange(q_start, q_start + tc)[:, None]
        k = torch.arange(s)[None, :]
        kept = torch.ones(s, dtype=torch.bool)
        km = self.keep[layer]
        kept[: min(km.numel(), s)] = km[:s]
        visible = (k <= q) & kept[None, :]  # [Tc, S]
        m = visible.sum(1).to(torch.float64)  # visible keys per query row
        ph = p.sum(1)  # [Tc, S], summed over heads
        self.received[layer][:s] += ph.sum(0)
        self.relative[layer][:s] += (ph * m[:, None]).sum(0)
        self.seen[layer][:s] += n_heads * visible.sum(0).to(torch.float64)
        d = q - k
        self.near[layer][:s] += (ph * ((d >= 0) & (d <= self.near_d))).sum(0)
        ent = -torch.special.xlogy(p, p).sum(-1)  # [Tc, H]
        norm = torch.where(m[:, None] > 1, ent / m.clamp_min(2).log()[:, None], torch.full_like(ent, float("nan")))
        rows = norm.mean(1)
        self.row_entropy[layer][q_start:q_start + tc] = rows
        self.last_entropy[layer] = float(rows[-1])


@dataclass
class CacheState:
    """The cache after a forward, as a policy sees it; the policy edits ``keep`` and ``bits`` in place.

    ``keep[layer]`` bool [n] (False: evicted; evictions are permanent whatever the policy sets back),
    ``bits[layer]`` int [n] (0: the model's precision, else 4..8), ``probs`` [V] the step's next-token
    distribution, ``entries[layer]`` the full-precision cached tensors [n, ...] (quantising policies only).
    """

    step: int
    n: int
    keep: list[torch.Tensor]
    bits: list[torch.Tensor]
    probs: torch.Tensor
    stats: Stats | None
    entries: list[list[torch.Tensor]] = field(default_factory=list)


# -- policies -----------------------------------------------------------------------------------------

class Policy:
    """A cache policy: ``apply(state)`` after every forward; ``PARAMS`` name -> (type, default)."""

    name = ""
    PARAMS: dict[str, tuple[type, object]] = {}
    attention = False  # needs the attention statistics
    quantises = False  # sets bits (needs a full-precision copy of the cache)

    def __init__(self, spec: str = "", **params):
        self.spec = spec or self.name
        self.given = dict(params)
        for key, (_, default) in self.PARAMS.items():
            setattr(self, key, params.get(key, default))
        self.check()

    def check(self) -> None:
        pass

    def start(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.triggers = 0

    def apply(self, state: CacheState) -> None:
        pass

    def events(self, evicted: int, bits: list[torch.Tensor], keep: list[torch.Tensor]) -> int:
        return evicted

    def _need(self, cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"{self.name}: {what}")

    def __repr__(self) -> str:
        return f"Policy({self.spec!r})"


class Full(Policy):
    name = "full"


class Window(Policy):
    name = "window"
    PARAMS = {"sink": (int, 4), "recent": (int, 64)}

    def check(self) -> None:
        self._need(self.sink >= 0 and self.recent >= 0, "sink and recent must be >= 0")

    def apply(self, st: CacheState) -> None:
        pos = torch.arange(st.n)
        drop = (pos >= self.sink) & (pos < st.n - self.recent)
        for k in st.keep:
            k[drop] = False


class HeavyHitters(Policy):
    name = "heavy_hitters"
    PARAMS = {"budget": (int, 64), "recent": (int, None)}
    attention = True

    def check(self) -> None:
        if self.recent is None:
            self.recent = self.budget // 2
        self._need(self.budget >= 1, "budget must be >= 1")
        self._need(0 <= self.recent <= self.budget, "recent must be in [0, budget]")

    def apply(self, st: CacheState) -> None:
        for layer, k in enumerate(st.keep):
            if int(k.sum()) <= self.budget:
                continue
            pos = torch.arange(st.n)
            recent = k & (pos >= st.n - self.recent)
            heavy = self.budget - int(recent.sum())
            cand = (k & ~recent).nonzero().squeeze(1)
            score = st.stats.received[layer][cand]
            order = torch.argsort(score, descending=True, stable=True)
            new = recent.clone()
            new[cand[order[:heavy]]] = True
            k &= new


class Entropy(Policy):
    name = "entropy"
    PARAMS = {"ratio": (float, 0.5), "max_entropy": (float, 0.8), "sink": (int, 1), "recent": (int, 8)}
    attention = True

    def check(self) -> None:
        self._need(self.ratio >= 0, "ratio must be >= 0")
        self._need(self.sink >= 0 and self.recent >= 0, "sink and recent must be >= 0")

    def apply(self, st: CacheState) -> None:
        pos = torch.arange(st.n)
        cand = (pos >= self.sink) & (pos < st.n - self.recent)
        for layer, k in enumerate(st.keep):
            ent = st.stats.last_entropy[layer]
            if not (ent < self.max_entropy):  # a diffuse layer (or one query over one key): nothing to tell apart
                continue
            seen = st.stats.seen[layer][: st.n]
            freq = st.stats.relative[layer][: st.n] / seen.clamp_min(1)
            k[cand & (seen > 0) & (freq < self.ratio)] = False


class Confidence(Policy):
    name = "confidence"
    PARAMS = {"threshold": (float, None), "shallow": (float, None), "deep": (float, None), "split": (int, None),
              "sink": (int, 0), "smooth": (int, 1)}

    def check(self) -> None:
        per_layer = self.shallow is not None or self.deep is not None
        self._need(not (per_layer and self.threshold is not None),
                   "give threshold=T, or shallow=S,deep=D (per layer), not both")
        self._need(not per_layer or (self.shallow is not None and self.deep is not None),
                   "the per-layer variant needs both shallow= and deep=")
        self._need(self.split is None or per_layer, "split= goes with shallow= and deep=")
        if not per_layer and self.threshold is None:
            self.threshold = 0.85
        self._need(self.smooth >= 1, "smooth must be >= 1")
        self._need(self.sink >= 0, "sink must be >= 0")

    def start(self, n_layers: int) -> None:
        super().start(n_layers)
        split = self.split if self.split is not None else n_layers // 2
        self.thresholds = ([self.threshold] * n_layers if self.threshold is not None else
                           [self.shallow if i < split else self.deep for i in range(n_layers)])
        self.history: list[float] = []

    def apply(self, st: CacheState) -> None:
        self.history.append(float(st.probs.max()))
        conf = sum(self.history[-self.smooth:]) / len(self.history[-self.smooth:])
        for layer, k in enumerate(st.keep):
            if conf < self.thresholds[layer]:
                old = (k & (torch.arange(st.n) >= self.sink)).nonzero()
                if old.numel():
                    k[old[0, 0]] = False  # the oldest cached token (after the sinks)


class TopKInt8(Policy):
    name = "topk_int8"
    PARAMS = {"k": (int, 512)}
    attention = True
    quantises = True

    def check(self) -> None:
        self._need(self.k >= 0, "k must be >= 0")

    def apply(self, st: CacheState) -> None:
        for layer, b in enumerate(st.bits):
            b.zero_()
            if st.n <= self.k:
                continue
            order = torch.argsort(st.stats.received[layer][: st.n], descending=True, stable=True)
            b[order[self.k:]] = 8

    def events(self, evicted, bits, keep) -> int:
        return int(sum(((b == 8) & k).sum() for b, k in zip(bits, keep)))


class QuantTree(Policy):
    name = "quant_tree"
    PARAMS = {"entropy": (float, 0.3), "position": (float, 0.7), "variance": (float, 0.5), "near": (int, 4)}
    attention = True
    quantises = True

    def check(self) -> None:
        self._need(self.near >= 0, "near must be >= 0")

    def features(self, st: CacheState) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """(attention entropy [n] per layer, positional sensitivity [n] per layer, layer variance [n])."""
        n = st.n
        ent = [torch.nan_to_num(st.stats.row_entropy[i][:n], nan=1.0) for i in range(len(st.keep))]
        pos = []
        for i in range(len(st.keep)):
            rec = st.stats.received[i][:n]
            pos.append(torch.where(rec > 0, st.stats.near[i][:n] / rec.clamp_min(1e-300), torch.ones_like(rec)))
        norms = torch.stack([t[0].detach().to("cpu", torch.float64).flatten(1).norm(dim=1) for t in st.entries])
        rel = norms / norms.mean(1, keepdim=True).clamp_min(1e-30)  # [L, n]
        var = rel.std(0, unbiased=False) if rel.size(0) > 1 else torch.zeros(n, dtype=torch.float64)
        return ent, pos, var

    def apply(self, st: CacheState) -> None:
        ent, pos, var = self.features(st)
        for layer, b in enumerate(st.bits):
            four = (ent[layer] < self.entropy) & (pos[layer] > self.position)
            b.copy_(torch.where(four, 4, torch.where(var > self.variance, 8, 6)))

    def events(self, evicted, bits, keep) -> int:
        return int(sum(((b == 4) & k).sum() for b, k in zip(bits, keep)))


class Recompute(Policy):
    name = "recompute"
    PARAMS = {"delta": (float, 0.012), "window": (int, 3)}

    def check(self) -> None:
        self._need(self.delta >= 0, "delta must be >= 0")
        self._need(self.window >= 1, "window must be >= 1")

    def start(self, n_layers: int) -> None:
        super().start(n_layers)
        self.prev: torch.Tensor | None = None
        self.stale = 0

    def apply(self, st: CacheState) -> None:
        p = st.probs.double()
        if self.prev is not None:
            self.stale = self.stale + 1 if float((p - self.prev).norm()) > self.delta else 0
            if self.stale >= self.window:
                self.triggers += 1
                self.stale = 0
        self.prev = p

    def events(self, evicted, bits, keep) -> int:
        return self.triggers


POLICIES: dict[str, type[Policy]] = {c.name: c for c in (Full, Window, HeavyHitters, Entropy, Confidence, TopKInt8,
                                                          QuantTree, Recompute)}


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def parse_policy(spec: str | Policy) -> Policy:
    """A ``Policy`` from its spec (``NAME`` or ``NAME:KEY=VALUE,...``); a one-line ValueError if malformed.

    The policy's ``spec`` is the canonical form: the given parameters in declared order (defaults left out)."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty KV policy spec {spec!r}; known policies: {', '.join(POLICIES)}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown KV policy {name!r} in {spec!r}; known policies: {', '.join(POLICIES)}")
    params: dict[str, object] = {}
    for part in [p.strip() for p in rest.split(",")] if rest.strip() else []:
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"{name}: {part!r} is not KEY=VALUE (in {spec!r})")
        if key not in cls.PARAMS:
            known = ", ".join(cls.PARAMS) or "none"
            raise ValueError(f"{name}: unknown parameter {key!r} (parameters: {known})")
        if key in params:
            raise ValueError(f"{name}: parameter {key!r} given twice")
        typ = cls.PARAMS[key][0]
        try:
            v = typ(value) if typ is float else int(value)
        except ValueError:
            raise ValueError(f"{name}: {key} must be {'a number' if typ is float else 'an integer'}, "
                             f"got {value!r}") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{name}: {key} must be finite, got {value!r}")
        params[key] = v
    canon = name + (":" + ",".join(f"{k}={_fmt(params[k])}" for k in cls.PARAMS if k in params) if params else "")
    return cls(canon, **params)


# -- the engine ---------------------------------------------------------------------------------------

@dataclass
class Trace:
    """One teacher-forced run under a policy: per generated position the recorded token's logprob and the
    argmax; the cache's bytes at the end; the policy's event count; the final masks and bits."""

    logprob: np.ndarray
    argmax: np.ndarray
    bytes_kept: int
    bytes_full: int
    events: int
    keep: list[torch.Tensor]
    bits: list[torch.Tensor]


def _cache_bytes(entries: list[tuple[int, list[torch.Tensor]]], keep: list[torch.Tensor],
                 bits: list[torch.Tensor]) -> tuple[int, int]:
    kept_b = full_b = 0
    for (first, tensors), k, b in zip(entries, keep, bits):
        k, b = k[first:], b[first:]
        for t in tensors:
            per = int(np.prod(t.shape[1:])) if t.dim() > 1 else 1
            es = t.element_size()
            full_b += t.size(0) * per * es
            kept_b += int((k & (b == 0)).sum()) * per * es
            for q in sorted(set(b[k].tolist()) - {0}):
                kept_b += math.ceil(int((k & (b == q)).sum()) * per * q / 8) + SCALE_BYTES
    return kept_b, full_b


def _quantise(entries, shadow, bits, keep) -> None:
    """The live cache = its full-precision copy, with the entries that have bits held at those bits."""
    for (first, tensors), sh, b, k in zip(entries, shadow, bits, keep):
        for t, s in zip(tensors, sh):
            n = t.size(0)
            t.copy_(s[:n])
            bl, kl = b[first:first + n], k[first:first + n]
            for q in sorted(set(bl[kl].tolist()) - {0}):
                idx = ((bl == q) & kl).nonzero().squeeze(1).to(t.device)
                t[idx] = fake_quant(s[idx], q)


def trace(adapter, ids: list[int], n_prompt: int, policy: Policy) -> Trace:
    """Feed ``ids`` teacher-forced through ``adapter`` (prefill ``ids[:n_prompt]``, then one token per step)
    with ``policy`` acting on the cache after every forward."""
    ids = [int(i) for i in ids]
    n_total, n_gen = len(ids), len(ids) - n_prompt
    if n_prompt < 1 or n_gen < 1:
        raise ValueError(f"need at least one prompt and one generated token (got {n_prompt} + {n_gen})")
    n_layers = adapter.summary.n_layers
    policy.start(n_layers)
    keep = [torch.ones(0, dtype=torch.bool) for _ in range(n_layers)]
    bits = [torch.zeros(0, dtype=torch.int64) for _ in range(n_layers)]
    stats = Stats(n_layers, n_total, keep, near_d=getattr(policy, "near", 4)) if policy.attention else None
    listeners = {"attn_probs": stats.observe} if stats is not None else {}
    shadow: list[list[torch.Tensor]] | None = None
    have = 0
    logprob, argmax = np.zeros(n_gen), np.zeros(n_gen, dtype=np.int64)
    evicted = 0
    with adapter.kv_session(n_total) as forward, adapter.seams(listeners):
        feed, pos = ids[:n_prompt], 0
        for step in range(n_gen):
            logits = forward(feed, pos)[-1].double()
            lp = torch.log_softmax(logits, -1)
            logprob[step] = float(lp[ids[n_prompt + step]])
            argmax[step] = int(logits.argmax())
            pos += len(feed)
            entries = adapter.kv_entries()
            if any(first > 0 for first, _ in entries):
                raise ValueError("the KV what-if does not support caches that drop tokens themselves "
                                 "(sliding-window layers)")
            before = [torch.cat([k, torch.ones(pos - k.numel(), dtype=torch.bool)]) for k in keep]
            for i in range(n_layers):
                keep[i] = before[i].clone()
                bits[i] = torch.cat([bits[i], torch.zeros(pos - bits[i].numel(), dtype=torch.int64)])
            if policy.quantises:
                if shadow is None:
                    shadow = [[torch.empty((n_total, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in ts]
                              for _, ts in entries]
                for (_, ts), sh in zip(entries, shadow):
                    for t, s in zip(ts, sh):
                        s[have:t.size(0)] = t[have:]
                have = pos
            st = CacheState(step=step, n=pos, keep=keep, bits=bits, probs=lp.exp(), stats=stats,
                            entries=[[s[:pos] for s in sh] for sh in shadow] if shadow is not None else [])
            policy.apply(st)
            for i in range(n_layers):
                keep[i] = keep[i] & before[i]  # evictions are permanent
                evicted += int((before[i] & ~keep[i]).sum())
            adapter.kv_keep(list(keep))
            if policy.quantises:
                _quantise(entries, shadow, bits, keep)
            feed = [ids[pos]] if pos < n_total else []
        kept_b, full_b = _cache_bytes(entries, keep, bits)
    return Trace(logprob, argmax, kept_b, full_b, policy.events(evicted, bits, keep), keep, bits)


def compare(base: Trace, t: Trace, n_prompt: int) -> dict:
    """The frame's columns (but ``policy``) of trace ``t`` against the full-cache trace ``base``."""
    differs = np.nonzero(t.argmax != base.argmax)[0]
    return {"bytes_kept": int(t.bytes_kept), "bytes_full": int(base.bytes_full),
            "delta_nll": float(np.mean(base.logprob - t.logprob)),
            "top1_agreement": float(np.mean(t.argmax == base.argmax)),
            "first_divergence": int(n_prompt + differs[0]) if differs.size else None, "events": int(t.events)}


def run_tokens(store: Store, run_id: str) -> tuple[list[int], int]:
    """A recorded run's token ids (prompt + generated, by position) and its prompt length."""
    query.run_row(store, run_id)  # RunNotFound
    t = query.table(store, "tokens", run_id, "pos", cols=["pos", "token_id", "is_prompt"])
    n_prompt = int(t["is_prompt"].sum())
    if t.height - n_prompt < 1:
        raise ValueError(f"run {run_id} has no generated tokens: nothing for a KV policy to change")
    if t["pos"].to_list() != list(range(t.height)):
        raise ValueError(f"run {run_id} has gaps in its tokens table: it cannot be fed again")
    return t["token_id"].to_list(), n_prompt


def kv_whatif(store: Store, run_id: str, policies, adapter=None, save: bool = True) -> pl.DataFrame:
    """Each policy's cost on the run's recorded tokens against the full cache: one row per policy (``COLUMNS``).

    Args:
        policies: one spec or a list of specs / ``Policy`` objects (duplicates are run once).
        adapter: the run's adapter (default: reloaded from its checkpoint, hash-checked).
        save: store the rows in ``policy_results`` (replacing this run's rows of the same policies).
    """
    pols = [parse_policy(p) for p in ([policies] if isinstance(policies, (str, Policy)) else list(policies))]
    if not pols:
        raise ValueError("no KV policy given; e.g. window:sink=4,recent=64 (known: " + ", ".join(POLICIES) + ")")
    unique: dict[str, Policy] = {}
    for p in pols:  # a spec given twice runs once
        unique.setdefault(p.spec, p)
    pols = list(unique.values())
    ids, n_prompt = run_tokens(store, run_id)
    if adapter is None:
        adapter = load_for_run(query.run_row(store, run_id))
    base = trace(adapter, ids, n_prompt, Full())
    rows = []
    for p in pols:
        t = base if isinstance(p, Full) else trace(adapter, ids, n_prompt, p)
        rows.append({"policy": p.spec, **compare(base, t, n_prompt)})
    frame = pl.DataFrame(rows, schema=SCHEMA)
    if save:
        stamp = datetime.now(timezone.utc).replace(tzinfo=None)
        out = frame.with_columns(pl.lit(run_id).alias("run_id"), pl.lit(stamp).alias("created_at"))
        store.replace_rows("policy_results", {"run_id": run_id, "policy": [p.spec for p in pols]}, out)
    return frame
