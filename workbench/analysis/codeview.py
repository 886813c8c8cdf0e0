"""Code view: a run's text read as Python: token classes, confidence by class, and a compile check.

Token classes come from the standard library's ``tokenize`` (``CLASSES``):

- ``keyword``: a NAME that ``keyword.iskeyword`` accepts (hard keywords only; ``match``/``case``/``_``
  and other soft keywords are names);
- ``name``: any other NAME (identifiers, builtins, soft keywords);
- ``number``, ``string`` (STRING, f-string parts on Python >= 3.12, and an unterminated triple-quoted
  string up to the end), ``operator`` (OP: punctuation, brackets, operators), ``comment``;
- ``newline``: NEWLINE and NL tokens, and line breaks between tokens (a backslash continuation's);
- ``indent``: leading whitespace of a line (INDENT tokens and the indentation of unchanged lines);
- ``whitespace``: any other whitespace between tokens;
- ``error``: what ``tokenize`` cannot read (ERRORTOKEN that is not whitespace, e.g. ``$`` or a lone
  quote).

A text ``tokenize`` gives up on (an inconsistent dedent) is tokenized again from the failing line on,
so one bad line does not turn the rest of the text into errors.

Model tokens are mapped onto these classes by character offsets: the run's text is the concatenation
of its tokens' ``text`` (``tokens.text``, in ``pos`` order), so token ``pos`` covers the characters
``[start, end)``; it gets the class covering most of its characters (ties: a non-blank class before
whitespace / indent / newline, so `` b`` is a name, then the class met first in the token). A token
with no characters has class null.

The compile check (``compile_check``) runs ``ast.parse`` on the text as it is and reports the first
syntax error Python finds (line, column, character offset and the model token there). Generated code
is often cut off mid-statement, so an error is called ``incomplete`` when it is only the end of the
text missing: the parser says a bracket ``was never closed``, an unexpected EOF or an unterminated
triple-quoted string, or the error lies past the text's last non-blank character (it ran out of
input: ``return x +``, ``if x``, ``def f():`` with no body yet); an unmatched closing bracket and a
null byte are never incomplete. Anything else is an ``error``: a real mistake. ``ok_lines`` says how
many leading lines parse on their own.
"""
from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize
from collections import Counter
from dataclasses import dataclass

import polars as pl

CLASSES = ("keyword", "name", "number", "string", "operator", "comment", "newline", "indent", "whitespace",
           "error")
_STRING_TYPES = {tokenize.STRING} | {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE",
                                                                     "FSTRING_END") if hasattr(tokenize, n)}
_EOF_MESSAGES = re.compile(r"was never closed|unexpected EOF|"
                           r"unterminated triple-quoted string|EOF while scanning|EOF in multi-line")
_NEVER_INCOMPLETE = re.compile(r"unmatched|closing parenthesis|does not match")


@dataclass(frozen=True)
class Span:
    """One Python token: its class and character offsets ``[start, end)`` in the text."""

    cls: str
    start: int
    end: int
    string: str
    type: str  # tokenize's name: NAME, OP, ...


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for i, ch in enumerate(text):
        if ch == "\n":
            starts.append(i + 1)
    return starts


def _class_of(tok: tokenize.TokenInfo) -> str | None:
    t = tok.type
    if t == tokenize.NAME:
        return "keyword" if keyword.iskeyword(tok.string) else "name"
    if t == tokenize.NUMBER:
        return "number"
    if t in _STRING_TYPES:
        return "string"
    if t == tokenize.OP:
        return "operator"
    if t == tokenize.COMMENT:
        return "comment"
    if t in (tokenize.NEWLINE, tokenize.NL):
        return "newline"
    if t == tokenize.INDENT:
        return "indent"
    if t == tokenize.ERRORTOKEN:
        return "whitespace" if tok.string.isspace() else "error"
    return None  # DEDENT, ENDMARKER, ENCODING: no characters


