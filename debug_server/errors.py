"""Errors in one line: what every page, log line and CLI message says about an exception.

A page's error is one line ("rank 3: unreachable after 2.0 s (...)"), never a traceback, and an
exception's text can span lines (JSON decode errors, aiohttp's, torch's) or be empty. Every
module that quotes an exception quotes it through :func:`first_line`.
"""

from __future__ import annotations


def first_line(e: BaseException, limit: int = 300, *, empty: str | None = None) -> str:
    """The first non-blank line of ``str(e)``, cut to ``limit`` characters.

    An exception without text gives ``empty``, by default its type name (``TimeoutError``),
    so that a message never ends in an empty pair of parentheses.
    """
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__ if empty is None else empty
    return lines[0].strip()[:limit]


__all__ = ["first_line"]
