"""workbench replay: re-run a recorded run and compare tokens and signals; exit 1 if they differ."""
from __future__ import annotations

import json

from workbench.analysis.replay import replay_run
from workbench.data.store import Store


def main(args) -> int:

    res = replay_run(Store(args.db), args.run_id, progress=True)
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(f"replayed {res['parent_run_id']} as {res['run_id']}: "
              + ("tokens and signals match" if res["match"] else "DIVERGED"))
        d = res["first_divergence"]
        if d:
            mag = "n/a" if d.get("magnitude") is None else f"{d['magnitude']:.3g}"
            where = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("step", "pos", "signal", "magnitude",
                                                                             "a", "b"))
            print(f"first divergence: step {d['step']}, pos {d['pos']}, {d['signal']}"
                  + (f" ({where})" if where else "") + f": {d.get('a')!r} -> {d.get('b')!r} (|delta| {mag})")
    return 0 if res["match"] else 1
