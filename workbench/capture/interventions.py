"""Interventions: declared, recorded edits of a model's computation ("what if expert 5 of layer 3 were banned").

Six constructors return small frozen ``Intervention`` values; each has a ``spec`` string and ``parse`` reads it
back (the CLI's ``--intervene``, the ``interventions`` table's ``spec`` column):

    ban_expert(3, 5)               ban:L3E5            removed from the router's choice: its tokens re-route
    boost_expert(3, 5, 1.5)        boost:L3E5=1.5      added to the expert's selection score
    force_expert(3, 5)             force:L3E5          always in the chosen set
    scale_head(2, 1, 0.0)          scale_head:L2H1=0   one head's output (before the output projection) scaled
    scale("layers.2.ffn", 0.5)     scale:layers.2.ffn=0.5   any module's output (its path in the model) scaled
    router_bias(3, [0.1, ...])     router_bias:L3=[0.1,...] a per-expert vector added to the selection scores

``applied(adapter, interventions)`` applies them for the duration of a block, through the adapter's seams, so
they act on our ``Transformer`` and on every ``transformers`` family the adapters cover (the mechanism of
``workbench.analysis.faults``, recorded): routing ones through the ``route`` seam (``Route.remove`` and
``Route.add_selection``; a forced expert is put into the final choice with the layer's ``RouterMath``),
``scale_head`` through ``head_out`` (as root cause ablates a head), ``scale`` through a forward hook on the
named module. ``workbench.record(..., interventions=[...])`` records under them and stores them with the run.

Declaring and parsing need no torch (the facade and the store read them); applying them does.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import polars as pl

__all__ = ["KINDS", "Intervention", "applied", "ban_expert", "boost_expert", "check", "force_expert", "normalize",
           "of_run", "parse", "router_bias", "rows", "scale", "scale_head", "stored"]

KINDS = ("ban", "boost", "force", "scale_head", "scale", "router_bias")
ROUTING = ("ban", "boost", "force", "router_bias")


def _num(v: float) -> str:
    """A float in its shortest round-trip form, without a trailing ``.0`` (``0``, ``1.5``, ``1e-05``)."""
    s = repr(float(v))
    return s[:-2] if s.endswith(".0") else s


@dataclass(frozen=True)
class Intervention:
    """One declared intervention. ``kind`` is one of ``KINDS``; the fields it does not use are None.

    Attributes:
        layer: the 0-based block (every kind but ``scale``).
        expert: the routed expert (ban, boost, force).
        head: the attention head (scale_head).
        path: a module path inside the model, as ``named_modules()`` names it (scale).
        value: the delta (boost) or factor (scale_head, scale).
        values: the per-expert vector (router_bias).
    """

    kind: str
    layer: int | None = None
    expert: int | None = None
    head: int | None = None
    path: str | None = None
    value: float | None = None
    values: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown intervention kind {self.kind!r}; kinds: {', '.join(KINDS)}")
        need = {"ban": ("layer", "expert"), "boost": ("layer", "expert", "value"), "force": ("layer", "expert"),
                "scale_head": ("layer", "head", "value"), "scale": ("path", "value"),
                "router_bias": ("layer", "values")}[self.kind]
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"{self.kind} needs {name}")
        for name in ("layer", "expert", "head"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{self.kind}: {name} must be an integer >= 0, got {v!r}")
        for v in ([self.value] if self.value is not None else []) + list(self.values or ()):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{self.kind}: values must be finite numbers, got {v!r}")
        if self.value is not None:
            object.__setattr__(self, "value", float(self.value))
        if self.values is not None:
            object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if self.path is not None and (not self.path or "=" in self.path or any(c.isspace() for c in self.path)):
            raise ValueError(f"scale: bad module path {self.path!r}")

    @property
    def spec(self) -> str:
        """The string form (``parse(iv.spec) == iv``)."""
        k = self.kind
        if k in ("ban", "force"):
            return f"{k}:L{self.layer}E{self.expert}"
        if k == "boost":
            return f"boost:L{self.layer}E{self.expert}={_num(self.value)}"
        if k == "scale_head":
            return f"scale_head:L{self.layer}H{self.head}={_num(self.value)}"
        if k == "scale":
            return f"scale:{self.path}={_num(self.value)}"
        return f"router_bias:L{self.layer}=[{','.join(_num(v) for v in self.values)}]"

    def __str__(self) -> str:
        return self.spec


def ban_expert(layer: int, expert: int) -> Intervention:
    """Expert ``expert`` of MoE layer ``layer`` is removed from the router's choice (its tokens go to the next best)."""
    return Intervention("ban", layer=layer, expert=expert)


