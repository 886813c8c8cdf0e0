"""Known answers on every MoE family of the installed ``transformers`` (issue 25): no false row, and which faults show.

The activation profile holds each expert's, router's, shared expert's, dense MLP's and attention map's output on a
few fixed inputs (``workbench.analysis.activations``, "Known answers"). A clean model must give those answers
exactly (else every clean run of that family would carry critical rows), and a weight edit of one of them must not.
For each family (``workbench.capture.tiny.moe_families``: tiny random models from each family's own config), a
profile is built on 6 random prompts of 20 tokens; a clean context of 16 other tokens is judged (known-answer rows:
the target is none); then, in the first MoE layer, half of the down projection of an expert that context chooses is
sign-flipped (``faults.KINDS["expert_flip"]``) and a head's output-projection columns are zeroed
(``faults.HELD_OUT["head_weights_dead"]``): is that expert / head the known-answer row? Since 2026-12-05 also the
norms: that layer's MLP input norm scaled x4 (``faults.HELD_OUT["mlp_norm"]``) and the final norm x0.3
(``faults.HELD_OUT["final_norm"]``), judged by the known answers alone.

    .venv/bin/python benchmarks/known_answers.py               # every family, writes its RESULTS section
    .venv/bin/python benchmarks/known_answers.py mixtral olmoe  # some (no RESULTS section)
"""
from __future__ import annotations

import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from results_md import write_section  # noqa: E402
from workbench.analysis import activations, faults  # noqa: E402
from workbench.capture.adapters import adapter_for  # noqa: E402
from workbench.capture.tiny import moe_families, tiny_family  # noqa: E402

SECTION = "## Known answers across transformers' MoE families"


def known_rows(a, ids, prof) -> dict:
    why: dict = {}
    ev = dict(activations.evidence(a, ids, prof, signals=why))
    return {k: v for k, v in ev.items() if why.get(k) == "known"}


def has_down(a, layer: int, expert: int) -> bool:
    """Whether routed expert ``expert`` of ``layer`` has a down projection to flip: a router may score more classes
    than the experts module holds (longcat_flash's zero-compute experts, applied by its MoE block itself)."""
    try:
        a.expert_down(layer, expert)
    except (ValueError, IndexError):
        return False
    return True


def exact_rows(a, ids, prof) -> dict:
    """The known answers alone (the layers' and the model's ends'), whatever the statistics say beside them."""
    return activations._known_evidence(a, activations.capture(a, ids)[0], prof) | activations._end_evidence(
        a, ids, prof)


def fault_named(a, ids, prof, kind: str, layer: int, index: int, want: tuple, rows=known_rows) -> str:
    try:
        with faults.ALL_KINDS[kind](a, layer, index=index):
            got = rows(a, ids, prof)
    except (ValueError, IndexError) as e:  # the family has no such part (e.g. no per-expert down projection)
        return f"n/a ({str(e)[:60]})"
    if not got:
        return "no row"
    return "named" if list(got) == [want] else "other: " + ", ".join(f"{k[0]} {k[1]}" for k in got)


def one(family: str) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    a = adapter_for(tiny_family(family))
    g = np.random.default_rng(3)
    prof = activations.build(a, [g.integers(3, 250, size=20).tolist() for _ in range(6)])
    held = prof.filter(prof["signal"].str.starts_with("known"))
    ids = np.random.default_rng(9).integers(3, 250, size=16).tolist()
    clean = known_rows(a, ids, prof)
    layer = a.summary.moe_layers[0] if a.summary.moe_layers else 0
    idx = activations.capture(a, ids)[0].get(("route", layer, None, None, "indices"))
    chosen = [int(e) for e in idx[1:].flatten().tolist() if 0 <= int(e) < a.summary.n_routed_experts] \
        if idx is not None else []
    chosen = [e for e in dict.fromkeys(chosen) if has_down(a, layer, e)]  # a zero expert has nothing to flip
    flip = fault_named(a, ids, prof, "expert_flip", layer, chosen[0], ("expert", layer, None, chosen[0], None)) \
        if chosen else "n/a (no routing read)"
    head = fault_named(a, ids, prof, "head_weights_dead", layer, 1, ("head", layer, 1, None, None)) \
        if a.summary.n_heads > 1 else "n/a (one head)"
    # the norms (since 2026-12-05): the MLP input norm of that layer scaled, the final norm scaled
    norm = fault_named(a, ids, prof, "mlp_norm", layer, 0, ("mlp_norm", layer, None, None, None), exact_rows)
    final = fault_named(a, ids, prof, "final_norm", 0, 0, ("final_norm", None, None, None, None), exact_rows)
    kinds = sorted(set(held["kind"].to_list()))
    return {"family": family, "cells": held.height, "kinds": kinds, "clean": len(clean), "flip": flip, "head": head,
            "norm": norm, "final": final, "seconds": time.perf_counter() - t0}


def markdown(rows: list[dict], seconds: float) -> str:
    n = len(rows)
    ok = [r for r in rows if "error" not in r]
    clean = sum(r["clean"] == 0 for r in ok)
    flips = [r for r in ok if not r["flip"].startswith("n/a")]
    heads = [r for r in ok if not r["head"].startswith("n/a")]
    norms = [r for r in ok if not r.get("norm", "n/a").startswith("n/a")]
    finals = [r for r in ok if not r.get("final", "n/a").startswith("n/a")]
    out = [SECTION, "",
           f"`python benchmarks/known_answers.py` ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()}, "
           f"torch {torch.__version__}, transformers {__import__('transformers').__version__}; {seconds:.0f} s).", "",
           f"{n} MoE families; the clean model gave every known answer exactly in **{clean} of {len(ok)}** (a row on a "
           f"clean context: {len(ok) - clean}); a sign-flipped expert was the known-answer row in "
           f"**{sum(r['flip'] == 'named' for r in flips)} of {len(flips)}** families where it applies, a head with "
           f"zeroed output weights in **{sum(r['head'] == 'named' for r in heads)} of {len(heads)}**, a scaled MLP "
           f"input norm in **{sum(r['norm'] == 'named' for r in norms)} of {len(norms)}**, a scaled final norm in "
           f"**{sum(r['final'] == 'named' for r in finals)} of {len(finals)}** (the norms: the known answers alone, "
           "whatever the statistics say beside them). \"no row\": the "
           "family's experts module is not one the workbench runs exactly (its experts get no known answers; the "
           "statistics still judge them).", "",
           "| family | known cells | kinds | rows on a clean context | sign-flipped expert "
           "| head output weights zeroed | MLP input norm x4 | final norm x0.3 |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | error: {r['error']} | | | | | | |")
        else:
            out.append(f"| {r['family']} | {r['cells']} | {', '.join(r['kinds'])} | {r['clean']} | {r['flip']} | "
                       f"{r['head']} | {r['norm']} | {r['final']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    rows = []
    for family in argv or moe_families():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                r = one(family)
            except Exception as e:  # noqa: BLE001 - a family that fails is a row of the table, not the end of it
                r = {"family": family, "error": f"{type(e).__name__}: {str(e)[:100]}"}
        rows.append(r)
        print(r, flush=True)
    text = markdown(rows, time.perf_counter() - t0)
    print(text)
    if not argv:
        write_section(ROOT / "benchmarks" / "RESULTS.md", SECTION, text)
    return 0 if all(r.get("clean", 1) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
