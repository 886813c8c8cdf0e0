"""What each component's activations look like on clean prompts, and how far one run's are from that.

The baseline profile (workbench.analysis.baseline) holds statistics of the *recorded* signals: head output
norms, attention entropy, the residual norm, routing shares. Many faults leave those inside the spread of clean
prompts: a shared expert that went dead, a layer that passes its input on, a router row pushed toward another
expert, a rotation of the wrong frequency. This module profiles the components themselves, from one
teacher-forced forward per calibration prompt (no generation), through the adapter's seams and module hooks
(``patching._Taps``), so it works on our ``Transformer`` and on every ``transformers`` family the adapters cover.

Per component (``kind, layer, head, expert``), over every calibration position but the first (position 0 is
every model's attention sink):

- the per-dimension mean and standard deviation of its output vector (``mean``, ``std``: FLOAT[]);
- the log of its output's L2 norm: mean and std (``log_norm_mean``, ``log_norm_std``);
- the log of its mean squared per-dimension z: mean and std (``dev_mean``, ``dev_std``): how far the vector lies
  from the clean mean in the component's own units (a direction change with the same size: a sign flip, a
  rotation, a pushed router row).

Components: the input norms' outputs (``attn_norm``, ``mlp_norm``), the KV latent (``kv_latent``), each head's
output before the output projection (``head``), the attention block's output (``attn_block``), the MLP or MoE
block's output (``mlp_block``, ``dense_mlp`` in dense layers), the shared experts' (``shared_expert``), what the
layer added to the residual stream (``resid``: stream after minus stream before; a skipped layer adds nothing),
the router's logit for each expert (``router`` with ``expert``), and per head two scalars of its attention
pattern, scored as that head: the mean log distance to the keys it reads and the weight on the previous token
(``head`` rows with signal ``pos_distance`` / ``prev_weight``: a rotation of the wrong frequency moves them).
These one-number components are judged by the context's mean z of the value itself (``_scalar``), not by the
log of its size, which runs off to minus infinity where the value reaches zero.
Each routed expert's own weighted contribution at the positions that chose it (``expert``, signal ``out``: the
experts are run again on the block's input, one module per expert or the fused module once per slot, and the
cells are kept only where the contributions add up to the block's output on every calibration prompt), how
often each expert is chosen (``router`` with ``expert``, signal ``chosen``: a binomial z of the context's rate,
judged against the overdispersion clean contexts of that length show), and the rotation each layer gives its
queries and keys (``rotary``, signal ``angle``: the angle at position 1 per frequency; a rotation is exact, so
every context position rotated otherwise counts ``MISMATCH_NATS``, like routing that disagrees with its router).

The first position: what a causal model computes at position 0 depends on the first token alone, so for the
tokens a context often begins with (``FIRST_TOKENS``: the calibration prompts' first tokens and the tokens their
lines begin with) the profile holds each component's exact output there (signal ``first:<signal>:<token>``, one
forward of the token alone, kept only where every calibration prompt beginning with it agrees; row
``first_check`` names the dtype it was made in, and a model run in another dtype is not compared). A context
beginning with such a token is checked there: a component whose output differs beyond float rounding
(``FIRST_TOL``) scores ``FIRST_NATS``, and only the first place it differs counts (what differs downstream of it,
in its layer, in later layers or in the logits, is capped at half). This is the clean model's own output on a
known input, so it names any weight change the first position passes through (a router row, an output row, an
expert chosen there, a dead shared expert) on the shortest context, but nothing where the run begins with
another token or the fault spares the first position (an expert not chosen there, a cached entry later on).

Known answers: each routed expert's, the shared experts', a dense layer's MLP's and the router weight's output on a
few fixed inputs of its layer (``KNOWN_INPUTS``: the MLP input norm's output at the middle of the first calibration prompts, held in
the profile as ``known_input`` rows), projected on ``KNOWN_DIMS`` fixed random directions (signal ``known``; the router's logits as they are). The
module is called on those inputs again when a run is judged: an expert that computes another function at its usual
size (half its down projection sign-flipped, its weights swapped with another's, noisy or badly quantised), which
keeps its outputs' size and spread on real contexts, answers differently there, wherever the context begins. The
row scores up to ``KNOWN_NATS`` (a critical finding), a routed expert only where some context position chose it,
and is never capped by upstream rows (its inputs are fixed); only in the dtype the profile was made in. What acts
outside the module (a mixing weight, the router's choice) leaves its answers as they were. The attention's linear
maps are held the same way on fixed standard-normal inputs (``_known_attention``; nothing stored but the answers):
the output projection's columns and a query or per-head KV projection's rows head by head (a ``head`` row; every
head of one map differing: the ``attn_block``), MLA's KV latent projection as ``kv_latent``, any other map as the
``attn_block``. A component known to compute another function explains whatever is unusual after it on a token's
path (``FLOW``: later layers, and later parts of its own), whatever its size: those rows are capped at
``KNOWN_AFTER`` (still a suspect for root cause, no warning of its own).

A run is scored on the context of one token (positions 1 .. pos - 1, every position the target's forward
sees): each component's z of the log norm and of the deviation, averaged over the context, and at the last
position (the one whose output is the target's distribution) at half weight. The score is the larger of
those absolute values, turned into nats as below and signed by the norm's direction (+ larger than clean,
- smaller). Besides the statistics, one consistency check that needs no profile: where the router's
own logits select other experts than the ones the tokens were sent to (``RouterMath.select``), the routing
was changed after the router (a dropped expert, a dispatch bug): a ``router`` row for the layer and an
``expert`` row for the expert that lost the most slots, scored 10 nats per position that disagrees, position 0
included (the check is exact; used only where the router math agreed with the model on every calibration
position: the ``router_check`` row). Likewise where the chosen experts are mixed with other weights than the
router's logits give (``WEIGHT_TOL``: a top-k cut to 1, a scaling factor or a normalisation gone wrong after the
router): a ``router`` row, 10 nats per position.

Context lengths: a run-level z is judged against calibration prefixes of its own length bucket (``RUN_BUCKETS``:
the 2-token context alone, then 3, 4-5, 6-9, 10-17, 18-31, 32-127, 128-511 and 512 tokens or more); the first
positions' activations differ from later ones' and a mean over few positions varies more, so a short context is
never judged by a long one's spread. A profile made with the older wide buckets (``OLD_BUCKETS``) is read with
them (``run_bucket``). Rate cells (``chosen``) are the exception: a rate's z already scales with the context's
length, so they pool the wide buckets (``OLD_BUCKETS``: the 2-token context with 3-31 tokens).

How rows are scored and ordered: each component's z is a two-sided normal tail in nats, Bonferroni-adjusted
within its family (all heads' outputs, all router logits, ...); the input embedding is judged per position
(one token's row) and the logits per vocabulary token (one output row off at every position, and no other
token's: a hidden state gone wrong moves many), each only beyond the largest z that calibration met (``BEYOND``);
an expert's own contribution is a row by itself only far past anything clean (``OWN_ALONE_Z``: a dead expert);
an unusual MoE block (``BLOCK_NATS``) names the expert
whose own contribution is far the most unusual (``OWN_Z``), or in a clearly unusual block (``EXPLAINS``) the one
whose positions carry its excess (``expert_behind``: Welch's t, Bonferroni over the experts); a part downstream of
an unusual part of its layer (``UPSTREAM``: at least ``BLOCK_NATS``, and at least half as unusual as the part, up to
a ``REACH``-th for a part of ``EXPLAINS`` nats or more: ``_reach``), and any part of a later layer than one at least
as unusual, is capped at half of it, so the first place where the activations went off ranks first (the experts'
own surprise that root cause reads, ``found["experts"]``, under the same two rules).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np
import polars as pl
import torch
from scipy.special import log_ndtr
from scipy.stats import betabinom

from workbench.analysis.memo import by_object
from workbench.analysis.patching import _Taps
from workbench.capture.adapters import Adapter, Route, adapter_for
from workbench.capture.adapters.base import ATTN_MAPS
from workbench.capture.experts import expert_outputs
from workbench.data import query

Key = tuple  # (kind, layer, head, expert, signal)
COLUMNS = {"kind": pl.Utf8, "layer": pl.Int32, "head": pl.Int32, "expert": pl.Int32, "signal": pl.Utf8,
           "n": pl.Int64, "mean": pl.List(pl.Float32), "std": pl.List(pl.Float32), "log_norm_mean": pl.Float64,
           "log_norm_std": pl.Float64, "dev_mean": pl.Float64, "dev_std": pl.Float64,
           "run_norm_mean": pl.List(pl.Float64), "run_norm_std": pl.List(pl.Float64),
           "run_dev_mean": pl.List(pl.Float64), "run_dev_std": pl.List(pl.Float64)}
# a run-level z is calibrated per context length: prefixes of calibration prompts with at least RUN_BUCKETS[b]
# (and fewer than RUN_BUCKETS[b + 1]) tokens; a head's output and attention change with how much it can read.
# Short contexts get narrow buckets, down to the 2-token context alone (position 1, which reads only itself and the
# sink): early positions' activations differ from later ones', and a mean over few positions varies more
RUN_BUCKETS = (2, 3, 4, 6, 10, 18, 32, 128, 512)
OLD_BUCKETS = (3, 32, 128, 512)  # profiles made before the 2-token bucket (their run_* lists have 4 entries)
MIN_RUNS = 5  # calibration prefixes a bucket needs, else it takes the nearest shorter bucket's spread
# and how many a length bucket needs for the statistics to judge contexts of its length at all: a spread from 5
# prefixes is no spread (a random 102M DeepSeek-V3 profiled on 60 prompts, 5 of them of 512 tokens or more, judged
# clean 500-960-token prompts with 15 component rows in 4 runs); past the last bucket that has them the profile's reach
# ends (``calibrated_context``), as it does past the longest calibration prompt
REACH_RUNS = 10
# within a layer, what a part's input passes through first: a part more unusual than this is explained by it
UPSTREAM = {"kv_latent": ("attn_norm",), "rotary": ("attn_norm",), "head": ("attn_norm", "kv_latent", "rotary"),
            "attn_block": ("attn_norm", "kv_latent", "rotary", "head"),
            # the MLP's input norm reads the stream after the attention: a head that broke changes it too
            "mlp_norm": ("attn_norm", "kv_latent", "rotary", "head", "attn_block"), "router": ("mlp_norm",),
            "shared_expert": ("mlp_norm",), "mlp_block": ("mlp_norm", "router", "shared_expert", "expert"),
            "dense_mlp": ("mlp_norm",),
            "resid": ("attn_norm", "attn_block", "mlp_norm", "router", "shared_expert", "expert", "mlp_block",
                      "dense_mlp")}
BEYOND = 1.5  # embedding and output rows: a z this many times the largest one calibration met
EXPERT_NATS = 3.0  # the expert behind an unusual MoE block: its positions' excess, after Bonferroni
EXPLAINS = 10.0  # nats: a clearly unusual part (an earlier layer's caps later layers' parts no more unusual)
REACH = 16.0  # an upstream part of EXPLAINS nats or more explains parts up to this many times as unusual (a z up to
# 4x its own), one of BLOCK_NATS parts up to 2x, and in between the reach grows linearly: a 10-nat part explains
# no 1000-nat part, a 4-nat one no 60-nat head
WEIGHT_TOL = 0.05  # a mixing weight this far (relative) from what the router's logits give was changed after it
MISMATCH_NATS = 10.0  # per context position whose experts differ from what the router's logits select
BLOCK_NATS = 4.0  # an MoE block this unusual names the expert whose own contribution is far the most unusual
LAST_WEIGHT = 0.5  # the last context position's z counts at this weight beside the context mean
FIT_TOL = 1e-3  # experts are profiled one by one only where their contributions add up to the block's output
ANGLE_TOL = 1e-2  # radians: a position whose rotation is further than this from the clean one is rotated wrongly
OWN_Z = 4.0  # an expert's own contribution this unusual (and twice any other's) is the one behind its block
# an expert's own contribution this unusual is a row by itself: twice the largest z that the demo's clean contexts of
# every length and four kinds of prompt met (15.6 over 24k expert-contexts); a dead expert (nothing out) is ~140
OWN_ALONE_Z = 30.0
RATE_FLOOR = 1.0  # a selection rate varies between clean contexts at least as much as a binomial count's
# the first position: what a causal model computes there depends on the first token alone, so for the tokens a
# context often begins with the profile holds each component's exact output (signal ``first:<signal>:<token>``)
FIRST_TOKENS = 48  # tokens profiled at position 0 (default: the calibration prompts' first tokens, then the commonest)
FIRST_TOL = 0.05  # a coordinate off by this fraction of (its clean spread + a tenth of the vector's RMS) differs
FIRST_NATS = 30.0  # a component whose first-position output differs from the clean model's on that token
FIRST_SIGNALS = ("out", "logit", "chosen")


def capture(a: Adapter, ids: list[int], seen: dict | None = None) -> tuple[dict[Key, torch.Tensor],
                                                                          dict[int, torch.Tensor],
                                                                          dict[int, torch.Tensor]]:
    """One teacher-forced forward of ``ids``: every component's output [T, D] (float32, CPU); per MoE layer the
    experts the router's logits select but the tokens did not go to ([T, E] bool); and per MoE layer whose
    ``RouterMath`` is exact, the positions whose experts were mixed with other weights than the router's logits give
    ([T] bool: more than 5% off, e.g. a top-k dropped to 1 or a scaling factor gone wrong after the router).
    ``seen``, when given, gets what ``cache_free`` returns from this same forward: ``"logprobs"`` and ``"norms"``."""
    taps = _Taps(a)
    taps.capture = True
    logits: dict[int, torch.Tensor] = {}
    lost: dict[int, torch.Tensor] = {}
    reweighted: dict[int, torch.Tensor] = {}
    pos_stats: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def routed(layer: int, r: Route) -> None:
        lg = r.logits.detach()
        logits[layer] = lg.float().cpu()
        want = r.math.select(lg)
        e = lg.size(1)
        exp = torch.zeros(lg.size(0), e, dtype=torch.bool).scatter_(1, want.cpu(), True)
        got = torch.zeros(lg.size(0), e, dtype=torch.bool).scatter_(1, r.indices.detach().cpu(), True)
        lost[layer] = exp & ~got
        if getattr(r.math, "exact", True):
            w_exp = r.math.weights_for(lg.float(), r.indices.detach().to(lg.device)).float()
            w = r.weights.detach().float().to(w_exp.device)
            tol = WEIGHT_TOL * w_exp.abs() + 1e-3 * float(w_exp.abs().amax().clamp(min=1e-6))
            reweighted[layer] = ((w - w_exp).abs() > tol).any(-1).cpu()

    def probs(layer: int, p: torch.Tensor, q_start: int, window=None) -> None:  # p [Tq, H, S]
        p = p.detach().float()
        tq, s = p.size(0), p.size(-1)
        key0 = max(0, q_start + tq - s)
        q = torch.arange(q_start, q_start + tq, device=p.device)[:, None, None]
        k = torch.arange(key0, key0 + s, device=p.device)[None, None, :]
        dist = torch.log1p((q - k).clamp_min(0).float())
        ld = (p * dist).sum(-1)  # [Tq, H]
        prev = (q[:, :, 0] - 1 - key0).clamp(0, s - 1)  # [Tq, 1]
        pw = p.gather(-1, prev[:, :, None].expand(tq, p.size(1), 1))[..., 0]
        pos_stats.setdefault(layer, []).append((q_start, ld.cpu(), pw.cpu()))

    angles: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def rotation(layer: int):
        def fn(pe, start) -> None:  # ours: complex freqs_cis [T, F]; transformers: (cos, sin) [B, T, d]
            if isinstance(pe, (tuple, list)) and len(pe) == 2:
                cos, sin = (t.detach().float().reshape(-1, t.size(-2), t.size(-1))[0] for t in pe)
                ang = torch.atan2(sin[:, : sin.size(-1) // 2], cos[:, : cos.size(-1) // 2])
            elif torch.is_tensor(pe) and pe.is_complex():
                ang = torch.angle(pe.detach()).float().reshape(-1, pe.size(-1))
            else:
                return None
            angles.setdefault(layer, []).append((int(start or 0), ang.cpu()))
            return None
        return fn

    # where the adapter offers them, the routed experts' outputs as the forward computed them (else run again)
    own: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def expert_out(layer: int, e: int, y: torch.Tensor, _act) -> None:
        own.setdefault(layer, []).append((e, y.detach().float().cpu()))

    seams = {"routed": routed, "attn_probs": probs}
    if getattr(a, "expert_out_seam", False):
        seams["expert_out"] = expert_out
    x = torch.tensor([ids], device=a.device)
    handles = []
    try:
        for layer in range(a.summary.n_layers):
            try:
                handles += a.rotary(layer, rotation(layer))
            except (NotImplementedError, ValueError):  # no rotary part here: nothing to observe
                pass
        with torch.no_grad(), taps.attached(), a.seams(seams):
            final = a.forward(x)
    finally:
        for h in handles:
            h.remove()
    c, s = taps.cache, a.summary
    if seen is not None:
        seen["logprobs"] = _logprobs(final[0], x[0])
        # a block's output of one row per position only (a parallel-residual block's [T, n, D] is no resid_post row)
        seen["norms"] = {"resid": {layer: c[("resid", layer)].float().norm(dim=-1).cpu().double().numpy()
                                   for layer in range(s.n_layers) if ("resid", layer) in c
                                   and c[("resid", layer)].size(0) == len(ids)},
                         "head": {layer: c[("z", layer)].float().norm(dim=-1).cpu().double().numpy()
                                  for layer in range(s.n_layers) if ("z", layer) in c
                                  and c[("z", layer)].dim() == 3 and c[("z", layer)].size(0) == len(ids)}}
    out: dict[Key, torch.Tensor] = {("unembed", None, None, None, "logit"): final[0].float().cpu()}
    prev = c.get(("embed", None))
    if prev is not None:
        out[("embed", None, None, None, "out")] = prev.float().cpu()
    for layer in range(s.n_layers):
        moe = layer in s.moe_layers
        for kind in ("attn_norm", "kv_latent", "attn_block", "mlp_norm", "shared_expert", "mlp_block"):
            y = c.get((kind, layer))
            if y is not None:
                kind = "dense_mlp" if kind == "mlp_block" and not moe else kind
                out[(kind, layer, None, None, "out")] = y.float().cpu()
        after = c.get(("resid", layer))
        if after is not None and prev is not None and after.shape == prev.shape:
            out[("resid", layer, None, None, "out")] = (after.float() - prev.float()).cpu()
        prev = after
        z = c.get(("z", layer))
        if z is not None:
            for h in range(z.size(1)):
                out[("head", layer, h, None, "out")] = z[:, h].float().cpu()
        route = c.get(("route", layer))
        if route is not None:
            out[("route", layer, None, None, "indices")] = route[0].cpu()
            out.update(_expert_rows(a, layer, c.get(("mlp_norm", layer)), route, c.get(("mlp_block", layer)),
                                    c.get(("shared_expert", layer)), own.get(layer)))
        if layer in logits:
            for e in range(logits[layer].size(1)):
                out[("router", layer, None, e, "logit")] = logits[layer][:, e:e + 1]
        if angles.get(layer):  # the rotation each position's keys and queries got: [T, F] angles
            first = sorted(angles[layer], key=lambda b: b[0])
            if first[0][0] == 0:
                out[("rotary", layer, None, None, "angle")] = torch.cat([b[1] for b in first])[: len(ids)]
        if layer in pos_stats:
            blocks = sorted(pos_stats[layer], key=lambda b: b[0])
            ld = torch.cat([b[1] for b in blocks])
            pw = torch.cat([b[2] for b in blocks])
            for h in range(ld.size(1)):
                out[("head", layer, h, None, "pos_distance")] = ld[:, h:h + 1]
                out[("head", layer, h, None, "prev_weight")] = pw[:, h:h + 1]
    return out, lost, reweighted


def expert_slots(a: Adapter, layer: int, x: torch.Tensor, indices: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor | None:
    """Each position's weighted contribution from each of its chosen experts, [T, K, D]: the layer's routed
    experts run again on the MoE block's input ``x`` [T, D] (``workbench.capture.experts``: one module per
    expert, or fused transformers-5 experts), times the weight each received. None where the experts module is
    not one that runs exactly."""
    ex = a.parts(layer).get("experts")
    if ex is None or x is None:
        return None
    out = expert_outputs(ex, x, indices)
    return None if out is None else torch.nan_to_num(out) * weights.float().cpu()[..., None]


def _gated(a: Adapter, layer: int) -> bool:
    """Whether the layer's MoE block scales its shared experts' output by a gate of its own (Qwen2-MoE's
    ``shared_expert_gate``) after the shared module returns."""
    block = a.parts(layer).get("mlp")
    return isinstance(getattr(block, "shared_expert_gate", None), torch.nn.Module)


def _expert_rows(a: Adapter, layer: int, x, route, block, shared, calls=None) -> dict[Key, torch.Tensor]:
    """Per routed expert of one layer: its weighted contribution at the positions that chose it (rows of the
    others NaN: ``("expert", layer, None, e, "out")`` [T, D]), whether each position chose it (``("router", layer,
    None, e, "chosen")`` [T, 1], 0 / 1), and how well the contributions (plus the shared experts') add up to the
    block's output (``("expert_fit", ...)``: relative error; the profile keeps expert cells only where it is
    small on every calibration prompt, so a family whose experts we cannot call exactly gets none). ``calls``: the
    experts' outputs as the forward computed them, (expert, rows [n, D]) in call order (``_own_slots``), else the
    experts run again."""
    idx = route[0].cpu()
    n_e = a.summary.n_routed_experts
    rows: dict[Key, torch.Tensor] = {}
    for e in range(n_e):
        rows[("router", layer, None, e, "chosen")] = (idx == e).any(1).float()[:, None]
    slots = _own_slots(idx, route[1], calls, n_e) if calls else None
    if slots is None:
        with torch.no_grad():
            slots = expert_slots(a, layer, x, *route)
    if slots is None or block is None:
        return rows
    b = block.float().cpu()
    total = slots.sum(1)
    if shared is not None:
        sh = shared.float().cpu()
        if _gated(a, layer):  # Qwen2-MoE's sigmoid gate acts after the module we read: the least-squares gate
            sh = sh * ((b - total) * sh).sum(-1, keepdim=True) / sh.pow(2).sum(-1, keepdim=True).clamp_min(1e-12)
        total = total + sh
    fit = float((b - total).norm() / b.norm().clamp_min(1e-12))
    rows[("expert_fit", layer, None, None, "fit")] = torch.tensor([[fit]])
    chosen = idx.unique().tolist()
    ys = torch.full((len(chosen), idx.size(0), slots.size(-1)), float("nan"))  # one buffer: a row [T, D] per expert
    for j, e in enumerate(chosen):
        r, k = torch.where(idx == e)
        ys[j, r] = slots[r, k]
        rows[("expert", layer, None, int(e), "out")] = ys[j]
    return rows


def _own_slots(idx: torch.Tensor, weights: torch.Tensor, calls: list[tuple[int, torch.Tensor]],
               n_e: int) -> torch.Tensor | None:
    """``expert_slots`` from the outputs the forward computed: each expert called once on the rows that chose it,
    in row order (``MoE.forward``), placed at their (row, slot), times the weight; None where the calls do not
    match the choice (an expert called twice, or on another number of rows): then the experts run again."""
    by_expert = dict(calls)
    if len(by_expert) != len(calls):
        return None
    slots = torch.zeros(*idx.shape, calls[0][1].size(-1))
    for e in idx.unique().tolist():
        if not 0 <= e < n_e:  # a slot naming no real expert: nothing (as expert_slots' NaN, zeroed)
            continue
        r, k = torch.where(idx == e)
        y = by_expert.get(e)
        if y is None or y.size(0) != r.numel():
            return None
        slots[r, k] = y
    return torch.nan_to_num(slots) * weights.float().cpu()[..., None]


def _moments(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return y.mean(0), y.std(0).clamp_min(1e-6) if y.size(0) > 1 else torch.ones(y.size(1))


def _cell_tensors(r: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A cell's per-dimension mean and std as tensors (``build`` converts each cell once and passes them)."""
    return torch.as_tensor(r["mean"]), torch.as_tensor(r["std"]).clamp_min(1e-6)