def boost_expert(layer: int, expert: int, delta: float) -> Intervention:
    """``delta`` added to the expert's selection score (what the router's top-k ranks by; the mixing weights stay
    the router's own scores of the chosen experts)."""
    return Intervention("boost", layer=layer, expert=expert, value=delta)


def force_expert(layer: int, expert: int) -> Intervention:
    """The expert is always in the chosen set (the rest of the choice: the router's best others)."""
    return Intervention("force", layer=layer, expert=expert)


def scale_head(layer: int, head: int, factor: float) -> Intervention:
    """One attention head's output (before the output projection) multiplied by ``factor`` (0: ablated)."""
    return Intervention("scale_head", layer=layer, head=head, value=factor)


def scale(path: str, factor: float) -> Intervention:
    """The output of the module at ``path`` (e.g. ``"layers.2.ffn"``; a transformers model:
    ``"model.layers.2.mlp"``) multiplied by ``factor``."""
    return Intervention("scale", path=path, value=factor)


def router_bias(layer: int, values) -> Intervention:
    """A per-expert vector added to layer ``layer``'s selection scores (one value per routed expert)."""
    return Intervention("router_bias", layer=layer, values=tuple(values))


_LE = re.compile(r"L(\d+)E(\d+)")
_LH = re.compile(r"L(\d+)H(\d+)")
_L = re.compile(r"L(\d+)")
FORMS = ("ban:L3E5", "boost:L3E5=1.5", "force:L3E5", "scale_head:L2H1=0", "scale:layers.2.ffn=0.5",
         "router_bias:L3=[0.5,0,...]")


def _float(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"intervention {spec!r}: {text!r} is not a number") from None


def parse(spec: str) -> Intervention:
    """An ``Intervention`` from its string form (one of ``FORMS``); a one-line ValueError otherwise."""
    if isinstance(spec, Intervention):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"an intervention is a spec string or an Intervention, got {type(spec).__name__}")
    s = spec.strip()
    kind, sep, rest = s.partition(":")
    if not sep or kind not in KINDS:
        raise ValueError(f"unknown intervention {spec!r}; forms: {', '.join(FORMS)}")
    where, eq, val = rest.partition("=")
    where, val = where.strip(), val.strip()
    if kind in ("ban", "force"):
        m = _LE.fullmatch(where)
        if not m or eq:
            raise ValueError(f"intervention {spec!r}: write {kind}:L<layer>E<expert>, e.g. {kind}:L3E5")
        return Intervention(kind, layer=int(m[1]), expert=int(m[2]))
    if not eq or not val:
        raise ValueError(f"intervention {spec!r} needs a value after '=' (forms: {', '.join(FORMS)})")
    if kind == "boost":
        m = _LE.fullmatch(where)
        if not m:
            raise ValueError(f"intervention {spec!r}: write boost:L<layer>E<expert>=<delta>, e.g. boost:L3E5=1.5")
        return Intervention(kind, layer=int(m[1]), expert=int(m[2]), value=_float(val, spec))
    if kind == "scale_head":
        m = _LH.fullmatch(where)
        if not m:
            raise ValueError(f"intervention {spec!r}: write scale_head:L<layer>H<head>=<factor>, "
                             "e.g. scale_head:L2H1=0")
        return Intervention(kind, layer=int(m[1]), head=int(m[2]), value=_float(val, spec))
    if kind == "scale":
        if not where:
            raise ValueError(f"intervention {spec!r}: write scale:<module path>=<factor>, e.g. scale:layers.2.ffn=0.5")
        return Intervention(kind, path=where, value=_float(val, spec))
    m = _L.fullmatch(where)
    if not m or not (val.startswith("[") and val.endswith("]")):
        raise ValueError(f"intervention {spec!r}: write router_bias:L<layer>=[v0,v1,...] (one value per expert)")
    items = [v.strip() for v in val[1:-1].split(",") if v.strip()]
    if not items:
        raise ValueError(f"intervention {spec!r}: the bias vector is empty")
    return Intervention(kind, layer=int(m[1]), values=tuple(_float(v, spec) for v in items))


