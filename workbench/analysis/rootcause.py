"""Root cause of one token: which earlier tokens, heads and experts made the model produce it.

The target is ``log p(token[pos] | tokens[:pos])`` under the run's model (the adapter a run was
recorded with, else its checkpoint), recomputed with a full forward pass without the KV cache. Every
model goes through its adapter's seams (workbench/adapters), so the same code explains our
``Transformer`` and every ``transformers`` family the adapters cover.

- Source tokens: layer Integrated Gradients over the input embedding's output (the sums of captum's
  ``LayerIntegratedGradients``, computed here in batched forward-backward passes) from a baseline of
  ``<|endoftext|>`` tokens (id 0), Gauss-Legendre quadrature, with the convergence delta
  (``sum(attr) - (f(x) - f(baseline))``) stored beside every token score.
  MoE caveat: top-k routing is piecewise constant along the integration path, so plain IG ("plain")
  integrates a discontinuous function and its completeness breaks, whatever the number of steps.
  Routing-frozen IG ("frozen") fixes every gate's expert choice to the one it made on the real input
  (the adapter's ``route`` seam); the gate weights are still computed from the router logits of the
  interpolated input (``RouterMath.weights_for``), so they stay differentiable and the frozen
  function is smooth: completeness holds to quadrature accuracy. At the real input the frozen and the
  real model agree exactly, so f(x) is the real target. "auto" = frozen for MoE models, plain for
  dense ones.
- Components: ablation (the sums of captum's ``FeatureAblation``) over a mask with one entry per attention head,
  routed expert and shared-expert block; each perturbation is one row of a batched forward, which joins the
  batch at its own layer (the layers before it run once, for the unablated row). A head is ablated by
  zeroing its output (its slice of the attention output projection's input, the ``head_out`` seam),
  the shared experts likewise (``shared_out``). A routed expert is ablated the MoE way: removed from
  the router's choice (its selection score set to -inf before the biased, group-limited top-k, by the
  layer's ``RouterMath``), so the router sends its tokens to the next-best expert, as if the
  expert did not exist. Zeroing its output instead would leave a hole that no trained MoE ever sees
  and would not undo a router that is biased toward it. A layer's router (kind ``router``) is ablated
  by removing its selection bias (DeepSeek-V3's aux-loss-free balancing term): the experts are chosen
  by raw affinity, the gate weights are unchanged (they always come from the raw scores); its score
  says how much the balancing bias, or a bias gone wrong, shaped the token. Only families with a
  selection bias have router components. Routing is otherwise free, so an ablation's effect includes the
  re-routing it causes downstream.

Scores share one unit, nats of the target logprob, so one ranking covers every kind: a token's score
is its IG attribution (the token rows of a frozen run add up to f(x) - f(baseline)), a component's is
f(x) - f(x without it), the drop in the target's logprob when it is removed (negative: removing it
would make the token more likely). Rows are ranked by absolute score (rank 1 = most responsible).

Without a reference, one more kind of evidence: how unusual each component's activations are. Where the model
has an activation profile (workbench.analysis.activations: ``workbench profile`` makes one; the demo ships
one) one teacher-forced forward over the context measures every component against it (input norms, KV latent,
heads and their attention's reach, attention / MLP blocks, shared experts, what each layer adds to the
stream, each expert's router logit; run-level calibrated, two-sided, Bonferroni within each family of rows, a
part downstream of a clearly unusual part of its layer capped below it), and routing that disagrees with the
router's own logits is named; of the recorded signals' profile only the never-chosen experts are then used, and
only where the activation profile has no selection-rate cells (``chosen``: calibrated on clean contexts of each
length, they judge an expert that is never chosen too).
Otherwise, against the model's baseline profile (workbench.analysis.baseline, ``load_profile``; rows of method ``profile``), two-sided,
from the signals the run recorded over the explained token's context: a head's output norm (``head_norm``,
too large or too small, a dead head), its attention's normalised entropy (``norm_entropy``: collapsed or
flattened; every head of a layer off the same way gives an ``attn_block`` row scored with their surprises
summed), each block's log change of
the residual norm (``log_resid_growth``, kind ``resid``: where the stream went off, the token's own scale
cancels; older profiles: the jump of the norm's z from the block before), the cached KV latent's norm
(``latent_norm``, kind ``kv_latent``) and each expert's share of its layer's routed slots (``expert_share``:
only an expert never chosen where the profile expects 3 slots or more: routing counts vary between prompts
far more than Poisson draws, so an expert chosen 3 times its share is ordinary on a repetitive prompt). Beside
them, without any profile, the weight rows: the target token's output-projection row and the context
tokens' embedding rows, against the model's other rows (robust z of the log norm; kinds ``unembed`` and
``embed``, ``row_evidence``). A profile
row's score is its surprise in nats, signed (+ too large, - too small): z^2 / 2 for a Gaussian cell
(z = (mean over the context - profile mean) / profile std, norms on the log scale where the profile has
their ``log_*`` cells), m for a never-chosen expert where m slots were expected (the Poisson log-likelihood
ratio at k = 0). The z of a mean over the context is deliberately not scaled by the square root of the number of
positions (a token's activations are strongly correlated along a run): a component off by one std at every
position scores as one odd position would, so the surprise understates a run-wide shift rather than inflate it.

The ranking rule without a reference, so that no kind of row crowds out another: three lists, each ordered
by its own |score| (profile rows with at least 2 nats of surprise, components by ablation, source tokens
by IG), take turns: rank 1 is the most unusual component, rank 2 the component whose removal moves the
target most, rank 3 the most responsible token, then round again (a list that runs out drops out; a component
a list names again, unusual and its removal mattering, takes no second turn: that row follows the turns, and
profile rows under 2 nats follow at the end). A token's +6 nats can then never push every component out of
the top 3, nor a component every token. One addition to the profile list: a routed expert whose own contribution
is unusual (too heavy-tailed over its few positions to be a row alone) becomes a profile row where its ablation
moves the target by at least a quarter of what the most important component's does (``corroborated``), and
an unusual MoE block names the one expert of its layer whose removal moves the target that much and twice any
other expert of the layer (``behind_block``: a swapped or sign-flipped expert keeps its outputs' size).
Inside the profile list (``_profile_turns``): rows within a quarter of each other's surprise (``TIE``) put the
earlier layer first, since a fault upstream shows downstream too and a surprise read off a few positions is that
noisy; and a layer row (attention or MLP block, what the layer adds to the stream) shares its turn with the most
unusual of its own parts in the list (a head, an expert, the router, an input norm, the block under ``resid``),
the part first: the part says where in the layer, the layer row how much.

Against a reference (``reference=``: a known-good run, module or checkpoint of the same architecture,
e.g. the model before a fine-tune, quantisation or routing change) the default is activation patching
(workbench.analysis.patching: which component, taken from the reference, gives the token back; columns
score and restored). With ``method="attribution_diff"`` the same attributions are computed
under the reference model on this run's tokens and subtracted, so a score says how much more (or
less) that token or component pushes the target here than in the reference. Components that matter
as much in both (the model's ordinary machinery) cancel; what changed stands out, even when the
change is small next to the ordinary effects (a router biased toward one expert moves a token by
well under a nat on the demo model). Methods get a ``_vs_reference`` suffix.
"""
from __future__ import annotations

import contextlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import polars as pl
import torch

from workbench.analysis import activations
from workbench.analysis.baseline import bucket_of, load_profile, resid_growth
from workbench.analysis.patching import last_position_only, patch_causes
from workbench.capture.adapters import Adapter, Route, adapter_for, load_adapter
from workbench.capture.resolve import load_for_run
from workbench.data import query
from workbench.model import file_sha256

MODES = ("auto", "frozen", "plain")
METHOD = {"frozen": "ig_routing_frozen", "plain": "ig_plain"}
COLUMNS = ["target_pos", "kind", "layer", "head", "expert", "source_pos", "score", "rank", "method", "delta",
           "restored"]
METHODS = ("patching", "attribution_diff", "ablation")  # with a reference: the first two; without: ablation


def target_fn(adapter: Adapter, target_id: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(ids[B, T]) -> [B]``: logprob of ``target_id`` after the last position."""
    def f(ids: torch.Tensor) -> torch.Tensor:
        logits = adapter.forward(ids)[:, -1].float()  # [B, V]
        return torch.log_softmax(logits, dim=-1)[:, target_id]
    return f


Progress = Callable[[str, int, int], None]  # (phase, done, total): root_cause's progress reports


def real_routing(model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The expert indices [T, K] every MoE layer chooses on ``ids`` [1, T] (a module or an adapter)."""
    return adapter_for(model).routing_of(ids)


@contextlib.contextmanager
def frozen_routing(model, indices: dict[int, torch.Tensor]) -> Iterator[None]:
    """Force every MoE layer to choose the experts in ``indices`` ({layer: [T, K]}) for any batch size.

    Routed rows are batch-major ([B*T]), so the recorded [T, K] are tiled B times; the weights are the
    router's for those experts, computed from this forward's logits (differentiable).
    """
    adapter = adapter_for(model)

    def force(layer: int, r: Route) -> None:
        real = indices.get(layer)
        if real is None:
            return
        n = r.indices.size(0)
        if n % real.size(0):
            raise ValueError(f"routing-frozen forward: {n} routed rows are not a multiple of the "
                             f"{real.size(0)} recorded tokens")
        r.freeze(real.to(r.indices.device).repeat(n // real.size(0), 1))

    if not indices:
        yield
        return
    with adapter.seams({"route": force}):
        yield


def gauss_legendre(steps: int) -> tuple[list[float], list[float]]:
    """(alphas in (0, 1), step sizes summing to 1): the Gauss-Legendre points of captum's "gausslegendre"."""
    x, w = np.polynomial.legendre.leggauss(steps)
    return (0.5 * (1 + x)).tolist(), (0.5 * w).tolist()


def integrated_gradients(model, ids: torch.Tensor, target_id: int, *, steps: int = 32,
                         mode: str = "frozen", batch_size: int | None = 16,
                         baseline_token: int = 0, progress: Progress | None = None) -> tuple[np.ndarray, float, float]:
    """IG of the target over the input embedding for each input token (a module or an adapter).

    Layer IG over the embedding's output (what captum's ``LayerIntegratedGradients`` with ``method="gausslegendre"``
    computes, the same sums): the output is replaced by ``b + alpha (x - b)`` at each Gauss-Legendre point, a
    batch of points per forward and backward (``batch_size`` points, all when None); the attribution is
    ``(x - b) * sum_i w_i grad_i``, the convergence delta ``sum(attr) - (f(x) - f(baseline))``. Cost: the
    routing forward (frozen), one forward of the input and baseline together, and ``steps / batch_size``
    forward-backward passes; the output projection runs on the last position only.

    Args:
        ids: [1, T] input tokens (the target token follows them).
        mode: "frozen" (routing-frozen) or "plain".
    Returns: (attribution per token [T], convergence delta, f(x) - f(baseline)).
    """

    if mode not in ("frozen", "plain"):
        raise ValueError(f"mode must be 'frozen' or 'plain' here, got {mode!r}")
    adapter = adapter_for(model)
    f = target_fn(adapter, target_id)
    base = torch.full_like(ids, baseline_token)
    frozen = adapter.routing_of(ids) if mode == "frozen" else {}
    alphas, sizes = gauss_legendre(steps)
    chunk = steps if batch_size is None else max(1, batch_size)
    emb = adapter.embedding()
    state: dict = {"out": None}

    def swap(_m, _args, _out):  # the embedding's output: this batch's interpolated rows
        return state["out"]

    with adapter.analysis(), frozen_routing(adapter, frozen), last_position_only(adapter):
        with torch.no_grad():
            x_emb, b_emb = emb(ids), emb(base)  # [1, T, D]
            ends = f(torch.cat([ids, base]))  # f(x), f(baseline)
        total = torch.zeros_like(x_emb)
        handle = emb.register_forward_hook(swap)
        try:
            for k in range(0, steps, chunk):
                a = alphas[k:k + chunk]
                scaled = torch.cat([b_emb + al * (x_emb - b_emb) for al in a], dim=0).requires_grad_()
                state["out"] = scaled
                (grad,) = torch.autograd.grad(f(ids.expand(len(a), -1)).sum(), scaled)
                w = torch.tensor(sizes[k:k + chunk]).float().to(grad.device).view(-1, *([1] * (grad.ndim - 1)))
                total = total + (grad * w).sum(0, keepdim=True)
                state["out"] = None
                if progress is not None:
                    progress("integrated gradients", min(k + chunk, steps), steps)
        finally:
            handle.remove()
        attr = (total * (x_emb - b_emb)).detach()
    gap = ends[0] - ends[1]
    delta = attr.sum() - gap
    return attr.sum(-1)[0].double().cpu().numpy(), float(delta), float(gap)


def components(model) -> list[tuple[str, int, int | None, int | None]]:
    """(kind, layer, head, expert) for every head, routed expert, shared-expert block and router."""
    return adapter_for(model).components()


def component_ablation(model, ids: torch.Tensor, target_id: int, batch_size: int = 16,
                       progress: Progress | None = None) -> tuple[list[tuple], np.ndarray]:
    """Effect on the target of removing each component, f(x) - f(x without it).

    Each forward holds one row of the unablated input (row 0, f(x)) and up to ``batch_size - 1`` components, one
    row each, in layer order; a component's row joins the batch at its own layer's block as a copy of row 0 (the
    layers before it are the same for every row, so they run once), and the output projection reads the last
    position only. Same sums as captum's ``FeatureAblation`` over a one-per-component mask, a fraction of the rows.

    Returns: (components, effects [C] in nats).
    """

    adapter = adapter_for(model)
    comps = adapter.components()
    col = {c: k for k, c in enumerate(comps)}
    seq = ids.size(1)
    state: dict = {"mask": None, "layers": set()}
    s = adapter.summary

    def rows_of(n: int, device) -> torch.Tensor:  # batch row of each routed row (batch-major)
        return torch.arange(n, device=device) // seq

    def heads(layer: int, z: torch.Tensor) -> torch.Tensor | None:  # z: [B, T, H, d], B: the rows at this layer
        if layer not in state["layers"]:
            return None
        cols = [col[("head", layer, h, None)] for h in range(z.size(2))]
        return z * state["mask"][: z.size(0), cols].to(z)[:, None, :, None]

    def route(layer: int, r: Route) -> None:
        if layer not in state["layers"]:
            return
        mask = state["mask"]
        rows = rows_of(r.indices.size(0), mask.device)
        keep = mask[:, [col[("expert", layer, None, j)] for j in range(s.n_routed_experts)]][rows] > 0.5  # [N, E]
        if not keep.all():
            r.remove(keep)
        rc = col.get(("router", layer, None, None))
        if rc is not None and (mask[:, rc] < 0.5).any():
            r.unbias(mask[rows, rc])  # 0: this row's router loses its selection bias

    def shared(layer: int, out: torch.Tensor) -> torch.Tensor | None:  # out: [B*T, D]
        if layer not in state["layers"]:
            return None
        rows = rows_of(out.size(0), state["mask"].device)
        return out * state["mask"][rows, col[("shared_expert", layer, None, None)]].to(out)[:, None]

    blocks = [adapter.parts(i)["block"] for i in range(s.n_layers)]

    def join(layer: int):  # the rows of this layer's components enter here, copies of row 0
        def hook(_m, args, kwargs):
            n = state["joins"].get(layer, 0)
            if not n:
                return None
            h = args[0] if args else kwargs["hidden_states"]
            h = torch.cat([h, h[:1].expand(n, *h.shape[1:])], dim=0)
            return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
        return hook

    f = target_fn(adapter, target_id)
    per = max(1, batch_size - 1)
    effects = np.zeros(len(comps))
    # first of the blocks' pre-hooks: a fault's or an intervention's own sees the joined rows
    handles = [b.register_forward_pre_hook(join(i), with_kwargs=True, prepend=True) for i, b in enumerate(blocks)]
    try:
        with adapter.analysis(), torch.no_grad(), adapter.seams({"head_out": heads, "route": route, "shared_out": shared}), \
                last_position_only(adapter):
            for k in range(0, len(comps), per):
                chunk = comps[k:k + per]
                mask = torch.ones(1 + len(chunk), len(comps), device=ids.device)
                for n, c in enumerate(chunk):
                    mask[1 + n, col[c]] = 0.0
                joins: dict[int, int] = {}
                for c in chunk:
                    joins[c[1]] = joins.get(c[1], 0) + 1
                state.update(mask=mask, layers=set(joins), joins=joins)
                out = f(ids).double().cpu().numpy()  # [1 + len(chunk)]
                effects[k:k + len(chunk)] = out[0] - out[1:]
                if progress is not None:
                    progress("ablation", k + len(chunk), len(comps))
    finally:
        for h in handles:
            h.remove()
    return comps, effects


def rank_causes(token_scores: np.ndarray, token_method: str, delta: float, comps: list[tuple],
                effects: np.ndarray, target_pos: int, component_method: str = "ablation") -> pl.DataFrame:
    """One frame ranked by |score| across source tokens and components (NaN scores rank last)."""
    n = len(token_scores)
    return _ranked(pl.DataFrame({
        "target_pos": [target_pos] * (n + len(comps)),
        "kind": ["token"] * n + [c[0] for c in comps],
        "layer": [None] * n + [c[1] for c in comps],
        "head": [None] * n + [c[2] for c in comps],
        "expert": [None] * n + [c[3] for c in comps],
        "source_pos": list(range(n)) + [None] * len(comps),
        "score": np.concatenate([token_scores, effects]).astype(np.float64),
        "method": [token_method] * n + [component_method] * len(comps),
        "delta": [delta] * n + [None] * len(comps),
        "restored": [None] * (n + len(comps)),
    }, schema=_SCHEMA))


_SCHEMA = {"target_pos": pl.Int32, "kind": pl.Utf8, "layer": pl.Int32, "head": pl.Int32, "expert": pl.Int32,
           "source_pos": pl.Int32, "score": pl.Float64, "method": pl.Utf8, "delta": pl.Float64,
           "restored": pl.Float64}


def _ranked(frame: pl.DataFrame) -> pl.DataFrame:
    key = pl.col("score").fill_nan(None).abs()
    frame = frame.sort(key, descending=True, nulls_last=True, maintain_order=True)
    return frame.with_columns(pl.arange(1, frame.height + 1, dtype=pl.Int32).alias("rank")).select(COLUMNS)


PARENTS = {"attn_block": ("head", "attn_norm", "kv_latent", "rotary"),
           "mlp_block": ("expert", "shared_expert", "router", "mlp_norm"), "dense_mlp": ("mlp_norm",),
           "resid": ("attn_block", "mlp_block", "dense_mlp")}
EXPLAINED = 0.8  # a layer row one of its parts explains to this fraction ranks right after that part


def _order(sites: list[tuple], scores: np.ndarray, gap: float | None = None) -> np.ndarray:
    """The value patching rows are ranked by.

    With the gap known, a row's value is how exactly its patch reproduces the reference: |gap| (1 - |1 - c|),
    c = score / |gap| the fraction of the gap it closes (a patch that overshoots to 150% explains the token no
    better than one that closes 50%), floored at 0; without it, |score|. Then a layer row (attn_block, mlp_block,
    dense_mlp; resid last) that parts of its own layer explain (each part at ``EXPLAINED`` of its value or more)
    takes a value just below the lowest of those parts, so the parts (the head, the expert, the norm) are named
    first and the layer row follows them."""
    s = np.nan_to_num(np.asarray(scores, np.float64), nan=0.0)
    if gap is not None and abs(gap) > 1e-6:
        v = abs(gap) * np.clip(1 - np.abs(1 - s / abs(gap)), 0.0, None)
    else:
        v = np.abs(s)
    for parent in ("attn_block", "mlp_block", "dense_mlp", "resid"):
        for n, k in enumerate(sites):
            if k[0] != parent or v[n] <= 0:
                continue
            kids = [v[m] for m, c in enumerate(sites) if c[1] == k[1] and c[0] != "resid"
                    and (c[0] in PARENTS[parent] or (parent == "resid" and c[0] != k[0]))
                    and v[m] >= EXPLAINED * v[n]]
            if kids:
                v[n] = min(kids) * (1 - 1e-9)
    return v


def rank_patching(sites: list[tuple], scores: np.ndarray, restored: np.ndarray, target_pos: int,
                  gap: float | None = None) -> pl.DataFrame:
    """One frame of ``patch_causes`` results ranked by how much of the gap they close (nats; tokens and
    components on one scale), a layer row after the parts of it that explain it (``_order``)."""
    n = len(sites)
    order = np.argsort(-_order(sites, scores, gap), kind="stable")
    sites = [sites[i] for i in order]
    scores, restored = np.asarray(scores, np.float64)[order], np.asarray(restored, np.float64)[order]
    frame = pl.DataFrame({
        "target_pos": [target_pos] * n, "kind": [k[0] for k in sites], "layer": [k[1] for k in sites],
        "head": [k[2] for k in sites], "expert": [k[3] for k in sites], "source_pos": [k[4] for k in sites],
        "score": scores, "method": ["patching"] * n, "delta": [None] * n, "restored": restored}, schema=_SCHEMA)
    return frame.with_columns(pl.arange(1, n + 1, dtype=pl.Int32).alias("rank")).select(COLUMNS)


def reference_adapter(reference, store, info: dict, like: Adapter) -> Adapter:
    """The known-good model to compare the run ``info`` with, checked against the run's model ``like``.

    Args:
        reference: a run id of ``store``, a module or adapter, or a checkpoint folder.
    """
    return _reference(reference, store, info, like)[0]


def _reference(reference, store, info: dict, like: Adapter) -> tuple[Adapter, list[int] | None]:
    """(the reference model, the reference run's tokens when ``reference`` is a run, else None)."""

    same = (f"would be the same model on the same tokens as run {info['run_id']} (same weights, dtype and "
            "tokens): every score would be 0; pick a run or checkpoint of a different model, dtype or prompt")
    ids = query.table(store, "tokens", info["run_id"], "pos", cols=["token_id"])["token_id"].to_list()
    if isinstance(reference, (str, Path)) and not (Path(reference) / "config.json").exists():
        try:
            ref_info = query.run_row(store, str(reference))
        except query.RunNotFound:
            raise ValueError(f"reference {str(reference)!r} is neither a run in {store.path} nor a checkpoint "
                             "folder (config.json + model.safetensors)") from None
        ref_ids = query.table(store, "tokens", ref_info["run_id"], "pos", cols=["token_id"])["token_id"].to_list()
        # a twin run of the same weights is a fine reference when its dtype or its tokens differ (fp32 for a
        # bf16 run; the same model on an edited prompt)
        if (ref_info.get("checkpoint_sha256") == info.get("checkpoint_sha256") and ref_info.get("dtype") == info.get("dtype")
                and ref_ids == ids):
            raise ValueError(f"reference run {ref_info['run_id']} {same}")
        if ref_info.get("checkpoint_sha256") == info.get("checkpoint_sha256") and ref_info.get("dtype") == info.get("dtype"):
            ref = like  # the same model on another prompt: patching compares the two forwards
        else:
            ref = load_for_run(ref_info, verify=False)
        tokens = ref_ids
    elif isinstance(reference, (str, Path)):
        if file_sha256(reference) == info.get("checkpoint_sha256") and info.get("dtype") == "float32":
            raise ValueError(f"reference checkpoint {reference} {same}")
        ref = load_adapter(reference)
    else:
        ref = adapter_for(reference)
    if not isinstance(reference, (str, Path)) or (Path(reference) / "config.json").exists():
        tokens = None
    if ref.module is like.module and tokens is None:
        raise ValueError("the reference is the run's own model: pass a different (known-good) model or run")
    if ref.summary.vocab_size != like.summary.vocab_size:
        raise ValueError("the reference model has a different vocabulary; root cause compares two models of one "
                         "architecture on the same tokens")
    if ref.components() != like.components():
        raise ValueError("the reference model has different layers, heads or experts than the run's model")
    return ref, tokens


def suspects(causes: pl.DataFrame, findings: pl.DataFrame) -> pl.DataFrame:
    """Components ranked by all the evidence: those a finding names come first (in the findings' order),
    then the rest by their root-cause rank.

    Args:
        causes: a ``root_cause`` ranking (its component rows are used).
        findings: the run's findings (``Run.findings()``).
    Returns: rank, kind, layer, head, expert, score (the component's root-cause score), cause_rank, finding
        (the naming finding's rank, NULL if none), evidence (that finding's explanation). A ``cache_mismatch``
        finding adds a ``kv_cache`` row (its layer's KV cache as the recorded run read it; no score: root cause
        recomputes without the cache).
    """
    comps = causes.filter(pl.col("kind") != "token").select("kind", "layer", "head", "expert", "score",
                                                           pl.col("rank").alias("cause_rank"))
    named: dict[tuple, tuple[int, str]] = {}
    for f in findings.iter_rows(named=True):
        if f["severity"] == "info":
            continue
        keys: list[tuple] = []
        if f["component"] == "head":
            keys = [("head", f["layer"], f["head"], None)]
        elif f["component"] == "expert":
            keys = [("expert", f["layer"], None, f["expert"]), ("router", f["layer"], None, None)]
        elif f["component"] in ("shared_expert", "mlp"):
            keys = [("shared_expert", f["layer"], None, None)]
        elif f["component"] == "router":
            keys = [("router", f["layer"], None, None)]
        elif f["component"] == "kv" and "cache_mismatch" in (f["kinds"] or []):
            keys = [("kv_cache", f["layer"], None, None)]  # no root-cause row: it recomputes without the cache
        for k in keys:
            named.setdefault(k, (f["rank"], f["explanation"]))
    cache = [k for k in named if k[0] == "kv_cache"]
    if cache:  # what only the recorded path had: a suspect of its own, named by its finding alone
        cols = ("kind", "layer", "head", "expert")
        rows = pl.DataFrame([dict(zip(cols, k)) for k in cache], schema={c: comps.schema[c] for c in cols})
        comps = pl.concat([comps, rows], how="diagonal_relaxed")
    key = [tuple(r) for r in comps.select("kind", "layer", "head", "expert").iter_rows()]
    comps = comps.with_columns(pl.Series("finding", [named.get(k, (None, None))[0] for k in key], pl.Int32),
                               pl.Series("evidence", [named.get(k, (None, None))[1] for k in key], pl.Utf8))
    comps = comps.sort(pl.col("finding").is_null(), pl.col("finding"), pl.col("cause_rank"), nulls_last=True)
    return comps.with_columns(pl.arange(1, comps.height + 1, dtype=pl.Int32).alias("rank")).select(
        "rank", "kind", "layer", "head", "expert", "score", "cause_rank", "finding", "evidence")


def sampler_note(store, run_id: str, pos: int) -> str | None:
    """A line saying the token at ``pos`` was the sampler's draw, not the model's choice, when the run sampled
    (temperature > 0) and the model ranked another token first: why a sampled token is there is the sampler first,
    whatever the components did. With the chance of a draw this unlikely (``anomalies.sampler_p``). None otherwise
    (greedy, the model's first choice, a prompt token, no such position)."""
    from workbench.analysis.anomalies import Sampler, sampler_p  # lazy: the detectors beside root cause

    info = query.run_row(store, run_id)
    sampler = Sampler.of_run(info, query.model_summary(info).vocab_size)
    if sampler is None or sampler.temperature <= 0:
        return None
    t = query.tokens(store, run_id).filter(pl.col("pos") == int(pos))
    if not t.height or t["is_prompt"][0]:
        return None
    r = t.row(0, named=True)
    if r["rank"] is None or r["rank"] <= 1 or r["prob"] is None:
        return None
    p = float(sampler_p([r["prob"]], [r["confidence"]], [r.get("topk_probs")], sampler.temperature, sampler.top_p,
                        sampler.vocab)[0])
    how = f"temperature {sampler.temperature:g}" + (f", top-p {sampler.top_p:g}" if sampler.top_p < 1 else "")
    if p == 0.0:  # past the nucleus: no draw at these settings gives it
        return (f"this token (p = {r['prob']:.3g}, rank {r['rank']}) lies outside what the sampler could draw at the "
                f"recorded settings ({how}): the recorded logits and the sampler disagree (another sampler, a forced "
                "token, or logits recorded from another computation than the one sampled)")
    return (f"the sampler drew this token ({how}): the model gave it p = {r['prob']:.3g}, its rank {r['rank']} (its "
            f"first choice had p = {r['confidence']:.3g}); a draw at most this likely happens with probability "
            f"{p:.2g} at these settings: the causes below explain the model's distribution, not this draw")


def cache_note(store, run_id: str) -> str | None:
    """A line saying the run's recorded probabilities are not what its model computes without the KV cache (the
    detectors' ``cache_mismatch`` row): root cause recomputes without the cache, so it explains another computation
    than the one that made the run. None without such a row (or without stored anomalies)."""
    try:
        hit = query.anomalies(store, run_id).filter(pl.col("kind") == "cache_mismatch")
    except Exception:  # noqa: BLE001 - an older database without the table: nothing to say
        return None
    if not hit.height:
        return None
    r = hit.row(0, named=True)
    where = f" of layer {r['layer']}" if r["layer"] is not None else ""
    return (f"this run's recorded probabilities are not what its model computes without the KV cache (up to "
            f"{r['score']:.2f} nats apart; anomaly cache_mismatch): root cause recomputes without the cache, so the "
            f"causes below explain the cache-free model, not the recorded tokens; look at the KV cache{where} (a "
            "corrupted cache entry, a decode kernel, a hook active while recording)")


def ig_check(df: pl.DataFrame, steps: int | None = None, tolerance: float = 0.05) -> str | None:
    """A warning when a ranking's Integrated Gradients did not converge: |delta| over ``tolerance`` of
    |f(x) - f(baseline)| (token rows sum to that gap plus delta). None when it converged (or has no IG rows)."""
    tok = df.filter(pl.col("kind") == "token")
    if tok.height == 0 or tok["delta"][0] is None or not np.isfinite(tok["delta"][0]):
        return None
    delta = float(tok["delta"][0])
    gap = float(tok["score"].sum()) - delta
    if abs(delta) <= tolerance * max(abs(gap), 1e-9):
        return None
    more = f"; try --steps {2 * steps}" if steps else "; try twice the steps"
    return (f"IG did not converge: convergence delta {delta:+.3g} is {abs(delta) / max(abs(gap), 1e-9):.0%} of "
            f"f(x) - f(baseline) = {gap:+.3g} (over {tolerance:.0%}){more}")


SIGNIFICANT = 2.0  # nats of surprise: profile rows under it follow the interleaved ranking instead of leading it


STARVED = 3.0  # expert-share evidence: the slots the profile expects of an expert this run never chose


def _surprise(z: np.ndarray) -> np.ndarray:
    return np.sign(z) * z * z / 2


def _heads_and_block(z: pl.DataFrame) -> list[tuple[tuple, float]]:
    """Rows for each head's z (columns layer, head, z), and an ``attn_block`` row for a layer whose heads are
    all off the same way (its input norm, rotation or KV latent, not one head)."""
    out = [(("head", r["layer"], r["head"], None, None), float(_surprise(np.array(r["z"]))))
           for r in z.iter_rows(named=True)]
    both = z.group_by("layer").agg((pl.col("z").sign().sum().abs() == pl.len()).alias("same"))
    total = {}
    for (_, layer, *_), v in out:
        total[layer] = total.get(layer, 0.0) + v
    # the block's surprise: its heads' together (they are off the same way, so one cause explains them all)
    return out + [(("attn_block", layer, None, None, None), float(total[layer]))
                  for layer, same in both.sort("layer").iter_rows() if same]


def profile_evidence(store, run_id: str, pos: int, profile: pl.DataFrame,
                     only_routing: bool = False) -> list[tuple[tuple, float]]:
    """((kind, layer, head, expert, source_pos), signed surprise in nats) of every component the profile covers,
    from the run's recorded signals over the context of the token at ``pos`` (positions < pos). ``only_routing``:
    only the never-chosen experts (where the components' activations are profiled too, workbench.analysis
    .activations, they judge the rest)."""
    out: list[tuple[tuple, float]] = []

    def cells(signal: str) -> pl.DataFrame:
        return profile.filter(pl.col("signal") == signal).select(
            "layer", "head", "expert", "bucket", "mean", pl.col("std").clip(lower_bound=1e-6))

    def norm_cells(signal: str, col: str) -> tuple[pl.DataFrame, pl.Expr]:
        """A norm's cells on the log scale where the profile has them (norms have heavy tails), else raw."""
        logged = cells("log_" + signal)
        if logged.height:
            return logged, pl.col(col).clip(lower_bound=1e-30).log()
        return cells(signal), pl.col(col)

    def read(table: str) -> pl.DataFrame:
        got = query.signal(store, table, run_id)  # empty for a run recorded without that probe
        return got.filter(pl.col("pos") < pos) if got.height else got

    def read_all(table: str) -> pl.DataFrame:  # only_routing: the tables it would discard are not read
        return pl.DataFrame() if only_routing else read(table)

    hn, (hp, hv) = read_all("head_norm"), norm_cells("head_norm", "norm")
    if hn.height and hp.height:
        z = hn.join(hp.drop("expert", "bucket"), on=["layer", "head"]).group_by("layer", "head").agg(
            ((hv - pl.col("mean")) / pl.col("std")).mean().alias("z")).sort("layer", "head")
        out += _heads_and_block(z)
    at, ap = read_all("attention"), cells("norm_entropy")
    if at.height and ap.height and not only_routing:  # collapsed (too low) or flattened (too high) attention
        at = at.filter(pl.col("norm_entropy").is_not_null()).with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
        z = at.join(ap.drop("expert"), on=["layer", "head", "bucket"]).group_by("layer", "head").agg(
            ((pl.col("norm_entropy") - pl.col("mean")) / pl.col("std")).mean().alias("z")).sort("layer", "head")
        out += _heads_and_block(z)
    rn, gp = read_all("resid_norm"), cells("log_resid_growth")
    if rn.height and gp.height:  # each block's log change of the norm: the token's own scale cancels
        g = resid_growth(rn.with_columns(bucket_of(pl.col("pos") + 1).alias("bucket")))
        z = g.join(gp.drop("head", "expert"), on=["layer", "bucket"]).group_by("layer").agg(
            ((pl.col("growth") - pl.col("mean")) / pl.col("std")).mean().alias("z")).sort("layer")
        out += [(("resid", layer, None, None, None), float(_surprise(np.array(zl)))) for layer, zl in z.iter_rows()]
    elif rn.height:  # a profile without growth cells: each block's jump in the raw norm's z
        rp, rv = norm_cells("resid_norm", "norm")
        if rp.height:
            rn = rn.with_columns(bucket_of(pl.col("pos") + 1).alias("bucket"))
            z = rn.join(rp.drop("head", "expert"), on=["layer", "bucket"]).group_by("layer").agg(
                ((rv - pl.col("mean")) / pl.col("std")).mean().alias("z")).sort("layer")
            prev = 0.0
            for layer, zl in z.iter_rows():  # the jump from the block before: where the stream went off
                out.append((("resid", layer, None, None, None), float(_surprise(np.array(zl - prev)))))
                prev = zl
    kv, (kp, kv_v) = read_all("kv_tokens"), norm_cells("latent_norm", "latent_norm")
    if kv.height and kp.height and not only_routing:
        kv = kv.filter(pl.col("step") == pl.col("step").min())  # the prefill's cache: the prompt's tokens
        z = kv.join(kp.drop("head", "expert", "bucket"), on="layer").group_by("layer").agg(
            ((kv_v - pl.col("mean")) / pl.col("std")).mean().alias("z")).sort("layer")
        out += [(("kv_latent", layer, None, None, None), float(_surprise(np.array(zl)))) for layer, zl in z.iter_rows()]
    rt, ep = read("routing"), cells("expert_share")
    if rt.height and ep.height:
        slots = rt.group_by("layer").agg(pl.len().alias("slots"))
        got = rt.group_by("layer", "expert").agg(pl.len().alias("k"))
        z = ep.select("layer", "expert", "mean").join(slots, on="layer").join(got, on=["layer", "expert"], how="left")
        for layer, expert, share, n, k in z.select("layer", "expert", "mean", "slots", "k").sort(
                "layer", "expert").iter_rows():
            m, k = max(share * n, 1e-9), float(k or 0)
            # routing counts vary between prompts far more than Poisson draws (an expert chosen 3x its share is
            # ordinary on a repetitive prompt): only a never-chosen expert the profile expects counts
            if k == 0 and m >= STARVED:
                llr = (k * np.log(k / m) if k else 0.0) - k + m  # Poisson log-likelihood ratio
                out.append((("expert", layer, None, expert, None), float(np.sign(k - m) * llr)))
    return out


WEIGHT_Z = 6.0  # a router's selection bias this many robust stds from its siblings' is no balancing term
WEIGHT_NATS = 30.0  # the most a weight that is off by itself scores


def _robust_z(x: np.ndarray, floor: float = 1e-6) -> np.ndarray:
    """(x - median) / (1.4826 MAD), the MAD at least ``floor``."""
    med = np.median(x)
    return (x - med) / max(1.4826 * float(np.median(np.abs(x - med))), floor)


def row_evidence(model: Adapter, ids: list[int], target: int, rival: int | None = None) -> list[tuple[tuple, float]]:
    """Weight-space evidence (no profile needed): how far the target's output-projection row, and each context
    token's embedding row, lie from the model's other rows in log norm (a robust z over the vocabulary: median
    and 1.4826 MAD), as signed surprise in nats: an ``unembed`` row, and an ``embed`` row at the context
    position whose token's row is the most unusual. ``rival``: the token the model ranks first at the explained
    position where that is not the target (what displaced it): where its output row is the most unusual of the
    whole vocabulary (a frequent token's ordinary row never is) it gives the ``unembed`` row instead, less log 2
    (two rows were looked at). And each MoE layer's
    selection bias (DeepSeek-V3's balancing term, where the family has one): the expert whose bias lies at least
    ``WEIGHT_Z`` robust stds from the layer's other experts' (balancing moves them a little, together), and twice
    as far as any other expert's (a layer of many experts with a wide spread has outliers of its own), gives a
    ``router`` row with that expert, z^2 / 2 nats less the log of the number of biases, at most ``WEIGHT_NATS``."""
    out: list[tuple[tuple, float]] = []
    n_bias = model.summary.n_routed_experts * max(len(model.summary.moe_layers), 1)
    for layer in model.summary.moe_layers:
        bias = model.router(layer).bias
        if bias is None or bias.numel() < 4:
            continue
        z = _robust_z(bias.detach().float().cpu().numpy(), floor=1e-3)  # equal biases: a thousandth apart is none
        e = int(np.argmax(np.abs(z)))
        second = float(np.sort(np.abs(z))[-2])
        if abs(z[e]) >= max(WEIGHT_Z, 2 * second):  # one bias alone far out, not the tail of a wide spread
            nats = min(z[e] ** 2 / 2 - np.log(n_bias), WEIGHT_NATS)
            out.append((("router", layer, None, e, None), float(np.sign(z[e]) * nats)))
    with torch.no_grad():
        for kind, w in (("unembed", model.unembedding().weight), ("embed", model.embedding().weight)):
            if w.ndim != 2 or w.size(0) != model.summary.vocab_size:
                continue
            z = _robust_z(w.float().norm(dim=1).clamp_min(1e-30).log().cpu().numpy())
            if kind == "unembed":
                v = float(_surprise(np.array(z[target])))
                if rival is not None and rival != target and abs(z[rival]) >= np.abs(z).max() > abs(z[target]):
                    v = float(np.sign(z[rival]) * max(z[rival] ** 2 / 2 - np.log(2), 0.0))  # two rows looked at
                out.append((("unembed", None, None, None, None), v))
            elif ids:  # the most unusual of the context's rows: Bonferroni over them
                p = int(np.argmax(np.abs(z[ids])))
                nats = activations.log_tail(float(z[ids[p]])) - np.log(len(set(ids)))
                out.append((("embed", None, None, None, p), float(np.sign(z[ids[p]]) * max(nats, 0.0))))
    return out


CORROBORATE = 0.25  # an expert's ablation this share of the largest component's makes its own surprise a row


def corroborated(df: pl.DataFrame, own: dict) -> list[tuple[tuple, float]]:
    """Profile rows for the routed experts whose own contribution is unusual (``own``: activations.evidence's
    ``experts``, at least ``SIGNIFICANT`` nats) and whose removal moves the explained token by at least
    ``CORROBORATE`` of the most any component's does: two independent kinds of evidence naming one expert. Over
    the few positions that chose an expert its own surprise alone is too heavy-tailed to be a row."""
    comps = df.filter(pl.col("kind") != "token")
    if not comps.height or not own:
        return []
    top = float(comps["score"].abs().max() or 0.0)
    out = []
    for r in comps.filter(pl.col("kind") == "expert").iter_rows(named=True):
        v = own.get(("expert", r["layer"], None, r["expert"], None), 0.0)
        if top > 0 and abs(r["score"]) >= CORROBORATE * top and abs(v) >= SIGNIFICANT:
            out.append((("expert", r["layer"], None, r["expert"], None), v))
    return out


def behind_block(df: pl.DataFrame, evidence: list[tuple[tuple, float]]) -> list[tuple[tuple, float]]:
    """Profile rows for the expert behind an unusual MoE block that no expert's own activations single out (a
    swapped or sign-flipped expert keeps its outputs' size): where the block is a profile row (at least
    ``SIGNIFICANT``) and, of its layer's experts, one's removal moves the explained token by at least ``CORROBORATE``
    of the most any component's does and twice any other expert's of the layer, that expert gets the block's
    surprise (the ranking then puts it beside the block, ``_profile_turns``)."""
    comps = df.filter(pl.col("kind") != "token")
    top = float(comps["score"].abs().max() or 0.0) if comps.height else 0.0
    out = []
    for key, v in strongest(evidence):
        if key[0] != "mlp_block" or abs(v) < SIGNIFICANT or top <= 0:
            continue
        ex = comps.filter((pl.col("kind") == "expert") & (pl.col("layer") == key[1])).sort(
            pl.col("score").abs(), descending=True)
        if not ex.height:
            continue
        first, second = abs(ex["score"][0]), abs(ex["score"][1]) if ex.height > 1 else 0.0
        if first >= CORROBORATE * top and first >= 2 * second:
            out.append((("expert", key[1], None, int(ex["expert"][0]), None), v))
    return out


def strongest(evidence: list[tuple[tuple, float]]) -> list[tuple[tuple, float]]:
    """One row per component: where several kinds of evidence name it, the largest surprise."""
    best: dict[tuple, float] = {}
    for key, v in evidence:
        if key not in best or abs(v) > abs(best[key]):
            best[key] = v
    return list(best.items())


TIE = 0.25  # profile rows this close in surprise (a fraction of the larger) rank the earlier layer first


def _parts(kind: str) -> set[str]:
    """Every kind below ``kind`` in ``PARENTS`` (a layer row's parts, their parts, ...)."""
    out, todo = set(), [kind]
    while todo:
        for c in PARENTS.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _profile_turns(rows: list[dict]) -> list[list[dict]]:
    """The profile list's turns (rows ordered by |score|, all at least ``SIGNIFICANT``): near ties (``TIE``) put
    the earlier layer first (a fault upstream shows downstream too, and a surprise read off a few positions is
    this noisy); a layer row (``PARENTS``) shares its turn with the most unusual of its own parts in the list,
    the part first (the part says where in the layer, the layer row how much)."""
    rows = list(rows)
    moved = True
    while moved:
        moved = False
        for i in range(len(rows) - 1):
            a, b = rows[i], rows[i + 1]
            if (a["layer"] is not None and b["layer"] is not None and b["layer"] < a["layer"]
                    and abs(b["score"]) >= (1 - TIE) * abs(a["score"])):
                rows[i], rows[i + 1], moved = b, a, True
    turns, taken = [], set()
    for i, r in enumerate(rows):
        if i in taken:
            continue
        taken.add(i)
        turn = [r]
        parts = _parts(r["kind"])
        for j in range(i + 1, len(rows)):
            if j not in taken and rows[j]["kind"] in parts and rows[j]["layer"] == r["layer"]:
                turn = [rows[j], r]
                taken.add(j)
                break
        turns.append(turn)
    return turns


def _named(row: dict) -> tuple:
    return row["kind"], row["layer"], row["head"], row["expert"], row["source_pos"]


def interleave(df: pl.DataFrame, evidence: list[tuple[tuple, float]]) -> pl.DataFrame:
    """The no-reference ranking rule (module doc): profile rows, components and tokens take turns."""
    prof = pl.DataFrame({
        "target_pos": [int(df["target_pos"][0])] * len(evidence) if df.height else [],
        "kind": [k[0] for k, _ in evidence], "layer": [k[1] for k, _ in evidence], "head": [k[2] for k, _ in evidence],
        "expert": [k[3] for k, _ in evidence], "source_pos": [k[4] for k, _ in evidence],
        "score": [v for _, v in evidence], "method": ["profile"] * len(evidence), "delta": [None] * len(evidence),
        "restored": [None] * len(evidence)}, schema=_SCHEMA)
    key = pl.col("score").fill_nan(None).abs()
    prof = prof.sort(key, descending=True, nulls_last=True, maintain_order=True)
    lists = [_profile_turns(list(prof.filter(key >= SIGNIFICANT).iter_rows(named=True))),
             [[r] for r in df.filter(pl.col("kind") != "token").sort(
                 key, descending=True, nulls_last=True, maintain_order=True).iter_rows(named=True)],
             [[r] for r in df.filter(pl.col("kind") == "token").sort(
                 key, descending=True, nulls_last=True, maintain_order=True).iter_rows(named=True)]]
    order, at, placed, again = [], [0, 0, 0], set(), []
    while any(at[i] < len(lists[i]) for i in range(3)):
        for i in range(3):
            while at[i] < len(lists[i]):  # a component named already (unusual, and its removal matters) takes no turn
                turn = lists[i][at[i]]
                at[i] += 1
                fresh = [r for r in turn if _named(r) not in placed]
                again += [r for r in turn if _named(r) in placed]
                if fresh:
                    order.extend(fresh)
                    placed.update(_named(r) for r in fresh)
                    break
    order.extend(again)  # its second row after the turns: the slot it would take goes to another suspect
    order.extend(prof.filter(~(key >= SIGNIFICANT) | key.is_null()).iter_rows(named=True))
    frame = pl.DataFrame(order, schema=_SCHEMA, orient="row") if order else prof.select(list(_SCHEMA)).clear()
    return frame.with_columns(pl.arange(1, frame.height + 1, dtype=pl.Int32).alias("rank")).select(COLUMNS)


ROW_TOKENS = 4096  # batch_size=None: forward rows so that rows x context tokens stay near this, 16 rows at least


def rows_per_forward(n_tokens: int, batch_size: int | None) -> int:
    """``batch_size``, or where None as many rows as ``ROW_TOKENS`` context tokens (16 at least): on a short
    context one forward of many rows costs little more than one of 16 (a small model's forward is mostly
    per-call work), on a long one it stays 16."""
    return batch_size if batch_size is not None else max(16, ROW_TOKENS // max(1, n_tokens))


def root_cause(store, run_id: str, pos: int, *, adapter=None, steps: int = 32, mode: str = "auto",
               batch_size: int | None = None, baseline_token: int = 0, save: bool = True, reference=None,
               method: str | None = None, top_layers: int = 2, progress: Progress | None = None) -> pl.DataFrame:
    """Ranked causes of the token at ``pos`` of run ``run_id``: source tokens, layers, heads, experts, routers, ...

    Args:
        adapter: the model (adapter or module) to explain with; None reloads the run's checkpoint (hash-checked).
        pos: position of the explained token, 1 <= pos < number of tokens.
        steps: IG integration steps (Gauss-Legendre points).
        mode: "auto" (frozen for MoE, plain for dense), "frozen" or "plain".
        batch_size: forward rows per IG / ablation / patching batch; None: ``rows_per_forward`` (as many rows as
            4096 context tokens, 16 at least).
        baseline_token: token id of the IG baseline sequence.
        save: replace the run's ``attributions`` rows for this position with the result.
        reference: a known-good run id, module, adapter or checkpoint folder of the same architecture (a run
            is compared on its own tokens: another prompt of as many tokens, or the same prompt).
        method: with a reference, "patching" (the default: activation patching, workbench.analysis.patching) or
            "attribution_diff" (this model's IG and ablation minus the reference's, see the module doc);
            without one, "ablation" (the default: IG over source tokens, ablation of components).
        top_layers: patching: how many of the best-scoring layers to descend into (heads, experts, norms, ...).
        progress: called as ``progress(phase, done, total)`` as the work goes (``workbench explain``'s bar).
    Returns: columns target_pos, kind (token|head|expert|shared_expert|router, and with patching resid,
        attn_block, mlp_block, dense_mlp, attn_norm, mlp_norm, kv_latent, rotary, embed, unembed; without a
        reference also final_norm), layer, head,
        expert, source_pos, score (nats of the target logprob), restored (patching: the fraction of the gap to
        the reference closed), rank (1 = most responsible), method, delta.
    """

    method = method or ("patching" if reference is not None else "ablation")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (reference is None) != (method == "ablation"):
        raise ValueError(f"method {method!r} " + ("needs a reference" if reference is None else
                                                   "takes no reference (use patching or attribution_diff)"))
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if steps < 1 or (batch_size is not None and batch_size < 1):
        raise ValueError(f"steps and batch_size must be >= 1 (got steps={steps}, batch_size={batch_size})")
    pos = query.as_position(pos)
    info = query.run_row(store, run_id)
    ids_all = query.table(store, "tokens", run_id, "pos", cols=["token_id"])["token_id"].to_list()
    if not ids_all and int(info.get("n_tokens") or 0) > 0:
        raise ValueError(f"run {run_id} has no tokens rows (recorded without the tokens probe): root cause needs the "
                         "token ids; record it again with the tokens probe")
    if len(ids_all) < 2:
        raise ValueError(f"run {run_id} has {len(ids_all)} tokens: nothing to explain")
    if not 1 <= pos < len(ids_all):
        raise ValueError(f"pos must be in 1..{len(ids_all) - 1} for run {run_id} (position 0 has no "
                         f"preceding context), got {pos}")
    model = adapter_for(adapter) if adapter is not None else load_for_run(info)
    vocab = model.summary.vocab_size
    if not 0 <= baseline_token < vocab:
        raise ValueError(f"baseline_token {baseline_token} is outside the vocabulary of {vocab}")
    batch_size = rows_per_forward(pos, batch_size)
    ids = torch.tensor([ids_all[:pos]], device=model.device)
    target = int(ids_all[pos])
    has_moe = bool(model.summary.moe_layers)
    ig_mode = ("frozen" if has_moe else "plain") if mode == "auto" else mode
    if not has_moe:
        ig_mode = "plain"  # nothing to freeze
    ref, ref_tokens = (None, None) if reference is None else _reference(reference, store, info, model)
    if ref is model and ref_tokens is not None:  # the same model on another run's tokens
        if ref_tokens[:pos] == ids_all[:pos]:
            raise ValueError(f"reference run {reference} is the same model on the same {pos} tokens before position "
                             f"{pos}: every score would be 0; pick a run of another prompt, model or dtype")
        if method == "attribution_diff":
            raise ValueError(f"reference run {reference} is the same model on another prompt: the difference of "
                             "attributions compares two models on this run's tokens; use method='patching'")
    if method == "patching":
        if ref_tokens is not None and len(ref_tokens) < pos:
            raise ValueError(f"reference run {reference} has {len(ref_tokens)} tokens: patching position {pos} needs "
                             f"a reference of at least {pos} tokens")
        ref_ids = torch.tensor([ref_tokens[:pos] if ref_tokens is not None else ids_all[:pos]], device=ref.device)
        sites, pscores, restored, gap, _ = patch_causes(model, ids, target, ref, ref_ids, batch_size=batch_size,
                                                        top_layers=top_layers, progress=progress)
        df = rank_patching(sites, pscores, restored, pos, gap)
        if save:
            _save(store, run_id, pos, df)
        return df
    scores, delta, _ = integrated_gradients(model, ids, target, steps=steps, mode=ig_mode, batch_size=batch_size,
                                            baseline_token=baseline_token, progress=progress)
    comps, effects = component_ablation(model, ids, target, batch_size=batch_size, progress=progress)
    token_method, suffix = METHOD[ig_mode], ""
    if ref is not None:
        ref_ids = ids.to(ref.device)
        r_scores, r_delta, _ = integrated_gradients(ref, ref_ids, target, steps=steps, mode=ig_mode,
                                                    batch_size=batch_size, baseline_token=baseline_token)
        effects = effects - component_ablation(ref, ref_ids, target, batch_size=batch_size)[1]
        scores, delta, suffix = scores - r_scores, delta - r_delta, "_vs_reference"
    df = rank_causes(scores, token_method + suffix, delta, comps, effects, pos, "ablation" + suffix)
    if ref is None:
        sha = info.get("checkpoint_sha256")
        profile = load_profile(store, sha)
        aprof = activations.load(store, sha)
        # the components' own activations supersede the recorded signals' statistics where a model has both; and
        # where they judge how often each expert is chosen (against clean contexts of this length), a never-chosen
        # expert is judged by that, not by a Poisson count (routing's overdispersion makes that far too sure)
        rates = aprof is not None and aprof.filter(pl.col("signal") == "chosen").height > 0
        evidence = profile_evidence(store, run_id, pos, profile, only_routing=aprof is not None) \
            if profile is not None and not rates else []
        found: dict = {}  # the same forward: each expert's own surprise, and the token the model ranks first
        evidence += activations.evidence(model, ids_all[:pos], aprof, found=found,
                                         max_stats=activations.calibrated_context(aprof), targets=[target])
        evidence += corroborated(df, found.get("experts", {}))
        evidence += behind_block(df, evidence)
        if progress is not None:
            progress("profile evidence", 1, 1)
        rival = found["top_token"]  # the token that displaced the target, if any: its output row is a suspect too
        df = interleave(df, strongest(evidence + row_evidence(model, ids_all[:pos], target, rival)))
    if save:
        _save(store, run_id, pos, df)
    return df


def _save(store, run_id: str, pos: int, df: pl.DataFrame) -> None:
    stamp = datetime.now(timezone.utc).replace(tzinfo=None)
    store.replace_rows("attributions", {"run_id": run_id, "target_pos": pos},
                       df.with_columns(pl.lit(run_id).alias("run_id"), pl.lit(stamp).alias("created_at")))