def _zs(y: torch.Tensor, r: dict, ms: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: the z of the log norm and of the log deviation, against the component's cell ``r``."""
    mu, sd = ms if ms is not None else _cell_tensors(r)
    zl = (y.norm(dim=-1).clamp_min(1e-30).log() - r["log_norm_mean"]) / r["log_norm_std"]
    zd = ((((y - mu) / sd) ** 2).mean(-1).clamp_min(1e-30).log() - r["dev_mean"]) / r["dev_std"]
    return zl, zd


def _chosen_rows(y: torch.Tensor) -> torch.Tensor:
    """The rows of a component's output that exist (an expert's: the positions that chose it; others: all)."""
    return y[~torch.isnan(y[:, 0])] if y.numel() else y


def _intraclass(p: float, ys: list[torch.Tensor]) -> float:
    """How alike one prompt's positions are in choosing an expert (the intraclass correlation of a beta-binomial,
    by the method of moments over the calibration prompts' rates): 0 would be independent positions."""
    p = min(max(p, 1e-4), 1 - 1e-4)
    vals = [(((float(y.mean()) - p) ** 2) / (p * (1 - p)) - 1 / y.size(0)) / (1 - 1 / y.size(0))
            for y in ys if y.size(0) >= 2]
    return float(min(max(np.mean(vals), 0.0), 1.0)) if vals else 0.0


def _rate_z(y: torch.Tensor, r: dict) -> float | None:
    """How far a context's selection rate of one expert (``y`` [n, 1]: 0 / 1 per position) is from its clean
    rate ``r["mean"][0]``, in standard errors of a beta-binomial: positions of one text choose alike (the
    intraclass correlation ``r["std"][0]``), so the rate of a long context varies about as much as the rates of
    whole clean prompts do, not as a count of independent positions would."""
    n = y.size(0)
    if n == 0:
        return None
    p = (r["mean"][0] * r["n"] + 0.5) / (r["n"] + 1.0)  # never exactly 0 or 1
    rho = r["std"][0]
    return (float(y.mean()) - p) / math.sqrt(p * (1 - p) * (1 / n + rho * (1 - 1 / n)))


def _rate_tail(y: torch.Tensor, r: dict) -> float:
    """-log of the two-sided P(a clean context of this length chooses the expert at least as far from its clean rate,
    on the side it is) under the beta-binomial ``_rate_z`` standardises by: the clean rate and the intraclass
    correlation of the calibration prompts. A rarely chosen expert's rate across texts is far from normal (mostly
    none, now and then a burst), so its normal z overstates a burst by orders of magnitude (a tiny PhiMoE's expert
    chosen at 10 of 95 positions of SQL, at 7 of 3,800 calibration positions: 76 nats as a z, 5 as the tail it has)."""
    n, k = y.size(0), int(y.sum())
    p = (r["mean"][0] * r["n"] + 0.5) / (r["n"] + 1.0)
    rho = min(max(float(r["std"][0]), 1e-6), 1 - 1e-6)
    a, b = p * (1 - rho) / rho, (1 - p) * (1 - rho) / rho
    lp = betabinom.logsf(k - 1, n, a, b) if k >= n * p else betabinom.logcdf(k, n, a, b)
    return float(-lp) - math.log(2) if math.isfinite(lp) else math.inf  # two-sided, as ``log_tail``'s


def _scalar(kind: str, signal: str) -> bool:
    """One number per position (a router logit, a head's reach or weight on the previous token): judged by its
    own z, since the log of its size runs off to minus infinity where it reaches zero."""
    return (kind == "router" and signal == "logit") or signal in ("pos_distance", "prev_weight")


def _value_z(y: torch.Tensor, r: dict, ms: tuple | None = None) -> torch.Tensor:
    """Per position, the z of a one-number component (a router logit) against its clean mean and spread."""
    mu, sd = ms if ms is not None else _cell_tensors(r)
    return ((y - mu) / sd)[:, 0]


def _run_z(y: torch.Tensor, r: dict, ms: tuple | None = None) -> tuple[float, float] | None:
    """A context's (mean z of the log norm, mean z of the deviation) for one component (an expert: over the
    positions that chose it; a ``chosen`` indicator: its rate, twice), or None where no position has it."""
    if r["signal"] == "chosen":
        z = _rate_z(y, r)
        return None if z is None else (z, z)
    if _scalar(r["kind"], r["signal"]):  # one number (that may reach or cross zero): its own z, not log |x|
        z = float(_value_z(y, r, ms).mean()) if y.numel() else None
        return None if z is None else (z, z)
    y = _chosen_rows(y)
    if y.size(0) == 0:
        return None
    zl, zd = _zs(y, r, ms)
    return float(zl.mean()), float(zd.mean())


def _off_rotation(y: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Per position of ``y`` ([T, F] rotary angles), whether it is rotated other than ``p * theta`` (the clean
    layer's angle at position 1: its frequencies), beyond float rounding."""
    p = torch.arange(y.size(0), dtype=torch.float64)[:, None]
    d = torch.remainder(y.double() - p * theta.double()[None] + math.pi, 2 * math.pi) - math.pi
    return d.abs().amax(-1) > ANGLE_TOL


def _largest(runs: dict, k: Key, stats: list[tuple]) -> list[float]:
    """Per length bucket, the largest |z| (standardised by that bucket's spread) clean prefixes reached; a
    bucket with too few prefixes takes the nearest shorter bucket's."""
    out, last = [], 3.0
    for b, (m, sd, _, _) in enumerate(stats):
        v = _bucket_runs(runs, k, b)
        if len(v) >= MIN_RUNS:
            last = float(np.abs((v[:, 0] - m) / sd).max())
        out.append(last)
    return out


WIDE = [max([0] + [i for i, lo in enumerate(OLD_BUCKETS) if start >= lo]) for start in RUN_BUCKETS]


def _bucket_runs(runs: dict, k: Key, b: int) -> np.ndarray:
    """The calibration prefixes a cell's bucket ``b`` is judged by: its own, or for a rate (``chosen``) every prefix
    of the wide bucket it lies in (``OLD_BUCKETS``): a rate's z already scales with the context's length, and the
    largest z over one narrow bucket's few prefixes is unstable."""
    if k[4] != "chosen":
        return np.array(runs.get((k, b), []))
    return np.array([v for c in range(len(RUN_BUCKETS)) if WIDE[c] == WIDE[b] for v in runs.get((k, c), [])])


def _capped(v: float, up: float) -> float:
    """``v`` explained by a part ``up`` nats unusual: at most half of it, its sign kept."""
    return math.copysign(min(abs(v), up / 2), v)


def _reach(up: float) -> float:
    """How many times its own surprise an upstream part of ``up`` nats explains (``REACH``)."""
    return 2.0 + (REACH - 2.0) * min(max((up - BLOCK_NATS) / (EXPLAINS - BLOCK_NATS), 0.0), 1.0)


def run_bucket(n_ctx: int, n_stats: int) -> int:
    """The length bucket of a context of ``n_ctx`` tokens, as an index into a cell's ``run_*`` lists of ``n_stats``
    entries: a profile made before the short buckets has 4 (``OLD_BUCKETS``) where a current one has 9
    (``RUN_BUCKETS``); any other length is read with the current buckets, clamped to its last entry."""
    starts = OLD_BUCKETS if n_stats == len(OLD_BUCKETS) else RUN_BUCKETS
    return min(max(i for i, lo in enumerate(starts) if n_ctx >= lo or i == 0), max(n_stats - 1, 0))


def _bucket_end(b: int, n: int) -> int:
    """The longest prefix of an ``n``-token prompt that lies in length bucket ``b`` (< its start: none)."""
    return min(RUN_BUCKETS[b + 1] - 1 if b + 1 < len(RUN_BUCKETS) else n, n)


def _held_row(kind: str, layer, head, expert, signal: str, n: int, mean: list, **stats) -> dict:
    """A profile row that holds values, not a statistic's cell (an exact answer, a check, a count): ``n`` and
    ``mean``, the statistics' columns at their neutral values unless ``stats`` gives them."""
    return {"kind": kind, "layer": layer, "head": head, "expert": expert, "signal": signal, "n": n, "mean": mean,
            "std": [], "log_norm_mean": 0.0, "log_norm_std": 1.0, "dev_mean": 0.0, "dev_std": 1.0,
            "run_norm_mean": [], "run_norm_std": [], "run_dev_mean": [], "run_dev_std": []} | stats


def _end_row(kind: str, signal: str, y: torch.Tensor) -> dict:
    """A known-answer row of the model's ends (no layer): ``y`` [N, W] as held, flattened."""
    return _held_row(kind, None, None, None, signal, y.size(0), y.flatten().tolist())


def build(a: Adapter, prompts: list[list[int]], seed: int = 0, first_tokens: list[int] | None = None) -> pl.DataFrame:
    """The activation profile of ``a`` from teacher-forced forwards of ``prompts`` (token-id lists).

    Two passes: the per-position cells, then the run-level spread: each prompt cut at a random length in each
    ``RUN_BUCKETS`` bucket it reaches, the mean over its positions of each z; how much that mean varies between
    clean prompts of that length (positions along one prompt are strongly correlated, so a run's mean z varies
    far more than 1 / sqrt(positions), and short and long contexts differ) is what a run is judged against.

    ``first_tokens``: the tokens whose first-position outputs are held exactly (at most ``FIRST_TOKENS``; e.g. the
    tokens lines of the calibration text begin with, as a prompt may begin with any line); default
    ``_first_tokens(prompts)``."""
    prompts = [list(p)[: a.summary.max_seq_len] for p in prompts if len(p) >= 3]
    if not prompts:
        raise ValueError("no calibration prompt had 3 tokens or more")
    acc: dict[Key, list[torch.Tensor]] = {}
    captured = []
    disagree = 0  # positions where clean routing differs from what RouterMath selects (a family it mis-models)
    fits: dict[int, float] = {}  # MoE layer -> the worst relative error of the experts' contributions' sum
    angle_rows: dict[Key, list[torch.Tensor]] = {}  # rotary layer -> each prompt's angles [T, F]
    for ids in prompts:
        got, lost, reweighted = capture(a, ids)
        disagree += sum(int(m.any(1).sum()) for m in lost.values()) + sum(int(m.sum()) for m in reweighted.values())
        captured.append(got)
        for k, y in got.items():
            if k[0] == "expert_fit":
                fits[k[1]] = max(fits.get(k[1], 0.0), float(y.max()))
            elif k[4] == "angle":  # a rotation is exact: its frequencies, if every prompt follows them
                if y.size(0) >= 2:
                    angle_rows.setdefault(k, []).append(y)
            elif k[0] != "route":  # the chosen experts: read beside the block, not profiled
                acc.setdefault(k, []).append(y[1:])
    cells: dict[Key, dict] = {}
    for k, ys in acc.items():
        y = _chosen_rows(torch.cat(ys).float())
        if y.size(0) < 2 or (k[0] == "expert" and fits.get(k[1], 1.0) > FIT_TOL):
            continue
        mu, sd = _moments(y)
        if k[4] == "chosen":  # a 0 / 1 per position: only its rate is judged (run level)
            cells[k] = {"kind": k[0], "layer": k[1], "head": k[2], "expert": k[3], "signal": k[4], "n": y.size(0),
                        "mean": mu.tolist(), "std": [_intraclass(float(mu[0]), [g[k][1:] for g in captured])],
                        "log_norm_mean": 0.0, "log_norm_std": 1.0, "dev_mean": 0.0, "dev_std": 1.0}
            continue
        ln = y.norm(dim=-1).clamp_min(1e-30).log()
        dev = (((y - mu) / sd) ** 2).mean(-1).clamp_min(1e-30).log()
        cells[k] = {"kind": k[0], "layer": k[1], "head": k[2], "expert": k[3], "signal": k[4], "n": y.size(0),
                    "mean": mu.tolist(), "std": sd.tolist(), "log_norm_mean": float(ln.mean()),
                    "log_norm_std": max(float(ln.std()), 1e-3), "dev_mean": float(dev.mean()),
                    "dev_std": max(float(dev.std()), 1e-3)}
    rng = np.random.default_rng(seed)
    tens = {k: _cell_tensors(r) for k, r in cells.items()}  # each cell's mean and std, converted once
    runs: dict[tuple, list[tuple[float, float]]] = {}  # (key, bucket) -> per prefix (mean z log norm, deviation)
    for got, ids in zip(captured, prompts):
        for b, lo in enumerate(RUN_BUCKETS):
            hi = _bucket_end(b, len(ids))
            if hi < lo:
                break
            n = int(round(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))) if hi > lo else lo
            n = min(max(n, lo), hi)
            for k, y in got.items():
                if k in cells:
                    got_z = _run_z(y[1:n], cells[k], tens[k])
                    if got_z is not None:
                        runs.setdefault((k, b), []).append(got_z)
    for k, r in cells.items():
        if k[4] == "angle":
            continue
        stats, last = [], (0.0, 1.0, 0.0, 1.0)
        floor = RATE_FLOOR if k[4] == "chosen" else 0.1
        for b in range(len(RUN_BUCKETS)):
            v = _bucket_runs(runs, k, b)
            if len(v) >= MIN_RUNS:
                last = (float(v[:, 0].mean()), max(float(v[:, 0].std()), floor),
                        float(v[:, 1].mean()), max(float(v[:, 1].std()), floor))
            stats.append(last)
        r |= {"run_norm_mean": [x[0] for x in stats], "run_norm_std": [x[1] for x in stats],
              "run_dev_mean": [x[2] for x in stats], "run_dev_std": [x[3] for x in stats]}
        if k[4] == "chosen":  # a rate's tails are content's, not a normal's: the largest clean z per bucket
            r["run_dev_mean"] = _largest(runs, k, stats)
            r["run_dev_std"] = [1.0] * len(stats)
    for k, ys in angle_rows.items():
        theta = ys[0][1]
        if all(int(_off_rotation(y, theta).sum()) == 0 for y in ys):
            cells[k] = _held_row(k[0], k[1], None, None, "angle", len(ys), theta.tolist(),
                                 std=[0.0] * theta.numel())
    emb = cells.get(("embed", None, None, None, "out"))
    if emb is not None:  # a token's row is what it is: the largest |z| any calibration token reached
        emb["run_dev_mean"] = [max(float(_zs(g[("embed", None, None, None, "out")][1:], emb,
                                             tens[("embed", None, None, None, "out")])[0].abs().max())
                                   for g in captured)]
    out_rows = _row_spread(captured, prompts, cells.get(("unembed", None, None, None, "logit")), rng)
    first_rows = _first_cells(a, prompts, captured, cells, first_tokens)
    known_rows = _known_cells(a, prompts, captured) + _known_end_cells(a)
    check = _held_row("router_check", None, None, None, "disagree", disagree, [])
    reach = _held_row("calibration", None, None, None, "max_context", max(len(p) for p in prompts), [])
    per_bucket = _held_row("calibration", None, None, None, "bucket_prompts", len(prompts),
                           [float(sum(len(p) >= lo for p in prompts)) for lo in RUN_BUCKETS])
    return pl.DataFrame([*cells.values(), check, reach, per_bucket, *out_rows, *first_rows, *known_rows],
                        schema=COLUMNS)


def _first_tokens(prompts: list[list[int]]) -> list[int]:
    """The tokens profiled at position 0: the calibration prompts' first tokens (commonest first), then the
    commonest tokens anywhere in them, ``FIRST_TOKENS`` in all."""
    firsts, every = Counter(p[0] for p in prompts), Counter(t for p in prompts for t in p)
    out = [t for t, _ in firsts.most_common()][:FIRST_TOKENS]
    return out + [t for t, _ in every.most_common() if t not in firsts][: FIRST_TOKENS - len(out)]


def _first_dev(y: torch.Tensor, v: torch.Tensor, spread: torch.Tensor | float = 0.0) -> float:
    """How far a first-position output ``y`` is from the clean one ``v`` (both [D]): the largest coordinate's
    difference over (its clean spread over positions + a tenth of the vector's RMS); a float rounding difference
    of the profile's dtype stays far below ``FIRST_TOL``, a changed weight on the path does not."""
    return float(_first_devs(y[None], v[None], torch.as_tensor(spread, dtype=torch.float64))[0])


def _first_devs(y: torch.Tensor, v: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """``_first_dev`` of each row of ``y`` and ``v`` [N, D] (``spread`` [N, D], or one that broadcasts), [N]: a row with
    a NaN is 0 where both rows are all NaN, else infinitely far."""
    y, v = y.double(), v.double()
    ny, nv = torch.isnan(y), torch.isnan(v)
    scale = 0.1 * v.pow(2).mean(-1, keepdim=True).sqrt() + spread.double()
    d = (y - v).abs()
    dev = torch.where(d > 0, d / scale.clamp_min(1e-30), torch.zeros_like(d)).amax(-1)
    nan = ny.any(-1) | nv.any(-1)
    both = ny.all(-1) & nv.all(-1)
    return torch.where(nan, torch.where(both, 0.0, math.inf), dev)


def _first_cells(a: Adapter, prompts: list[list[int]], captured: list[dict], cells: dict,
                 tokens: list[int] | None = None) -> list[dict]:
    """Rows ``(kind, layer, head, expert, "first:<signal>:<token>")``: each component's output at position 0 when
    the context begins with ``token`` (one forward of that token alone), for ``_first_tokens``. A component is
    kept only where every calibration prompt beginning with a profiled token gives that output there (a family
    whose first position depends on what follows, e.g. capacity-limited routing, gets none)."""
    tokens = list(dict.fromkeys(tokens))[:FIRST_TOKENS] if tokens is not None else _first_tokens(prompts)
    alone = {t: capture(a, [t])[0] for t in tokens}
    bad: set = set()
    for got, ids in zip(captured, prompts):
        ref = alone.get(ids[0])
        for k, y in (got.items() if ref is not None else ()):
            sd = cells[k]["std"] if k in cells and k[4] != "chosen" and len(cells[k]["std"]) == y.size(1) else 0.0
            if k in ref and k[4] in FIRST_SIGNALS and _first_dev(y[0], ref[k][0], torch.as_tensor(sd)) > FIRST_TOL / 10:
                bad.add(k)
    agree = Counter(ids[0] for ids in prompts)
    rows = [_held_row("first_check", None, None, None, str(a.dtype).split(".")[-1], len(alone), [])]
    for t, got in alone.items():
        for k, y in got.items():
            if k[4] not in FIRST_SIGNALS or k[0] in ("route", "expert_fit") or k in bad:
                continue
            if k[0] == "expert" and bool(torch.isnan(y[0]).any()):  # not chosen here: its ``chosen`` row says so
                continue
            rows.append(_held_row(k[0], k[1], k[2], k[3], f"first:{k[4]}:{t}", agree.get(t, 0), y[0].tolist()))
    return rows


class _Prepared:
    """A profile's rows the way ``evidence`` reads them, selected and converted once per profile object: ``load``
    hands out the same object while the stored profile is unchanged, so the detectors after every recording (and
    root cause, token after token) do not filter and convert the same rows again."""

    def __init__(self, prof: pl.DataFrame):
        self.prof = prof
        self.made_in = prof.filter(pl.col("kind") == "first_check")["signal"].to_list()
        check = prof.filter(pl.col("kind") == "router_check")
        self.trusted = check.height == 0 or int(check["n"][0]) == 0  # clean routing agreed with RouterMath
        reach = prof.filter((pl.col("kind") == "calibration") & (pl.col("signal") == "max_context"))
        # the longest context the calibration ran (a profile made before this row: unknown), and no further than the
        # last length bucket with REACH_RUNS calibration prompts (a profile made before it said: as far as the first)
        self.max_context: int | None = int(reach["n"][0]) if reach.height else None
        counts = prof.filter((pl.col("kind") == "calibration") & (pl.col("signal") == "bucket_prompts"))
        if counts.height and self.max_context is not None:
            self.max_context = min(self.max_context, _bucket_reach(counts["mean"][0].to_list(), self.max_context))
        self.known_inputs = {r["layer"]: r for r in prof.filter(pl.col("kind") == "known_input").iter_rows(named=True)}
        self.known: dict[int, list[dict]] = {}  # layer -> its known-answer cells
        for r in prof.filter(pl.col("signal").str.starts_with("known")).iter_rows(named=True):
            if r["layer"] is not None:
                self.known.setdefault(r["layer"], []).append(r)
        ends = {(r["kind"], r["signal"]): r for r in prof.filter(pl.col("layer").is_null() & pl.col("signal").is_in(
            ["known:rows", "known:norm"])).iter_rows(named=True)}
        self.known_embed = ends.get(("embed", "known:rows"))  # every input-embedding row as held
        self.known_unembed = ends.get(("unembed", "known:rows"))  # every output-projection row (not where tied)
        self.known_final = ends.get(("final_norm", "known:norm"))  # the final norm's answer on fixed inputs
        self._end_rows: dict[str, tuple[torch.Tensor, float]] = {}  # kind -> (rows, their median RMS)
        rest = prof.filter(~pl.col("signal").str.starts_with("first:") & ~pl.col("kind").is_in(["first_check",
                                                                                              "known_input",
                                                                                              "calibration"])
                           & ~pl.col("signal").str.starts_with("known"))
        self.rest = [((r["kind"], r["layer"], r["head"], r["expert"], r["signal"]), r)
                     for r in rest.iter_rows(named=True)]
        self.mlp_block = [r for k, r in self.rest if k[0] == "mlp_block"]
        self.unembed_rows = next((r for k, r in self.rest if k[0] == "unembed_rows"), None)
        self._firsts: dict[int, list[dict]] = {}
        self._first_ts: dict[int, list[tuple]] = {}
        self._means: dict[tuple, torch.Tensor] = {}  # (id of a row of ``known`` / ``known_inputs``, dtype)
        self._spread: dict | None = None
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a row of ``rest`` (held here)

    def end_rows(self, kind: str) -> tuple[torch.Tensor, float]:
        """``known_embed``'s (``kind`` "embed") or ``known_unembed``'s ("unembed") rows as a tensor [V,
        KNOWN_EMBED_DIMS] and their median RMS (a typical row's size, at least 1e-30), converted once."""
        if kind not in self._end_rows:
            cell = self.known_embed if kind == "embed" else self.known_unembed
            rows = torch.tensor(cell["mean"], dtype=torch.float32).view(int(cell["n"]), -1)
            self._end_rows[kind] = (rows, max(float(rows.double().pow(2).mean(1).sqrt().median()), 1e-30))
        return self._end_rows[kind]

    def firsts(self, token: int) -> list[dict]:
        """The ``first:`` cells of a context whose first token is ``token``."""
        rows = self._firsts.get(token)
        if rows is None:
            if len(self._firsts) > 256:
                self._firsts.clear()
            rows = self._firsts[token] = list(self.prof.filter(
                pl.col("signal").str.ends_with(f":{token}") & pl.col("signal").str.starts_with("first:")).iter_rows(
                    named=True))
        return rows

    def first_tensors(self, token: int) -> list[tuple]:
        """``firsts(token)`` as (cell key, signal, clean output [D], its spread [D] or None), converted once."""
        got = self._first_ts.get(token)
        if got is None:
            if len(self._first_ts) > 256:
                self._first_ts.clear()
            spread, got = self.spread(), []
            for r in self.firsts(token):
                signal = r["signal"].split(":")[1]
                k = (r["kind"], r["layer"], r["head"], r["expert"], signal)
                v = torch.as_tensor(r["mean"])
                sd = spread.get(k)
                got.append((k, signal, v, torch.as_tensor(sd) if sd is not None and len(sd) == v.numel() else None))
            self._first_ts[token] = got
        return got

    def spread(self) -> dict:
        """(kind, layer, head, expert, signal) -> the clean per-dimension std of each ``out`` / ``logit`` cell."""
        if self._spread is None:
            self._spread = {(r["kind"], r["layer"], r["head"], r["expert"], r["signal"]): r["std"]
                            for r in self.prof.filter(pl.col("signal").is_in(["out", "logit"])).select(
                                "kind", "layer", "head", "expert", "signal", "std").iter_rows(named=True)}
        return self._spread

    def mean(self, r: dict, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A known-answer or known-input row's ``mean`` as a tensor (``torch.tensor``'s default dtype, or ``dtype``),
        converted on first use (the rows live as long as this object; never written to: callers read it)."""
        key = (id(r), dtype)
        if key not in self._means:
            self._means[key] = torch.tensor(r["mean"], dtype=dtype)
        return self._means[key]

    def tensors(self, r: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One of ``rest``'s cells' mean and std as tensors (``_cell_tensors``), converted on first use."""
        if id(r) not in self._tensors:
            self._tensors[id(r)] = _cell_tensors(r)
        return self._tensors[id(r)]


_PREPARED: dict[int, tuple] = {}  # id(profile) -> (profile, its _Prepared): memo.by_object


def _bucket_reach(counts: list[float], longest: int) -> int:
    """The longest context the statistics judge: the end of the last length bucket (``RUN_BUCKETS``) that it and
    every shorter one has ``REACH_RUNS`` calibration prompts reaching it (``counts``: per bucket); ``longest`` for
    the last bucket, and for a calibration of fewer prompts than that (a small profile's spreads are all short of
    prompts alike: no length is singled out)."""
    reach = longest
    for b, n in enumerate(counts[: len(RUN_BUCKETS)]):
        if n < REACH_RUNS:
            break
        reach = RUN_BUCKETS[b + 1] - 1 if b + 1 < len(RUN_BUCKETS) else longest
    return reach


def _prepared(prof: pl.DataFrame) -> _Prepared:
    return by_object(_PREPARED, prof, _Prepared)


def calibrated_context(prof: pl.DataFrame | None) -> int | None:
    """The longest context (tokens) the profile's calibration ran, or None (no profile, or one made before it said)."""
    return None if prof is None else _prepared(prof).max_context


def _made_in(prof: pl.DataFrame, dtype: torch.dtype) -> bool:
    """Whether the profile's exact outputs (first position, known answers) were made in ``dtype`` (its
    ``first_check`` row): in another dtype the same weights round otherwise, so they are not compared."""
    return _prepared(prof).made_in == [str(dtype).split(".")[-1]]


def _known_tol(prof: pl.DataFrame, dtype: torch.dtype) -> float | None:
    """How far a known answer may be off in ``dtype``: ``KNOWN_TOL`` in the profile's own dtype, ``KNOWN_TOL_HALF``
    for a model run in half precision against a profile made in fp32 (it rounds otherwise, by far less), None (not
    compared) for any other pair."""
    if _made_in(prof, dtype):
        return KNOWN_TOL
    if _prepared(prof).made_in == ["float32"] and dtype in (torch.bfloat16, torch.float16):
        return KNOWN_TOL_HALF
    return None


def _first_evidence(got: dict, first: int, prof: pl.DataFrame, dtype: torch.dtype) -> dict[tuple, float]:
    """Components whose output at position 0 differs from the clean model's on the context's first token (only
    where the model runs in the dtype the profile was made in: another one rounds otherwise)."""
    if not _made_in(prof, dtype):
        return {}
    prep = _prepared(prof)
    cells = prep.first_tensors(first)
    if not cells:
        return {}
    by_width: dict[int, list[tuple]] = {}  # the cells this context has, by width: one deviation per width
    for k, signal, v, sd in cells:
        y = got.get(k)
        if y is None or y.size(0) == 0 or y.size(1) != v.numel():
            continue
        if k[0] == "expert" and bool(torch.isnan(y[0]).any()):
            continue  # no longer chosen here: its router's ``chosen`` row says so
        by_width.setdefault(v.numel(), []).append((k, signal, y[0], v, sd))
    off: dict[tuple, float] = {}
    for group in by_width.values():
        sd_dtype = next((sd.dtype for *_, sd in group if sd is not None), torch.float32)
        spread = torch.stack([sd if sd is not None else torch.zeros(v.numel(), dtype=sd_dtype)
                              for _, _, _, v, sd in group])
        devs = _first_devs(torch.stack([c[2] for c in group]), torch.stack([c[3] for c in group]), spread)
        for (k, signal, y0, v, _), dev in zip(group, devs.tolist()):
            if dev <= FIRST_TOL:
                continue
            key = ("embed", None, None, None, 0) if k[0] == "embed" else (k[0], k[1], k[2], k[3], None)
            sign = float(y0.double().norm() - v.double().norm()) if signal != "chosen" else float(y0[0] - v[0])
            off[key] = _signed_nats(FIRST_NATS, sign)
    # what differs downstream of a first-position difference is its consequence: only the first place counts
    depth = {k: -1 if k[0] == "embed" else math.inf if k[0] == "unembed" else k[1] for k in off}
    first = min(depth.values(), default=None)
    kinds = {k[0] for k in off if depth[k] == first}
    up = UPSTREAM | {"expert": ("mlp_norm", "router")}  # an expert's weighted output follows the router's choice
    return {key: v / 2 if depth[key] > first or any(u in kinds for u in up.get(key[0], ())) else v
            for key, v in off.items()}


# known answers: each routed expert's, shared expert's, dense MLP's, router's and attention map's output on a few
# fixed inputs of its layer (module doc)
KNOWN_INPUTS = 4  # inputs per layer: the MoE or MLP block's input at the middle of the first calibration prompts
KNOWN_DIMS = 16  # each output is held as its projection on this many fixed random directions (a profile stays small)
KNOWN_TOL = 0.05  # a projection off by this fraction of the clean one's RMS: the component computes another function
# a model run in bf16 / fp16 against a profile made in fp32: the same weights round otherwise, by up to 0.019-0.023 of
# the RMS in bf16 (0.003 in fp16) on the demo and a random 102M DeepSeek-V3, every component: judged past this instead
KNOWN_TOL_HALF = 0.1
KNOWN_FULL = 0.5  # off by this fraction or more: ``KNOWN_NATS``; in between, proportionally
KNOWN_NATS = 60.0  # a component that no longer computes what it did when profiled (its weights or its code changed)
KNOWN_AFTER = 10.0  # what is unusual after it on the token's path is its consequence: capped at this (under a warning)


@functools.lru_cache(maxsize=64)
def _known_projection(d: int) -> torch.Tensor:
    """The fixed directions the known answers are held on, [D, KNOWN_DIMS] (the same for every profile of width D,
    in every release: NumPy's legacy generator, whose stream is frozen)."""
    return torch.from_numpy(np.random.RandomState(d).standard_normal((d, KNOWN_DIMS)) / math.sqrt(d)).float()


OUT_NAMES = ATTN_MAPS["out"]  # an attention's output projection: its columns are per head
HEAD_ROWS = ATTN_MAPS["query"] + ATTN_MAPS["kv_up"]  # projections whose rows are per head, held head by head
LATENT_NAMES = ATTN_MAPS["kv_latent"]  # MLA's shared KV latent: the ``kv_latent`` component


def _held(y: torch.Tensor) -> torch.Tensor:
    """An answer [N, W] as held: projected on ``_known_projection`` where it is wider than ``KNOWN_DIMS``."""
    y = torch.nan_to_num(y.detach().float().cpu(), nan=0.0)
    return y @ _known_projection(y.size(1)) if y.size(1) > KNOWN_DIMS else y


@functools.lru_cache(maxsize=64)
def _known_unit_inputs(d: int) -> torch.Tensor:
    """The fixed inputs of a linear map of input width D, [KNOWN_INPUTS, D] (standard normal, NumPy's frozen stream;
    never written to: callers read it)."""
    return torch.from_numpy(np.random.RandomState(d).standard_normal((KNOWN_INPUTS, d)))


def _known_attention(a: Adapter, layer: int) -> dict[Key, torch.Tensor]:
    """The attention's linear maps on fixed inputs (``KNOWN_INPUTS`` standard normal rows per input width, NumPy's
    frozen stream: a linear map shows any change of its weight on any input), named by what they feed: the output
    projection's columns and a query or per-head KV projection's rows head by head (``("head", layer, h, None,
    "known:<module>")``), MLA's KV latent projection as ``kv_latent``, any other linear map (GQA's key and value
    projections, a low-rank query's first half) as the ``attn_block``."""
    attn = a.parts(layer).get("attn")
    h_n = a.summary.n_heads
    out: dict[Key, torch.Tensor] = {}
    if not isinstance(attn, torch.nn.Module):
        return out
    with torch.no_grad():
        for name, lin in attn.named_modules():
            if not isinstance(lin, torch.nn.Linear):
                continue
            leaf, w = name.split(".")[-1], lin.weight
            if w.is_meta:  # offloaded (a device map's hooks bring it in only inside the model's own forward)
                continue
            u = _known_unit_inputs(lin.in_features).to(w.device, w.dtype)
            if leaf in OUT_NAMES and lin.in_features % h_n == 0:
                d = lin.in_features // h_n
                for h in range(h_n):
                    cols = slice(h * d, (h + 1) * d)
                    out[("head", layer, h, None, f"known:{name}")] = _held(u[:, cols] @ w[:, cols].T)
            elif leaf in HEAD_ROWS and lin.out_features % h_n == 0:
                y = torch.nn.functional.linear(u, w, lin.bias)
                k = lin.out_features // h_n
                for h in range(h_n):
                    out[("head", layer, h, None, f"known:{name}")] = _held(y[:, h * k:(h + 1) * k])
            else:
                kind = "kv_latent" if leaf in LATENT_NAMES else "attn_block"
                out[(kind, layer, None, None, f"known:{name}")] = _held(torch.nn.functional.linear(u, w, lin.bias))
    return out


def _norm_like(m) -> bool:
    """A normalisation module with a weight vector (RMSNorm, LayerNorm, a QK norm): what it computes on fixed inputs
    depends on nothing but that weight, so any change of it shows."""
    w = getattr(m, "weight", None)
    return (isinstance(m, torch.nn.Module) and not isinstance(m, torch.nn.Linear) and torch.is_tensor(w)
            and w.dim() == 1 and not w.is_meta and "norm" in type(m).__name__.lower())


def _norm_answer(m: torch.nn.Module) -> torch.Tensor | None:
    """A norm's output on the first of the fixed standard normal rows of its width, whole ([1, D], float32: a norm
    scales channel by channel, so one channel gone wrong is one coordinate of it, which a projection would dilute
    by the square root of the width; None: it takes other inputs than [N, D])."""
    w = m.weight
    u = _known_unit_inputs(w.numel())[:1].to(w.device, w.dtype)
    try:
        with torch.no_grad():
            y = m(u)
    except Exception:  # a norm that takes more than the hidden states: no known answer
        return None
    y = y[0] if isinstance(y, tuple) else y
    return torch.nan_to_num(y.detach().float().cpu(), nan=0.0) if torch.is_tensor(y) and y.shape == u.shape else None


def _norm_dev(y: torch.Tensor, v: torch.Tensor) -> float:
    """How far a norm's answer ``y`` is from the clean ``v``: its largest coordinate's difference over the RMS of
    ``v`` (a channel x4 at width 4,096: 3, where the RMS of the difference gives 0.05)."""
    y, v = y.double().flatten(), v.double().flatten()
    if bool(torch.isnan(y).any()):
        return math.inf
    return float((y - v).abs().max() / v.pow(2).mean().sqrt().clamp_min(1e-30))


def _known_norms(a: Adapter, layer: int) -> dict[Key, torch.Tensor]:
    """Each norm of ``layer`` on fixed inputs (``_norm_answer``), named by what it feeds: ``("attn_norm" | "mlp_norm",
    layer, None, None, "known:norm")`` for the block's input norms; inside the attention, MLA's KV latent norm as
    ``kv_latent`` and any other (a low-rank query's norm, a QK norm) as the ``attn_block``. A norm whose weight was
    scaled, reset to ones or given an outlier channel is then named at once, where its layer's statistics might only
    see a consequence."""
    parts = a.parts(layer)
    mods: list[tuple[str, str, object]] = [(k, "norm", parts.get(k)) for k in ("attn_norm", "mlp_norm")]
    attn = parts.get("attn")
    if isinstance(attn, torch.nn.Module):
        mods += [("kv_latent" if m is parts.get("kv") else "attn_block", f"norm:{name}", m)
                 for name, m in attn.named_modules()]
    out, seen = {}, set()
    for kind, name, m in mods:
        if not _norm_like(m) or id(m) in seen:
            continue
        seen.add(id(m))
        y = _norm_answer(m)
        if y is not None:
            out[(kind, layer, None, None, f"known:{name}")] = y
    return out


def _known_maps(a: Adapter, layer: int) -> dict[Key, torch.Tensor]:
    """The answers on fixed inputs that need no captured input: the attention's linear maps and the layer's norms."""
    return _known_attention(a, layer) | _known_norms(a, layer)


def _known_outputs(a: Adapter, layer: int, x: torch.Tensor,
                   experts: list[int] | None = None) -> dict[Key, torch.Tensor]:
    """Each callable component of ``layer`` run on ``x`` [N, D] (float32, CPU): ``(kind, layer, None, expert,
    "known")`` -> its output projected on ``_known_projection``, [N, KNOWN_DIMS] (the router: its weight's logits
    for every expert, [N, E]). Routed experts through
    ``expert_outputs`` (None where the family's experts module is not one we run exactly), the shared experts' and
    a dense layer's MLP module called on ``x`` (skipped where the module does not take a [N, D] input); ``experts``:
    only these routed experts (default: all)."""
    parts, out = a.parts(layer), {}

    def held(y) -> torch.Tensor | None:
        y = y[0] if isinstance(y, tuple) else y
        return _held(y) if torch.is_tensor(y) and y.shape == x.shape else None

    with torch.no_grad():
        ex = parts.get("experts")
        if ex is not None:
            which = list(range(a.summary.n_routed_experts)) if experts is None else list(experts)
            idx = torch.tensor(which, dtype=torch.long).repeat_interleave(x.size(0))[:, None]  # each on every input
            ys = expert_outputs(ex, x.repeat(len(which), 1), idx) if which else None
            if ys is not None:
                for j, e in enumerate(which):
                    y = held(ys[j * x.size(0):(j + 1) * x.size(0), 0])
                    if y is not None:
                        out[("expert", layer, None, e, "known")] = y
        w = getattr(parts.get("router"), "weight", None)  # the router's logits for every expert (not projected)
        if torch.is_tensor(w) and w.dim() == 2 and w.size(1) == x.size(1) and not w.is_meta:
            out[("router", layer, None, None, "known")] = (x.to(w.device, w.dtype) @ w.T).float().cpu()
        mods = {"shared_expert": parts.get("shared")}
        if layer not in a.summary.moe_layers:
            mods["dense_mlp"] = parts.get("mlp")
        for kind, m in mods.items():
            if isinstance(m, torch.nn.Module):
                p = next(m.parameters(), None)
                try:
                    y = held(m(x.to(p.device, p.dtype) if p is not None else x))
                except Exception:  # a module that takes more than the hidden states: no known answer
                    y = None
                if y is not None:
                    out[(kind, layer, None, None, "known")] = y
    return out


def _known_cells(a: Adapter, prompts: list[list[int]], captured: list[dict]) -> list[dict]:
    """Rows ``("known_input", layer, ..., "in")`` (the layer's fixed inputs, [N * D] flattened) and ``(kind, layer,
    None, expert, "known")`` (a component's projected outputs on them, [N * KNOWN_DIMS]): the MLP input norm's
    output at the middle position of the first ``KNOWN_INPUTS`` calibration prompts (real inputs: every hidden
    unit in its usual range). A component is kept only where a second call gives the same answer."""
    rows = []
    for layer in range(a.summary.n_layers):
        xs = [got[("mlp_norm", layer, None, None, "out")][len(ids) // 2] for got, ids in zip(captured, prompts)
              if ("mlp_norm", layer, None, None, "out") in got][:KNOWN_INPUTS]
        x = torch.stack(xs).float() if xs else None  # no MLP input norm read (a parallel block): attention only
        first = (_known_outputs(a, layer, x) if x is not None else {}) | _known_maps(a, layer)
        again = (_known_outputs(a, layer, x) if x is not None else {}) | _known_maps(a, layer)
        kept = {k: y for k, y in first.items() if k in again and _known_dev(again[k], y) <= KNOWN_TOL / 10}
        if not kept:
            continue
        if x is not None and any(not k[4].startswith("known:") for k in kept):
            rows.append(_held_row("known_input", layer, None, None, "in", x.size(0), x.flatten().tolist()))
        rows += [_held_row(*k, y.size(0), y.flatten().tolist()) for k, y in kept.items()]
    return rows


KNOWN_EMBED_DIMS = 4  # each input-embedding row held as its projection on the first 4 of the known directions


def _embedding_held(w: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Input-embedding rows [N, D] as held: [N, KNOWN_EMBED_DIMS] (float32, CPU; ``chunk`` rows at a time, so a large
    vocabulary is never copied whole in float32)."""
    p = _known_projection(w.size(1))[:, :KNOWN_EMBED_DIMS].to(w.device)
    return torch.cat([torch.nan_to_num(w[i:i + chunk].detach().float(), nan=0.0) @ p
                      for i in range(0, w.size(0), chunk)]).cpu()


def _vocab_weight(m) -> torch.Tensor | None:
    w = getattr(m, "weight", None)
    return w if torch.is_tensor(w) and w.dim() == 2 and not w.is_meta else None


def _final_norm(a: Adapter):
    try:
        m = a.final_norm()
    except (NotImplementedError, AttributeError, ValueError):  # a family whose final norm we cannot find: no answer
        return None
    return m if _norm_like(m) else None


def _known_end_cells(a: Adapter) -> list[dict]:
    """The model's ends, held exactly: ``("embed", None, None, None, "known:rows")``, every input-embedding row; the
    same of the output projection (``unembed``; not where it is the embedding's own tensor, tied); and the final
    norm's answer on fixed inputs (``("final_norm", None, None, None, "known:norm")``). An embedding is a lookup
    table: its answer for a token is the token's row, and a row another token's (a vocabulary off by a pair),
    rescaled or noisy is named at the positions that hold it, where a row of usual size looks clean to the
    statistics. An output projection or final norm changed as a whole moves every logit alike (a temperature): the
    statistics see low confidence everywhere, not where it comes from."""
    rows = []
    w = _vocab_weight(a.embedding())
    with torch.no_grad():
        if w is not None:
            rows.append(_end_row("embed", "known:rows", _embedding_held(w)))
        u = _vocab_weight(a.unembedding())
        if u is not None and (w is None or u.data_ptr() != w.data_ptr()):
            rows.append(_end_row("unembed", "known:rows", _embedding_held(u)))
    fn = _final_norm(a)
    y, again = (_norm_answer(fn), _norm_answer(fn)) if fn is not None else (None, None)
    if y is not None and again is not None and _known_dev(again, y) <= KNOWN_TOL / 10:
        rows.append(_end_row("final_norm", "known:norm", y))
    return rows


def _row_devs(w: torch.Tensor, toks: torch.Tensor, held: tuple[torch.Tensor, float]) -> torch.Tensor:
    """How far rows ``toks`` of ``w`` are from the held ones (``held``: all rows as held and their median RMS): the
    RMS of the difference over the clean row's RMS (a row near zero, padding, judged on the rows' typical size)."""
    rows, scale = held
    clean = rows[toks]
    with torch.no_grad():
        now = _embedding_held(w[toks.to(w.device)])
    return (now - clean).double().pow(2).mean(1).sqrt() / clean.double().pow(2).mean(1).sqrt().clamp_min(0.1 * scale)


ROW_SAMPLE = 256  # output-projection rows always compared (evenly spaced): a change of the whole projection shows


def _end_evidence(a: Adapter, ids: list[int], prof: pl.DataFrame, targets: list[int] = ()) -> dict[tuple, float]:
    """The model's ends against the rows the profile holds (only where the model runs in the dtype the profile was
    made in): ``("embed", None, None, None, pos)`` -> ``KNOWN_NATS`` times how far off (up to all of it) for the first
    position holding each token of the context whose input-embedding row differs; ``("unembed", ...)`` where an
    output-projection row of the context's tokens, of ``targets`` or of ``ROW_SAMPLE`` fixed rows differs;
    ``("final_norm", ...)`` where the final norm's answer on its fixed inputs does."""
    prep = _prepared(prof)
    if not _made_in(prof, a.dtype):
        return {}
    out: dict[tuple, float] = {}
    cell = prep.known_final
    fn = _final_norm(a) if cell is not None else None
    y = _norm_answer(fn) if fn is not None else None
    if y is not None and y.numel() == len(cell["mean"]):
        dev = _norm_dev(y, prep.mean(cell).view(y.shape))
        if not dev <= KNOWN_TOL:
            out[("final_norm", None, None, None, None)] = KNOWN_NATS * min(1.0, dev / KNOWN_FULL)
    u = _vocab_weight(a.unembedding()) if prep.known_unembed is not None else None
    if u is not None:
        n = min(int(prep.known_unembed["n"]), u.size(0))
        toks = {int(t) for t in [*ids, *targets] if 0 <= int(t) < n}
        toks |= set(np.linspace(0, n - 1, min(ROW_SAMPLE, n)).astype(int).tolist())
        dev = float(_row_devs(u, torch.tensor(sorted(toks)), prep.end_rows("unembed")).max()) if toks else 0.0
        if not dev <= KNOWN_TOL:
            out[("unembed", None, None, None, None)] = KNOWN_NATS * min(1.0, dev / KNOWN_FULL)
    w = _vocab_weight(a.embedding()) if prep.known_embed is not None else None
    if w is None or not ids:
        return out
    first = {}
    for pos, t in enumerate(ids):
        if 0 <= int(t) < min(int(prep.known_embed["n"]), w.size(0)):
            first.setdefault(int(t), pos)
    if first:
        dev = _row_devs(w, torch.tensor(list(first)), prep.end_rows("embed"))
        out |= {("embed", None, None, None, first[t]): KNOWN_NATS * min(1.0, float(d) / KNOWN_FULL)
                for t, d in zip(first, dev.tolist()) if not d <= KNOWN_TOL}
    return out


def _known_dev(y: torch.Tensor, v: torch.Tensor) -> float:
    """How far projected outputs ``y`` are from the clean ``v``: the RMS of the difference over the RMS of ``v``."""
    y, v = y.double().flatten(), v.double().flatten()
    if bool(torch.isnan(y).any()):
        return math.inf
    return float((y - v).pow(2).mean().sqrt() / v.pow(2).mean().sqrt().clamp_min(1e-30))


def _known_evidence(a: Adapter, got: dict, prof: pl.DataFrame) -> dict[tuple, float]:
    """Components of the context's path whose output on their layer's fixed inputs differs from the clean model's
    (in the dtype the profile was made in, or in half precision against an fp32 profile with ``KNOWN_TOL_HALF``:
    ``_known_tol``): ``KNOWN_NATS`` times how far off, up to all of it. A routed expert counts only where some context
    position chose it (else it took no part)."""
    tol = _known_tol(prof, a.dtype)
    if tol is None:
        return {}
    prep = _prepared(prof)
    fixed = _FIXED.get()
    off: dict[tuple, float] = {}
    for layer in sorted(prep.known):
        mine = prep.known[layer]
        idx = got.get(("route", layer, None, None, "indices"))
        chosen = set(idx.unique().tolist()) if idx is not None else set()
        if fixed is not None:  # every expert's answer once while the weights are fixed; this context's chosen ones
            key = (id(a.module), id(prep), layer)
            if key not in fixed:
                fixed[key] = (a.module, prep, _known_devs(a, prep, layer, None))
            devs = {k: d for k, d in fixed[key][2].items() if k[0] != "expert" or k[3] in chosen}
        else:
            devs = _known_devs(a, prep, layer, sorted(chosen))
        heads: dict[str, dict[int, float]] = {}  # a per-head map: the heads whose part of it differs
        for c in mine:
            k = (c["kind"], layer, c["head"], c["expert"], c["signal"])
            dev = devs.get(k)
            if dev is None or dev <= tol:  # None: an expert no position chose (it took no part), or not run
                continue
            nats = KNOWN_NATS * min(1.0, dev / KNOWN_FULL)
            if c["kind"] == "head":
                heads.setdefault(c["signal"], {})[c["head"]] = nats
                continue
            key = (c["kind"], layer, c["head"], c["expert"], None)
            off[key] = max(off.get(key, 0.0), nats)
        for signal, got_h in heads.items():
            n_h = sum(c["kind"] == "head" and c["signal"] == signal for c in mine)
            if n_h >= 2 and len(got_h) == n_h:  # every head's part of one map differs: the map, i.e. the block
                got_h = {None: max(got_h.values())}
            for h, nats in got_h.items():
                key = ("head", layer, h, None, None) if h is not None else ("attn_block", layer, None, None, None)
                off[key] = max(off.get(key, 0.0), nats)
    return off


def _known_devs(a: Adapter, prep: _Prepared, layer: int, experts: list[int] | None) -> dict[tuple, float]:
    """(kind, layer, head, expert, signal) -> how far the component's answer on the layer's fixed inputs is from
    the profile's (``_known_dev``), for each known cell of ``layer`` that could be run (routed experts: ``experts``,
    None: all)."""
    r = prep.known_inputs.get(layer)
    now = {}
    if r is not None and r["n"] >= 1:
        x = prep.mean(r, torch.float32).view(r["n"], -1).clone()  # a copy: a module's hook may write to its input
        now = _known_outputs(a, layer, x, experts)
    mine = prep.known[layer]
    if any(c["signal"].startswith("known:") for c in mine):
        now |= _known_maps(a, layer)
    out = {}
    for c in mine:
        k = (c["kind"], layer, c["head"], c["expert"], c["signal"])
        if k in now and now[k].numel() == len(c["mean"]):
            dev = _norm_dev if c["signal"].startswith("known:norm") else _known_dev
            out[k] = dev(now[k], prep.mean(c).view(now[k].shape))
    return out


# while ``fixed_weights()`` is entered (in this thread or task): the known answers' deviations computed in it
_FIXED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("workbench_fixed_weights", default=None)


@contextlib.contextmanager
def fixed_weights() -> Iterator[None]:
    """Within it, each model's known answers are computed once (every routed expert's, then each context's chosen
    ones taken from them) and reused by every judgment: for a caller that holds the weights still meanwhile (a prompt
    set's detectors after each of its runs). Never around anything that edits weights or hooks in between (fault
    injection, interventions): the answers would be the first ones'."""
    token = _FIXED.set({})
    try:
        yield
    finally:
        _FIXED.reset(token)


def _row_z(logits: torch.Tensor, cell: dict, ms: tuple | None = None) -> torch.Tensor:
    """Per vocabulary token: the mean over positions of |z| of its logit ([T, V] -> [V])."""
    mu, sd = ms if ms is not None else _cell_tensors(cell)
    return ((logits - mu) / sd).abs().mean(0)


def _row_spread(captured: list[dict], prompts: list[list[int]], cell: dict | None, rng) -> list[dict]:
    """The ``unembed_rows`` cell: per context-length bucket, the mean and spread over calibration prefixes and
    vocabulary tokens of ``_row_z`` (one output row gone wrong moves its token's logit at every position)."""
    if cell is None:
        return []
    stats = []
    last = (1.0, 1.0, 0.0)
    for b, lo in enumerate(RUN_BUCKETS):
        vals = []
        for got, ids in zip(captured, prompts):
            hi = _bucket_end(b, len(ids))
            if hi >= lo:
                n = int(rng.integers(lo, hi + 1))
                vals.append(_row_z(got[("unembed", None, None, None, "logit")][1:n], cell))
        if len(vals) >= MIN_RUNS:
            v = torch.cat(vals)
            last = (float(v.mean()), max(float(v.std()), 1e-3), float(((v - v.mean()) / v.std()).max()))
        stats.append(last)
    return [_held_row("unembed_rows", None, None, None, "abs_z", 0, [], run_norm_mean=[x[0] for x in stats],
                      run_norm_std=[x[1] for x in stats], run_dev_mean=[x[2] for x in stats])]


def save(store, sha: str, rows: pl.DataFrame, source: str) -> int:
    """Replace the model's activation profile with ``rows``; returns the number of components."""
    stamp = datetime.now(timezone.utc).replace(tzinfo=None)
    full = rows.with_columns(pl.lit(sha).alias("checkpoint_sha256"), pl.lit(stamp).alias("created_at"),
                             pl.lit(source).alias("source"))
    store.replace_rows("activation_profiles", {"checkpoint_sha256": sha}, full)
    return full.height


def load(store, sha: str | None) -> pl.DataFrame | None:
    """The model's activation profile, or None (the bundled demo's is copied in on first use). The rows are read
    once per process and database while the stored profile stays the same (its row count, newest ``created_at``
    and source): the detectors judge every recording against it."""
    if not sha:
        return None
    key = (str(getattr(store, "path", id(store))), sha)
    stamp = query.profile_stamp(store, sha, "activation_profiles")
    cached = _LOADED.get(key)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    got = query.activation_profile(store, sha)
    stale = got.height and BUNDLED.exists() and _from_bundle(stamp)  # an older release's bundled rows
    if (got.height == 0 or stale) and BUNDLED.exists():
        bundled = pl.read_parquet(BUNDLED)
        if stale and bundled["source"][0] == stale:
            _LOADED[key] = (stamp, got)
            return got
        if bundled.height and bundled["checkpoint_sha256"][0] == sha:
            if getattr(store, "read_only", False):
                return bundled
            store.replace_rows("activation_profiles", {"checkpoint_sha256": sha}, bundled)
            got = query.activation_profile(store, sha)
            stamp = query.profile_stamp(store, sha, "activation_profiles")
    out = got if got.height else None
    _LOADED[key] = (stamp, out)
    return out


_LOADED: dict[tuple[str, str], tuple] = {}  # (db, sha) -> (stamp, rows)


def _from_bundle(stamp: tuple) -> str | None:
    """The stored profile's source when it was copied from a bundled file (not made by ``workbench profile``)."""
    src = stamp[2]
    return src if src and BUNDLE_SOURCE in src else None


def expert_behind(indices: torch.Tensor, odd: torch.Tensor) -> int | None:
    """The expert whose positions (``indices`` [T, K]: the experts each position went to) have a far higher
    ``odd`` score ([T]: how unusual the block's output is there) than the other positions: Welch's t of the
    two means as a z, Bonferroni over the experts, at least ``EXPERT_NATS``; else None."""
    best, n_e = None, int(indices.max()) + 1 if indices.numel() else 0
    for e in range(n_e):
        has = (indices == e).any(1)
        a, b = odd[has], odd[~has]
        if a.numel() == 0 or b.numel() < 2:
            continue
        se = math.sqrt((float(a.var()) if a.numel() > 1 else float(b.var())) / a.numel() + float(b.var()) / b.numel())
        z = (float(a.mean()) - float(b.mean())) / max(se, 1e-6)
        nats = log_tail(z) - math.log(2 * n_e) if z > 0 else 0.0
        if nats >= EXPERT_NATS and (best is None or nats > best[1]):
            best = (e, nats)
    return None if best is None else best[0]


def log_tail(z: float) -> float:
    """-log P(|Z| >= z) for a standard normal Z (two-sided), in nats."""
    return -float(log_ndtr(-abs(z))) - math.log(2.0)  # scipy's norm.logsf, without its per-call overhead (40 us)


def _signed_nats(nats: float, sign: float) -> float:
    return float(math.copysign(max(nats, 0.0), sign if sign else 1.0))


def evidence(a: Adapter, ids: list[int], prof: pl.DataFrame | None, last: bool = True,
             signals: dict | None = None, found: dict | None = None,
             min_stats: int = 2, max_stats: int | None = None, targets: list[int] = (),
             seen: dict | None = None) -> list[tuple[tuple, float]]:
    """((kind, layer, head, expert, source_pos), signed surprise in nats) for every profiled component, on the
    context ``ids`` (the tokens before the explained one), plus the routing consistency rows (no profile
    needed). A head's output and its two attention-pattern scalars give one ``head`` row: the largest.
    ``signals``, when given, is filled with the signal behind each row (``out``, ``chosen``, ``logit``, ...).
    ``found``, when given, gets what the forward saw besides the rows: ``"experts"``, each routed expert's own
    surprise (its weighted contribution at the positions that chose it; signed nats, Bonferroni over every expert:
    over a few positions it is heavy-tailed, so it is no row of its own here, only through the block it makes
    unusual, unless its z is past ``OWN_ALONE_Z``, e.g. an expert that outputs nothing; root cause uses it where
    the expert's ablation says it also matters to the explained token), and
    ``"top_token"``, the token the model ranks first after the last position. ``targets``: tokens whose output rows
    are compared with the profile's beside the context's and the top token's (root cause: the explained token).
    ``seen``: ``capture``'s, filled from the same forward."""
    got, lost, reweighted = capture(a, list(ids), seen)
    top_token = int(got[("unembed", None, None, None, "logit")][-1].argmax()) if ids else None
    experts: dict | None = None
    if found is not None:
        found["top_token"] = top_token
        experts = found.setdefault("experts", {})
    best: dict[tuple, float] = {}
    why = signals if signals is not None else {}

    def put(key: tuple, v: float, signal: str | None = None) -> None:
        if abs(v) > abs(best.get(key, 0.0)):
            best[key] = v
            why[key] = signal

    prep = _prepared(prof) if prof is not None else None
    trusted = prep is None or prep.trusted  # clean routing agreed with RouterMath
    exact: dict[tuple, tuple[float, str]] = {}  # the routing checks: exact, so no consequence of anything upstream
    for layer, m in lost.items() if trusted else ():
        bad = m.any(1)  # positions whose experts differ from the router's own choice (exact: position 0 too)
        if bad.any():
            e = int(m.sum(0).argmax())
            exact[("router", layer, None, None, None)] = (MISMATCH_NATS * float(bad.sum()), "mismatch")
            exact[("expert", layer, None, e, None)] = (MISMATCH_NATS * float(m[:, e].sum()), "mismatch")
    for layer, m in reweighted.items() if trusted else ():
        key = ("router", layer, None, None, None)
        if m.any() and MISMATCH_NATS * float(m.sum()) > exact.get(key, (0.0, ""))[0]:
            # the experts the router chose, mixed with other weights than its logits give
            exact[key] = (MISMATCH_NATS * float(m.sum()), "weights")
    for key, (v, sig) in exact.items():
        put(key, v, sig)
    firsts, known = {}, {}
    if prof is not None and len(ids) >= 1:
        firsts = _first_evidence(got, int(ids[0]), prof, a.dtype)
        ends = [*targets, *([] if top_token is None else [top_token])]  # output rows judged beside the context's
        known = _known_evidence(a, got, prof) | _end_evidence(a, list(ids), prof, ends)
    # the statistics' cells judge a context of ``min_stats`` to ``max_stats`` tokens (past the longest context the
    # calibration ran, what a clean model computes is unknown to them); the exact checks above judge any
    if prof is not None and max(min_stats, 2) <= len(ids) <= (max_stats or len(ids)):
        zs: dict[tuple, tuple[float, float]] = {}  # component -> (|z|, sign)
        rate_tail: dict[tuple, float] = {}  # a selection rate's -log tail under its beta-binomial (``_rate_tail``)
        positional: dict[int, list[float]] = {}
        for k, r in prep.rest:  # the statistics' cells (not the exact ones above)
            y = got.get(k)
            if y is None or y.size(0) < 2 or len(r["mean"]) != y.size(1):
                continue
            b = run_bucket(len(ids), len(r["run_norm_mean"]))
            if k[4] == "angle":  # the rotation is exact: every context position rotated otherwise is a fault
                off = int(_off_rotation(y, torch.as_tensor(r["mean"]))[1:].sum())
                if off:
                    put(("rotary", k[1], None, None, None), MISMATCH_NATS * off, "angle")
                continue
            if k[4] == "chosen":  # how often the expert is chosen, against clean contexts of this length
                run_l = (_rate_z(y[1:], r) - r["run_norm_mean"][b]) / r["run_norm_std"][b]
                if abs(run_l) > BEYOND * r["run_dev_mean"][b]:  # routing varies with content: beyond all clean text
                    zs[k] = (abs(run_l), run_l)
                    rate_tail[k] = _rate_tail(y[1:], r)
                continue
            if _scalar(k[0], k[4]):  # the context's mean z, against clean contexts of this length
                run_l = (float(_value_z(y[1:], r, prep.tensors(r)).mean()) - r["run_norm_mean"][b]) / r["run_norm_std"][b]
                zs[k] = (abs(run_l), run_l)
                if k[4] in ("pos_distance", "prev_weight"):
                    positional.setdefault(k[1], []).append(run_l)
                continue
            seen = ~torch.isnan(y[1:, 0])  # an expert's rows: the positions that chose it; others: every one
            if not seen.any():
                continue
            zl, zd = _zs(y[1:][seen], r, prep.tensors(r))
            if k[0] == "embed":  # one token's row: the most unusual position, Bonferroni over the context
                p = int(zl.abs().argmax())
                seen = r["run_dev_mean"][0] if r["run_dev_mean"] else 0.0
                if float(zl[p].abs()) <= BEYOND * seen:  # rare tokens' rows: within what calibration met
                    continue
                nats = log_tail(float(zl[p].abs())) - math.log(zl.numel())
                put(("embed", None, None, None, p + 1), _signed_nats(nats, float(zl[p])))
                continue
            if k[0] == "unembed":  # one token's output row: its logit off all along, Bonferroni over the vocabulary
                sr = prep.unembed_rows
                if sr is not None:
                    rb = run_bucket(len(ids), len(sr["run_norm_mean"]))
                    zr = (_row_z(y[1:], r, prep.tensors(r)) - sr["run_norm_mean"][rb]) / sr["run_norm_std"][rb]
                    top2 = zr.topk(min(2, zr.numel())).values
                    beyond = BEYOND * sr["run_dev_mean"][rb]  # every calibration token's z, and then some
                    # one row alone beyond it: an output row gone wrong moves its own token's logit only; a hidden
                    # state gone wrong (anything upstream) moves the logits of every token aligned with the change
                    if float(top2[0]) > beyond and (top2.numel() < 2 or float(top2[1]) <= beyond):
                        nats = log_tail(float(zr.max())) - math.log(zr.numel())
                        put(("unembed", None, None, None, None), _signed_nats(nats, 1.0))
                continue
            run_l = (float(zl.mean()) - r["run_norm_mean"][b]) / r["run_norm_std"][b]
            run_d = (float(zd.mean()) - r["run_dev_mean"][b]) / r["run_dev_std"][b]
            at_last = last and bool(torch.isnan(y[-1, 0]).logical_not())  # the last position has this output
            z = max(abs(run_l), run_d, *((LAST_WEIGHT * abs(float(zl[-1])), LAST_WEIGHT * float(zd[-1]))
                                         if at_last else ()))
            sign = run_l if k[4] == "out" else float(y[1:].mean()) - float(np.mean(r["mean"]))
            zs[k] = (z, sign)
            if k[4] in ("pos_distance", "prev_weight"):
                positional.setdefault(k[1], []).append(run_l)
        family: dict[tuple, int] = {}
        for k in zs:
            family[(k[0], k[4])] = family.get((k[0], k[4]), 0) + 1
        own = {k[1:4]: z for k, (z, _) in zs.items() if k[0] == "expert"}  # each expert's own contribution
        for k, (z, sign) in zs.items():  # two-sided tail, Bonferroni over the component's family
            tail = min(log_tail(z), rate_tail[k]) if k in rate_tail else log_tail(z)  # a rate: its own distribution's
            nats = _signed_nats(tail - math.log(family[(k[0], k[4])]), sign)
            if k[0] != "expert" or z >= OWN_ALONE_Z:  # an expert's far beyond anything clean: a row of its own
                put((k[0], k[1], k[2], k[3], None), nats, k[4])
            if k[0] == "expert" and experts is not None:  # heavy-tailed (a few positions each): for root cause
                experts[(k[0], k[1], k[2], k[3], None)] = nats
        for r in prep.mlp_block:  # the expert behind a block
            nats = best.get(("mlp_block", r["layer"], None, None, None), 0.0)
            idx = got.get(("route", r["layer"], None, None, "indices"))
            if abs(nats) >= BLOCK_NATS and idx is not None:
                mine = sorted(((z, key[2]) for key, z in own.items() if key[0] == r["layer"]), reverse=True)
                e = None
                if len(mine) >= 2 and mine[0][0] >= OWN_Z and mine[0][0] >= 2 * mine[1][0]:
                    e = mine[0][1]  # one expert's own contribution is far more unusual than any other's
                elif abs(nats) >= EXPLAINS:  # else, in a clearly unusual block, the expert whose positions carry it
                    zl, zd = _zs(got[("mlp_block", r["layer"], None, None, "out")][1:], r, prep.tensors(r))
                    e = expert_behind(idx[1:], torch.maximum(zl.abs(), zd))
                if e is not None:
                    put(("expert", r["layer"], None, e, None), math.copysign(abs(nats) + 1.0, nats), "behind")
        for layer, vs in positional.items():  # most heads of a layer read other positions: its rotation
            nats = log_tail(float(np.median(np.abs(vs)))) - math.log(len(positional))  # the middle head's
            put(("rotary", layer, None, None, None), _signed_nats(nats, 1.0))
    for key, v in firsts.items():  # after the statistics (an expert behind a block reads only those)
        put(key, v, "first")
    size = {}  # (kind, layer) -> the largest |surprise| of that kind in that layer (any head or expert)
    for key, v in best.items():
        size[key[:2]] = max(size.get(key[:2], 0.0), abs(v))
    def explains(up: float, v: float) -> bool:  # an upstream part of ``up`` nats explains a part of |v|
        return up >= BLOCK_NATS and up * _reach(up) >= abs(v)

    def earlier(up: float, v: float) -> bool:  # an earlier layer broke something of ``up`` nats: it reaches |v|
        return up >= max(EXPLAINS, abs(v))

    for key in list(best):  # a part downstream of an unusual part of its layer, of comparable size: explained by it
        up = max([size.get((u, key[1]), 0.0) for u in UPSTREAM.get(key[0], ())], default=0.0)
        if explains(up, best[key]):
            best[key] = _capped(best[key], up)
    layers = sorted({k[1] for k in best if k[1] is not None})
    e0 = ("embed", None, None, None, 0)  # the first token's embedding differs at position 0: before every layer
    before, top = {}, abs(best.get(e0, 0.0)) if why.get(e0) == "first" else 0.0  # layer -> the largest |surprise| in the layers before it (and embed)
    for layer in layers:
        before[layer] = top
        top = max([top] + [abs(v) for k, v in best.items() if k[1] == layer])
    for key in list(best):  # what an earlier layer broke at least as clearly reaches every later one
        up = before.get(key[1], 0.0) if key[0] != "unembed" or why.get(key) != "first" else top  # logits: last
        if earlier(up, best[key]):
            best[key] = _capped(best[key], up)
    for key, v in (experts or {}).items():  # the experts' own surprise: under the same two rules as the rows
        up = max(size.get(("mlp_norm", key[1]), 0.0), size.get(("router", key[1]), 0.0))
        prior = before.get(key[1], 0.0)
        capped = _capped(v, up) if explains(up, v) else v
        experts[key] = _capped(capped, prior) if earlier(prior, v) else capped
    for key, v in known.items():  # an answer on fixed inputs is no consequence of anything upstream: never capped
        if abs(v) >= abs(best.get(key, 0.0)):
            best[key], why[key] = v, "known"
    for key, (v, sig) in exact.items():  # nor is routing that disagrees with its own router's logits (at least)
        if abs(v) >= abs(best.get(key, 0.0)):
            best[key], why[key] = v, sig
    # (an embedding row named at its position is no anchor: it changes what follows that position only, and the run's
    # statistics are over every position; a fault elsewhere must stay visible beside it)
    anchors = {**{k: v for k, (v, _) in exact.items()}, **{k: v for k, v in known.items() if k[0] != "embed"}}
    if anchors:  # and a component known to compute another function (or routing changed after its router) explains
        # whatever is unusual after it, any size: an expert whose mixing weight was cut to 0 looks dead
        first = min(anchors, key=_flow)
        top = max(abs(v) for v in anchors.values())
        up = min(top, 2 * KNOWN_AFTER)  # a consequence stays a suspect for root cause, no warning of its own
        for key in list(best):
            if key not in anchors and _flow(key) > _flow(first):
                best[key] = _capped(best[key], up)
        for key, v in (experts or {}).items():
            if key not in anchors and _flow(key) > _flow(first):
                experts[key] = _capped(v, up)
    return list(best.items())


FLOW = ("attn_norm", "kv_latent", "rotary", "head", "attn_block", "mlp_norm", "router", "expert", "mlp_block",
        "resid")  # within a layer, the order a token's hidden state passes the parts (siblings share a place)
FLOW_AT = {k: i for i, k in enumerate(FLOW)} | {"shared_expert": FLOW.index("expert"), "dense_mlp": FLOW.index(
    "expert")}


def _flow(key: tuple) -> tuple[float, int]:
    """Where a row's component sits on a token's path: (layer, place in it); the embedding first, logits last."""
    if key[0] == "embed":
        return (-1.0, 0)
    if key[1] is None:  # the final norm, then the output projection
        return (math.inf, 1 if key[0] == "unembed" else 0)
    return (float(key[1]), FLOW_AT.get(key[0], len(FLOW)))


BUNDLED = Path(__file__).resolve().parents[2] / "data" / "demo" / "activations.parquet"
BUNDLE_SOURCE = "prompts of data/prompts/calibration"  # scripts/build_activation_profile.py's


# detection over a whole run (workbench.analysis.anomalies.detect with the recording's model)
WARNING_NATS = 20.0  # a component this unusual (after Bonferroni within its family) is a warning row
CRITICAL_NATS = 60.0  # and a critical one
def cache_free(a: Adapter, ids: list[int]) -> tuple[np.ndarray, dict[str, dict[int, np.ndarray]]]:
    """One forward of ``ids`` as a whole, without the KV cache and without gradients: each token's logprob under
    the positions before it ([T - 1]: tokens 1 .. T - 1) and, per layer, the norms the recorder keeps: ``"resid"``
    the residual stream's per position ([T]), ``"head"`` each head's output's ([T, H]), to hold a recorded run
    against (``anomalies.cache_rows``)."""
    a = adapter_for(a)
    norms: dict[str, dict[int, np.ndarray]] = {"resid": {}, "head": {}}

    def resid(layer: int, h: torch.Tensor) -> None:
        norms["resid"][layer] = h.detach()[0].float().norm(dim=-1).cpu().double().numpy()

    def head(layer: int, z: torch.Tensor) -> None:
        norms["head"][layer] = z.detach()[0].float().norm(dim=-1).cpu().double().numpy()
    x = torch.tensor([list(ids)], device=a.device)
    with torch.no_grad(), a.seams({"resid_post": resid, "head_out": head}):
        logits = a.forward(x)[0]
    return _logprobs(logits, x[0]), norms


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1 from a forward's logits [T, V]: [T - 1] float64."""
    lp = torch.log_softmax(logits[:-1].detach().float(), -1).gather(1, ids[1:, None].to(logits.device))[:, 0]
    return lp.cpu().double().numpy()


MAX_TOKENS = 2048  # a run's first tokens that the check reads (one teacher-forced forward with attention)
WORDS = {"embed": "the input embedding of the token at position {pos}",
         "unembed": "the output projection (one token's logit is off at every position)",
         "final_norm": "the final norm (before the output projection)",
         "attn_norm": "the attention's input norm", "kv_latent": "the KV latent", "head": "head {head}",
         "attn_block": "the attention block", "mlp_norm": "the MLP's input norm", "mlp_block": "the MoE block",
         "dense_mlp": "the MLP", "shared_expert": "the shared experts", "resid": "what the layer adds to the stream",
         "router": "the router", "expert": "expert {expert}", "rotary": "the rotary part (every head's reach)"}


STATS_MIN_TOKENS = 3  # the detector's component statistics: runs of at least this many tokens (2 positions judged)


# the signals of ``evidence``'s exact checks (no statistic: what a clean model computes, or must): judged on any text
EXACT_SIGNALS = frozenset({"first", "known", "mismatch", "weights", "angle"})


def anomaly_rows(a: Adapter, ids: list[int], prof: pl.DataFrame | None, routing_shift: bool = False,
                 novel: bool = False, seen: dict | None = None) -> list[dict]:
    """Anomaly rows (kind ``component_outlier``, the schema of workbench.analysis.anomalies) for the components
    whose activations over the first ``MAX_TOKENS`` of ``ids`` are at least ``WARNING_NATS`` unusual. The
    statistics judge a run of at least ``STATS_MIN_TOKENS`` tokens (the exact checks every run): one position's
    output against the calibration's two-token prefixes is no test of a model (a clean 1+1-token run, a prompt's
    first token and the model's own next one, stood 21-23 nats out at a layer's input norm). ``routing_shift``: the
    run's text routes unlike the calibration's at many layers at once (``anomalies.content_shift``): how often each
    expert is chosen is then shown as info (content, not a broken router). ``novel``: the run's tokens are mostly ones
    the calibration never saw (``anomalies.Baseline.novelty``): every statistical row is info, the exact checks (the
    routing consistency, the first position's and the known inputs' outputs, the rotation) are judged."""
    rows = []
    a = adapter_for(a)
    signals: dict = {}
    for key, nats in evidence(a, list(ids)[:MAX_TOKENS], prof, last=False, signals=signals, min_stats=STATS_MIN_TOKENS,
                              seen=seen):
        kind, layer, head, expert, pos = key
        if abs(nats) < WARNING_NATS:
            continue
        what = WORDS.get(kind, kind).format(head=head, expert=expert, pos=pos)
        where = "" if layer is None else f"layer {layer} "
        if signals.get(key) == "first":
            what = {"embed": "the first token's input embedding",
                    "unembed": "the output logits (the final norm's and the output projection's work)"}.get(kind, what)
            what = f"the router's output for expert {expert}" if kind == "router" and expert is not None else what
            how = (f"{'differ' if kind == 'unembed' else 'differs'} at position 0 from what the clean model "
                   "computes for this first token (the profile holds its exact output)")
        elif signals.get(key) == "known" and kind == "embed":
            how = "is not the row the profile holds for that token (the embedding's weights changed)"
        elif signals.get(key) == "known":
            what = "the output projection" if kind == "unembed" else what
            how = ("no longer computes what it computed when the profile was made (its output on the profile's fixed "
                   "inputs differs: its weights or its code changed)")
        elif kind == "router" and expert is not None and signals.get(key) == "chosen":
            what = f"expert {expert}"
            how = f"is chosen {'more' if nats > 0 else 'less'} often than on clean text of this length"
        elif kind == "router" and expert is not None:
            what, how = f"the router's logit for expert {expert}", "is outside its clean range"
        elif kind == "router" and signals.get(key) == "weights":
            how = "mixes the experts it chose with other weights than its own logits give"
        elif kind == "router":
            how = "sends tokens to other experts than its own logits select"
        elif kind == "expert" and signals.get(key) == "behind":
            how = "is chosen where the MoE block's output is unusual"
        elif kind == "expert" and signals.get(key) == "mismatch":
            how = "loses tokens that its router's logits give it"
        elif kind == "embed":
            how = "is unusually small" if nats < 0 else "is unusually large"
        elif kind == "unembed":
            how = ""
        else:
            how = "puts out unusually small values" if nats < 0 else "puts out values far from its clean range"
        rate = kind == "router" and expert is not None and signals.get(key) == "chosen"
        moot = novel and signals.get(key) not in EXACT_SIGNALS  # a statistic of text the calibration never saw
        sev = "info" if (rate and routing_shift) or moot else "critical" if abs(nats) >= CRITICAL_NATS else "warning"
        rows.append({"kind": "component_outlier", "severity": sev,
                     "pos": pos, "layer": layer, "head": head, "expert": expert,
                     "score": abs(nats) / math.log(10), "threshold": WARNING_NATS / math.log(10),
                     "explanation": f"{where}{what}{' ' + how if how else ''} against the activation profile "
                                    f"({abs(nats):.0f} nats, {kind})"
                                    + (" (the run's text is unlike the calibration's: see novel_input)"
                                       if moot else ""),
                     "component": kind})
    return rows
