"""Which transformers families record a prompt set batched exactly: every MoE family of the installed transformers
(``workbench.capture.tiny.moe_families``) and a few dense ones, as tiny random models; three prompts of 3, 8 and 11
tokens recorded in one batched generation (``HFAdapter.stream_batch``, whatever ``supports_batch`` says) against
each prompt's single recording. One line per family: OK, or the first signal columns that differ (token ids and
other exact columns equal, real-valued ones within replay's 1e-4). The families that differ are
``workbench.capture.adapters.hf.SINGLE_ONLY``.

    python benchmarks/hf_batch_sweep.py [FAMILY ...]
"""
from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import workbench  # noqa: E402
from workbench.capture.adapters import adapter_for  # noqa: E402
from workbench.capture.recorder import RecordSettings, new_run_id, record_batch  # noqa: E402
from workbench.capture.tiny import moe_families, tiny_family  # noqa: E402
from workbench.data.signals import TABLES  # noqa: E402
from workbench.data.store import Store  # noqa: E402

PROMPTS = [[5, 17, 42], [5, 17, 42, 99, 123, 7, 250, 64], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
NEW = [4, 3, 5]
DENSE = ["llama", "qwen2", "mistral", "gemma2", "gemma3_text", "qwen3", "olmo2", "phi3"]
TOL = 1e-4  # replay's


def differences(db: Store, single: str, batched: str) -> list:
    bad = []
    for name, table in TABLES.items():
        q = f"SELECT * EXCLUDE (run_id) FROM {name} WHERE run_id = ? ORDER BY {table.order}"
        x, y = db.sql(q, [single]), db.sql(q, [batched])
        if x.height != y.height:
            bad.append((name, "rows", x.height, y.height))
            continue
        bad += [(name, c) for c in table.names("key") + table.names("exact") if x[c].to_list() != y[c].to_list()]
        for c in table.names("tol"):
            d = (x[c] - y[c]).abs().max()
            if d is not None and d > TOL:
                bad.append((name, c, round(float(d), 6)))
    return bad


def check(family: str, folder: Path) -> str:
    torch.manual_seed(0)
    adapter = adapter_for(tiny_family(family))
    adapter.supports_batch = True  # measured, whatever the adapter says
    db = Store(folder / f"{family}.duckdb")
    ids = [new_run_id() for _ in PROMPTS]
    errors = record_batch(PROMPTS, [RecordSettings(max_new_tokens=n) for n in NEW], model=adapter, db=db, run_ids=ids,
                          run_fields=[None] * len(PROMPTS))
    if any(errors):
        return f"errors {errors}"
    bad = []
    for i, p in enumerate(PROMPTS):
        one = workbench.record(p, model=adapter, db=db, detect=False, max_new_tokens=NEW[i])
        bad += [(f"row {i}", *d) for d in differences(db, one.run_id, ids[i])]
    return "OK" if not bad else f"differs: {bad[:4]}"


def main(argv: list[str] | None = None) -> int:
    families = (argv if argv is not None else sys.argv[1:]) or moe_families() + DENSE
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    folder = Path(tempfile.mkdtemp(prefix="hf_batch_sweep_"))
    for family in families:
        t = time.perf_counter()
        try:
            got = check(family, folder)
        except Exception as e:  # noqa: BLE001 - one line per family, whatever it raises
            got = f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        print(f"{family}: {got} ({time.perf_counter() - t:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
