"""Write the prompt sets of the anomaly detectors: a calibration set (the demo's baseline profile) and a clean
evaluation set, each spanning four kinds of text and prompt lengths up to 1,024 tokens.

Kinds (the ``id`` of every prompt starts with its kind, ``library:``, ``script:``, ``test:`` or ``docs:``,
since a prompt file carries no other fields):

- ``library``: a function or method opening (a def line and up to two more lines, dedented), or a longer
  stretch of the file from that def on;
- ``script``: the opening of a script or an algorithm module (a file with an ``if __name__ == "__main__"``
  block, or a demo), from its first import on;
- ``test``: a test function's opening (``def test_...``) and what follows it;
- ``docs``: natural-language text: a docstring of at least three lines of prose, or a block of comments.

Short prompts are the openings themselves (< 128 tokens); long ones run on from the same place in the file
to a length drawn between 128 and 1,024 tokens (the demo tokenizer's count).

Sources, disjoint by file and mostly by package. Calibration: the demo model's training split (library,
scripts, docstrings) and the standard library's test suite (tests are never trained on). Evaluation: the
held-out validation packages (attrs, click, jinja2, requests, rich: never trained on), the standard library's
``turtledemo`` scripts (never trained on: public algorithm demos) and the test suites of numpy, networkx and
matplotlib. ``data/prompts/clean_eval.jsonl`` (24 library openings of the held-out packages, used by other
benchmarks; made by this script's earlier version) is left as it is.

    .venv/bin/python scripts/make_prompt_sets.py
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenizers import Tokenizer  # noqa: E402

from model.corpus import corpus_files  # noqa: E402
from model.tokenizer import DEFAULT_TOKENIZER  # noqa: E402
from model.train import read_text  # noqa: E402

KINDS = ("library", "script", "test", "docs")
MAIN = re.compile(r"""^if __name__ == ['"]__main__['"]""", re.M)
_TOK: list = []


def n_tokens(text: str) -> int:
    if not _TOK:
        _TOK.append(Tokenizer.from_file(str(DEFAULT_TOKENIZER)))
    return len(_TOK[0].encode(text).ids)


def cut(text: str, n: int) -> str:
    """The longest prefix of ``text`` (whole lines, no trailing whitespace) with at most ``n`` tokens."""
    if not _TOK:
        n_tokens("")
    enc = _TOK[0].encode(text)
    if len(enc.ids) > n:
        text = text[:enc.offsets[n][0]]
        text = text[:text.rfind("\n")] if "\n" in text else text
    return text.rstrip()


def _ranked(files: list[Path], salt: str) -> list[Path]:
    return sorted(files, key=lambda f: hashlib.sha1((salt + f.parent.name + "/" + f.name).encode()).hexdigest())


def _dedent(lines: list[str], indent: int) -> list[str]:
    return [x[indent:] if x[:indent].strip() == "" else x.lstrip() for x in lines]


def starts(kind: str, lines: list[str]) -> list[tuple[int, int, str]]:
    """(line, indent, short opening) candidates of one kind in a file's lines."""
    out = []
    if kind in ("library", "test"):
        for i, line in enumerate(lines):
            s = line.lstrip()
            want = s.startswith("def test") if kind == "test" else (s.startswith("def ") and not s.startswith("def test"))
            if want and line.rstrip().endswith(":"):
                indent = len(line) - len(s)
                out.append((i, indent, "\n".join(_dedent(lines[i:i + 3], indent)).rstrip()))
    elif kind == "script":
        for i, line in enumerate(lines):
            if line.startswith(("import ", "from ")):
                out.append((i, 0, "\n".join(lines[i:i + 6]).rstrip()))
                break
    else:  # docs: a docstring with >= 3 lines of prose, or >= 3 comment lines in a row
        for i, line in enumerate(lines):
            s = line.lstrip()
            indent = len(line) - len(s)
            if s.startswith(('"""', "r\"\"\"")) and s.strip() not in ('"""', 'r"""') or s in ('"""', 'r"""'):
                block = lines[i:i + 6]
                prose = [x for x in block[1:] if re.search(r"[A-Za-z]{3,} [A-Za-z]{2,} [A-Za-z]{2,}", x)]
                if len(prose) >= 3:
                    out.append((i, indent, "\n".join(_dedent(block, indent)).rstrip()))
            elif s.startswith("# ") and all(x.lstrip().startswith("#") for x in lines[i:i + 3]) and \
                    (i == 0 or not lines[i - 1].lstrip().startswith("#")):
                block = lines[i:i + 5]
                block = block[:next((k for k, x in enumerate(block) if not x.lstrip().startswith("#")), len(block))]
                out.append((i, indent, "\n".join(_dedent(block, indent)).rstrip()))
    return out


