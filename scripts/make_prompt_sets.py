"""Write data/prompts/calibration.jsonl and data/prompts/clean_eval.jsonl: the openings of Python functions
(a few lines each). Calibration prompts come from the demo model's training split (the standard library
and the installed packages), evaluation prompts from its held-out validation packages, so the two sets
share no file and the clean set is code the model never saw.

    .venv/bin/python scripts/make_prompt_sets.py
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench.model.corpus import corpus_files  # noqa: E402
from workbench.model.train import read_text  # noqa: E402


def openings(files: list[Path], n: int, salt: str, per_file: int = 1) -> list[dict]:
    """n function or method openings (a def line and up to two more lines, dedented), at most ``per_file``
    from one file, files in an order chosen by hash."""
    ranked = sorted(files, key=lambda f: hashlib.sha1((salt + f.parent.name + "/" + f.name).encode()).hexdigest())
    out = []
    for f in ranked:
        lines = read_text(f).splitlines()
        taken = 0
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                indent = len(line) - len(line.lstrip())  # methods too, dedented
                # no trailing newline: a prompt's final "\n" is a token the tokenizer only makes before column-0
                # code, so the model would end the function there
                text = "\n".join(x[indent:] for x in lines[i:i + 3]).rstrip()
                if 20 <= len(text) <= 240 and text.isascii():
                    out.append({"id": f"{f.parent.name}/{f.name}:{i + 1}", "prompt": text})
                    taken += 1
                    if taken == per_file or len(out) == n:
                        break
        if len(out) == n:
            break
    return out


def main() -> int:
    train, val = corpus_files()
    for name, files, n, per_file in (("calibration", train, 144, 1), ("clean_eval", val, 24, 3)):
        path = ROOT / "data" / "prompts" / f"{name}.jsonl"
        rows = openings(files, n, name, per_file)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