def python_tokens(text: str) -> list[Span]:
    """The text's Python tokens with a class each (zero-width DEDENT / ENDMARKER left out)."""
    starts = _line_starts(text)
    spans: list[Span] = []
    base = 0  # index of the first line of the part being tokenized
    while base < len(starts) and starts[base] < len(text):
        def at(row: int, col: int, base: int = base) -> int:
            line = base + row - 1
            return min(starts[line] + col, len(text)) if line < len(starts) else len(text)

        restart = None
        try:
            for tok in tokenize.generate_tokens(io.StringIO(text[starts[base]:]).readline):
                cls = _class_of(tok)
                s, e = at(*tok.start), at(*tok.end)
                if cls is not None and e > s:
                    spans.append(Span(cls, s, e, text[s:e], tokenize.tok_name[tok.type]))
        except IndentationError as err:  # an inconsistent dedent: tokenize again from that line on
            where = err.args[1] if len(err.args) > 1 and isinstance(err.args[1], tuple) else None
            restart = max(base + (int(where[1]) - 1 if where else 1), base + 1)
        except (tokenize.TokenError, SyntaxError) as err:
            msg = str(err.args[0]) if err.args else ""
            where = err.args[1] if len(err.args) > 1 and isinstance(err.args[1], tuple) else None
            if "string" in msg and where:  # an unterminated triple-quoted string runs to the end
                s = at(*where[:2])
                spans = [sp for sp in spans if sp.end <= s]
                if s < len(text):
                    spans.append(Span("string", s, len(text), text[s:], "STRING"))
        if restart is None:
            break
        base = restart
    return spans


def char_classes(text: str) -> list[str]:
    """The class of every character of ``text`` (gaps between tokens: newline, indent or whitespace)."""
    out: list[str | None] = [None] * len(text)
    for sp in python_tokens(text):
        for i in range(sp.start, sp.end):
            if out[i] is None:
                out[i] = sp.cls
    line_start = True  # still in the line's leading whitespace
    for i, ch in enumerate(text):
        if out[i] is None:
            if ch in "\r\n":
                out[i] = "newline"
            elif ch in " \t\f":
                out[i] = "indent" if line_start else "whitespace"
            elif ch.isspace() or ch == "\\":
                out[i] = "whitespace"
            else:
                out[i] = "error"
        if ch == "\n":
            line_start = True
        elif ch not in " \t\f\r":
            line_start = False
    return out  # type: ignore[return-value]


def token_offsets(texts: list[str | None]) -> list[tuple[int, int]]:
    """``[start, end)`` of each model token in the concatenated text."""
    out, at = [], 0
    for t in texts:
        n = len(t or "")
        out.append((at, at + n))
        at += n
    return out


BLANK = ("whitespace", "indent", "newline")


def _majority(classes: list[str]) -> str | None:
    """The class of most characters; ties: a non-blank class before a blank one, then the one met first."""
    if not classes:
        return None
    count = Counter(classes)
    best = max(count.values())
    tied = [c for c in classes if count[c] == best]
    return next((c for c in tied if c not in BLANK), tied[0])


def token_classes(tokens: pl.DataFrame) -> pl.DataFrame:
    """Each model token's Python class: ``pos, text, start, end, class`` plus the token columns present
    among ``is_prompt, confidence, entropy, prob``."""
    t = tokens.sort("pos")
    texts = t["text"].to_list()
    text = "".join(x or "" for x in texts)
    chars = char_classes(text)
    offs = token_offsets(texts)
    keep = [c for c in ("is_prompt", "confidence", "entropy", "prob") if c in t.columns]
    return t.select("pos", "text", *keep).with_columns(
        pl.Series("start", [s for s, _ in offs], pl.Int64), pl.Series("end", [e for _, e in offs], pl.Int64),
        pl.Series("class", [_majority(chars[s:e]) for s, e in offs], pl.String)).select(
        "pos", "text", "start", "end", "class", *keep)