def prompts(kind: str, files: list[Path], n_short: int, n_long: int, salt: str, rng: random.Random,
            per_file: int = 1) -> list[dict]:
    """``n_short`` openings (< 128 tokens) and ``n_long`` longer prompts (128-1,024 tokens, lengths drawn
    log-uniformly) of one kind, at most ``per_file`` from one file, files in an order chosen by hash."""
    short, long_ = [], []
    for f in _ranked(files, salt + kind):
        if len(short) >= n_short and len(long_) >= n_long:
            break
        try:
            text = read_text(f)
        except (OSError, UnicodeDecodeError):
            continue
        if kind == "script" and not (MAIN.search(text) or "turtledemo" in f.parts):
            continue
        lines = text.splitlines()
        taken = 0
        for i, indent, opening in starts(kind, lines):
            if taken == per_file:
                break
            if not (20 <= len(opening) <= 400 and opening.isascii()):
                continue
            tag = f"{kind}:{f.parent.name}/{f.name}:{i + 1}"
            if len(short) < n_short:
                if n_tokens(opening) < 128:
                    short.append({"id": tag, "prompt": opening})
                    taken += 1
            elif len(long_) < n_long:
                target = int(round(2 ** rng.uniform(7, 10)))  # 128 .. 1024 tokens
                body = "\n".join(_dedent(lines[i:i + 400], indent))
                if not body.isascii():
                    continue
                text_n = cut(body, target)
                if n_tokens(text_n) >= 128:
                    long_.append({"id": tag + f":{n_tokens(text_n)}t", "prompt": text_n})
                    taken += 1
    return short + long_


def main() -> int:
    train, val = corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    std_tests = sorted((stdlib / "test").rglob("test_*.py"))
    eval_tests = [f for pkg in ("numpy", "networkx", "matplotlib") for f in sorted((site / pkg).rglob("tests/test_*.py"))]
    demos = sorted((stdlib / "turtledemo").glob("*.py"))
    rng = random.Random(0)
    sets = {
        # name: {kind: (files, n short, n long, per file)}
        "calibration": {"library": (train, 36, 14, 1), "script": (train, 36, 14, 1),
                        "test": (std_tests, 36, 14, 1), "docs": (train, 36, 14, 1)},
        "clean_kinds": {"library": (val, 8, 8, 2), "script": (demos + val, 8, 8, 1),
                        "test": (eval_tests, 8, 8, 1), "docs": (val, 8, 8, 2)},
    }
    for name, kinds in sets.items():
        rows = []
        for kind, (files, n_short, n_long, per_file) in kinds.items():
            got = prompts(kind, files, n_short, n_long, name, rng, per_file)
            print(f"{name} {kind}: {len(got)} prompts, tokens "
                  f"{sorted(n_tokens(r['prompt']) for r in got)}")
            rows += got
        path = ROOT / "data" / "prompts" / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} prompts")
    cal = {r["id"].split(":")[1] for r in map(json.loads, (ROOT / "data/prompts/calibration.jsonl").open())}
    ev = {r["id"].split(":")[1] for r in map(json.loads, (ROOT / "data/prompts/clean_kinds.jsonl").open())}
    assert not cal & ev, f"calibration and evaluation share files: {sorted(cal & ev)[:5]}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
