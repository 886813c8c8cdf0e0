"""Prompt sets: a JSONL file (one object per line with ``prompt`` and optional ``id``, ``max_new_tokens``,
``temperature``, ``seed``), a folder of ``*.txt`` files (one prompt each, sorted by name), or a ``.txt``
file (one prompt per line). Used by ``workbench profile`` and anything else that runs a set of prompts.
"""
from __future__ import annotations

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
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file or folder at {path}")
    out: list[dict] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                d = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("prompt"), str) or not d["prompt"].strip():
                raise ValueError(f"{path}:{n}: each line needs a non-empty string \"prompt\"")
            unknown = set(d) - set(FIELDS)
            if unknown:
                raise ValueError(f"{path}:{n}: unknown keys {sorted(unknown)}; known: {FIELDS}")
            out.append({**d, "id": str(d.get("id", n))})
        else:
            out.append({"prompt": line, "id": str(n)})
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out
