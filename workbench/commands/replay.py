"""workbench replay: re-run a recorded run and compare tokens and signals; exit 1 if they differ.

``--model FOLDER`` and ``--tokenizer PATH`` (read with ``getattr``: declared in workbench/cli.py) replace the
run's recorded model folder and tokenizer."""
from __future__ import annotations

import json

from workbench.analysis.replay import replay_run
from workbench.capture.resolve import run_tokenizer
from workbench.data import query
from workbench.data.store import Store


def main(args) -> int:
    """``--model FOLDER`` / ``--tokenizer PATH`` override the run's recorded model folder and tokenizer (the
    weights must still hash to the recorded ones); without them, the recorded absolute paths are used."""
    store = Store(args.db)
    model, tok = getattr(args, "model", None), getattr(args, "tokenizer", None)
    tokenizer = run_tokenizer(query.run_row(store, args.run_id), model, tok)
    res = replay_run(store, args.run_id, model=model, tokenizer=tokenizer, progress=True)
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(f"replayed {res['parent_run_id']} as {res['run_id']}: "
              + ("DIVERGED" if not res["match"] else "tokens and signals match" if res["tokens_match"] is not None
                 else "signals match (no tokens rows to compare: recorded without the tokens probe)"))
        d = res["first_divergence"]
        if d:
            mag = "n/a" if d.get("magnitude") is None else f"{d['magnitude']:.3g}"
            where = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("step", "pos", "signal", "magnitude",
                                                                             "a", "b"))
            print(f"first divergence: step {d['step']}, pos {d['pos']}, {d['signal']}"
                  + (f" ({where})" if where else "") + f": {d.get('a')!r} -> {d.get('b')!r} (|delta| {mag})")
    return 0 if res["match"] else 1
