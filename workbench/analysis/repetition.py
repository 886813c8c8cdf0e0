"""Degenerate generation read off a run's generated token ids: the commonest visible failure of a language model.

- a loop: a stretch of generated tokens that repeats a unit of 1-32 tokens at least three times over, with at
  least ``min_loop`` tokens repeated (``_path_to_path_to_path_to...``);
- a repeated n-gram: the same ``ngram`` tokens generated ``min_copies`` times or more (not inside a loop);
- a copy: ``min_copy`` or more generated tokens in a row that repeat a span of the prompt verbatim.

``spans(tokens)`` lists them (the anomaly detectors' ``repetition`` rows); ``covered_positions(tokens)`` is the
set of positions they cover (the routing tests leave those out: a loop's routing repeats with its tokens, and
the loop is already reported). ``input_loops(tokens)``: loops the prompt itself holds (degenerate input, one info
row each; no detector judges their positions), which ``spans`` leaves out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl


@dataclass(frozen=True)
class Span:
    what: str  # "loop" | "ngram" | "copy"
    pos: int  # first position
    tokens: int  # tokens it covers
    threshold: int  # the minimum that counts
    positions: tuple[int, ...]
    explanation: str


def _quote(texts: list, a: int, b: int) -> str:
    s = "".join(str(x) for x in texts[a:b])
    return repr(s if len(s) <= 40 else s[:37] + "...")


def _sequence(tokens: pl.DataFrame) -> tuple[list, list[int], list, int] | None:
    """(ids, positions, texts, index of the first generated token) of a run's tokens from position 1, or None."""
    t = tokens.filter(pl.col("pos") > 0).sort("pos")
    if t.height == 0:
        return None
    col = "token_id" if "token_id" in t.columns and t["token_id"].null_count() == 0 else "text"
    ids = t[col].to_list()
    texts = t["text"].to_list() if "text" in t.columns else [str(i) for i in ids]
    gen = [i for i, x in enumerate(t["is_prompt"].to_list()) if not x]
    return ids, t["pos"].to_list(), texts, gen[0] if gen else len(ids)


class _Periods:
    """For each period p of 1-32 tokens, how many tokens from each position on repeat the one p back (numpy, once per
    sequence), and the positions where some period reaches a loop (``min_loop`` tokens and two periods): the scans
    below jump between those instead of trying 32 periods at every position (a 4,000-token prompt: ~90 -> ~5 ms)."""

    def __init__(self, ids: list, min_loop: int):
        codes: dict = {}
        a = np.array([codes.setdefault(x, len(codes)) for x in ids], dtype=np.int64)
        n = a.size
        idx = np.arange(n)
        self.runs = np.zeros((33, n), dtype=np.int64)
        cand = np.zeros(n, dtype=bool)
        for p in range(1, min(33, n)):
            eq = np.zeros(n, dtype=bool)
            eq[p:] = a[p:] == a[:-p]
            # the first position >= j where the repetition breaks: run length from j
            self.runs[p] = np.minimum.accumulate(np.where(eq, n, idx)[::-1])[::-1] - idx
            cand |= self.runs[p] >= max(2 * p, min_loop)
        self.cand = np.flatnonzero(cand)

    def next(self, i: int) -> int | None:
        """The first position >= ``i`` where some period could loop, or None."""
        k = int(np.searchsorted(self.cand, i))
        return int(self.cand[k]) if k < self.cand.size else None

    def loop_at(self, i: int, end: int, min_loop: int) -> tuple[int, int] | None:
        """(period, length) of the longest stretch from ``i`` (before ``end``) where each token repeats the one a
        period back (the smallest period of 1-32 tokens among those as long), if at least ``min_loop`` tokens and two
        periods long."""
        best = None
        for p in range(1, 33):
            run = min(int(self.runs[p, i]), end - i)
            if run >= max(2 * p, min_loop) and (best is None or run > best[1] + p):
                best = (p, run)
        return best


def input_loops(tokens: pl.DataFrame, min_loop: int = 12) -> list[Span]:
    """Loops the prompt itself holds (``"a a a a ..."``, a line pasted many times): each from its start in the prompt
    through the generated tokens that go on repeating it. Degenerate input, not generation: what a model computes over
    a repeated span is outside anything clean text shows, so the detectors do not judge those positions."""
    seq = _sequence(tokens)
    return [] if seq is None else _input_loops(seq, _Periods(seq[0], min_loop), min_loop)


