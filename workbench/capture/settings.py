"""``RecordSettings``: every generation and recording setting of a recording, in one value.

``workbench.record``, ``workbench.record_many`` and the CLI keep their keyword arguments and flags; each builds
one ``RecordSettings`` and hands it down (``record_run``, ``record_batch``, the prompt sets, the Ray actors and
the background recorder take it as it is). Nothing here imports torch: the facade builds settings without it.

What is not a setting of the generation stays beside it: the prompt, the model and tokenizer, the database,
the run's id, parent and extra ``runs`` columns, and live consumers (``progress``, ``on_token``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from workbench.data.signals import PROBES, UNHASHED_PROBES

DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # None: the model's own dtype
PER_PROMPT = ("max_new_tokens", "temperature", "seed")  # what one prompt of a set may override


@dataclass(frozen=True)
class RecordSettings:
    """How to generate and what to record.

    Attributes:
        max_new_tokens: tokens to generate (the first comes with the prompt's forward).
        temperature: 0 = greedy; else sampling at this temperature.
        top_p: nucleus cut (1 = none).
        seed: the sampling seed.
        dtype: None (the model's own), or "float32" / "bfloat16" / "float16" (and fp32 / bf16 / fp16).
        probes: the signals to record (``workbench.data.signals.PROBES``: all of them by default).
        topk: alternatives kept per generated token.
        backend: "auto" | "native" | "transformers": how a DeepseekV3 folder is run.
        device_map: a transformers folder placed across devices by accelerate (single recordings only).

    Built without checks (a prompt set's per-prompt override may be bad for that prompt alone); ``check()``
    raises the one-line ``ValueError`` a recording raises before it loads a model or writes a row.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    dtype: str | None = None
    probes: tuple[str, ...] = PROBES
    topk: int = 5
    backend: str = "auto"
    device_map: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.probes, str):  # a lone name, not its letters
            object.__setattr__(self, "probes", (self.probes,))
        elif not isinstance(self.probes, tuple):
            object.__setattr__(self, "probes", tuple(self.probes))

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, settings: RecordSettings | None = None, **kw: Any) -> RecordSettings:
        """``settings`` (default: the defaults) with the keyword fields given; a TypeError names unknown ones."""
        unknown = set(kw) - set(cls.names())
        if unknown:
            raise TypeError(f"unknown recording settings {sorted(unknown)}; RecordSettings has {list(cls.names())}")
        base = settings if settings is not None else cls()
        if not isinstance(base, RecordSettings):
            raise TypeError(f"settings must be a RecordSettings, got {type(base).__name__}")
        return dataclasses.replace(base, **kw) if kw else base

    @classmethod
    def of_run(cls, info: dict) -> RecordSettings:
        """The settings a recorded run ran with, from its ``runs`` row (``params`` and ``seed``), to run it again
        (replay). The dtype and backend are the reloaded model's own (``resolve.load_for_run``)."""
        p = json.loads(info.get("params") or "{}")
        return cls(max_new_tokens=int(p.get("max_new_tokens", 64)), temperature=float(p.get("temperature", 0.0)),
                   top_p=float(p.get("top_p", 1.0)), seed=int(info.get("seed") or 0),
                   probes=tuple(p.get("probes") or PROBES), topk=int(p.get("topk", 5)))

    def for_item(self, item: dict) -> RecordSettings:
        """These settings with a prompt set item's own ``max_new_tokens`` / ``temperature`` / ``seed``."""
        over = {k: item[k] for k in PER_PROMPT if k in item}
        return dataclasses.replace(self, **over) if over else self

    # -- checking ---------------------------------------------------------------------------------
    def check(self) -> RecordSettings:
        """ValueError (one line) for settings no recording can run with; returns self."""
        if self.dtype not in (None, *DTYPE_NAMES):
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        check_generation(self.max_new_tokens, self.temperature, self.top_p, self.seed, self.topk)
        unknown = set(self.probes) - set(PROBES)
        if unknown:
            raise ValueError(f"unknown probes {sorted(unknown)}; choose from {PROBES}")
        if not self.probes:
            raise ValueError(f"no probes chosen: a run would record nothing; choose from {PROBES}")
        return self

    @property
    def probe_names(self) -> list[str]:
        """The probes, each once, in the order given."""
        return list(dict.fromkeys(self.probes))

    # -- what is stored ---------------------------------------------------------------------------
    def params(self, prompt_ids: list[int], backend: str) -> dict:
        """The run's ``params`` column (``backend``: the adapter's, which "auto" resolved to)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "topk": self.topk, "probes": sorted(self.probe_names), "prompt_ids": prompt_ids, "backend": backend}

    def batch_dict(self) -> dict:
        """The settings a prompt set's default batch id hashes (``prompt_sets.batch_id_for``): the same keys and
        values as before ``RecordSettings`` existed, so an existing shard folder resumes under the same id."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "dtype": self.dtype,
                "probes": sorted(p for p in self.probes if p not in UNHASHED_PROBES), "topk": self.topk,
                "backend": self.backend}


def check_generation(max_new_tokens, temperature, top_p, seed, topk) -> None:
    """ValueError (one line) for settings no generation can run with; called before any run row exists."""
    def number(name, v, kind=(int, float)):
        if isinstance(v, bool) or not isinstance(v, kind):
            raise ValueError(f"{name} must be a number, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v!r}")
        return v

    if number("max_new_tokens", max_new_tokens, int) < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (the first new token comes with the prompt's forward), "
                         f"got {max_new_tokens}")
    if number("temperature", temperature) < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < number("top_p", top_p) <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus cut), got {top_p}")
    number("seed", seed, int)
    if number("topk", topk, int) < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
