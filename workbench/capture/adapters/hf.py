"""The adapter for ``transformers`` causal LMs: dense ones, and every MoE family of the installed ``transformers``
(docs/families.md: 69 of its 70 record their router's choice), with no family code.

What it looks for:

- decoder layers: the largest ``ModuleList`` of as many modules as the config has layers. A layer's softmax attention
  is ``self_attn`` / ``self_attention`` / ``attn`` / ``attention`` (or an attention ``mixer``); hybrid layers without
  one (Mamba, gated delta net, short convolution) record every other signal, and the run's notes name their kind;
- MoE blocks: a module holding ``experts`` (or a child class ``*Experts``) beside a router (a child ``gate`` /
  ``router``, or a class ending in Router / Gate / Gating). When the model loads, the block is run on random rows
  (else the router alone, given its selection bias when it takes one as an argument) to see where the choice
  travels (``RouterSeam``): as ``experts(hidden, top_k_index, top_k_weights)`` (the transformers 5.x convention:
  Mixtral, Qwen, DeepSeek, ...), in the router's output tuple (Gemma 4), as a dense score matrix (Llama 4) or as
  tokens sorted by expert (JetMoE). The layer's ``RouterMath`` (softmax / sigmoid / sqrt-softplus / the router's own
  probabilities, selection bias on scores or logits, groups, renormalisation, scale, per-expert scale) is the rule
  that reproduces what the experts receive from the router's logits, so margins and re-routing use the router's
  real arithmetic; a router no rule reproduces is still recorded as its experts receive it, with a note that score,
  margin and re-routing are approximate. A router that fails when probed, or experts no router feeds as indices
  (product-key, hash routing), are recorded without routing, with one note naming the module.

The seams:

- routing: a forward hook on the router keeps its logits; where the choice travels (above) it is read and may be
  replaced (ablation, frozen routing, faults);
- attention probabilities: a forward hook on each attention module (eager attention returns them), the
  prompt prefilled in blocks of ``attn_chunk`` query rows so at most [H, chunk, S] exist at once; layers whose
  head count differs from the model's (per-layer configs) are not recorded;
- head outputs: a forward pre-hook on the attention's ``o_proj`` (its input is the heads' outputs side by side);
- shared experts (``shared_experts`` / Qwen2-MoE's ``shared_expert``, before its sigmoid gate) and the
  residual stream (each decoder layer's output; parallel streams flattened into one): forward hooks;
- KV state: the ``transformers`` cache's keys and values (``latent_norm`` holds a token's value norm
  over all kv heads, ``rope_norm`` its rotated keys').
A looped layer (run several times per forward) is seen on its first pass.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import re
import tempfile
import warnings
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from workbench.capture.experts import supported as experts_supported
from workbench.capture.preflight import check_config, check_no_remote_code
from workbench.model import state_sha256
from workbench.model.generate import check_prompt, decode, decode_batch

from .base import Adapter, Listener, ModelSummary, QuantPoints, attention_map, first_output
from .routing import SCORE_FUNCS, RouterMath, _by_expert

ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")
# a layer holds experts when a module is named so, or its class says so (a family prefix such as "Glm4Moe" in
# "Glm4MoeMLP" does not: a dense layer of an MoE family is dense)
MOE_NAME = re.compile(r"^(experts|moe|block_sparse_moe|sparse_moe)$")
MOE_CLASS = re.compile(r"(Experts?|MoE|Moe|MoeBlock|MoELayer|MoeLayer|Router)$")  # not *Gate: forget gates
SELECTION_BIAS = ("e_score_correction_bias", "expert_bias", "balancing_biases")
SCALES = ("routed_scaling_factor", "route_scale", "router_scaling_factor", "moe_routed_scaling_factor")
EXPERT_SCALE = ("per_expert_scale",)
ATTN_NAMES = ("self_attn", "self_attention", "attn", "attention")
LINEAR_ATTENTION = ("Lightning", "DeltaNet", "DeltaAttention")  # class names of attention without a softmax
FINAL_NORM = ("norm", "final_norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "model_norm")
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_local_heads")
ATOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HALF_AGREE = 0.95  # in half precision, rounded logits tie now and then: the rule must reproduce 95% of the rows
# families whose rows of a batched generation (HFAdapter.stream_batch) differ from their single recordings beyond the
# replay tolerance (benchmarks/hf_batch_sweep.py, transformers 5.24): a prompt set records them one at a time. A
# longer prompt's positions are fed one per forward there: glm_moe_dsa's sparse indexer, dots3_note and qwen3_next's
# gated delta net compute a prompt fed so differently from its prefill; llama4's chunked and deepseek_v4's
# compressed attention keep the logits but their caches show the attention probe other keys; minimax's lightning
# attention hands out no probabilities; doge's and dbrx's rows change beside other rows (their logits by 2 and 2e-3)
SINGLE_ONLY = frozenset({"dbrx", "deepseek_v4", "doge", "dots3_note", "dots3_note_text", "glm_moe_dsa", "llama4",
                         "llama4_text", "minimax", "qwen3_next"})


def folder_model_type(path: str | Path) -> str | None:
    """``model_type`` of a Hugging Face folder's config.json; None for our own checkpoints or non-folders."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _text_config(cfg):
    """The language model's config (a multimodal config's text config)."""
    get = getattr(cfg, "get_text_config", None)
    try:
        return get() if callable(get) else cfg
    except Exception:  # noqa: BLE001 - a config without one is its own text config
        return cfg


def _cfg(cfg, *names, default=None):
    """The first of ``names`` set on ``cfg`` (a per-layer attribute that refuses global access counts as unset)."""
    for n in names:
        try:
            v = getattr(cfg, n, None)
        except Exception:  # noqa: BLE001 - transformers' per-layer attributes raise on global access
            v = None
        if v is not None:
            return v
    return default


def _through(cache, fns: dict, keys: bool):
    """``cache`` whose ``update`` passes what layer ``i`` writes through ``fns[i]`` (looked up at each write): its
    values, and with ``keys`` its keys too."""
    update = cache.update

    def through(key, value, layer_idx, *args, **kwargs):
        fn = fns.get(layer_idx)
        if fn is not None:
            key, value = fn(key) if keys else key, fn(value)
        return update(key, value, layer_idx, *args, **kwargs)
    cache.update = through
    return cache


