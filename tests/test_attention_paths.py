"""MLA's attention paths against an explicit float64 softmax: the plain prefill (CPU SDPA's flash kernel over a
value padded to the key's head dim, or keys padded to the value's), the decode step (two matmuls and a softmax),
and the reduced-statistics prefill in tiles of the causal triangle (what ``hook_attn_stats`` hands over)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import workbench.model.model as mm
from helpers import tiny_model
from workbench.model.model import MLA, ModelArgs


def mla(**kw) -> MLA:
    args = dataclasses.replace(ModelArgs.preset("tiny"), **kw)
    torch.manual_seed(0)
    return MLA(args).eval()


def reference(q, k, v, start_pos, scale, chunk):
    """Output [B, T, H, v] and, per block of ``chunk`` query rows, (q_start, stats [B, Tc, H, 3], received [B, S])."""
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    pos = torch.arange(start_pos, start_pos + q.size(1))[:, None]
    s = s.masked_fill(torch.arange(k.size(1))[None, :] > pos, float("-inf"))
    p = s.softmax(-1)  # [B, H, T, S]
    out = torch.einsum("bhts,bshd->bthd", p, v)
    ent = -torch.special.xlogy(p, p).sum(-1)
    stats = torch.stack([ent, p.amax(-1), p[..., 0]], -1).transpose(1, 2)  # [B, T, H, 3]
    blocks = [(start_pos + t0, stats[:, t0:t0 + chunk], p[:, :, t0:t0 + chunk].sum((1, 2)))
              for t0 in range(0, q.size(1), chunk)]
    return out, blocks


def qkv(b, t, s, h, dq, dv, seed=0, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, h, dq, generator=g) * sharp, torch.randn(b, s, h, dq, generator=g),
            torch.randn(b, s, h, dv, generator=g))


CASES = [(50, 50, 0), (37, 87, 50), (2, 70, 68)]  # whole prefill; a block after cached keys; two rows at the end


@pytest.mark.parametrize("t,s,start", CASES)
@pytest.mark.parametrize("dq,dv", [(48, 32), (24, 32), (32, 32)])
def test_plain_prefill_equals_the_explicit_softmax(t, s, start, dq, dv):
    a = mla()
    a.attn_chunk = 16
    q, k, v = qkv(2, t, s, a.n_heads, dq, dv)
    ref, _ = reference(q, k, v, start, a.softmax_scale, 16)
    with torch.no_grad():
        got = a._attend_naive(q, k, v, start)
    assert got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)


def test_plain_paths_hand_sdpa_one_head_dim(monkeypatch):
    """The flash kernel, not the math kernel: every SDPA call of a prefill (expanded or latent) and of a cached
    block gets q, k and v with one head dim; a decode step calls no SDPA at all."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kw):
        calls.append((q.size(-1), k.size(-1), v.size(-1), q.size(-2)))
        return sdpa(q, k, v, *args, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    a = mla()
    assert a.qk_nope_head_dim + a.qk_rope_head_dim != a.v_head_dim and a.kv_lora_rank != a.qk_rope_head_dim
    q, k, v = qkv(1, 40, 60, a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)
    g = torch.Generator().manual_seed(1)
    lat = [torch.randn(1, 40, a.n_heads, a.kv_lora_rank, generator=g),
           torch.randn(1, 40, a.n_heads, a.qk_rope_head_dim, generator=g),
           torch.randn(1, 60, a.kv_lora_rank, generator=g), torch.randn(1, 60, a.qk_rope_head_dim, generator=g)]
    with torch.no_grad():
        a._attend_naive(q, k[:, :40], v[:, :40], 0)
        a._attend_naive(q[:, :20], k, v, 40)
        a._attend_fused(lat[0], lat[1], lat[2][:, :40], lat[3][:, :40], 0)
        a._attend_fused(lat[0][:, :20], lat[1][:, :20], lat[2], lat[3], 40)
        n = len(calls)
        a._attend_fused(lat[0][:, :1], lat[1][:, :1], lat[2], lat[3], 59)
    assert n == 4 and len(calls) == n
    assert all(dq == dk == dv for dq, dk, dv, _ in calls), calls


@pytest.mark.parametrize("start,s", [(0, 1), (59, 60), (10, 60)])
def test_latent_decode_and_short_prefill_equal_the_explicit_softmax(start, s):
    """``_attend_fused``: a decode row (matmuls and a softmax) and a short prefill block (SDPA over the padded latent
    value) equal an explicit float64 softmax over the shared latent keys."""
    a = mla()
    h, c, r = a.n_heads, a.kv_lora_rank, a.qk_rope_head_dim
    g = torch.Generator().manual_seed(2)
    t = 1 if start == s - 1 else 7
    q_abs, q_pe = torch.randn(2, t, h, c, generator=g), torch.randn(2, t, h, r, generator=g)
    kv, k_pe = torch.randn(2, s, c, generator=g), torch.randn(2, s, r, generator=g)
    k = torch.cat([kv, k_pe], -1)[:, :, None].expand(-1, -1, h, -1)
    ref, _ = reference(torch.cat([q_abs, q_pe], -1), k, kv[:, :, None].expand(-1, -1, h, -1), start,
                       a.softmax_scale, 1024)
    with torch.no_grad():
        got = a._attend_fused(q_abs, q_pe, kv, k_pe, start)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tile", [None, 1])
@pytest.mark.parametrize("t,s,start", CASES)
def test_reduced_stats_in_tiles_equal_the_probabilities(monkeypatch, tile, t, s, start):
    """The stats prefill over the causal triangle, in tiles of at least 16 rows (``TILE`` = 1: every tile 16 rows,
    several per block of ``attn_chunk`` rows), hands ``hook_attn_stats`` one call per block with the
    entropy, max and sink weight of every row and the attention each key received, and returns the output."""
    if tile is not None:
        monkeypatch.setattr(mm, "TILE", tile)
    a = mla()
    a.attn_chunk = 40
    q, k, v = qkv(2, t, s, a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim, sharp=4.0)
    ref, blocks = reference(q, k, v, start, a.softmax_scale, 40)
    seen = []
    a.hook_attn_stats.register_forward_hook(
        lambda m, args, kw, out: seen.append((kw["q_start"], out, kw["received"])), with_kwargs=True)
    with torch.no_grad():
        got = a._attend_naive_stats(q, k, v, start)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    assert [q0 for q0, _, _ in seen] == [q0 for q0, _, _ in blocks]
    for (_, st, rec), (_, st_ref, rec_ref) in zip(seen, blocks):
        assert st.shape == st_ref.shape and rec.shape == rec_ref.shape == (2, s)
        torch.testing.assert_close(st.double(), st_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(rec.double(), rec_ref, atol=1e-4, rtol=1e-4)


def test_reduced_stats_under_autograd_give_the_plain_paths_gradient(monkeypatch):
    """Root cause's gradients run through the stats path (no in-place ops there): tiles, a masked diagonal and
    cached keys give the same output and gradient as the plain path."""
    monkeypatch.setattr(mm, "TILE", 1)
    a = mla()
    a.attn_chunk = 24
    q, k, v = qkv(1, 37, 87, a.n_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)
    w = torch.randn(1, 37, a.n_heads, a.v_head_dim, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (a._attend_naive, a._attend_naive_stats):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = fn(qq, kk, vv, 50)
        (out * w).sum().backward()
        grads.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_a_stats_kernel_is_set_while_attached_and_one_that_fails_falls_back(monkeypatch):
    """The native adapter sets ``MLA.stats_kernel`` (on CUDA: the Triton forward) only while a stats listener is
    attached; on the CPU it sets none. A kernel that raises on the first block warns once and leaves the tiles
    to compute the same statistics."""
    from workbench.capture.adapters import adapter_for, native

    model = tiny_model()
    adapter = adapter_for(model)
    x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    assert model.layers[0].attn.naive(40)

    def collect():
        seen = []
        with torch.no_grad(), adapter.seams({"attn_stats": lambda i, st, rec, q0: seen.append((i, q0, st, rec))}):
            kernels = [layer.attn.stats_kernel for layer in model.layers]
            logits = model(x)
        return logits, seen, kernels

    ref_logits, ref, kernels = collect()
    assert kernels == [None] * len(model.layers)  # a model on the CPU
    calls = []

    def broken(*args):
        calls.append(args[-1])
        raise RuntimeError("no device")
    monkeypatch.setattr(native, "_stats_kernel", lambda module: broken)
    with pytest.warns(UserWarning, match="stats kernel failed"):
        logits, seen, kernels = collect()
    assert kernels == [broken] * len(model.layers) and calls == [0] * len(model.layers)
    assert all(layer.attn.stats_kernel is None for layer in model.layers)  # unset on exit (and after the failure)
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)
    assert len(seen) == len(ref) > 0
    for (i, q0, st, rec), (i2, q2, st2, rec2) in zip(seen, ref):
        assert (i, q0) == (i2, q2)
        torch.testing.assert_close(st, st2, atol=0, rtol=0)
        torch.testing.assert_close(rec, rec2, atol=0, rtol=0)
