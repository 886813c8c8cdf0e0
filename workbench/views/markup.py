"""Stored text shown as text: in plotly labels and in Gradio Markdown.

Plotly renders a subset of HTML in titles, legend names, hover text, annotations and tick labels (``<a href>``
becomes a live link, ``<br>`` a line break), so every stored string placed there goes through ``plotly_text``
(``<``, ``>`` and ``&`` as entities).

Gradio's Markdown turns bare URLs (``http://``, ``https://``, ``ftp://``, ``www.``) and e-mail addresses into
links (GitHub-flavoured autolinks) and renders ``$$...$$`` as LaTeX, even in text whose HTML and Markdown syntax
is escaped. ``defuse`` breaks those with an invisible WORD JOINER (U+2060): ``http\u2060://``, ``www\u2060.``,
``a\u2060@b``, ``$\u2060$``; what the reader sees is unchanged. It is applied to a whole Markdown message
whose stored parts are escaped already (``apps.shared.md_text``); ``md_plain`` does both for one value.
"""
from __future__ import annotations

import html
import re

WJ = "\u2060"  # WORD JOINER: invisible, and no line break at it
_SCHEME = re.compile(r"(?i)(https?|ftp)(:)")
_WWW = re.compile(r"(?i)(www)(\.)")
_AT = re.compile(r"(?<=[A-Za-z0-9._+-])@")
_DOLLARS = re.compile(r"\$(?=\$)")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]!~])")


def plotly_text(value) -> str:
    """``value`` as literal text in a plotly title, legend name, hover text, annotation or tick label."""
    return html.escape("" if value is None else str(value), quote=False)


def defuse(markdown: str) -> str:
    """A Markdown message with no autolink and no math left: URL schemes, ``www.``, e-mail addresses and
    ``$$`` broken by an invisible word joiner. For messages whose stored parts are escaped already."""
    s = _SCHEME.sub(rf"\1{WJ}\2", markdown)
    s = _WWW.sub(rf"\1{WJ}\2", s)
    s = _AT.sub(f"{WJ}@", s)
    return _DOLLARS.sub(f"${WJ}", s)


def md_plain(value) -> str:
    """``value`` as literal text inside Gradio Markdown, on one line: HTML escaped, Markdown's inline syntax
    backslash-escaped, no autolink, no math."""
    one_line = " ".join(str(value).splitlines())
    return defuse(html.escape(_MD_SPECIAL.sub(r"\\\1", one_line), quote=True))
