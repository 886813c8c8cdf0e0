"""``workbench`` command line: one parser, each command's body in ``workbench/commands/<name>.py``.

Every command takes ``--db PATH`` (default ``$WORKBENCH_DB`` or ``data/workbench.duckdb``). Errors a
user can fix (unknown run id, bad database, empty prompt) print one line to stderr and exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import duckdb

from workbench.data.query import RunNotFound
from workbench.data.store import StoreError, default_db

# commands that read a database someone recorded before: a --db that does not exist is a typo, refused before
# anything is created (record, demo, import and profile make a new one; ui only with --create or at the default)
READS_DB = ("search", "runs", "explain", "anomalies", "findings", "replay", "diff", "report", "kv-whatif",
            "expert-cache", "export", "placement", "atlas")


def _moved(p) -> None:
    """--model / --tokenizer: where a run's model and tokenizer are now, if they moved since it was recorded."""
    p.add_argument("--model", default=None, metavar="FOLDER",
                   help="the run's checkpoint folder, if it moved (weights must hash to the recorded ones)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="the run's tokenizer.json, if it moved")


def _db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, help="DuckDB file (default: $WORKBENCH_DB or data/workbench.duckdb)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workbench", description="MoE observability workbench")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("record", help="generate with probes attached and store every signal")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a file")
    src.add_argument("--prompts", metavar="FILE.jsonl|FILE.txt|DIR",
                     help="a prompt set, each prompt its own run of one batch (JSONL: prompt, optional id, "
                          "max_new_tokens, temperature, seed; .txt: one prompt per line; DIR: its *.jsonl sets and "
                          "*.txt files, one prompt each); rerunning resumes the batch")
    p.add_argument("--model", default=None, help="checkpoint folder (ours, or any transformers causal LM, MoE or "
                                                  "dense); default: bundled demo")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the model folder's; required when "
                                                      "the folder has none)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "transformers"],
                   help="how a DeepseekV3 folder runs: our own Transformer (auto, native) or transformers")
    p.add_argument("--device-map", default=None, metavar="auto|DEVICE|JSON",
                   help="place a transformers folder across devices with accelerate (a model larger than one "
                        "device): auto, balanced, a device, or a JSON {module: device}")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="run the model in this dtype")
    p.add_argument("--json", action="store_true", help="print a JSON object (with run_id) as the last line")
    p.add_argument("--batch-id", default=None, help="--prompts: the batch's id (default: a hash of the set and "
                                                     "the settings, so the same command resumes it)")
    p.add_argument("--out", default=None, metavar="DIR", help="--prompts: write each finished run as Parquet "
                                                              "shards under DIR (export layout) instead of --db")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="--prompts: run the set on a Ray Data actor pool (a local cluster, or ADDRESS); needs --out "
                        "and the ray extra")
    p.add_argument("--workers", type=int, default=1, help="--ray: actors, one model each (default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="--prompts: prompts recorded together in one batched "
                   "generation, similar lengths together (default 8; 1: one at a time)")
    p.add_argument("--no-detect", action="store_true", help="skip anomaly detection after each run")
    p.add_argument("--intervene", action="append", default=None, metavar="SPEC",
                   help="record under an intervention (repeatable): ban:L3E5, boost:L3E5=1.5, force:L3E5, "
                        "scale_head:L2H1=0, scale:layers.2.ffn=0.5, router_bias:L3=[v0,v1,...] "
                        "(workbench.interventions)")
    p.add_argument("--parent", default=None, metavar="RUN", help="the run this one varies (runs.parent_run_id)")
    _db(p)

    p = sub.add_parser("import", help="merge a folder of Parquet shards (export / record --out) into a database")
    p.add_argument("traces", metavar="DIR")
    _db(p)

    p = sub.add_parser("search", help="find runs and positions whose decoded text contains TEXT")
    p.add_argument("text")
    p.add_argument("--batch", default=None, metavar="BATCH_ID", help="only this batch's runs")
    p.add_argument("--ignore-case", "-i", action="store_true")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("runs", help="list recorded runs")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("demo", help="record the sample prompts with the demo model, then open the UI")
    p.add_argument("--no-ui", action="store_true", help="record only")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    _db(p)

    p = sub.add_parser("ui", help="open the Gradio workbench")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--auth", default=None, help="USER:PASS")
    p.add_argument("--traces", default=None, metavar="DIR", help="serve a folder of Parquet shards (export / record "
                                                                "--out) read-only instead of --db")
    p.add_argument("--checkpoint-root", action="append", default=[], metavar="DIR",
                   help="a folder whose checkpoints (it and every folder under it) the Record tab may load, besides "
                        "the bundled demo (repeatable)")
    p.add_argument("--create", action="store_true",
                   help="make a new database at --db if there is none (default: a missing --db is refused)")
    _db(p)

    p = sub.add_parser("train", help="train the demo model from scratch (reproduces data/demo in a new folder)")
    p.add_argument("--out", default="models/demo", help="output folder (resumes a run there); data/demo, or a "
                                                        "folder with a finished checkpoint, needs --force")
    p.add_argument("--force", action="store_true", help="allow writing over data/demo or a finished checkpoint")
    p.add_argument("--preset", default="demo")
    p.add_argument("--steps", type=int, default=3200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--balance-rate", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _db(p)

    p = sub.add_parser("profile", help="record a calibration set and store the model's baseline profile")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl|DIR", help="the calibration prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, metavar="FILE.parquet", help="also write the profile to this file")
    _db(p)

    p = sub.add_parser("eval", help="recompute the model card's numbers on the validation files")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="cap on validation tokens (default: all)")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("explain", help="root cause of the token at POS in a run")
    p.add_argument("run_id")
    p.add_argument("pos", type=int)
    p.add_argument("--steps", type=int, default=32, help="integration steps")
    p.add_argument("--mode", default="auto", choices=["auto", "frozen", "plain"])
    p.add_argument("--reference", default=None, metavar="RUN_ID|CHECKPOINT",
                   help="a known-good run (its model, its tokens) or checkpoint folder: which component taken "
                        "from it gives the token back (activation patching)")
    p.add_argument("--method", default=None, choices=["patching", "attribution_diff", "ablation"],
                   help="with --reference: patching (default) or attribution_diff; without: ablation")
    p.add_argument("--json", action="store_true")
    _moved(p)
    _db(p)

    p = sub.add_parser("anomalies", help="detect and list a run's anomalies")
    p.add_argument("run_id")
    p.add_argument("--kind", action="append", default=None, help="only these kinds (repeatable)")
    p.add_argument("--severity", choices=["info", "warning", "critical"], default=None,
                   help="only rows at least this severe")
    p.add_argument("--layer", type=int, action="append", default=None, help="only these layers (repeatable)")
    p.add_argument("--recompute", action="store_true", help="detect again (e.g. after `workbench profile`)")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("findings", help="a run's anomalies grouped into ranked findings, one per component")
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("replay", help="re-run a recorded run and compare")
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true")
    _moved(p)
    _db(p)

    p = sub.add_parser("diff", help="compare two runs")
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("report", help="export an anomaly report")
    p.add_argument("run_id")
    p.add_argument("--out", default=None)
    p.add_argument("--format", default="html", choices=["html", "json", "md"])
    p.add_argument("--explain", type=int, default=3, metavar="N",
                   help="root-cause the N most severe anomalous positions (IG is slow; stored results are reused)")
    _db(p)

    p = sub.add_parser("kv-whatif", help="re-run a run's tokens with KV-cache policies; cost vs the full cache")
    p.add_argument("run_id")
    p.add_argument("--policy", action="append", required=True, metavar="SPEC",
                   help="repeatable: full, window:sink=4,recent=64, heavy_hitters:budget=64, entropy, "
                        "confidence:threshold=0.85 (or shallow=0.80,deep=0.92), topk_int8:k=512, quant_tree, "
                        "recompute:delta=0.012,window=3 (see workbench.analysis.kv_policies)")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("expert-cache", help="replay a run's routing through a per-layer LRU cache of K experts")
    p.add_argument("run_id")
    p.add_argument("--slots", default="2,4,8", metavar="K,K,...", help="cache sizes K per MoE layer (default 2,4,8)")
    p.add_argument("--predictor", default="none", choices=["none", "prev3", "lookahead", "all"],
                   help="prefetch: none (plain LRU), prev3 (last 3 tokens' experts), lookahead (the recorded "
                        "routing of the next 5 positions: an oracle), all (each of them)")
    p.add_argument("--decode-only", action="store_true", help="count generated positions only")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("atlas", help="the expert atlas of a batch: each expert's load, top tokens, classes, label")
    p.add_argument("batch_id", metavar="BATCH")
    p.add_argument("--layer", type=int, default=None, help="only this MoE layer")
    p.add_argument("--top", type=int, default=None, metavar="N", help="only the N experts of highest load share")
    p.add_argument("--recompute", action="store_true", help="compute it again (else the stored one is read)")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("placement", help="a batch's routing replayed over an expert-parallel placement: "
                                          "device load and all-to-all traffic per policy")
    p.add_argument("batch_id", metavar="BATCH")
    p.add_argument("--devices", type=int, required=True, metavar="G", help="devices (G must divide experts + R)")
    p.add_argument("--redundant", type=int, default=0, metavar="R", help="redundant expert slots (replicas of the "
                   "hottest experts; default 0)")
    p.add_argument("--policy", action="append", default=None, metavar="contiguous|eplb|FILE.json",
                   help="repeatable (default: contiguous and eplb); FILE.json: {layer or \"*\": [[experts of "
                        "device 0], ...]}")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("expert-contrast", help="rank (layer, expert) by how much more often set A chooses it than "
                                                "set B (per-run shares, Welch's t over runs)")
    p.add_argument("a", metavar="A", help="a batch id, comma-separated run ids, or a prompt file (.txt / .jsonl, "
                                          "recorded first with --model)")
    p.add_argument("b", metavar="B", help="the same for set B")
    p.add_argument("--top", type=int, default=20, metavar="N", help="rows printed (default 20; 0: all)")
    p.add_argument("--generated-only", action="store_true", help="count generated tokens only")
    p.add_argument("--model", default=None, help="prompt files: the model to record them with (default: bundled demo)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="prompt files: tokens to generate (default 32)")
    p.add_argument("--json", action="store_true")
    _db(p)

    p = sub.add_parser("export", help="export runs as Hive-partitioned Parquet")
    p.add_argument("--parquet", required=True, metavar="DIR")
    p.add_argument("--run", dest="run_id", default=None, help="only this run")
    _db(p)
    return ap


class _Stop(Exception):
    """An error of the lenient first pass of ``parse_args``."""


class _Lenient(argparse.ArgumentParser):
    def error(self, message):  # noqa: D401 - argparse's hook
        raise _Stop(message)


def _relax(ap: argparse.ArgumentParser) -> None:
    """Nothing of ``ap`` (or its subcommands) required, typed or limited to choices: what is left over is only
    what no parser knows."""
    for action in ap._actions:  # noqa: SLF001 - argparse has no public walk
        action.required = False
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                _relax(sub)
        else:
            action.type, action.choices = None, None
    for group in ap._mutually_exclusive_groups:  # noqa: SLF001
        group.required = False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. An unknown flag is named (argparse's "unrecognized arguments: --promt", exit 2)
    even where a required option is missing too: argparse checks required options first, so ``record --promt x``
    said "one of the arguments --prompt ... is required". A lenient pass (nothing required) finds what no parser
    takes; the real pass then reports everything else as argparse does."""
    argv = list(sys.argv[1:] if argv is None else argv)
    lenient = build_parser()
    for ap in [lenient] + [sub for a in lenient._actions if isinstance(a, argparse._SubParsersAction)  # noqa: SLF001
                            for sub in a.choices.values()]:
        ap.__class__ = _Lenient
    _relax(lenient)
    real = build_parser()
    if "-h" in argv or "--help" in argv:
        return real.parse_args(argv)
    try:
        args, extra = lenient.parse_known_args(argv)
    except _Stop:
        return real.parse_args(argv)  # its own error (an invalid choice, a bad number, ...)
    if extra:
        sub = {a.dest: a for a in real._actions}.get("command")  # noqa: SLF001
        target = sub.choices.get(getattr(args, "command", None)) if sub is not None else None
        (target or real).error(f"unrecognized arguments: {' '.join(extra)}")
    return real.parse_args(argv)


def _missing_db(args: argparse.Namespace) -> str | None:
    """For a command that reads a database: a one-line error when its --db does not exist (nothing is created)."""
    if args.command not in READS_DB:
        return None
    db = Path(args.db) if getattr(args, "db", None) else default_db()
    if db.exists():
        return None
    return (f"no database at {db} (nothing was created); record a run first (`workbench record`, `workbench demo "
            f"--no-ui`) or give --db an existing file or shard folder")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = _missing_db(args)
    if missing:
        print(f"workbench {args.command}: error: {missing}", file=sys.stderr)
        return 2

    name = {"import": "import_traces"}.get(args.command, args.command.replace('-', '_'))  # kv-whatif: kv_whatif.py
    mod = importlib.import_module(f"workbench.commands.{name}")
    try:
        return int(mod.main(args) or 0)
    except (RunNotFound, StoreError, ValueError, FileNotFoundError) as e:
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2
    except duckdb.Error as e:  # a database that fails mid-command (a truncated file read past its end, ...)
        db = getattr(args, "db", None) or default_db()
        print(f"workbench {args.command}: error: {db}: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"workbench {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n", 1)[0].split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
