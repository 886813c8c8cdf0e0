"""The app's run-pick chain on a synthetic store: time and store reads per pick, before / after (issue 24).

A pick runs every view of the run (load_run, token_views, attention, experts, KV, code, replay); a token click
runs token_views again. ``--chain new`` calls the tab callbacks (``workbench.apps.tabs.*``) with a fresh
``Session`` per pick (one read of each table per pick, shared by the views); ``--chain old`` calls
``benchmarks/store_scale.py``'s ``views`` (the app before issue 24, call for call: a ``Run`` and its own reads
per view). Run it against an older checkout for the before numbers::

    python benchmarks/ui_views.py --db /tmp/scale.duckdb --runs 400 --chain new       # builds the store once
    PYTHONPATH=/tmp/before python benchmarks/ui_views.py --db /tmp/scale.duckdb --chain old

(the older checkout with ``workbench/apps``, ``workbench/model`` and ``workbench/probes`` linked to its
``apps``, ``model``, ``probes`` folders, so that every import comes from it). ``store.sql`` calls are counted as
store reads.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import workbench
from workbench.data.store import Store

# the store_scale.py of the checkout whose workbench is imported (for its store builder and its old views)
sys.path.insert(0, str(Path(workbench.__file__).resolve().parents[1] / "benchmarks"))
import store_scale

VIEW_MS: dict[str, list[float]] = {}  # view name -> ms of each call


def _timed(name: str, fn, *a):
    t = time.perf_counter()
    out = fn(*a)
    VIEW_MS.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
    return out


def new_chain(store: Store):
    """(pick, click) through the tab callbacks."""
    from workbench.apps.shared import AppContext
    from workbench.apps.tabs import attention, code, experts, kv_cache, replay, run_view

    app = AppContext(store)

    def pick(rid: str):
        s = app.session()
        out = _timed("load_run", run_view.load_run, app, s, rid)
        last = out[6].value
        _timed("replay", replay.replay, app, s, rid, last // 2)
        _timed("token_views", run_view.token_views, app, s, rid, out[3].value)
        _timed("attention_views", attention.attention_views, app, s, rid, None, False)
        _timed("expert_views", experts.expert_views, app, s, rid, None, 16)
        _timed("kv_views", kv_cache.kv_views, app, s, rid, "")
        _timed("code_views", code.code_views, app, s, rid, True)
        return app, s

    def click(rid: str, state) -> None:
        app_, s = state
        run_view.token_views(app_, s, rid, int(s.frames.n_prompt_tokens) + 1)

    return pick, click


def old_chain(store: Store):
    v = store_scale.views(store)
    names = ["load_run", "replay", "token_views", "attention_views", "expert_views", "kv_views", "code_views"]

    def pick(rid: str) -> None:
        for n in names:
            _timed(n, v[f"view: {n}"], rid, rid)

    return pick, (lambda rid, _: v["view: token_views"](rid, rid))


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="the synthetic store (built here if it does not exist)")
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--chain", choices=["new", "old"], default="new")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = Path(args.db)
    built = not path.exists()
    store = Store(path)
    if built:
        store_scale.build(store, args.runs, args.tokens, store_scale.Shape.demo(), per_append=50)
    run_ids = store.sql("SELECT run_id FROM runs")["run_id"].to_list()
    reads = {"n": 0}
    real_sql = store.sql

    def counted(*a, **k):
        reads["n"] += 1
        return real_sql(*a, **k)
    store.sql = counted
    pick, click = new_chain(store) if args.chain == "new" else old_chain(store)
    rng = random.Random(args.seed)
    picked = [rng.choice(run_ids) for _ in range(args.samples)]
    state = pick(picked[0])  # warm-up: imports, first-call costs
    VIEW_MS.clear()
    pick_ms, pick_reads, click_ms, click_reads = [], [], [], []
    for rid in picked:
        reads["n"] = 0
        t = time.perf_counter()
        state = pick(rid)
        pick_ms.append((time.perf_counter() - t) * 1e3)
        pick_reads.append(reads["n"])
        reads["n"] = 0
        t = time.perf_counter()
        click(rid, state)
        click_ms.append((time.perf_counter() - t) * 1e3)
        click_reads.append(reads["n"])
    n_tokens = store.sql("SELECT count(*) AS n FROM tokens")["n"][0]
    res = {"chain": args.chain, "workbench": str(Path(workbench.__file__).parent), "runs": len(run_ids),
           "tokens": int(n_tokens), "samples": args.samples,
           "pick_ms": {"p50": round(statistics.median(pick_ms), 1), "p95": round(pct(pick_ms, 95), 1)},
           "store_reads_per_pick": statistics.median(pick_reads),
           "token_click_ms": {"p50": round(statistics.median(click_ms), 1), "p95": round(pct(click_ms, 95), 1)},
           "store_reads_per_token_click": statistics.median(click_reads),
           "views_ms_p50_p95": {n: [round(statistics.median(v), 1), round(pct(v, 95), 1)] for n, v in VIEW_MS.items()}}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
