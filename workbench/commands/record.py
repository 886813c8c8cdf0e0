"""workbench record: generate with probes attached; with --json the last stdout line is a JSON object."""
from __future__ import annotations

import json
from pathlib import Path


def main(args) -> int:
    from workbench.run import record

    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
    run = record(prompt, model=args.model, tokenizer=args.tokenizer, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_p=args.top_p, seed=args.seed, db=args.db, dtype=args.dtype,
                 backend=args.backend, progress=True)
    info = run.refresh().info
    out = {"run_id": run.run_id, "status": info["status"], "db": str(run.store.path),
           "prompt_tokens": info["n_prompt_tokens"], "tokens": info["n_tokens"], "text": run.generated_text}
    if args.json:
        print(json.dumps(out))
    else:
        print(run.prompt + run.generated_text)
        print(f"\nrun {run.run_id} ({info['status']}) -> {run.store.path}")
    return 0