def _decoder_layers(hf: nn.Module) -> nn.ModuleList:
    """The decoder layers: the largest ``ModuleList`` of as many modules as the config has layers (hybrid models
    mix attention, state-space, convolution and MoE-only layers; some count sub-layers instead)."""
    n = _cfg(_text_config(hf.config), "num_hidden_layers", "n_layers", "num_layers")
    lists = [m for _, m in hf.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    same = [m for m in lists if n is not None and len(m) == int(n)]
    pool = same or [m for m in lists if len(m) > 1]
    if not pool:
        raise ValueError(f"cannot find the decoder layers of {type(hf).__name__} (no list of modules)")
    return max(pool, key=lambda m: sum(p.numel() for p in m.parameters()))


def _attention(layer: nn.Module, declared: str | None = None) -> nn.Module | None:
    """A layer's softmax attention module, or None (a state-space, convolution, linear-attention or MLP layer; a layer
    the config declares linear attention, ``declared`` its ``layer_types`` entry: MiniMax's lightning attention sits in
    ``self_attn``, and what it returns beside its output is no probability)."""
    if declared is not None and "linear" in str(declared):
        return None
    for owner in (layer, *layer.children()):
        for n in ATTN_NAMES:
            m = getattr(owner, n, None)
            if isinstance(m, nn.Module) and not isinstance(m, nn.ModuleList):
                return None if any(w in type(m).__name__ for w in LINEAR_ATTENTION) else m
    mixer = getattr(layer, "mixer", None)
    if isinstance(mixer, nn.Module) and "Attention" in type(mixer).__name__ and "Linear" not in type(mixer).__name__:
        return mixer
    return None


def _windows(cfg, attn: list) -> list[int | None]:
    """Each layer's sliding attention window: its attention module's ``sliding_window``, else the config's for a
    layer the config makes sliding (``layer_types``, or every layer when it has none, as transformers' cache and mask
    do: Mistral, Mixtral keep the window on the config only), else None."""
    w, types = _cfg(cfg, "sliding_window"), getattr(cfg, "layer_types", None)
    out: list[int | None] = []
    for i, a in enumerate(attn):
        own = getattr(a, "sliding_window", None) if a is not None else None
        if own is None and a is not None and isinstance(w, int) and not isinstance(w, bool) and \
                getattr(cfg, "use_sliding_window", True) is not False:
            kind = "sliding_attention" if types is None else (types[i] if i < len(types) else None)
            own = w if kind == "sliding_attention" else None
        out.append(own)
    return out


def _heads(attn: nn.Module | None, default: int | None) -> int | None:
    """The number of query heads of one attention module (per-layer head counts differ in some families)."""
    if attn is None:
        return None
    o, hd = attention_map(attn, "out"), getattr(attn, "head_dim", None)
    if o is not None and isinstance(hd, int) and hd > 0 and o.in_features % hd == 0:
        return o.in_features // hd
    for n in HEAD_ATTRS:
        v = getattr(attn, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return default


def _layer_kind(layer: nn.Module) -> str:
    """What a layer without softmax attention mixes tokens with (its mixer's class name)."""
    for n in ("mamba", "linear_attn", "conv", "mixer", "short_conv", "linear_attention", "ssm"):
        m = getattr(layer, n, None)
        if isinstance(m, nn.Module):
            return type(m).__name__
    return type(layer).__name__


def _find_router(layer: nn.Module, skip: nn.Module | None = None) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """(block, router, experts): a module holding ``experts`` (or a child whose class ends in Experts, JetMoE's
    parallel experts) beside a router (a child named ``gate`` / ``router`` or whose class ends in Router / Gate /
    Gating), else None. Modules inside ``skip`` (the layer's attention: JetMoE's attention-head experts) are not
    looked at."""
    inside = {id(m) for m in skip.modules()} if skip is not None else set()
    for _, mod in layer.named_modules():
        if id(mod) in inside:
            continue
        experts = getattr(mod, "experts", None)
        if not isinstance(experts, nn.Module):
            experts = next((c for c in mod.children() if type(c).__name__.endswith("Experts")), None)
        if experts is None:
            continue
        for rname, router in mod.named_children():
            if router is not experts and (ROUTER_CLASS.search(type(router).__name__) or rname in ("gate", "router")):
                return mod, router, experts
    return None


def _weight_holder(router: nn.Module) -> nn.Module:
    """The module holding a router's weight [E, D]: the router itself, or its one child with a 2-D weight (HunYuan's
    gate keeps it in ``wg``)."""
    w = getattr(router, "weight", None)
    if torch.is_tensor(w) and w.dim() == 2:
        return router
    held = [m for m in router.modules() if m is not router and torch.is_tensor(getattr(m, "weight", None))
            and m.weight.dim() == 2]
    return held[0] if len(held) == 1 else router


def _unrouted_part(layer: nn.Module) -> nn.Module:
    """What a note names for a layer whose experts are not routed here: its router, else its MoE block."""
    found = _find_router(layer)
    if found:
        return found[1]
    return next((m for n, m in layer.named_modules() if n and (MOE_NAME.match(n.rsplit(".", 1)[-1])
                                                                or MOE_CLASS.search(type(m).__name__))), layer)


def _holds_experts(layer: nn.Module) -> bool:
    return any(MOE_NAME.match(n.rsplit(".", 1)[-1]) or MOE_CLASS.search(type(m).__name__)
               for n, m in layer.named_modules() if n)


def _tensor_attr(mods, names):
    """(owner, name) of the first tensor attribute ``names`` found on ``mods`` (a module's live buffer)."""
    for m in mods:
        for n in names:
            if isinstance(getattr(m, n, None), torch.Tensor):
                return m, n
    return None


def _received(args, kwargs):
    """Where the experts' (indices [N, K], weights [N, K]) are in their call: ((kind, key), (kind, key)) or None."""
    items = [("arg", i, a) for i, a in enumerate(args)] + [("kw", k, v) for k, v in kwargs.items()]
    idx = next((it for it in items if isinstance(it[2], torch.Tensor) and it[2].ndim == 2
                and not it[2].is_floating_point() and it[2].dtype != torch.bool), None)
    if idx is None:
        return None
    w = next((it for it in items if isinstance(it[2], torch.Tensor) and it[2].is_floating_point()
              and it[2].shape == idx[2].shape), None)
    return None if w is None else ((idx[0], idx[1]), (w[0], w[1]))


def _started(cache) -> bool:
    """True for a cache that holds tokens (a family's own cache class, once the model made it)."""
    try:
        return int(cache.get_seq_length()) > 0
    except Exception:  # noqa: BLE001 - a cache class without get_seq_length: made by the model, so started
        return True


def _get(args, kwargs, where):
    return args[where[1]] if where[0] == "arg" else kwargs[where[1]]


def _put(args, kwargs, where, value):
    if where[0] == "arg":
        args = (*args[:where[1]], value, *args[where[1] + 1:])
    else:
        kwargs = {**kwargs, where[1]: value}
    return args, kwargs


def _floats(out) -> list[int]:
    """Positions of the 2-D+ float tensors in a router's output tuple."""
    return [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o.is_floating_point() and o.ndim >= 2]


class RouterSeam:
    """How one layer's routing is observed and replaced: the router's logits, and the (indices, weights) the
    experts receive, from the experts' call ("experts"), from the router's output tuple ("output"), or from a
    dense score matrix the router returns with zeros outside the choice ("dense", Llama 4). ``repointed``: read at the
    router's output because its block re-points the choice before the experts' call (``_infer``)."""

    def __init__(self, style: str, logits_at: int | None, idx_at=None, w_at=None, top_k: int = 0):
        self.style, self.logits_at, self.idx_at, self.w_at, self.top_k = style, logits_at, idx_at, w_at, top_k
        self.repointed = False

    def logits(self, out) -> torch.Tensor:
        x = out if self.logits_at is None else out[self.logits_at]
        return x.reshape(-1, x.size(-1))

    def from_output(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        if self.style == "sorted":  # JetMoE: (order by expert, token of each, gates, tokens per expert, logits)
            order, _, gates, sizes, logits = out
            experts = torch.repeat_interleave(torch.arange(logits.size(-1), device=order.device),
                                              torch.as_tensor(sizes, device=order.device))
            idx, w = torch.empty_like(order), torch.empty_like(gates)
            idx[order], w[order] = experts, gates
            return idx.view(-1, self.top_k), w.view(-1, self.top_k)
        if self.style == "dense":
            scores = out[0].reshape(-1, out[0].size(-1))
            idx = scores.topk(self.top_k, dim=-1)[1]
            return idx, scores.gather(1, idx)
        return out[self.idx_at], out[self.w_at]

    def rebuild(self, out, idx: torch.Tensor, w: torch.Tensor):
        if self.style == "sorted":
            flat = idx.reshape(-1).to(out[0].dtype)
            order = flat.sort(0)[1]
            sizes = torch.bincount(flat, minlength=out[4].size(-1)).tolist()
            return (order, order.div(self.top_k, rounding_mode="trunc"), w.reshape(-1).to(out[2].dtype)[order], sizes,
                    out[4])
        out = list(out)
        if self.style == "dense":
            s = out[0]
            out[0] = torch.zeros_like(s.reshape(-1, s.size(-1))).scatter_(1, idx, w.to(s.dtype)).reshape(s.shape)
        else:
            out[self.idx_at], out[self.w_at] = idx.to(out[self.idx_at].dtype), w.to(out[self.w_at].dtype)
        return tuple(out)


def _probe_router(block: nn.Module, router: nn.Module, experts: nn.Module, hidden_size: int, bias, seed: int = 0):
    """Run the MoE block (else the router alone) on random rows: (router output, the experts' call (args, kwargs)
    or None). A router that takes its selection bias as an argument (HY-V3, MiniMax-M2, AFMoE) gets it."""
    p = next(router.parameters(), None)
    p = p if p is not None else next(block.parameters())
    hook = getattr(router, "_hf_hook", None)  # an offloaded layer (accelerate) runs where its hook says
    device = p.device if p.device.type != "meta" else getattr(hook, "execution_device", None) or "cpu"
    # the hidden states' dtype: the experts' (a router kept in fp32 casts its own input)
    q = next((t for t in (*experts.parameters(), *block.parameters()) if t.is_floating_point()), p)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 64, hidden_size, generator=g).to(device, q.dtype)
    got: dict = {}
    hs = [router.register_forward_hook(lambda _m, _a, o: got.setdefault("out", o)),
          experts.register_forward_pre_hook(lambda _m, a, kw: got.setdefault("call", (a, kw)), with_kwargs=True)]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if block is not router:
                try:
                    block(x)
                except Exception:  # noqa: BLE001 - a block that needs more than hidden states (a whole layer)
                    got.clear()
            if "out" not in got:
                extra = [p_ for p_ in inspect.signature(router.forward).parameters.values()
                         if p_.default is inspect.Parameter.empty and p_.kind in (p_.POSITIONAL_ONLY,
                                                                                 p_.POSITIONAL_OR_KEYWORD)][1:]
                args = [getattr(*bias) if bias is not None else None for _ in extra]
                error = None
                for shape in (x, x[0]):
                    try:
                        router(shape, *args)
                        break
                    except Exception as e:  # noqa: BLE001 - routers take [1, N, D] or [N, D]
                        got.clear()
                        error = error or e
                if "out" not in got and error is not None:
                    raise error  # the router's own error, told in the run's notes
    finally:
        for h in hs:
            h.remove()
    return got.get("out"), got.get("call")


def _agree(math: RouterMath, logits: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, atol: float) -> float:
    """The share of rows whose (indices, weights) ``math`` reproduces from ``logits`` (as sets, within ``atol``)."""
    mine_i, mine_w = math.route(logits)
    mine = _by_expert(mine_i, mine_w, math.n_experts)
    theirs = _by_expert(idx, w.float(), math.n_experts)
    return float(((mine - theirs).abs() <= atol + 1e-4 * theirs.abs()).all(-1).float().mean())


def infer_router_math(router: nn.Module, hidden_size: int, seed: int = 0, block: nn.Module | None = None,
                      experts: nn.Module | None = None) -> RouterMath | None:
    """The ``RouterMath`` that reproduces ``router``'s own output on random inputs, or None."""
    found = _infer(block if block is not None else router, router, experts if experts is not None else router,
                   hidden_size, seed)
    return None if found is None or not found[0].exact else found[0]


def _infer(block, router, experts, hidden_size: int, seed: int = 0):
    """(RouterMath, RouterSeam) of one MoE block, or None when its routing cannot be observed. The math is the
    rule of ``RouterMath``'s space that reproduces what the experts receive from the router's logits; when none
    does, the returned math has ``exact=False`` (the selection is still observed exactly).

    A block may re-point the router's choice before its experts see it: LongCat-Flash's (transformers 5.25 on) runs
    its zero-compute (identity) experts itself and hands the experts module those slots as a real expert with weight
    0. Where the experts' indices are not the ones the router's output tuple holds, and only the router's output is
    reproduced by a rule, that output is the seam: the choice is recorded, and re-routing written, where the router
    hands it to its block (whatever the block then does with it)."""
    bias_src = _tensor_attr([router, *router.modules(), block], SELECTION_BIAS)
    out, call = _probe_router(block, router, experts, hidden_size, bias_src)
    if out is None:
        return None
    tup = isinstance(out, (tuple, list))
    recv = _received(*call) if call is not None else None
    if recv is not None:
        idx, w = _get(*call, recv[0]), _get(*call, recv[1])
        fl = _floats(out) if tup else []
        seam = RouterSeam("experts", fl[0] if tup and fl else None, recv[0], recv[1])
        if tup and not fl:
            return None
    elif (tup and len(out) == 5 and isinstance(out[3], list) and isinstance(out[0], torch.Tensor) and out[0].ndim == 1
          and int(_cfg(router, "top_k", default=0) or 0)):
        seam = RouterSeam("sorted", 4, top_k=int(router.top_k))
        idx, w = seam.from_output(out)
    elif tup and len(out) >= 3 and isinstance(out[2], torch.Tensor) and not out[2].is_floating_point():
        seam = RouterSeam("output", 0, 2, 1)
        idx, w = out[2], out[1]
    elif tup and len(out) == 2 and all(isinstance(o, torch.Tensor) and o.is_floating_point() for o in out):
        k = int(_cfg(router, "top_k", default=0) or 0)
        if not k:
            return None
        seam = RouterSeam("dense", 1, top_k=k)
        idx, w = seam.from_output(out)
    else:
        return None
    found = _rule(router, block, bias_src, seam, out, idx, w)
    if found is None or found[0].exact or seam.style != "experts":
        return found
    own = _received(out, {}) if tup else None  # the router's own (indices, weights) in its output tuple
    if own is not None and own[0][0] == own[1][0] == "arg":
        r_idx, r_w = out[own[0][1]], out[own[1][1]]
        if r_idx.shape == idx.shape and not torch.equal(r_idx.sort(-1)[0], idx.sort(-1)[0]):
            at_router = _rule(router, block, bias_src, RouterSeam("output", seam.logits_at, own[0][1], own[1][1]),
                              out, r_idx, r_w)
            if at_router is not None and at_router[0].exact:
                at_router[1].repointed = True
                return at_router
    return found


def _rule(router, block, bias_src, seam: RouterSeam, out, idx: torch.Tensor, w: torch.Tensor):
    """(RouterMath, seam, bias source): the rule that reproduces the choice (``idx``, ``w``) read at ``seam`` from the
    router's logits in ``out``, or an observed (``exact=False``) softmax; None when they do not line up."""
    logits = seam.logits(out)
    # the router's arithmetic in half precision rounds its weights: compared within that precision
    atol = max(ATOL.get(logits.dtype, 1e-3), ATOL.get(w.dtype, 1e-3))
    logits = logits.float()
    idx, w = idx.reshape(-1, idx.size(-1)), w.reshape(-1, w.size(-1)).float()
    if logits.size(0) != idx.size(0):
        return None
    n_exp, top_k = logits.size(-1), idx.size(-1)
    seam.top_k = top_k
    bias = getattr(*bias_src).reshape(-1) if bias_src is not None else None
    if bias is not None and bias.numel() != n_exp:
        bias = None
    n_group = int(_cfg(router, "num_group", "n_group", default=1) or 1)
    topk_group = int(_cfg(router, "topk_group", default=1) or 1)
    if getattr(router, "topk_method", None) == "greedy" or n_group <= 1 or n_exp % n_group:
        n_group = topk_group = 1
    scales = {1.0} | {float(v) for m in (router, block) for n in SCALES
                      if isinstance(v := getattr(m, n, None), (int, float)) and not isinstance(v, bool)}
    es = _tensor_attr([router, block], EXPERT_SCALE)
    expert_scales = [None] + ([getattr(*es)] if es is not None else [])
    norm_attr = getattr(router, "norm_topk_prob", None)
    biases = [(None, "scores")] + ([(bias, "scores"), (bias, "logits")] if bias is not None else [])
    for score, (b, on), group_score, norm, scale, e_scale in product(
            SCORE_FUNCS, biases, ("max", "top2"),
            (bool(norm_attr), not bool(norm_attr)) if norm_attr is not None else (True, False), sorted(scales),
            expert_scales):
        if n_group == 1 and group_score == "top2":
            continue
        math = RouterMath(n_experts=n_exp, top_k=top_k, score=score, bias=b, n_group=n_group, topk_group=topk_group,
                          group_score=group_score, norm=norm, eps=0.0 if score == "softmax" else 1e-20, scale=scale,
                          bias_on=on, expert_scale=e_scale)
        with torch.no_grad():
            if _agree(math, logits, idx, w, atol) >= (1.0 if atol <= 1e-5 else HALF_AGREE):
                return math, seam, bias_src
    # observed: the experts' own (indices, weights) are recorded; scores and margins from a softmax of the logits
    return RouterMath(n_experts=n_exp, top_k=top_k, score="softmax", norm=True, exact=False), seam, None


class HFAdapter(Adapter):
    """Adapter over a ``transformers`` causal LM (eager attention)."""

    supports_batch = True  # stream_batch: rows fed the same positions, as our model's (no padding before a token)

    def __init__(self, hf: nn.Module, folder: str | Path | None = None, attn_chunk: int = 512):
        impl = getattr(hf.config, "_attn_implementation", None)
        if impl not in (None, "eager") and hasattr(hf, "set_attn_implementation"):
            # fused kernels (sdpa, flash) never hand out the probabilities: the attention signals need eager
            warnings.warn(f"{type(hf).__name__} was loaded with attn_implementation={impl!r}, which exposes no "
                          "attention probabilities: switched to 'eager' so attention and KV signals are recorded",
                          stacklevel=3)
            hf.set_attn_implementation("eager")
        self.module = hf.eval()
        self.module._workbench_adapter = self  # adapter_for(module) finds it again
        self.checkpoint_path = str(folder) if folder is not None else None
        self.attn_chunk = attn_chunk
        cfg = _text_config(hf.config)
        hidden = int(_cfg(cfg, "hidden_size", "d_model"))
        self.layers = _decoder_layers(hf)
        self._final_norm: nn.Module | None = None  # ``final_norm()``, found on first use
        types = getattr(cfg, "layer_types", None) or []
        self.attn: list[nn.Module | None] = [_attention(layer, types[i] if i < len(types) else None)
                                             for i, layer in enumerate(self.layers)]
        self.moe: dict[int, tuple[nn.Module, nn.Module, nn.Module, RouterMath]] = {}
        self._seam: dict[int, RouterSeam] = {}
        self._bias_src: dict[int, tuple[nn.Module, str] | None] = {}
        unrouted: list[int] = []
        inexact: list[int] = []
        notes: list[str] = []
        for i, layer in enumerate(self.layers):
            found = _find_router(layer, self.attn[i])
            got = None
            if found:
                try:
                    got = _infer(*found, hidden)
                except Exception as e:  # noqa: BLE001 - an unknown router is recorded without routing, never fatal
                    notes.append(f"layer {i}'s router could not be probed ({type(e).__name__}: "
                                 f"{(str(e).splitlines() or [''])[0][:120]})")
            if got is not None:
                math, seam, bias_src = got
                self.moe[i] = (*found, math)
                self._seam[i], self._bias_src[i] = seam, bias_src
                if not math.exact:
                    inexact.append(i)
            elif found or _holds_experts(layer):
                unrouted.append(i)
        maths = [m[3] for m in self.moe.values()]
        n_shared = 0
        if self.moe:
            block = next(iter(self.moe.values()))[0]
            if getattr(block, "shared_experts", None) is not None:
                n_shared = int(_cfg(cfg, "n_shared_experts", "num_shared_experts", default=1) or 1)
            elif getattr(block, "shared_expert", None) is not None:
                n_shared = 1
        if unrouted:
            what = sorted({type(_unrouted_part(self.layers[i])).__name__ for i in unrouted})
            notes.append(f"layers {unrouted} hold experts that no adapter recognises ({', '.join(what)}: no router "
                         "whose choice the experts receive as indices and weights, e.g. hash, product-key or "
                         "attention-head routing): routing is not recorded for them")
        extra = [i for i, (_, _, ex, m) in self.moe.items()
                 if isinstance(getattr(ex, "num_experts", None), int) and m.n_experts > ex.num_experts]
        for at_router in (False, True):  # a skip expert the experts see as expert 0; zero experts the block runs
            these = [i for i in extra if self._seam[i].repointed == at_router]
            if not these:
                continue
            i = these[0]
            n_real, n_all = self.moe[i][2].num_experts, self.moe[i][3].n_experts
            beyond = (f"layers {these}: the router ({type(self.moe[i][1]).__name__}) scores {n_all - n_real} "
                      f"class(es) beyond its {n_real} experts")
            ids = f"expert {n_real}" if n_all - n_real == 1 else f"experts {n_real}-{n_all - 1}"
            notes.append(f"{beyond} (zero-compute experts its MoE block applies itself): a token sent there is "
                         f"recorded as the router chose it, {ids}" if at_router else
                         f"{beyond} (a skip expert): a token sent there is recorded as the experts receive it, "
                         "expert 0 with weight 0")
        no_super = [i for i, (_, _, ex, _) in self.moe.items() if not self._super_ok(ex)]
        if no_super:
            kinds = sorted({type(self.moe[i][2]).__name__ for i in no_super})
            notes.append(f"layers {no_super}: expert_extremes (super experts) is not recorded ({', '.join(kinds)}: "
                         "only experts with transformers' standard fused layout are run again exactly)")
        if inexact:
            kinds = sorted({type(self.moe[i][1]).__name__ for i in inexact})
            notes.append(f"layers {inexact}: the router's rule ({', '.join(kinds)}) is not modelled; the routing "
                         "recorded is the choice and weights the experts receive, but score and margin use a "
                         "softmax of its logits, and re-routing what-ifs use that approximation")
        # attention: layers without softmax attention (state-space, convolution, linear attention) are noted;
        # layers whose head count differs from the model's are recorded without per-head signals
        g_heads = _cfg(cfg, "num_attention_heads", "n_heads")
        heads = [_heads(a, g_heads) for a in self.attn]
        present = [h for h in heads if h]
        n_heads = int(max(set(present), key=present.count) if present else (g_heads or 1))
        self._heads = [h if h == n_heads else None for h in heads]
        self._o_proj = [attention_map(a, "out") if h else None for a, h in zip(self.attn, self._heads)]
        moa = [i for i, a in enumerate(self.attn) if a is not None and any(
            ROUTER_CLASS.search(type(m).__name__) for m in a.modules())]
        if moa:
            notes.append(f"layers {moa} route tokens to attention-head experts "
                         f"({type(self.attn[moa[0]]).__name__}): that routing is not recorded")
        no_attn = [i for i, a in enumerate(self.attn) if a is None]
        if no_attn:
            kinds = sorted({_layer_kind(self.layers[i]) for i in no_attn})
            notes.append(f"layers {no_attn} have no softmax attention ({', '.join(kinds)}): attention, head and KV "
                         "signals are recorded for the attention layers only")
        odd = [i for i, (a, h) in enumerate(zip(self.attn, self._heads)) if a is not None and h is None]
        if odd:
            notes.append(f"layers {odd} have another head count than the model's {n_heads}: their attention and "
                         "head signals are not recorded")
        no_o = [i for i, (a, h, o) in enumerate(zip(self.attn, self._heads, self._o_proj))
                if a is not None and h and o is None]
        if no_o:
            notes.append(f"layers {no_o} have no per-head output projection (o_proj): head outputs are not recorded")
        streams = int(_cfg(cfg, "hc_mult", "hc_count", default=1) or 1)
        if streams > 1:
            notes.append(f"the residual stream is {streams} parallel streams: resid_norm is the norm over all of them")
        family = str(hf.config.model_type)
        self.supports_batch = not {family, getattr(_text_config(hf.config), "model_type", None)} & SINGLE_ONLY
        if not self.supports_batch:
            notes.append(f"{family}: a prompt set records one prompt at a time (its rows of a batched generation "
                         "differ from their single recordings)")
        self._windows = _windows(cfg, self.attn)
        self._passes: dict[int, int] = {}
        loops = int(_cfg(cfg, "loop_num_passes", default=1) or 1)
        if loops > 1:
            notes.append(f"looped layers run {loops} passes per token: every signal is recorded on the first pass")
        n_kv = _cfg(cfg, "num_key_value_heads", default=None)
        self.summary = ModelSummary(
            family=str(hf.config.model_type), backend="transformers", n_layers=len(self.layers), n_heads=n_heads,
            n_kv_heads=int(n_kv if isinstance(n_kv, int) else n_heads), vocab_size=int(_cfg(cfg, "vocab_size")),
            max_seq_len=int(_cfg(cfg, "max_position_embeddings", "max_seq_len", default=2048)),
            moe_layers=sorted(self.moe), n_routed_experts=maths[0].n_experts if maths else 0,
            n_shared_experts=n_shared, top_k=maths[0].top_k if maths else 0,
            selection_bias=any(m.has_bias for m in maths), unrouted_layers=unrouted, notes=notes)
        self._pos = 0
        self._cache = None
        self._attn_listeners = 0
        # looped layers (a block run several times per forward): seams see a layer's first pass only
        self._looped = loops > 1
        self._pass_hooks = [] if not self._looped else [
            hf.register_forward_pre_hook(lambda _m, _a: self._passes.clear())] + [
            layer.register_forward_pre_hook(lambda _m, _a, i=i: self._passes.__setitem__(i, self._passes.get(i, 0) + 1))
            for i, layer in enumerate(self.layers)]

    def _first_pass(self, i: int) -> bool:
        return not self._looped or self._passes.get(i, 1) <= 1

    def router(self, layer: int) -> RouterMath:
        math = self.moe[layer][3]
        src = self._bias_src.get(layer)
        if math.bias is None or src is None:
            return math
        # the live buffer (a dtype or device move replaces it; a fault changes it in place)
        return replace(math, bias=getattr(*src).reshape(-1))

    # -- running --------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._pos = 0
        return self.module(ids, use_cache=False).logits.float()

    def embedding(self) -> nn.Module:
        return self.module.get_input_embeddings()

    def stream(self, prompt: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> Iterator:
        """The prefill step (in query blocks while attention is observed), then one step per token."""
        from transformers import DynamicCache  # lazy: transformers is optional; only its models get here

        prompt = check_prompt(prompt, max_new_tokens, self.summary.max_seq_len)
        cache = self._written(DynamicCache(config=self.module.config))

        def forward(ids: list[int], pos: int, index: int) -> torch.Tensor:
            nonlocal cache
            logits, cache = self._feed(cache, ids, pos, self.attn_chunk if self._attn_listeners and index == 0
                                       else len(ids))
            return logits

        try:
            with torch.inference_mode():
                yield from decode(forward, prompt, max_new_tokens, temperature, top_p, seed, eos_id)
        finally:
            self._cache = None

    def stream_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                     temperature: Sequence[float], top_p: Sequence[float], seed: Sequence[int],
                     eos_id: int | None) -> Iterator:
        """Several prompts in one ``DynamicCache`` of B rows, as our model's ``stream_batch``
        (``workbench.model.generate.decode_batch``): every row is fed the same positions, the first forward the
        shortest prompt (in query blocks while attention is observed), a longer prompt's remaining tokens
        teacher-forced one per forward while the shorter rows decode, a finished row fed token 0. No row has a
        token before its first, so the causal mask and the positions a row would have alone are exact for every
        family (sliding windows, attention sinks, families that ignore ``position_ids``), no attention mask or
        padding is needed, and each row's seams see exactly its single recording's tensors (up to summation
        order): attention over its own keys only, no routing of padding before its tokens."""
        from transformers import DynamicCache  # lazy: transformers is optional; only its models get here

        prompts = [check_prompt(p, n, self.summary.max_seq_len) for p, n in zip(prompts, max_new_tokens)]
        cache = self._written(DynamicCache(config=self.module.config))

        def forward(rows: list[list[int]], pos: int) -> torch.Tensor:
            nonlocal cache
            logits, cache = self._feed_rows(cache, rows, pos, self.attn_chunk if self._attn_listeners and pos == 0
                                            else len(rows[0]))
            return logits

        try:
            with torch.inference_mode():
                yield from decode_batch(forward, prompts, max_new_tokens, temperature, top_p, seed, eos_id)
        finally:
            self._cache = None

    def _feed(self, cache, ids: list[int], pos: int, chunk: int) -> tuple[torch.Tensor, object]:
        """Feed ``ids`` from position ``pos`` through ``cache`` in blocks of ``chunk`` tokens: (logits [T, V] fp32,
        the cache)."""
        logits, cache = self._feed_rows(cache, [ids], pos, chunk)
        return logits[0], cache

    def _feed_rows(self, cache, rows: list[list[int]], pos: int, chunk: int) -> tuple[torch.Tensor, object]:
        """``_feed`` for B rows of equal length fed the same positions: (logits [B, T, V] fp32, the cache)."""
        parts = []
        for c0 in range(0, len(rows[0]), chunk):
            self._pos = pos + c0
            x = torch.tensor([r[c0:c0 + chunk] for r in rows], device=self.device)
            if cache is not None and not getattr(self, "_own_cache", False):
                try:
                    out = self.module(x, cache=cache, use_cache=True)
                except ValueError as e:
                    if "cache" not in str(e) or cache.get_seq_length() > 0:
                        raise
                    self._own_cache = True  # a family with a cache class of its own (MiniMax): it makes one
                    out = self.module(x, use_cache=True)
            else:
                out = self.module(x, use_cache=True) if cache is None or getattr(self, "_own_cache", False) and \
                    not _started(cache) else self.module(x, cache=cache, use_cache=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            parts.append(out.logits.float())
        self._cache = cache
        return (torch.cat(parts, 1) if len(parts) > 1 else parts[0]), cache

    def kv_state(self, row: int = 0) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor, int]]:
        out = []
        for i, layer in enumerate(getattr(self._cache, "layers", None) or []):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.numel() == 0:
                continue
            n = keys.size(-2)
            keys, values = keys[row:row + 1], values[row:row + 1]  # batch row ``row`` (a batched generation's)
            nbytes = keys.numel() * keys.element_size() + values.numel() * values.element_size()
            # [B, Hkv, S, d] -> [S, Hkv*d]: a token's cached vectors over all kv heads (values first, as the
            # latent is for our model)
            seen = int(getattr(layer, "cumulative_length", n))  # a sliding-window layer keeps the newest n
            out.append((i, n, nbytes, values[0].transpose(0, 1).flatten(1), keys[0].transpose(0, 1).flatten(1),
                        seen - n))
        return out

    def kv_sizes(self) -> list[tuple[int, int, int]]:
        """``kv_state``'s (layer, cached tokens, bytes of one row) without its tensors (every step of every row)."""
        out = []
        for i, layer in enumerate(getattr(self._cache, "layers", None) or []):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.numel() == 0:
                continue
            nbytes = keys.numel() * keys.element_size() + values.numel() * values.element_size()
            out.append((i, keys.size(-2), nbytes // keys.size(0)))
        return out

    # -- the KV what-if seam: eviction adds -inf to each layer's 4D attention mask (eager attention) --------
    @contextlib.contextmanager
    def kv_session(self, max_len: int) -> Iterator:
        from transformers import DynamicCache  # lazy: transformers is optional; only its models get here

        cache = self._written(DynamicCache(config=self.module.config))
        self._kv_keep: list[torch.Tensor | None] = [None] * len(self.layers)

        def evict(_m, args, kwargs, i):
            keep = self._kv_keep[i]
            if keep is None:
                return None
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            t = h.size(1)
            mask = kwargs.get("attention_mask")
            if mask is None:  # built here: causal over the cached keys and the t new ones
                s = cache.get_seq_length(i) + t
                q = torch.arange(s - t, s, device=h.device)[:, None]
                mask = torch.zeros(t, s, dtype=h.dtype, device=h.device).masked_fill(
                    torch.arange(s, device=h.device)[None] > q, float("-inf"))[None, None]
            s = mask.size(-1)
            if keep.numel() > s:
                raise ValueError(f"layer {i}'s attention sees {s} keys but {keep.numel()} are cached: the KV "
                                 "what-if does not support sliding-window caches")
            add = torch.zeros(s, dtype=mask.dtype, device=mask.device)
            add[: keep.numel()].masked_fill_(~keep, float("-inf"))
            kwargs["attention_mask"] = mask + add
            return args, kwargs

        handles = [a.register_forward_pre_hook(lambda m, a_, kw, i=i: evict(m, a_, kw, i), with_kwargs=True)
                   for i, a in enumerate(self.attn) if a is not None]

        def forward(ids, pos: int) -> torch.Tensor:
            nonlocal cache
            # always in blocks: the same arithmetic, observed or not
            logits, cache = self._feed(cache, list(ids), pos, self.attn_chunk)
            return logits

        try:
            with torch.inference_mode():
                yield forward
        finally:
            for hd in handles:
                hd.remove()
            self._cache = None
            self._kv_keep = [None] * len(self.layers)

    # -- what-ifs on a full forward (precision) ----------------------------------------------------------
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def quantization_points(self, layer: int) -> QuantPoints:
        moe = self.moe.get(layer)
        if moe is None:
            return QuantPoints(self.layers[layer], [], [])
        experts = moe[2]
        fused = [] if any(isinstance(m, nn.Linear) for m in experts.modules()) else [experts]
        return QuantPoints(self.layers[layer], [moe[1]], fused)

    @contextlib.contextmanager
    def teacher_forcing(self, length: int) -> Iterator:
        from transformers import DynamicCache  # lazy: transformers is optional; only its models get here

        m = self.module
        quant = self.__dict__.setdefault("_kv_quant", {})

        def forward(ids: torch.Tensor) -> torch.Tensor:
            cache = _through(DynamicCache(config=m.config), quant, keys=True)  # a fresh cache, quantize_kv's fns
            self._pos = 0  # the attention probe's position counter
            return m(ids, cache=cache, use_cache=True).logits.float()

        with torch.no_grad():
            yield forward

    @contextlib.contextmanager
    def cache_writes(self, layer: int, fn) -> Iterator[None]:
        writes = self.__dict__.setdefault("_kv_writes", {})
        # the cache's own layer indices of the block's parts (a block with two attentions, LongCat-Flash's, has two;
        # a block whose parts carry none: the block's)
        block = self.layers[layer]
        idx = sorted({int(m.layer_idx) for m in block.modules()
                      if m is not block and isinstance(getattr(m, "layer_idx", None), int)}) or [layer]
        for i in idx:
            writes[i] = fn
        try:
            yield
        finally:
            for i in idx:
                if writes.get(i) is fn:
                    del writes[i]

    def _written(self, cache):
        """``cache`` whose ``update`` passes the values each layer writes through ``cache_writes``' functions."""
        writes = self.__dict__.get("_kv_writes")
        return _through(cache, writes, keys=False) if writes else cache

    @contextlib.contextmanager
    def quantize_kv(self, layer: int, fn) -> Iterator[None]:
        quant = self.__dict__.setdefault("_kv_quant", {})
        quant[layer] = fn
        try:
            yield
        finally:
            if quant.get(layer) is fn:
                del quant[layer]

    def kv_entries(self) -> list[tuple[int, list[torch.Tensor]]]:
        out = []
        for layer in getattr(self._cache, "layers", None) or []:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.numel() == 0:
                out.append((0, []))
                continue
            n = keys.size(-2)
            seen = int(getattr(layer, "cumulative_length", n))
            # [B, Hkv, S, d] -> [S, Hkv, d] views of batch row 0 (edits write through); values first, as kv_state
            out.append((seen - n, [values[0].transpose(0, 1), keys[0].transpose(0, 1)]))
        return out


    def state_sha256(self) -> str:
        return state_sha256(self.module)

    # -- the parts of a layer (activation patching, fault injection) ---------------------------------
    def parts(self, layer: int) -> dict[str, nn.Module | None]:
        b = self.layers[layer]
        attn = self.attn[layer]
        moe = self.moe.get(layer)
        block = moe[0] if moe else None
        shared = None if block is None else (getattr(block, "shared_experts", None)
                                             or getattr(block, "shared_expert", None))
        return {"block": b, "attn": attn, "mlp": getattr(b, "mlp", None) or block,
                "attn_norm": getattr(b, "input_layernorm", None), "mlp_norm": getattr(b, "post_attention_layernorm", None),
                "kv": getattr(attn, "kv_a_layernorm", None) or getattr(attn, "v_proj", None), "shared": shared,
                "router": _weight_holder(moe[1]) if moe else None, "experts": moe[2] if moe else None}

    def expert_down(self, layer: int, expert: int) -> torch.Tensor:
        experts = self.moe[layer][2]
        down = getattr(experts, "down_proj", None)
        if isinstance(down, torch.Tensor) and down.ndim == 3:  # fused [E, D, I] (or [E, I, D])
            w = down[expert]
            return w if w.size(0) == self.unembedding().weight.size(1) else w.transpose(0, 1)
        mods = list(experts) if isinstance(experts, nn.ModuleList) else []
        if mods and hasattr(mods[expert], "down_proj"):
            return mods[expert].down_proj.weight
        raise ValueError(f"cannot find expert {expert}'s down projection in layer {layer} of {self.summary.family}")

    def unembedding(self) -> nn.Module:
        return self.module.get_output_embeddings()

    @functools.cached_property
    def cache_exact(self) -> bool:  # type: ignore[override]
        """False for attention that selects its keys (an indexer's top-k: DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2,
        dots3-note; Doge's dynamic mask): its cached decode chooses among other keys than the whole sequence's forward
        does, so the two differ on a clean model (0.3-4.9 nats on the tiny configs of transformers 5.25; every other
        MoE family of it agrees within 5e-5)."""
        if _cfg(_text_config(self.module.config), "index_topk", "keep_window_size") is not None:
            return False
        return not any(type(m).__name__.endswith("Indexer") for m in self.module.modules())

    @functools.cached_property
    def cache_exact_len(self) -> int | None:  # type: ignore[override]
        """Past ``original_max_position_embeddings`` a longrope or dynamic-NTK rotary embedding picks its frequencies
        by the length: a cached decode that crosses it keeps keys rotated the short way, a whole forward rotates
        them all the long way. None for a rotary embedding the same at every length."""
        cfg = _text_config(self.module.config)
        rp = _cfg(cfg, "rope_parameters") or _cfg(cfg, "rope_scaling") or {}
        parts = [rp] + [v for v in rp.values() if isinstance(v, dict)] if isinstance(rp, dict) else []
        for part in parts:
            if part.get("rope_type", part.get("type")) in ("longrope", "dynamic"):
                orig = (part.get("original_max_position_embeddings") or _cfg(cfg, "original_max_position_embeddings")
                        or _cfg(cfg, "max_position_embeddings"))
                return int(orig or 0)
        return None

    def final_norm(self) -> nn.Module:
        """The norm after the last decoder layer: a module named like one (``norm``, ``ln_f``, ...) outside the
        decoder layers, the nearest the root (``model.norm``, ``transformer.ln_f``,
        ``model.decoder.final_layer_norm``)."""
        if self._final_norm is None:  # looked up once (the component check and the lens ask on every call)
            inside = {id(m) for m in self.layers.modules()}
            found = [(name.count("."), name, m) for name, m in self.module.named_modules()
                     if name.rsplit(".", 1)[-1] in FINAL_NORM and id(m) not in inside
                     and any(True for _ in m.parameters())]
            if not found:
                raise ValueError(f"cannot find the final norm of {self.summary.family} (no module named "
                                 f"{' / '.join(FINAL_NORM)} outside the decoder layers)")
            self._final_norm = min(found, key=lambda f: f[:2])[2]
        return self._final_norm

    def lens_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().lens_logits(h)
        cfg = _text_config(self.module.config)
        cap = _cfg(cfg, "final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        scale = _cfg(cfg, "logit_scale")
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            logits = logits * scale
        div = _cfg(cfg, "logits_scaling")
        if isinstance(div, (int, float)) and not isinstance(div, bool) and div:
            logits = logits / div
        return logits

    def _rotary_emb(self) -> nn.Module:
        for _, m in self.module.named_modules():
            if type(m).__name__.endswith("RotaryEmbedding") and isinstance(getattr(m, "inv_freq", None), torch.Tensor):
                return m
        raise ValueError(f"{self.summary.family} has no rotary embedding module with inv_freq")

    def rotary(self, layer: int, fn) -> list:
        def pre(_m, args, kwargs):
            pe = kwargs.get("position_embeddings")
            if pe is None:
                return None
            new = fn(pe, self._pos)
            if new is None:
                return None
            kwargs["position_embeddings"] = new
            return args, kwargs
        attn = self.attn[layer]
        return [] if attn is None else [attn.register_forward_pre_hook(pre, with_kwargs=True)]

    def start_positions(self, layer: int, fn) -> list:
        return [self.layers[layer].register_forward_pre_hook(lambda _m, _args: fn(self._pos))]

    def scaled_rotation(self, rotation, factor: float, start: int = 0):
        cos, sin = rotation
        rot = self._rotary_emb()
        inv = rot.inv_freq.float().to(cos.device)
        t = torch.arange(start, start + cos.size(-2), device=cos.device, dtype=torch.float32)
        emb = torch.outer(t, inv * factor)
        emb = torch.cat([emb, emb], -1)
        if emb.size(-1) != cos.size(-1):
            raise ValueError(f"the rotary embedding of {self.summary.family} is not the rotate-half layout")
        a = float(getattr(rot, "attention_scaling", 1.0))
        return ((emb.cos() * a).to(cos).expand_as(cos), (emb.sin() * a).to(sin).expand_as(sin))

    # -- seams ----------------------------------------------------------------------------------------
    def _attach(self, seam: str, fn: Listener) -> list:
        if seam == "attn_probs":
            batched = getattr(fn, "batched", False)

            def on_attn(m, _a, out, i):
                probs = out[1] if isinstance(out, tuple) and len(out) > 1 else None
                # softmax probabilities [B, H, Tc, S] (a module returning something else is not attention we read)
                if isinstance(probs, torch.Tensor) and probs.ndim == 4 and self._first_pass(i):
                    p = probs.detach().transpose(1, 2)  # [B, Tc, H, S]; a batch fan-out takes every row
                    fn(i, p if batched else p[0], self._pos, self._windows[i])
            handles = [a.register_forward_hook(lambda m, a_, o, i=i: on_attn(m, a_, o, i))
                       for i, (a, h) in enumerate(zip(self.attn, self._heads)) if a is not None and h]
            self._attn_listeners += 1
            return handles + [_Undo(self._attn_done)]
        if seam == "head_out":
            h = self.summary.n_heads

            def on_o(_m, args, i):
                if not self._first_pass(i):
                    return None
                x = args[0]
                z = x.view(*x.shape[:-1], h, x.size(-1) // h)  # [B, T, H, d]
                new = fn(i, z)
                return None if new is None else (new.reshape(x.shape), *args[1:])
            return [o.register_forward_pre_hook(lambda m, a, i=i: on_o(m, a, i))
                    for i, o in enumerate(self._o_proj) if o is not None]
        if seam == "resid_post":
            def on_layer(_m, _a, out, i):
                if self._first_pass(i):
                    x = first_output(out)
                    fn(i, x.flatten(2) if x.ndim == 4 else x)  # parallel residual streams [B, T, n, D]: all of them
            return [l.register_forward_hook(lambda m, a, o, i=i: on_layer(m, a, o, i)) for i, l in enumerate(self.layers)]
        if seam == "expert_in":
            return self._attach_expert_in(fn)
        if seam == "shared_out":
            handles = []
            for i, (block, _, _, _) in self.moe.items():
                shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert")

                def on_shared(_m, _a, out, i=i):
                    if not self._first_pass(i) or not isinstance(out, torch.Tensor):
                        return None
                    new = fn(i, out.reshape(-1, out.size(-1)))
                    return None if new is None else new.reshape(out.shape)
                handles.append(shared.register_forward_hook(on_shared))
            return handles
        raise KeyError(seam)

    def _attach_expert_in(self, fn: Listener) -> list:
        """``expert_in``: fused experts' own input (their forward's first argument, [N, D]), shaped as the MoE
        block's input [B, T, D]; only for fused experts ``workbench.capture.experts`` computes exactly (one module
        per expert: what a family's block hands them is not known here, so nothing; the notes say so)."""
        handles = []
        for i, (block, _, experts, _) in self.moe.items():
            if not self._super_ok(experts):
                continue
            shape: dict = {}

            def on_block(_m, args, kwargs, shape=shape):
                h = args[0] if args else kwargs.get("hidden_states")
                if isinstance(h, torch.Tensor) and h.ndim == 3:
                    shape["s"] = h.shape

            def on_experts(_m, args, kwargs, i=i, shape=shape):
                x = args[0] if args else kwargs.get("hidden_states")
                s = shape.pop("s", None)
                if isinstance(x, torch.Tensor) and s is not None and x.numel() == s.numel() and self._first_pass(i):
                    fn(i, x.reshape(s))
            handles.append(block.register_forward_pre_hook(on_block, with_kwargs=True))
            handles.append(experts.register_forward_pre_hook(on_experts, with_kwargs=True))
        return handles

    @staticmethod
    def _super_ok(experts) -> bool:
        return not isinstance(experts, nn.ModuleList) and experts_supported(experts)

    def _attach_routing(self) -> list:
        handles = []
        for i, (_, router, experts, _) in self.moe.items():
            seam = self._seam[i]
            seen: dict = {}

            def on_router(_m, _a, out, i=i, seam=seam, seen=seen):
                seen["logits"] = seam.logits(out)
                if seam.style == "experts" or not self._first_pass(i):
                    return None
                idx, w = seam.from_output(out)
                new = self._dispatch_route(i, seen["logits"], idx, w)
                return None if new is None else seam.rebuild(out, new[0], new[1])
            handles.append(router.register_forward_hook(on_router))
            if seam.style != "experts":
                continue

            def on_experts(_m, args, kwargs, i=i, seam=seam, seen=seen):
                if not self._first_pass(i) or "logits" not in seen:
                    return None
                idx, w = _get(args, kwargs, seam.idx_at), _get(args, kwargs, seam.w_at)
                shape = idx.shape
                new = self._dispatch_route(i, seen["logits"], idx.reshape(-1, shape[-1]), w.reshape(-1, shape[-1]))
                if new is None:
                    return None
                args, kwargs = _put(args, kwargs, seam.idx_at, new[0].to(idx.dtype).reshape(shape))
                return _put(args, kwargs, seam.w_at, new[1].to(w.dtype).reshape(shape))
            handles.append(experts.register_forward_pre_hook(on_experts, with_kwargs=True))
        return handles

    def _attn_done(self) -> None:
        self._attn_listeners -= 1


class _Undo:
    """A handle whose ``remove()`` runs a function (bookkeeping undone with the hooks)."""

    def __init__(self, fn):
        self.fn = fn

    def remove(self) -> None:
        self.fn()


def _placement(device_map) -> dict:
    """from_pretrained's keyword arguments for a device map (a map that offloads to "disk" gets a folder)."""
    if device_map is None:
        return {}
    out = {"device_map": device_map}
    if isinstance(device_map, dict) and "disk" in device_map.values():
        out["offload_folder"] = tempfile.mkdtemp(prefix="workbench-offload-")
    return out


def load_hf(folder: str | Path, dtype: torch.dtype | None = None, device: str = "cpu",
            attn_chunk: int = 512, device_map=None) -> HFAdapter:
    """Load a local Hugging Face causal-LM folder (never downloads; safetensors only) with eager attention.

    ``device_map`` ("auto", "balanced", a device, or {module path: device}) places the model across devices with
    accelerate, for a model larger than one device; inputs then go to the embedding's device and transformers'
    dispatch hooks move activations between devices."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is optional; only its folders get here
    from transformers.utils import logging as hf_logging  # lazy: as above

    folder = Path(folder)
    cfg = check_config(folder, str(dtype).removeprefix("torch.") if dtype is not None else None, device_map)
    check_no_remote_code(folder, cfg)
    try:
        # use_safetensors: a folder holding only pickled *.bin weights is refused, never unpickled;
        # trust_remote_code=False: a folder's own Python is never run, and transformers never asks
        with warnings.catch_warnings(), _quiet(hf_logging):  # missing weights are told in one line below
            warnings.simplefilter("ignore")
            hf, info = AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, attn_implementation="eager", dtype=dtype or torch.float32,
                use_safetensors=True, trust_remote_code=False, output_loading_info=True, **_placement(device_map))
    except ImportError as e:
        raise ValueError(f"device_map needs accelerate (pip install 'moe-workbench[devicemap]'): {e}") from None
    except Exception as e:  # noqa: BLE001 - transformers and safetensors raise many types; one line for all
        raise ValueError(f"cannot load {folder} with transformers: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}") from None
    check_loaded(folder, hf, info)
    return HFAdapter(hf if device_map is not None else hf.to(device), folder, attn_chunk)


@contextlib.contextmanager
def _quiet(hf_logging) -> Iterator[None]:
    """transformers' own loading report (a table of missing keys on stderr) off while a folder loads."""
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def check_loaded(folder: Path, hf: nn.Module, info: dict) -> None:
    """Weights the model has but the folder's safetensors do not (transformers would leave them random and only
    warn) or tensors whose shape does not fit: refused, in one line."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = [m if isinstance(m, str) else m[0] for m in (info.get("mismatched_keys") or [])]
    if missing or mismatched:
        n = len(hf.state_dict())
        what = (f"{len(missing)} of the model's {n} weights are not in its safetensors (e.g. {missing[:3]})"
                if missing else f"{len(mismatched)} weights have another shape than the config's (e.g. "
                f"{mismatched[:3]})")
        raise ValueError(f"{folder}: {what}; they would run with random values. Is the folder complete, and "
                         "saved for this model_type?")