def _input_loops(seq: tuple, per: _Periods, min_loop: int) -> list[Span]:
    """``input_loops`` of a ``_sequence`` and its ``_Periods``."""
    ids, pos, texts, g0 = seq
    out: list[Span] = []
    i = 1
    while i < g0:
        i = per.next(i)
        if i is None or i >= g0:
            break
        got = per.loop_at(i, g0, min_loop)  # a loop within the prompt alone
        if got is None:
            i += 1
            continue
        p, run = got
        start, end = i - p, i + run
        while end < len(ids) and ids[end] == ids[end - p]:  # and the generated tokens that go on with it
            end += 1
        out.append(Span("input_loop", pos[start], end - start, min_loop, tuple(pos[start:end]),
                        f"the prompt repeats the {p}-token unit {_quote(texts, start, start + p)} from position "
                        f"{pos[start]} ({end - start} tokens, to position {pos[end - 1]}"
                        f"{', the generation going on with it' if end > g0 else ''}): degenerate input, those "
                        "positions are not judged"))
        i = end
    return out


def spans(tokens: pl.DataFrame, min_loop: int = 12, ngram: int = 8, min_copies: int = 3,
          min_copy: int = 32) -> list[Span]:
    """Loops, repeated n-grams and copies of the prompt in a run's tokens (``pos``, ``token_id`` or ``text``,
    ``is_prompt``), in that order; none inside a loop the prompt itself holds (``input_loops``)."""
    return scan(tokens, min_loop, ngram, min_copies, min_copy)[1]


def scan(tokens: pl.DataFrame, min_loop: int = 12, ngram: int = 8, min_copies: int = 3,
         min_copy: int = 32) -> tuple[list[Span], list[Span]]:
    """(``input_loops``, ``spans``) of a run's tokens, from one sequence and one ``_Periods`` (the detectors need
    both, and the positions they cover)."""
    seq = _sequence(tokens)
    if seq is None:
        return [], []
    ids, pos, texts, g0 = seq
    per = _Periods(ids, min_loop)
    inputs = _input_loops(seq, per, min_loop)
    n = len(ids)
    if g0 >= n:
        return inputs, []
    out: list[Span] = []
    index_of = {p: k for k, p in enumerate(pos)}
    inside = {index_of[x] for s in inputs for x in s.positions}
    covered: set[int] = set(inside)
    # loops: the smallest period p with ids[i] == ids[i - p] over a long stretch of generated positions
    i = max([g0] + [x + 1 for x in inside])
    while i < n:
        i = per.next(i)
        if i is None:
            break
        best = per.loop_at(i, n, min_loop)
        if best is None:
            i += 1
            continue
        p, run = best
        start, end = max(i - p, 0), i + run
        out.append(Span("loop", pos[start], end - start, min_loop, tuple(pos[start:end]),
                        f"generation loops from position {pos[start]}: the {p}-token unit {_quote(texts, start, start + p)} "
                        f"repeated {(end - start) / p:.1f} times ({end - start} tokens, to position {pos[end - 1]})"))
        covered.update(range(start, end))
        i = end
    # repeated n-grams outside the loops
    seen: dict[tuple, list[int]] = {}
    for k in range(g0, n - ngram + 1):
        if any(x in covered for x in range(k, k + ngram)):
            continue
        key = tuple(ids[k:k + ngram])
        if not seen.get(key) or seen[key][-1] + ngram <= k:  # non-overlapping copies
            seen.setdefault(key, []).append(k)
    for key, at in seen.items():
        if len(at) >= min_copies and not any(x in covered for a in at for x in range(a, a + ngram)):
            idx = [x for a in at for x in range(a, a + ngram)]
            out.append(Span("ngram", pos[at[0]], len(at) * ngram, min_copies * ngram, tuple(pos[x] for x in idx),
                            f"the {ngram}-token span {_quote(texts, at[0], at[0] + ngram)} is generated {len(at)} times "
                            f"(positions {', '.join(str(pos[a]) for a in at[:6])})"))
            covered.update(idx)
    # copies of the prompt
    if g0 >= min_copy:
        index: dict[tuple, list[int]] = {}
        for k in range(g0 - min_copy + 1):
            index.setdefault(tuple(ids[k:k + min_copy]), []).append(k)
        k = g0
        while k <= n - min_copy:
            src = index.get(tuple(ids[k:k + min_copy]))
            if not src or any(x in covered for x in range(k, k + min_copy)):
                k += 1
                continue
            length, s0 = min_copy, src[0]
            while k + length < n and s0 + length < g0 and ids[k + length] == ids[s0 + length]:
                length += 1
            out.append(Span("copy", pos[k], length, min_copy, tuple(pos[k:k + length]),
                            f"generation copies {length} tokens of the prompt verbatim (positions {pos[k]}-"
                            f"{pos[k + length - 1]} repeat {pos[s0]}-{pos[s0 + length - 1]})"))
            covered.update(range(k, k + length))
            k += length
    return inputs, out


def covered_positions(tokens: pl.DataFrame) -> set[int]:
    """Every position inside a loop, a repeated n-gram or a copy of the prompt, or a loop of the prompt itself."""
    inputs, found = scan(tokens)
    return {p for s in inputs + found for p in s.positions}
