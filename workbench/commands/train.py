"""workbench train: reproduce the bundled demo checkpoint from scratch (resumes if interrupted)."""
from __future__ import annotations

from workbench.model.train import train


def main(args) -> int:

    out = train(args.out, preset=args.preset, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                balance_rate=args.balance_rate, seed=args.seed, threads=args.threads, force=args.force)
    print(f"checkpoint written to {out}")
    return 0
