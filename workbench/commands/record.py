"""workbench record: generate with probes attached; with --json the last stdout line is a JSON object."""
from __future__ import annotations

import json
from pathlib import Path

from workbench.capture.interventions import normalize
from workbench.capture.settings import RecordSettings
from workbench.run import record, record_many


def main(args) -> int:
    if getattr(args, "prompts", None) is not None:
        return record_set(args)
    if args.out or args.ray or args.batch_id or args.batch_size != 8:
        raise ValueError("--out, --ray, --batch-id and --batch-size go with --prompts")
    interventions = normalize(args.intervene)  # a bad spec is refused before the model loads

    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
    run = record(prompt, model=args.model, tokenizer=args.tokenizer, db=args.db, progress=True,
                 settings=settings(args, device_map=device_map(args.device_map)), interventions=interventions,
                 parent_run_id=args.parent)
    info = run.refresh().info
    out = {"run_id": run.run_id, "status": info["status"], "db": str(run.store.path),
           "prompt_tokens": info["n_prompt_tokens"], "tokens": info["n_tokens"], "text": run.generated_text,
           "interventions": [i.spec for i in interventions], "parent_run_id": info["parent_run_id"]}
    if args.json:
        print(json.dumps(out))
    else:
        print(run.prompt + run.generated_text)
        under = f" under {', '.join(out['interventions'])}" if interventions else ""
        print(f"\nrun {run.run_id} ({info['status']}){under} -> {run.store.path}")
    return 0


def settings(args, **more) -> RecordSettings:
    """The recording settings the flags give (--max-new-tokens, --temperature, --top-p, --seed, --dtype, --backend)."""
    return RecordSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, dtype=args.dtype, backend=args.backend, **more)


def device_map(text: str | None):
    """--device-map: None, a JSON object {module path: device}, or a name (auto, balanced, cpu, cuda:0, ...)."""
    if text is None or not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--device-map is not valid JSON: {e}") from None


def record_set(args) -> int:
    """``--prompts``: every prompt its own run of one batch (``workbench.record_many``)."""

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.intervene or args.parent:
        raise ValueError("--intervene and --parent record one prompt (--prompt / --prompt-file), not --prompts")
    if args.ray and not args.out:
        raise ValueError("--ray writes Parquet shards: give --out DIR")
    batch = record_many(args.prompts, model=args.model, tokenizer=args.tokenizer, db=args.db, out=args.out,
                        batch_id=args.batch_id, settings=settings(args), detect=not args.no_detect, progress=True, ray=args.ray, workers=args.workers,
                        batch_size=args.batch_size)
    runs = batch.runs()
    status = batch.status()
    out = {"batch_id": batch.batch_id, "where": str(batch.store.path), "status": status,
           "recorded": len(batch.recorded), "skipped": len(batch.skipped),
           "runs": [{"run_id": r["run_id"], "key": r["batch_item"], "status": r["status"], "tokens": r["n_tokens"],
                     "error": r["error"]} for r in runs.iter_rows(named=True)]}
    if args.json:
        print(json.dumps(out))
    else:
        for r in out["runs"]:
            print(f"{r['run_id']}  {r['status']:<11} {r['tokens'] or 0:>5} tok  {r['key']}"
                  + (f"  ({r['error']})" if r["error"] else ""))
        what = ", ".join(f"{n} {s}" for s, n in status.items())
        print(f"\nbatch {batch.batch_id}: {what} ({len(batch.recorded)} recorded now, {len(batch.skipped)} "
              f"skipped as complete) -> {batch.store.path}")
    return 0
