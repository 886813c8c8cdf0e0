"""Prompt sets: a JSONL file (one object per line with ``prompt`` and optional ``id``, ``max_new_tokens``,
``temperature``, ``seed``), a folder of ``*.txt`` files (one prompt each, sorted by name), or a ``.txt``
file (one prompt per line). Used by ``workbench profile`` and anything else that runs a set of prompts.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

FIELDS = ("prompt", "id", "max_new_tokens", "temperature", "seed")


def load_prompts(path: str | Path) -> list[dict]:
    """The prompts at ``path`` as dicts with at least ``prompt`` and ``id``; ValueError names a bad line."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"{path} holds no *.txt prompt files")
        return [{"prompt": f.read_text(encoding="utf-8"), "id": f.stem} for f in files]
    out = [{**d, "id": str(d.get("id", n))} for n, d in _file_lines(path)]
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def _file_lines(path: Path) -> list[tuple[int, dict]]:
    """(line number, prompt dict) of a prompt file's non-blank lines: a ``.jsonl`` line's object, checked
    (ValueError naming the line), any other file's line as ``{"prompt": line}``."""
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file or folder at {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            out.append((n, {"prompt": line}))
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(d, dict) or not isinstance(d.get("prompt"), str) or not d["prompt"].strip():
            raise ValueError(f"{path}:{n}: each line needs a non-empty string \"prompt\"")
        unknown = set(d) - set(FIELDS)
        if unknown:
            raise ValueError(f"{path}:{n}: unknown keys {sorted(unknown)}; known: {FIELDS}")
        out.append((n, d))
    return out


def prompt_key(item: dict, index: int) -> str:
    """A prompt's key within a batch: its explicit ``id``, else ``<index>:<12 hex of its SHA-256>``."""

    if item.get("id") is not None:
        return str(item["id"])
    return f"{index}:{hashlib.sha256(item['prompt'].encode('utf-8')).hexdigest()[:12]}"


def load_prompt_set(path: str | Path) -> list[dict]:
    """A prompt set for ``workbench record --prompts`` / ``record_many``: dicts with ``prompt``, ``key`` and the
    per-prompt settings given (``max_new_tokens``, ``temperature``, ``seed``).

    - ``FILE.jsonl``: one JSON object a line (``prompt``; optional ``id``, ``max_new_tokens``, ``temperature``,
      ``seed``); blank lines are skipped.
    - ``FILE.txt``: one prompt per line (blank lines skipped).
    - ``DIR``: every ``*.jsonl`` (a set, as above) and every ``*.txt`` (ONE prompt: the whole file, as in
      ``data/prompts``) in it, by file name. Keys get the file's stem as a prefix (``calibration/3``).
    A prompt's key is its ``id`` when given (a ``.txt`` in a folder: its stem), else ``<index>:<text hash>``.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in (".jsonl", ".txt"))
        if not files:
            raise ValueError(f"{path} holds no *.jsonl or *.txt prompt files")
        out: list[dict] = []
        for f in files:
            if f.suffix == ".txt":
                text = f.read_text(encoding="utf-8")
                if text.strip():
                    out.append({"prompt": text, "key": f.stem})
            else:
                out += [{**d, "key": f"{f.stem}/{d['key']}"} for d in load_prompt_set(f)]
        if not out:
            raise ValueError(f"{path} holds no prompts")
        return out
    if path.is_file() and path.suffix not in (".jsonl", ".txt"):
        raise ValueError(f"{path}: a prompt set is a .jsonl or .txt file, or a folder of them")
    items = [d for _, d in _file_lines(path)]
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return [{**{k: v for k, v in d.items() if k != "id"}, "key": prompt_key(d, i)} for i, d in enumerate(items)]