def normalize(interventions: Iterable | None) -> list[Intervention]:
    """A list of ``Intervention`` from specs and / or ``Intervention`` values (None: none)."""
    if interventions is None:
        return []
    if isinstance(interventions, (str, Intervention)):
        interventions = [interventions]
    return [parse(i) for i in interventions]


def rows(run_id: str, interventions: list[Intervention]) -> dict[str, list]:
    """The ``interventions`` table's rows of one run (columns as in ``workbench.data.schema``)."""
    return {"run_id": [run_id] * len(interventions), "idx": list(range(len(interventions))),
            "kind": [i.kind for i in interventions], "layer": [i.layer for i in interventions],
            "expert": [i.expert for i in interventions], "head": [i.head for i in interventions],
            "path": [i.path for i in interventions], "value": [i.value for i in interventions],
            "spec": [i.spec for i in interventions]}


def stored(store, run_id: str) -> pl.DataFrame:
    """The run's ``interventions`` rows (idx, kind, layer, expert, head, path, value, spec), in order."""
    return store.sql("SELECT idx, kind, layer, expert, head, path, value, spec FROM interventions "
                     "WHERE run_id = ? ORDER BY idx", [run_id])


def of_run(store, run_id: str) -> list[Intervention]:
    """The interventions run ``run_id`` was recorded under (parsed from their stored specs)."""
    return [parse(s) for s in stored(store, run_id)["spec"].to_list()]


# -- applying them ---------------------------------------------------------------------------------------------
def check(adapter, interventions: list[Intervention]) -> None:
    """A one-line ValueError for an intervention the model cannot take (a dense layer, an expert, head or module
    that does not exist, a bias of the wrong length, more forced experts than the router chooses)."""
    s = adapter.summary
    forced: dict[int, set[int]] = {}
    banned: dict[int, set[int]] = {}
    for iv in interventions:
        if iv.layer is not None and not 0 <= iv.layer < s.n_layers:
            raise ValueError(f"{iv.spec}: layer {iv.layer} out of range: the model has layers 0..{s.n_layers - 1}")
        if iv.kind in ROUTING and iv.layer not in s.moe_layers:
            raise ValueError(f"{iv.spec}: layer {iv.layer} has no router (MoE layers: {list(s.moe_layers)})")
        if iv.kind in ROUTING and not adapter.router(iv.layer).exact:
            raise ValueError(f"{iv.spec}: layer {iv.layer}'s routing rule is observed, not modelled: it cannot be "
                             "re-routed")
        if iv.expert is not None and not 0 <= iv.expert < s.n_routed_experts:
            raise ValueError(f"{iv.spec}: expert {iv.expert} out of range: the layer has experts "
                             f"0..{s.n_routed_experts - 1}")
        o_proj = getattr(adapter, "_o_proj", None)  # transformers: None for a layer without attention (Mamba, ...)
        if iv.kind == "scale_head" and o_proj is not None and o_proj[iv.layer] is None:
            raise ValueError(f"{iv.spec}: layer {iv.layer} has no attention heads")
        if iv.head is not None and not 0 <= iv.head < s.n_heads:
            raise ValueError(f"{iv.spec}: head {iv.head} out of range: the layer has heads 0..{s.n_heads - 1}")
        if iv.kind == "router_bias" and len(iv.values) != s.n_routed_experts:
            raise ValueError(f"{iv.spec}: {len(iv.values)} values for {s.n_routed_experts} experts")
        if iv.kind == "scale":
            try:
                adapter.module.get_submodule(iv.path)
            except AttributeError:
                raise ValueError(f"{iv.spec}: the model has no module {iv.path!r} (module paths as "
                                 "model.named_modules() names them)") from None
        if iv.kind == "force":
            forced.setdefault(iv.layer, set()).add(iv.expert)
        if iv.kind == "ban":
            banned.setdefault(iv.layer, set()).add(iv.expert)
    for layer, experts in banned.items():
        if len(experts) > s.n_routed_experts - s.top_k:
            raise ValueError(f"layer {layer}: {len(experts)} experts banned, the router must still choose {s.top_k} "
                             f"of {s.n_routed_experts}")
    for layer, experts in forced.items():
        if experts & banned.get(layer, set()):
            raise ValueError(f"layer {layer}: expert(s) {sorted(experts & banned[layer])} both forced and banned")
        if len(experts) > s.top_k:
            raise ValueError(f"layer {layer}: {len(experts)} experts forced, the router chooses {s.top_k}")


