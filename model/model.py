"""A small, faithful DeepSeek-V3: MLA attention, DeepSeekMoE, YaRN RoPE, a latent KV cache.

Reads like DeepSeek-V3's ``inference/model.py`` (same module names, so checkpoints and the paper map
one to one) with two differences that a workbench needs: ``forward`` returns logits for every
position and is differentiable (no ``inference_mode`` inside), and every interesting tensor passes
through an identity ``HookPoint`` named ``hook_*`` that probes can listen to by module path.

Dimension letters: B batch, T query tokens, S key tokens, D model dim, H heads, E routed experts,
K active experts per token, C kv latent rank, R rope head dim, V vocabulary.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

PRESETS = Path(__file__).parent / "presets"


@dataclass
class ModelArgs:
    """Hyper-parameters of the network; presets are JSON files in ``model/presets``."""

    vocab_size: int = 4096
    dim: int = 256
    inter_dim: int = 512  # dense MLP hidden size
    n_layers: int = 6
    n_dense_layers: int = 1  # the first layers use a dense MLP instead of MoE
    n_heads: int = 4
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    # moe
    moe_inter_dim: int = 128
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    # mla
    q_lora_rank: int = 0  # 0: a plain wq
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # yarn
    original_seq_len: int = 512
    rope_theta: float = 10000.0
    rope_factor: float = 1.0  # > 1 turns YaRN on
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0  # softmax-scale correction (HF: mscale_all_dim)
    rope_attn_factor: float = 1.0  # multiplies cos/sin (HF: mscale / mscale_all_dim ratio)
    # bookkeeping
    tie_embeddings: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError("n_routed_experts must be a multiple of n_expert_groups")
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError("n_limited_groups must be in [1, n_expert_groups]")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown score_func {self.score_func!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def preset(cls, name: str) -> "ModelArgs":
        """Load a JSON preset by name (``tiny``, ``demo``) or path."""
        path = Path(name) if str(name).endswith(".json") else PRESETS / f"{name}.json"
        return cls(**json.loads(path.read_text()))

    def to_dict(self) -> dict:
        return asdict(self)


class HookPoint(nn.Module):
    """Identity module: a named seam where probes attach forward hooks.

    Extra keyword arguments (e.g. ``q_start``) reach hooks registered with ``with_kwargs=True``.
    A hook that returns a tensor replaces the value flowing on (used for interventions).

    ``tap(fn)`` is the workbench's way in: ``fn(x, info)`` (``info``: the keyword arguments) sees the value after
    every hook, and a tensor it returns replaces it, as a hook's does. A point with taps and no hooks calls them
    without ``nn.Module``'s hook machinery (a recorder listens at tens of points per decode step).
    """

    def __init__(self) -> None:
        super().__init__()
        self.taps: list = []

    def forward(self, x: torch.Tensor, **info) -> torch.Tensor:
        return x

    def __call__(self, x: torch.Tensor, **info) -> torch.Tensor:
        if (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
                or _global_hooks()):
            x = super().__call__(x, **info)
        for fn in self.taps:
            y = fn(x, info)
            if y is not None:
                x = y
        return x

    def tap(self, fn) -> "Tap":
        """Call ``fn(x, info)`` on every value through this point (its result, if a tensor, flows on instead) until
        the returned handle's ``remove()``."""
        self.taps.append(fn)
        return Tap(self.taps, fn)

    @property
    def active(self) -> bool:
        return bool(self._forward_hooks) or bool(self._forward_pre_hooks) or bool(self.taps)


class Tap:
    """The handle of ``HookPoint.tap``: ``remove()`` as a hook's handle."""

    def __init__(self, taps: list, fn) -> None:
        self.taps, self.fn = taps, fn

    def remove(self) -> None:
        if self.fn in self.taps:
            self.taps.remove(self.fn)


def _global_hooks() -> bool:
    """Whether any module-wide hook is registered (``nn.modules.module.register_module_forward_hook`` ...)."""
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def precompute_freqs_cis(args: ModelArgs, seqlen: int) -> torch.Tensor:
    """Complex rotations [seqlen, R/2] for RoPE, with YaRN interpolation when rope_factor > 1."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if args.rope_factor > 1:
        def correction_dim(n_rot: float) -> float:
            return dim * math.log(args.original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(args.beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / args.rope_factor * (1 - smooth) + freqs * smooth
    t = torch.arange(seqlen, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.full_like(freqs, args.rope_attn_factor), freqs)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the last dim. x: [B, T, (H,) R]; freqs_cis: [T, R/2]."""
    dtype = x.dtype
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    shape = [1] * xc.ndim
    shape[1], shape[-1] = xc.size(1), xc.size(-1)
    y = torch.view_as_real(xc * freqs_cis.view(shape)).flatten(-2)
    return y.to(dtype)


