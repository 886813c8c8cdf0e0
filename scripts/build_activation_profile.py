"""Rebuild the bundled demo model's profiles: ``data/demo/activations.parquet`` (and, with ``--profile-out``, the
signal profile ``data/demo/profile.parquet`` from the same runs).

    python scripts/build_activation_profile.py [--db /tmp/calibration.duckdb] \
        [--prompts data/prompts/calibration.jsonl data/prompts/calibration_text.jsonl] [--profile-out data/demo/profile.parquet]

Records the calibration prompt sets (default: ``data/prompts/calibration.jsonl`` and
``data/prompts/calibration_text.jsonl``) with the bundled model (greedy, 32 new tokens: what ``workbench profile``
does), then profiles the components (``workbench.analysis.activations.build``) over the first 1,024 tokens of every
complete run and writes the rows; the exact first-position outputs are held for the prompts' first tokens and the
tokens their lines begin with (``line_starts``, the demo tokenizer). Deterministic: the same checkpoint and prompts
give the same file.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
import tempfile
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.analysis import activations  # noqa: E402
from workbench.analysis.baseline import ACTIVATION_TOKENS, build_profile  # noqa: E402
from workbench.analysis.baseline import SCHEMA as PROFILE_SCHEMA  # noqa: E402
from workbench.capture.adapters import load_adapter  # noqa: E402
from workbench.capture.prompt_sets import record_many  # noqa: E402
from workbench.capture.prompts import load_prompts  # noqa: E402
from workbench.data import query  # noqa: E402
from workbench.data.store import Store  # noqa: E402
from workbench.model.tokenizer import load_tokenizer  # noqa: E402

PROMPTS = [ROOT / "data" / "prompts" / "calibration.jsonl", ROOT / "data" / "prompts" / "calibration_text.jsonl"]


def line_starts(items: list[dict], toks: list[list[int]]) -> list[int]:
    """The tokens held exactly at position 0: the calibration prompts' first tokens, then the first tokens of their
    lines tokenized alone (a prompt may begin with any line), commonest first."""
    tok = load_tokenizer(ROOT / "data" / "demo" / "tokenizer.json")
    firsts = Counter(t[0] for t in toks if t)
    lines = Counter(tok.encode(line).ids[0] for it in items for line in it["prompt"].splitlines() if line.strip())
    return [t for t, _ in firsts.most_common()] + [t for t, _ in lines.most_common() if t not in firsts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", default=None, help="scratch database for the calibration runs (default: a temp file)")
    ap.add_argument("--out", default=str(ROOT / "data" / "demo" / "activations.parquet"))
    ap.add_argument("--batch-id", default=None, help="profile this batch of --db's runs instead of recording")
    ap.add_argument("--prompts", nargs="+", default=[str(p) for p in PROMPTS], help="calibration prompt sets")
    ap.add_argument("--profile-out", default=None, help="also write the signal profile of the same runs here "
                    "(the bundled one: data/demo/profile.parquet)")
    args = ap.parse_args(argv)
    files = [Path(p) for p in args.prompts]
    items = [it for f in files for it in load_prompts(f)]
    names = " and ".join(_rel(f) for f in files)
    db = args.db or str(Path(tempfile.mkdtemp()) / "calibration.duckdb")
    store = Store(db)
    model = load_adapter(ROOT / "data" / "demo")
    if args.batch_id:  # calibration runs recorded before (e.g. by another version of the recorder)
        batch_id = args.batch_id
    else:
        batch_id = record_many(items, model=model, db=store, max_new_tokens=32, progress=True).batch_id
    runs = query.batch_runs(store, batch_id).filter(pl.col("status") == "complete")["run_id"].to_list()
    toks = [query.table(store, "tokens", r, "pos", cols=["token_id"])["token_id"].to_list()[:ACTIVATION_TOKENS]
            for r in runs]
    sha = query.run_row(store, runs[0])["checkpoint_sha256"]
    source = f"{len(runs)} prompts of {names}, first {ACTIVATION_TOKENS} tokens, teacher-forced"
    firsts = line_starts(items, toks)
    rows = activations.build(model, toks, first_tokens=firsts)
    source += (f", exact first position of {min(len(firsts), activations.FIRST_TOKENS)} tokens, length buckets from "
               f"{activations.RUN_BUCKETS[0]} tokens, known answers on {activations.KNOWN_INPUTS} inputs per layer"
               ", every input-embedding and output-projection row and every norm"  # a newer release's
               f", longest context {max(len(t) for t in toks)} tokens")
    # the bundled file: the stored columns, no time stamp (the same inputs give the same bytes)
    rows = rows.with_columns(pl.lit(sha).alias("checkpoint_sha256"),
                             pl.lit(None, dtype=pl.Datetime("us")).alias("created_at"), pl.lit(source).alias("source"))
    rows.write_parquet(args.out)
    print(f"{rows.height} components from {len(runs)} calibration runs -> {args.out}")
    if args.profile_out:  # the signal profile of the same runs (what ``workbench profile`` stores), no time stamp
        cells = build_profile(store, runs).with_columns(
            pl.lit(sha).alias("checkpoint_sha256"), pl.lit(None, dtype=pl.Datetime("us")).alias("created_at"),
            pl.lit(json.dumps({"prompts": names, "runs": len(runs), "max_new_tokens": 32})).alias("source"))
        cells = cells.select([pl.col(c).cast(t) for c, t in PROFILE_SCHEMA.items()]).sort(
            ["signal", "layer", "head", "expert", "bucket"], nulls_last=True)
        cells.write_parquet(args.profile_out)
        print(f"{cells.height} profile cells from {len(runs)} calibration runs -> {args.profile_out}")
    return 0


def _rel(path: Path) -> str:
    """``path`` relative to the project (how the bundled files name their prompts), else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
