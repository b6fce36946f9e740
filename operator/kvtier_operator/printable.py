"""The one escape for text built from user input on its way to conditions, Events and the operator's log.

A URL, a path or a server's error message can carry control characters: a terminal escape (ESC), a backspace that
hides what precedes it, a bidi override (U+202E) that shows text reversed, zero-width characters, line or paragraph
separators that forge a log line. Every character Python does not call printable (categories Cc, Cf, Cs, Co, Cn,
Zl, Zp and every space but ' ') is written as a visible escape (``\\x1b``, ``\\u202e``); printable non-ASCII text
(accents, CJK) is kept as it is.
"""
from __future__ import annotations

import logging


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (see the module's doc)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


class PrintableFormatter(logging.Formatter):
    """Escapes the message of every log line (its arguments included); a traceback keeps its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        saved = record.message
        record.message = printable(saved)
        try:
            return super().formatMessage(record)
        finally:
            record.message = saved