@contextlib.contextmanager
def applied(adapter, interventions: Iterable) -> Iterator[None]:
    """Apply ``interventions`` (specs or ``Intervention``) to ``adapter``'s model for the block; removed on exit,
    whatever happens inside. Nothing is attached when the list is empty."""
    import torch  # lazy: declaring and parsing interventions needs no torch; applying them does

    from workbench.capture.adapters.base import first_output, replace_first_output  # lazy: imports torch

    ivs = normalize(interventions)
    if not ivs:
        yield
        return
    check(adapter, ivs)
    n_exp = adapter.summary.n_routed_experts
    by_layer: dict[int, list[Intervention]] = {}
    heads: dict[int, list[Intervention]] = {}
    for iv in ivs:
        if iv.kind in ROUTING:
            by_layer.setdefault(iv.layer, []).append(iv)
        elif iv.kind == "scale_head":
            heads.setdefault(iv.layer, []).append(iv)
    plans: dict[int, tuple] = {}
    for layer, group in by_layer.items():
        keep = torch.ones(n_exp, dtype=torch.bool)
        extra = torch.zeros(n_exp, dtype=torch.float32)
        forced = torch.zeros(n_exp, dtype=torch.bool)
        for iv in group:
            if iv.kind == "ban":
                keep[iv.expert] = False
            elif iv.kind == "boost":
                extra[iv.expert] += iv.value
            elif iv.kind == "router_bias":
                extra += torch.tensor(iv.values, dtype=torch.float32)
            else:
                forced[iv.expert] = True
        plans[layer] = (keep, extra, forced)

    def route(layer: int, r) -> None:
        plan = plans.get(layer)
        if plan is None:
            return
        keep, extra, forced = plan
        n = r.indices.size(0)
        if not keep.all():  # every row: with group-limited routing a banned expert moves its group's score too
            r.remove(keep.to(r.logits.device)[None].expand(n, -1))
        if extra.any():
            r.add_selection(extra)
        if forced.any():  # the final choice: the forced experts, then the best others under every edit so far
            m = r.math
            bias = m.bias.float().to(r.logits.device) if m.bias is not None else None
            if r.extra is not None:
                bias = r.extra if bias is None else bias + r.extra
            sel = m.selection(r.logits, bias=bias, keep=r.keep)
            sel = sel.masked_fill(forced.to(sel.device)[None], float("inf"))
            idx = sel.topk(m.top_k, dim=-1)[1]
            r.force(torch.ones(n, dtype=torch.bool), idx, m.weights_for(r.logits, idx))

    def head_out(layer: int, z):  # [B, T, H, d]
        group = heads.get(layer)
        if not group:
            return None
        factor = torch.ones(z.size(2), dtype=z.dtype, device=z.device)
        for iv in group:
            factor[iv.head] *= iv.value
        return z * factor[None, None, :, None]

    seams = {}
    if plans:
        seams["route"] = route
    if heads:
        seams["head_out"] = head_out
    handles = []
    try:
        for iv in ivs:
            if iv.kind == "scale":
                mod = adapter.module.get_submodule(iv.path)
                handles.append(mod.register_forward_hook(
                    lambda _m, _a, out, f=iv.value: replace_first_output(out, first_output(out) * f)))
        with adapter.seams(seams):
            yield
    finally:
        for h in handles:
            h.remove()
