"""Control characters from user input (a URL, a path, a server's error message) reach no condition, target
message, Event or operator log line unescaped: a terminal escape (ESC), a backspace, a bidi override (U+202E), a
line separator would otherwise rewrite what an admin reads in kubectl or the log. One helper escapes them all."""
from __future__ import annotations

import io
import logging

import pytest
from kvtier_operator import handlers, main
from kvtier_operator import reconcile as rc
from kvtier_operator.printable import PrintableFormatter, printable
from kvtier_operator.status import Cond, merge_conditions

HOSTILE = "redis://h:1\x1b[2J\x08\x08\u202egnp.exe\u200b\u2028fake line\u00a0\x00\r\n\x7f\U000e0041"


@pytest.mark.parametrize("char, shown", [
    ("\x1b", "\\x1b"), ("\x08", "\\x08"), ("\x00", "\\x00"), ("\r", "\\x0d"), ("\n", "\\x0a"), ("\x7f", "\\x7f"),
    ("\x9b", "\\x9b"),                      # the C1 control sequence introducer
    ("\u202e", "\\u202e"), ("\u2066", "\\u2066"), ("\u200b", "\\u200b"), ("\ufeff", "\\ufeff"),
    ("\u2028", "\\u2028"), ("\u2029", "\\u2029"), ("\u00a0", "\\xa0"), ("\u3000", "\\u3000"),
    ("\U000e0041", "\\U000e0041"),          # a tag character
])
def test_every_non_printable_character_is_escaped(char, shown):
    assert printable(f"a{char}b") == f"a{shown}b"


def test_printable_text_is_kept_as_it_is():
    for text in ("redis://valkey.kv:6379/0", "café ünïcode 日本語", "a b\tc".replace("\t", " "), ""):
        assert printable(text) == text


def _clean(text: str) -> bool:
    return text.isprintable()


def test_conditions_and_target_messages_are_escaped():
    [cond] = merge_conditions([], [Cond("Ready", "False", "Refused", HOSTILE)], 1, "2026-12-01T08:00:00Z")
    assert _clean(cond["message"]) and "\\x1b[2J" in cond["message"]
    t = rc.TargetPlan("Deployment", "llm", rc.ERROR, HOSTILE)
    assert _clean(t.status()["message"])


def test_events_and_their_log_lines_are_escaped(monkeypatch, caplog):
    posted = []
    monkeypatch.setattr(handlers.kopf, "event", lambda body, **kw: posted.append(kw))
    with caplog.at_level(logging.INFO, logger="kvtier.operator"):
        handlers.post_event({"metadata": {}}, ("ns", "p"), rc.Event("Warning", "Refused", HOSTILE))
    [event] = posted
    assert _clean(event["message"]) and "\\u202e" in event["message"]
    assert all(_clean(r.getMessage()) for r in caplog.records)


def test_every_log_line_of_the_operator_is_escaped(monkeypatch):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    main.install_log_escaping()
    assert isinstance(handler.formatter, PrintableFormatter)
    logging.getLogger("kvtier.operator").warning("SLO guard of %s cannot evaluate: %s", "ns/p", HOSTILE)
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1 and _clean(line[:-1]), repr(line)
