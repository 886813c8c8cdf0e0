"""The Triton pass for the attention each key received (``received_attention``, from the forward's lse) equals the
column sums of a materialised softmax, and ``MLA.stats_kernel`` set to ``mla_stats`` hands ``hook_attn_stats`` what
the CPU stats path does, with the same logits (all under TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
from helpers import run_interpreted

pytest.importorskip("triton")


SCRIPT = r"""
import math
import torch
from workbench.model import ModelArgs, Transformer
from workbench.probes.triton_attention import attention_with_stats, mla_stats, received_attention, visible
g = torch.Generator().manual_seed(0)
# (B, H, Hk, T, S, D, q_start, window, causal, block_m, block_n)
CASES = [(1, 2, 1, 70, 70, 48, 0, None, True, None, None),       # prefill, MQA
         (2, 2, 2, 37, 100, 32, 63, None, True, 16, 32),        # a block after cached keys
         (1, 2, 2, 1, 100, 40, 99, None, True, None, None),     # one row
         (1, 2, 1, 50, 100, 40, 50, 20, True, 16, 16),          # sliding window
         (1, 2, 1, 37, 100, 32, 0, None, False, 16, 16)]        # not causal
for B, H, Hk, T, S, d, q0, win, causal, bm, bn in CASES:
    q = torch.randn(B, H, T, d, generator=g) * 2
    k = torch.randn(B, Hk, S, d, generator=g)
    v = torch.randn(B, Hk, S, 16, generator=g)
    sc = 1 / math.sqrt(d)
    _, st = attention_with_stats(q, k, v, sc, q0, win, causal)
    rec = received_attention(q, k, st["lse"], sc, q0, win, causal, block_m=bm, block_n=bn)
    s = (q.double() @ k.double().repeat_interleave(H // Hk, 1).mT) * sc
    ref = s.masked_fill(~visible(T, S, q0, win, causal), float("-inf")).softmax(-1).sum(2)
    torch.testing.assert_close(rec.double(), ref, atol=1e-4, rtol=1e-4)
    assert (ref.amax(-1) > 1.5 * ref.mean(-1)).all()  # keys differ: the comparison has teeth

model = Transformer(ModelArgs.preset("tiny")).init_weights(seed=1, std=0.1).eval()
for layer in model.layers:
    layer.attn.attn_chunk = 24
x = torch.randint(0, 256, (1, 76), generator=g)  # two blocks of 40 and 36 rows: both over expanded keys
assert model.layers[0].attn.naive(40)

def run(kernel):
    seen = []
    for layer in model.layers:
        layer.attn.stats_kernel = kernel
        layer.attn.hook_attn_stats._forward_hooks.clear()
        layer.attn.hook_attn_stats.register_forward_hook(
            lambda m, a, kw, out: seen.append((kw["q_start"], out.clone(), kw["received"].clone())), with_kwargs=True)
    model.setup_cache(1, 80)
    with torch.no_grad():
        logits = torch.cat([model(x[:, :40], start_pos=0), model(x[:, 40:], start_pos=40)], 1)
    model.clear_cache()
    return logits, seen

ref_logits, ref = run(None)
logits, got = run(mla_stats)
torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
assert [q for q, _, _ in got] == [q for q, _, _ in ref] == [0, 24] * len(model.layers) + [40, 64] * len(model.layers)
for (_, st, rec), (_, st_ref, rec_ref) in zip(got, ref):
    assert st.shape == st_ref.shape and rec.shape == rec_ref.shape
    torch.testing.assert_close(st, st_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rec, rec_ref, atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_received_attention_and_the_models_kernel_path():
    run_interpreted(SCRIPT)