def class_summary(classes: pl.DataFrame, generated_only: bool = True) -> pl.DataFrame:
    """Confidence and entropy by token class: ``class, tokens, mean_confidence, median_confidence,
    mean_entropy, low_confidence_share`` (confidence < 0.2), in ``CLASSES`` order; tokens with no
    prediction (position 0) are left out, and with ``generated_only`` the prompt's too."""
    c = classes.filter(pl.col("class").is_not_null() & pl.col("confidence").is_not_null())
    if generated_only and "is_prompt" in c.columns:
        c = c.filter(~pl.col("is_prompt"))
    agg = c.group_by("class").agg(
        pl.len().cast(pl.Int64).alias("tokens"), pl.col("confidence").mean().alias("mean_confidence"),
        pl.col("confidence").median().alias("median_confidence"), pl.col("entropy").mean().alias("mean_entropy"),
        (pl.col("confidence") < 0.2).mean().alias("low_confidence_share"))
    order = {k: i for i, k in enumerate(CLASSES)}
    return agg.sort(pl.col("class").replace_strict(order, default=len(order), return_dtype=pl.Int64))


def code_view(tokens: pl.DataFrame, generated_only: bool = True) -> pl.DataFrame:
    """``class_summary(token_classes(tokens))``: a run's confidence and entropy by Python token class."""
    return class_summary(token_classes(tokens), generated_only)


def _pos_at(offsets: list[tuple[int, int]], offset: int) -> int | None:
    """Index of the token whose characters hold ``offset`` (the last one for the end of the text)."""
    if not offsets:
        return None
    for i, (s, e) in enumerate(offsets):
        if s <= offset < e:
            return i
    nonempty = [i for i, (s, e) in enumerate(offsets) if e > s]
    return nonempty[-1] if nonempty and offset >= offsets[nonempty[-1]][0] else (nonempty[0] if nonempty else None)


def _parses(src: str) -> bool:
    try:
        ast.parse(src)
        return True
    except (SyntaxError, ValueError):
        return False


def compile_check(text: str, token_texts: list[str | None] | None = None, pos0: int = 0) -> dict:
    """``ast.parse`` the text as it is; the first syntax error and where it is.

    Args:
        text: the source (a run's text).
        token_texts: the model tokens' texts whose concatenation is ``text``: the error's token ``pos``
            is found through them (``pos0`` + index).

    Returns ``{"status": "ok" | "incomplete" | "error", "ok": bool, "message", "line", "col" (1-based,
    as Python reports them), "offset" (0-based character offset into the text), "pos", "ok_lines" (leading
    lines that parse alone), "lines"}``; the error fields are None when the text parses.
    """
    lines = text.split("\n")
    n_lines = len(lines) - (1 if text.endswith("\n") else 0)
    out = {"status": "ok", "ok": True, "message": None, "line": None, "col": None, "offset": None, "pos": None,
           "ok_lines": n_lines, "lines": n_lines}
    try:
        ast.parse(text)
        return out
    except (SyntaxError, ValueError) as e:
        err = e
    starts = _line_starts(text)
    msg = str(err.args[0]) if err.args else type(err).__name__
    line = getattr(err, "lineno", None)
    col = getattr(err, "offset", None)
    if line is None:  # e.g. null bytes: Python gives no position
        i = text.find("\0")
        offset = i if i >= 0 else len(text)
        line = text.count("\n", 0, offset) + 1
        col = offset - starts[line - 1] + 1
    else:
        line = max(1, min(int(line), len(starts)))
        col = max(1, int(col or 1))
        offset = min(starts[line - 1] + col - 1, len(text))
    last = len(text.rstrip()) - 1  # the last non-blank character
    incomplete = (getattr(err, "lineno", None) is not None and not _NEVER_INCOMPLETE.search(msg)
                  and (bool(_EOF_MESSAGES.search(msg)) or offset > last))
    ok_lines = 0
    for n in range(min(line - 1, n_lines), 0, -1):
        if _parses("\n".join(lines[:n]) + "\n"):
            ok_lines = n
            break
    pos = None
    if token_texts is not None:
        i = _pos_at(token_offsets(token_texts), offset)
        pos = None if i is None else pos0 + i
    out.update(status="incomplete" if incomplete else "error", ok=False, message=msg, line=line, col=col,
               offset=offset, pos=pos, ok_lines=ok_lines)
    return out


def run_compile_check(tokens: pl.DataFrame) -> dict:
    """``compile_check`` of a run's text (its ``tokens`` frame), the error mapped to a token ``pos``."""
    t = tokens.sort("pos")
    texts = t["text"].to_list()
    pos0 = int(t["pos"][0]) if t.height else 0
    return compile_check("".join(x or "" for x in texts), texts, pos0)
