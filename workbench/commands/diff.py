"""workbench diff: compare two runs aligned by position (first divergence, confidence, entropy, routing)."""
from __future__ import annotations

import json

from workbench.analysis.diff import diff_runs
from workbench.data.store import Store


def main(args) -> int:

    d = diff_runs(Store(args.db), args.run_a, args.run_b)
    s = d.summary
    if args.json:
        print(json.dumps(s, default=str))
        return 0

    def num(x) -> str:
        return "n/a" if x is None else f"{x:.4g}"

    first = s["first_divergence_pos"]
    print(f"A {s['run_a']} ({s['dtype_a']}, {s['n_tokens_a']} tokens)  vs  B {s['run_b']} ({s['dtype_b']}, "
          f"{s['n_tokens_b']} tokens); same prompt: {s['same_prompt']}, same checkpoint: {s['same_checkpoint']}")
    if first is None:
        print("tokens: identical")
    else:
        t = s["first_divergence_tokens"]
        print(f"tokens: first divergence at pos {first}: {t['a']!r} vs {t['b']!r}; "
              f"{s['token_diff_share']:.1%} of {s['n_compared']} shared positions differ")
    print(f"|delta confidence|: mean {num(s['mean_abs_d_confidence'])}, max {num(s['max_abs_d_confidence'])}; "
          f"|delta logprob|: mean {num(s['mean_abs_d_logprob'])}, max {num(s['max_abs_d_logprob'])}")
    print(f"|delta head entropy|: mean {num(s['mean_abs_d_head_entropy'])}, "
          f"max per position {num(s['max_abs_d_head_entropy'])}")
    if s["routing_change_share"]:
        print("routing, share of slots whose expert differs: "
              + ", ".join(f"layer {k}: {v:.1%}" for k, v in s["routing_change_share"].items()))
    f = s["first_signal_divergence"]
    if f:
        print(f"first signal difference: step {f['step']}, pos {f['pos']}, {f['signal']} "
              f"(|delta| {num(f['magnitude'])})")
    return 0
