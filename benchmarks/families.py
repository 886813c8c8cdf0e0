"""Every MoE family of the installed ``transformers``: what the workbench records for each (issue 26, item 5).

Each family (``workbench.capture.tiny.moe_families``) is built as a tiny random model from its own default config,
shrunk (``tiny_family``: hidden 64, 4 layers keeping every layer kind, 8 experts top-2), and 12 tokens are recorded
(8 prompt token ids, 4 generated). The routing recorded is compared, row by row, with what the family's experts
received during the same recording (``tiny.RouterReference``, hooks of its own). Prints a Markdown table (the one in
docs/families.md) and the counts.

    .venv/bin/python benchmarks/families.py                 # every family
    .venv/bin/python benchmarks/families.py jamba mixtral   # some
"""
from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging as hf_logging

import workbench
from workbench.capture.adapters import adapter_for
from workbench.capture.tiny import RouterReference, moe_families, tiny_family

PROMPT = [5, 17, 42, 99, 123, 7, 250, 64]
NEW = 4


def one(family: str, store) -> dict:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hf = tiny_family(family)
    adapter = adapter_for(hf)
    ref = RouterReference(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = workbench.record(PROMPT, model=adapter, max_new_tokens=NEW, db=store, detect=False)
    ref = ref.close()
    s = run.model_summary
    rt = run.routing()
    same = bool(s.moe_layers)
    for layer in s.moe_layers:
        got = rt.filter(rt["layer"] == layer).sort("pos", "slot")
        idx_ref = ref.get(layer, (None,))[0]
        if idx_ref is None:
            same = False
            break
        idx = got["expert"].to_numpy().reshape(-1, idx_ref.size(1))
        same &= idx.shape == tuple(idx_ref.shape) and bool((np.sort(idx, 1) == np.sort(idx_ref.numpy(), 1)).all())
    exact_rule = all(adapter.router(i).exact for i in s.moe_layers)
    routing = ("not recorded" if not s.moe_layers else
               ("exact" if exact_rule else "exact choice, rule observed") if same else "DIFFERS")
    attn = [i for i, a in enumerate(adapter.attn) if a is not None]
    rule = ""
    if s.moe_layers:
        m = adapter.router(s.moe_layers[0])
        rule = (f"{m.score}" + (f", bias on {m.bias_on}" if m.has_bias else "") + (", groups" if m.n_group > 1 else "")
                + (", renorm" if m.norm else "") + (f", x{m.scale:g}" if m.scale != 1 else "")
                + (", per-expert scale" if m.expert_scale is not None else "")) if m.exact else "not modelled"
    return {"family": family, "status": run.status, "routing": routing, "rule": rule, "moe": s.moe_layers,
            "unrouted": s.unrouted_layers, "attn": attn, "layers": s.n_layers, "notes": s.notes,
            "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    families = argv or moe_families()
    store = workbench.Store(Path(tempfile.mkdtemp(prefix="families-")) / "w.duckdb")
    rows = []
    for f in families:
        try:
            rows.append(one(f, store))
        except Exception as e:  # noqa: BLE001 - a family that fails is a row of the table, not the end of it
            rows.append({"family": f, "status": f"FAILED: {type(e).__name__}: {e}"[:120], "routing": "-", "rule": "",
                         "moe": [], "unrouted": [], "attn": [], "layers": 0, "notes": [], "seconds": 0.0})
    print("| family | routing | router rule | MoE layers | attention layers | notes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        notes = "; ".join(r["notes"]).replace("|", "/") if r["status"] == "complete" else r["status"]
        print(f"| {r['family']} | {r['routing']} | {r['rule']} | {r['moe']} | {r['attn']} of {r['layers']} | "
              f"{notes} |")
    n = {k: sum(r["routing"] == k for r in rows) for k in ("exact", "exact choice, rule observed", "not recorded",
                                                          "DIFFERS")}
    print(f"\n{len(rows)} families: {n['exact']} exact (rule matched), {n['exact choice, rule observed']} exact choice "
          f"with the rule observed, {n['not recorded']} without routing (noted), {n['DIFFERS']} differing, "
          f"{sum(r['status'] != 'complete' for r in rows)} failed; "
          f"{sum(r['seconds'] for r in rows):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