class KVCache(nn.Module):
    """What MLA really caches: the normalised kv latent [B, S, C] and the shared rope key [B, S, R]."""

    def __init__(self, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.register_buffer("kv", torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("pe", torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device),
                             persistent=False)
        self.length = 0
        self.hook_latent = HookPoint()  # [B, T, C] written at start_pos
        self.hook_rope = HookPoint()  # [B, T, R]

    @property
    def max_len(self) -> int:
        return self.kv.size(1)

    def bytes_per_token(self) -> int:
        return (self.kv.size(-1) + self.pe.size(-1)) * self.kv.element_size()

    def update(self, start_pos: int, kv: torch.Tensor, pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start_pos + kv.size(1)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > max_len {self.max_len}")
        kv = self.hook_latent(kv, start_pos=start_pos)
        pe = self.hook_rope(pe, start_pos=start_pos)
        self.kv[: kv.size(0), start_pos:end] = kv.detach()
        self.pe[: pe.size(0), start_pos:end] = pe.detach()
        self.length = end
        return self.kv[: kv.size(0), :end], self.pe[: pe.size(0), :end]


class MLA(nn.Module):
    """Multi-head Latent Attention, computed in the latent space ("absorb"), as DeepSeek decodes."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        self.attn_chunk = 1024  # query rows per block when probabilities are observed
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * args.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale = args.qk_head_dim ** -0.5
        if args.rope_factor > 1:
            self.softmax_scale *= yarn_mscale(args.rope_factor, args.mscale) ** 2
        self.cache: KVCache | None = None
        self.hook_attn_probs = HookPoint()  # [B, Tc, H, S] one block of query rows, kwarg q_start
        # [B, Tc, H, 3] entropy, max weight and weight on key 0 per query row and head of one block; kwargs
        # q_start and received [B, S] (the block's attention on each key, summed over its rows and heads)
        self.hook_attn_stats = HookPoint()
        # [B, 1, H, S] a decode row's probabilities, kwarg q_start: while listened to, the stats path hands a decode
        # row here instead of reducing it (a recorder reduces many kept rows at once; fewer operations per step)
        self.hook_attn_row = HookPoint()
        # a fused kernel for the stats prefill without gradients, set by whoever knows one for the device (the
        # Triton forward of workbench.probes.triton_attention on CUDA): fn(q, k, v, scale, q_start) ->
        # (output [B, T, H, v], stats [B, T, H, 3], received [B, S]); None: _attend_naive_stats
        self.stats_kernel = None
        self.hook_z = HookPoint()  # [B, T, H, v] per-head output before wo
        self.hook_out = HookPoint()  # [B, T, D]

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, self.n_heads, -1)  # [B, T, H, nope+R]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_norm(kv)  # [B, T, C]
        k_pe = apply_rotary_emb(k_pe, freqs_cis)  # [B, T, R], shared by all heads
        if self.cache is not None:
            kv, k_pe = self.cache.update(start_pos, kv, k_pe)  # [B, S, C], [B, S, R]
        wkv_b = self.wkv_b.weight.view(self.n_heads, -1, self.kv_lora_rank)
        if self.naive(seqlen) and not self.hook_attn_probs.active:
            # a prefill attends as multi-head attention over keys and values expanded from the latent cache
            k_nope = torch.einsum("bsc,hdc->bshd", kv, wkv_b[:, : self.qk_nope_head_dim])  # [B, S, H, nope]
            v = torch.einsum("bsc,hdc->bshd", kv, wkv_b[:, -self.v_head_dim:])  # [B, S, H, v]
            q = torch.cat([q_nope, q_pe], -1)  # [B, T, H, nope+R]
            k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.n_heads, -1)], -1)  # [B, S, H, nope+R]
            attend = self._attend_naive
            if self.hook_attn_stats.active:
                kernel = self.stats_kernel is not None and not torch.is_grad_enabled()
                attend = self._attend_kernel_stats if kernel else self._attend_naive_stats
            z = attend(q, k, v, start_pos)  # [B, T, H, v]
        else:
            q_abs = torch.einsum("bthd,hdc->bthc", q_nope, wkv_b[:, : self.qk_nope_head_dim])  # [B, T, H, C]
            if self.hook_attn_probs.active:
                o = self._attend_observed(q_abs, q_pe, kv, k_pe, start_pos)
            elif self.hook_attn_stats.active:
                o = self._attend_stats(q_abs, q_pe, kv, k_pe, start_pos)
            else:
                o = self._attend_fused(q_abs, q_pe, kv, k_pe, start_pos)  # [B, T, H, C]
            z = torch.einsum("bthc,hdc->bthd", o, wkv_b[:, -self.v_head_dim:])  # [B, T, H, v]
        z = self.hook_z(z)
        return self.hook_out(self.wo(z.flatten(2)))

    def naive(self, seqlen: int) -> bool:
        """Whether ``seqlen`` query rows attend over expanded keys and values ("naive") rather than in latent
        space ("absorb", as DeepSeek decodes). Per cached key the naive way pays once for expanding it,
        H * C * (nope + v), and then H * T * (nope + R + v) for the scores and values; the absorbed way pays
        H * T * (2C + R). Decode steps stay absorbed; a long enough prefill block is cheaper naive."""
        c, nope, v = self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        return seqlen > 1 and c * (nope + v) < seqlen * (2 * c - nope - v)

    def _attend_naive(self, q, k, v, start_pos: int) -> torch.Tensor:
        """Scaled-dot-product attention over per-head keys [B, S, H, nope+R] and values [B, S, H, v].

        CPU SDPA takes its flash kernel only when q, k and v share one head dim, and its math kernel (all
        [B, H, T, S] scores at once) otherwise: the narrower of k and v is padded with zeros, which changes
        neither the scores nor the output's own columns, and the output is sliced back."""
        seqlen, keys, dv = q.size(1), k.size(1), v.size(-1)
        q, k, v = _same_head_dim(q, k, v)
        causal = start_pos == 0 and seqlen == keys
        if causal:  # the flash kernel masks by itself in O(T) memory: the whole sequence at once
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               scale=self.softmax_scale)
            return o.transpose(1, 2)[..., :dv]
        outs = []  # a block after cached keys needs a [T, S] mask: in blocks of query rows
        for t0 in range(0, seqlen, self.attn_chunk):
            t1 = min(t0 + self.attn_chunk, seqlen)
            kend = min(keys, start_pos + t1)  # keys past the block's last row are masked anyway
            mask = causal_mask(t1 - t0, kend, start_pos + t0, q.device)
            o = F.scaled_dot_product_attention(q[:, t0:t1].transpose(1, 2), k[:, :kend].transpose(1, 2),
                                               v[:, :kend].transpose(1, 2), attn_mask=mask, scale=self.softmax_scale)
            outs.append(o.transpose(1, 2)[..., :dv])
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _attend_naive_stats(self, q, k, v, start_pos: int) -> torch.Tensor:
        """``_attend_naive`` with the softmax written out and reduced on the way to what ``hook_attn_stats`` hands
        over (see ``_attend_stats``), once per block of ``attn_chunk`` query rows. Inside a block the rows go in
        tiles of at most 64 query rows (``TILE`` rows x heads), each against the keys up to its last row only (the
        causal triangle, as the flash kernel of the plain path skips masked keys): d = s - max, e = exp(d), l = sum e;
        entropy log l - sum(e * d) / l, max weight 1 / l, sink weight e_0 / l, the output (e @ V) / l, and the attention
        each key received one matrix-vector product per tile. Masked scores are a large finite negative, so
        that e * d is 0 there, not nan."""
        bsz, seqlen, h, dv = q.size(0), q.size(1), self.n_heads, self.v_head_dim
        keys, scale = k.size(1), self.softmax_scale
        kh = k.transpose(1, 2).flatten(0, 1).float()  # [B*H, S, nope+R]
        vh = v.transpose(1, 2).flatten(0, 1)  # [B*H, S, v]
        vf = vh.float()
        grad = torch.is_grad_enabled()
        outs = []
        for t0 in range(0, seqlen, self.attn_chunk):
            t1 = min(t0 + self.attn_chunk, seqlen)
            tc = t1 - t0
            stats, out = [], []
            received = q.new_zeros(bsz * h, 1, keys, dtype=torch.float32)
            rows = max(16, min(tc, 64, TILE // (bsz * h)))
            for r0 in range(t0, t1, rows):
                r1 = min(r0 + rows, t1)
                kend = min(keys, start_pos + r1)  # the tile's last row sees keys 0 .. start_pos + r1 - 1
                qh = q[:, r0:r1].transpose(1, 2).flatten(0, 1).float()  # [B*H, Tr, nope+R]
                s = torch.bmm(qh, kh[:, :kend].transpose(1, 2))  # [B*H, Tr, S']
                s = s * scale if grad else s.mul_(scale)
                lo = min(kend, start_pos + r0)  # keys before lo are seen by every row of the tile
                if lo < kend:
                    m_ = causal_mask(r1 - r0, kend - lo, start_pos + r0 - lo, q.device).clamp_(min=MASKED)
                    if grad:  # autograd keeps the scores: no in-place overwrite
                        s = torch.cat([s[..., :lo], s[..., lo:] + m_], -1)
                    else:
                        s[..., lo:].add_(m_)
                m = s.amax(-1, keepdim=True)
                d = s - m if grad else s.sub_(m)
                e = d.exp()
                inv = e.sum(-1, keepdim=True).reciprocal()
                i1 = inv.squeeze(-1)
                entropy = -i1.log() - torch.linalg.vecdot(e, d) * i1
                stats.append(torch.stack([entropy.clamp(min=0.0), i1, e[..., 0] * i1], -1))
                received[..., :kend].baddbmm_(inv.detach().transpose(1, 2), e.detach())
                if v.dtype == torch.float32:
                    o = torch.bmm(e, vf[:, :kend])
                    out.append(o * inv if grad else o.mul_(inv))
                else:  # a half-precision model: probabilities in fp32, p @ V in the model's dtype (as the plain path)
                    out.append(torch.bmm((e * inv).to(v.dtype), vh[:, :kend]).float())
            stats = stats[0] if len(stats) == 1 else torch.cat(stats, 1)
            self.hook_attn_stats(stats.view(bsz, h, tc, 3).transpose(1, 2), q_start=start_pos + t0,
                                 received=received.view(bsz, h, keys).sum(1))
            out = out[0] if len(out) == 1 else torch.cat(out, 1)
            outs.append(out.reshape(bsz, h, tc, dv).transpose(1, 2).type_as(q))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _attend_kernel_stats(self, q, k, v, start_pos: int) -> torch.Tensor:
        """``_attend_naive_stats`` through ``stats_kernel``, one call per block of ``attn_chunk`` query rows."""
        outs = []
        for t0 in range(0, q.size(1), self.attn_chunk):
            t1 = min(t0 + self.attn_chunk, q.size(1))
            kend = min(k.size(1), start_pos + t1)
            try:
                o, stats, received = self.stats_kernel(q[:, t0:t1], k[:, :kend], v[:, :kend], self.softmax_scale,
                                                       start_pos + t0)
            except Exception as e:  # noqa: BLE001  a kernel that cannot run here: the tiles, before any block
                if t0:
                    raise
                warnings.warn(f"attention stats kernel failed ({type(e).__name__}: {e}); using the unfused path")
                self.stats_kernel = None
                return self._attend_naive_stats(q, k, v, start_pos)
            if kend < k.size(1):
                received = F.pad(received, (0, k.size(1) - kend))
            self.hook_attn_stats(stats, q_start=start_pos + t0, received=received)
            outs.append(o)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _attend_fused(self, q_abs, q_pe, kv, k_pe, start_pos: int) -> torch.Tensor:
        """Scaled-dot-product attention as MQA in latent space: one shared key/value per token."""
        seqlen, keys, c = q_abs.size(1), kv.size(1), kv.size(-1)
        if seqlen == 1 and q_abs.dtype == torch.float32:
            # a decode step: the scores of all heads as one [B, H, C] @ [B, C, S] matmul (plus the rope part),
            # a softmax and one matmul for the output; SDPA's setup costs several times that at this size
            s = torch.baddbmm(torch.bmm(q_pe.flatten(1, 2), k_pe.mT), q_abs.flatten(1, 2), kv.mT,
                              beta=self.softmax_scale, alpha=self.softmax_scale)  # [B, H, S]
            return torch.bmm(s.softmax(-1), kv).view(q_abs.size(0), 1, self.n_heads, c)
        if seqlen > self.attn_chunk:  # a [T, S] mask in blocks of query rows
            ch = self.attn_chunk
            return torch.cat([self._attend_fused(q_abs[:, t0:t0 + ch], q_pe[:, t0:t0 + ch], kv, k_pe, start_pos + t0)
                              for t0 in range(0, seqlen, ch)], 1)
        q = torch.cat([q_abs, q_pe], -1).transpose(1, 2)  # [B, H, T, C+R]
        k = torch.cat([kv, k_pe], -1).unsqueeze(1).expand(-1, self.n_heads, -1, -1)  # [B, H, S, C+R]
        # the value padded to the key's head dim (zeros): CPU SDPA's flash kernel instead of its math kernel
        v = F.pad(kv, (0, k.size(-1) - c)).unsqueeze(1).expand(-1, self.n_heads, -1, -1)  # [B, H, S, C+R]
        # a whole-sequence prefill lets the kernel mask by itself: no [T, S] mask, O(T) extra memory
        causal = seqlen > 1 and start_pos == 0 and seqlen == keys
        mask = None
        if seqlen > 1 and not causal:
            mask = causal_mask(seqlen, keys, start_pos, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale)
        return o[..., :c].transpose(1, 2)

    def _attend_observed(self, q_abs, q_pe, kv, k_pe, start_pos: int) -> torch.Tensor:
        """Explicit softmax in blocks of query rows, so a probe sees probabilities in O(chunk x S)."""
        seqlen, keys = q_abs.size(1), kv.size(1)
        outs = []
        for t0 in range(0, seqlen, self.attn_chunk):
            t1 = min(t0 + self.attn_chunk, seqlen)
            tc = t1 - t0
            # "bthc,bsc->bths" as one [B, Tc*H, C] @ [B, C, S] matmul (all heads share the latent keys)
            scores = (torch.bmm(q_abs[:, t0:t1].flatten(1, 2), kv.transpose(1, 2))
                      + torch.bmm(q_pe[:, t0:t1].flatten(1, 2), k_pe.transpose(1, 2))).view(
                          q_abs.size(0), tc, self.n_heads, keys) * self.softmax_scale
            if tc > 1 or start_pos + t0 + 1 < keys:
                mask = causal_mask(tc, keys, start_pos + t0, q_abs.device)  # [Tc, S]
                scores = scores + mask[None, :, None, :]
            probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q_abs)  # [B, Tc, H, S]
            probs = self.hook_attn_probs(probs, q_start=start_pos + t0)
            if self.hook_attn_stats.active:
                p = probs.float()
                stats = torch.stack([-torch.special.xlogy(p, p).sum(-1), p.amax(-1), p[..., 0]], -1)
                self.hook_attn_stats(stats, q_start=start_pos + t0, received=p.sum(dim=(1, 2)))
            # "bths,bsc->bthc"
            outs.append(torch.bmm(probs.flatten(1, 2), kv).view(q_abs.size(0), tc, self.n_heads, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _attend_stats(self, q_abs, q_pe, kv, k_pe, start_pos: int) -> torch.Tensor:
        """The explicit softmax in latent space (decode steps, short prefills), reduced on the way to what
        ``hook_attn_stats`` hands over: the entropy is lse - sum(p * s), where sum(p * s) = scale * q . (p @ K)
        comes from the output's own matmul and p @ k_pe; max and sink weight from p; the attention each key
        received is a sum of p over the block's rows. Few operations: a decode step's cost is mostly their count."""
        bsz, seqlen, keys = q_abs.size(0), q_abs.size(1), kv.size(1)
        h, c, scale = self.n_heads, self.kv_lora_rank, self.softmax_scale
        if seqlen == 1 and q_abs.dtype == torch.float32 and keys == start_pos + 1:
            # a decode step: the plain decode's matmuls and softmax (_attend_fused), the statistics from its scores
            # and probabilities (entropy lse - p . s), the output as the plain path computes it
            s = torch.baddbmm(torch.bmm(q_pe.flatten(1, 2), k_pe.mT), q_abs.flatten(1, 2), kv.mT,
                              beta=scale, alpha=scale)  # [B, H, S]
            p = s.softmax(-1)
            if self.hook_attn_row.active:
                p = self.hook_attn_row(p.view(bsz, 1, h, keys), q_start=start_pos).view(bsz, h, keys)
                return torch.bmm(p, kv).view(bsz, 1, h, c)
            entropy = s.logsumexp(-1) - torch.linalg.vecdot(p, s)
            stats = torch.stack([entropy.clamp(min=0.0), p.amax(-1), p[..., 0]], -1)
            self.hook_attn_stats(stats.view(bsz, 1, h, 3), q_start=start_pos, received=p.sum(1))
            return torch.bmm(p, kv).view(bsz, 1, h, c)
        kv_f, pe_f = kv.float(), k_pe.float()  # no copy in fp32: a decode step does not copy the cache
        outs = []
        for t0 in range(0, seqlen, self.attn_chunk):
            t1 = min(t0 + self.attn_chunk, seqlen)
            tc = t1 - t0
            qc, qr = q_abs[:, t0:t1].flatten(1, 2).float(), q_pe[:, t0:t1].flatten(1, 2).float()  # [B, Tc*H, C|R]
            s = torch.baddbmm(torch.bmm(qr, pe_f.mT), qc, kv_f.mT, beta=scale, alpha=scale)  # [B, Tc*H, S]
            if tc > 1 or start_pos + t0 + 1 < keys:
                s.view(bsz, tc, h, keys).add_(causal_mask(tc, keys, start_pos + t0, s.device)[:, None, :])
            p = s.softmax(-1)
            o, pr = torch.bmm(p, kv_f), torch.bmm(p, pe_f)  # p @ K: its latent part is the output
            entropy = s.logsumexp(-1) - scale * (torch.linalg.vecdot(qc, o) + torch.linalg.vecdot(qr, pr))
            stats = torch.stack([entropy.clamp(min=0.0), p.amax(-1), p[..., 0]], -1)
            self.hook_attn_stats(stats.view(bsz, tc, h, 3), q_start=start_pos + t0, received=p.sum(1))
            if kv.dtype != torch.float32:  # a half-precision model: p @ V in its dtype, as _attend_observed
                o = torch.bmm(p.type_as(kv), kv)
            outs.append(o.view(bsz, tc, h, c).type_as(q_abs))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

def causal_mask(seqlen: int, keys: int, start_pos: int, device) -> torch.Tensor:
    """Additive mask [T, S]: query start_pos+i sees keys 0..start_pos+i."""
    q_pos = torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]
    k_pos = torch.arange(keys, device=device)[None, :]
    return torch.zeros(seqlen, keys, device=device).masked_fill(k_pos > q_pos, float("-inf"))


def _same_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k [.., qk] and v [.., v] zero-padded to one head dim (CPU SDPA's flash kernel needs it)."""
    dq, dv = q.size(-1), v.size(-1)
    if dv < dq:
        v = F.pad(v, (0, dq - dv))
    elif dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    return q, k, v


# query rows x heads (x batch rows) per tile of the reduced attention, and at most 64 rows whatever the heads
# (measured on one core at 512-4096 keys: 64-row tiles beat 128-512 with 16 heads and with 4; 16-32 are no
# better)
TILE = 1024
MASKED = -1e30  # a masked score in the reduced attention: exp gives 0, and 0 * (it - max) stays 0


class MLP(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x). Dense layers and shared experts."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.hook_out = HookPoint()  # [N, D]; keyword act: the down projection's input [N, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.silu(self.w1(x)) * self.w3(x)
        return self.hook_out(self.w2(act), act=act)


class Expert(MLP):
    """A routed expert; hook_out sees [N_e, D] for the N_e tokens routed to it (before weighting)."""


class Gate(nn.Module):
    """Router: scores, biased group-limited top-k selection, normalised and scaled weights.

    The raw scores (``hook_scores``) decide the weights; the selection scores (``hook_selection``,
    scores + bias, with groups masked) decide only which experts are chosen.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.topk = args.n_activated_experts
        self.n_groups = args.n_expert_groups
        self.topk_groups = args.n_limited_groups
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        self.register_buffer("bias", torch.zeros(args.n_routed_experts))  # aux-loss-free balancing
        self.hook_logits = HookPoint()  # [N, E]
        self.hook_scores = HookPoint()  # [N, E]
        self.hook_selection = HookPoint()  # [N, E], -inf outside the chosen groups
        self.hook_indices = HookPoint()  # [N, K]
        self.hook_weights = HookPoint()  # [N, K]

    def selection(self, scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Scores the top-k chooses by: scores + bias, -inf outside the ``topk_groups`` best groups."""
        sel = scores + bias  # [N, E]
        if self.n_groups > 1:
            grouped = sel.view(sel.size(0), self.n_groups, -1)  # [N, G, E/G]
            if self.score_func == "sigmoid":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(self.topk_groups, dim=-1)[1]  # [N, topk_groups]
            mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            sel = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        return sel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.hook_logits(F.linear(x.float(), self.weight.float()))  # [N, E]
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        scores = self.hook_scores(scores)
        sel = self.hook_selection(self.selection(scores, self.bias))
        indices = self.hook_indices(sel.topk(self.topk, dim=-1)[1])  # [N, K]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and (self.score_func == "sigmoid" or self.topk > 1):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = self.hook_weights(weights * self.route_scale)
        return weights.type_as(x), indices


class MoE(nn.Module):
    """DeepSeekMoE: shared experts always on, plus K of E fine-grained routed experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dim = args.dim
        self.n_routed_experts = args.n_routed_experts
        self.gate = Gate(args)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim) for _ in range(args.n_routed_experts))
        self.shared_experts = MLP(args.dim, args.n_shared_experts * args.moe_inter_dim)
        self.hook_out = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)  # [N, D]
        weights, indices = self.gate(x)  # [N, K], [N, K]
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i, expert in enumerate(self.experts):
            if counts[i] == 0:
                continue
            idx, top = torch.where(indices == i)
            y = y.index_add(0, idx, expert(x[idx]) * weights[idx, top, None])
        y = y + self.shared_experts(x)
        return self.hook_out(y.view(shape))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attn = MLA(args)
        self.ffn = MLP(args.dim, args.inter_dim) if layer_id < args.n_dense_layers else MoE(args)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.hook_resid_pre = HookPoint()  # [B, T, D]
        self.hook_resid_mid = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.attn(self.attn_norm(x), start_pos, freqs_cis))
        return self.hook_resid_post(x + self.ffn(self.ffn_norm(x)))


class Transformer(nn.Module):
    """The whole network. ``forward(tokens[B, T], start_pos=0) -> logits[B, T, V]`` (fp32)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.head.weight = self.embed.weight
        # a plain attribute, not a buffer: Module.to(dtype) would cast the complex table to real
        self.freqs_cis = precompute_freqs_cis(args, args.max_seq_len)  # [max_seq_len, R/2] complex64
        self.hook_embed = HookPoint()  # [B, T, D]
        self.hook_norm = HookPoint()  # [B, T, D] after the final norm
        self.hook_logits = HookPoint()  # [B, T, V]

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Transformer":
        """Random init (seeded): normal(0, std) matrices, unit norms, zero gate bias."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def setup_cache(self, batch: int = 1, max_len: int | None = None) -> None:
        """Allocate a fresh latent KV cache per layer (replacing any previous one)."""
        max_len = max_len or self.args.max_seq_len
        p = next(self.parameters())
        for layer in self.layers:
            layer.attn.cache = KVCache(batch, max_len, self.args.kv_lora_rank, self.args.qk_rope_head_dim,
                                       dtype=p.dtype, device=p.device)

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.attn.cache = None

    def kv_bytes_per_token(self) -> int:
        """Bytes the latent cache holds per token, all layers together."""
        elem = next(self.parameters()).element_size()
        return self.args.n_layers * (self.args.kv_lora_rank + self.args.qk_rope_head_dim) * elem

    def forward(self, tokens: torch.Tensor | None = None, start_pos: int = 0,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens) if inputs_embeds is None else inputs_embeds
        h = self.hook_embed(h)
        seqlen = h.size(1)
        if start_pos + seqlen > self.freqs_cis.size(0):
            raise ValueError(f"sequence of {start_pos + seqlen} tokens exceeds max_seq_len {self.args.max_seq_len}")
        if self.freqs_cis.device != h.device:
            self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis)
        h = self.hook_norm(self.norm(h))
        return self.hook_logits(self.head(h).float())
