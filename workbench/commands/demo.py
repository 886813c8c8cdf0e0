"""workbench demo: record the sample prompts in data/prompts with the demo model, then open the UI.

Prompts already recorded with the same model checkpoint and settings are skipped, so running the
demo twice records nothing new. ``--no-ui`` records only.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl

from workbench.apps.app import launch
from workbench.commands.ui import check_port
from workbench.model import file_sha256, load_checkpoint
from workbench.run import Workbench, record

PROMPTS = Path(__file__).resolve().parents[2] / "data" / "prompts"


def prompt_files(folder: Path | None = None) -> list[Path]:
    """The sample prompts (``data/prompts/*.txt``), in name order."""
    folder = folder or PROMPTS
    files = sorted(p for p in folder.glob("*.txt") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no sample prompts (*.txt) in {folder}")
    return files


def already_recorded(wb, prompt: str, sha: str, max_new_tokens: int) -> str | None:
    """run_id of a complete run of ``prompt`` with this checkpoint and settings, if any."""

    runs = wb.runs().filter((pl.col("prompt") == prompt) & (pl.col("status") == "complete"))
    for r in runs.iter_rows(named=True):
        run = wb.run(r["run_id"])
        p = run.params
        if (run.info["checkpoint_sha256"] == sha and p.get("max_new_tokens") == max_new_tokens
                and p.get("temperature") == 0.0):
            return r["run_id"]
    return None


def main(args) -> int:

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.no_ui:
        check_port(args.host, args.port)  # before minutes of recording, not after
    wb = Workbench(args.db)
    model = load_checkpoint()  # the bundled demo model; FileNotFoundError (one line) if it is missing
    sha = file_sha256(model.checkpoint_path)
    for f in prompt_files():
        prompt = f.read_text(encoding="utf-8")
        done = already_recorded(wb, prompt, sha, args.max_new_tokens)
        if done:
            print(f"{f.name}: already recorded as {done}", file=sys.stderr)
            continue
        run = record(prompt, model=model, max_new_tokens=args.max_new_tokens, db=wb.store, progress=True)
        print(f"{f.name}: recorded {run.run_id}", file=sys.stderr)
    print(json.dumps({"db": str(wb.path), "runs": wb.runs().height}))
    if args.no_ui:
        return 0
    launch(wb.store, args.host, args.port)
    return 0
