"""How the scenario talks: numbered steps with a line of why, short notes, the status table and new Events.

The table prints a row whenever what it shows changes (not on every poll), so a wait reads as a short history.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Optional, TextIO

from . import observe

BOLD, DIM, RED, GREEN, YELLOW, RESET = "\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[33m", "\033[0m"


class Reporter:
    def __init__(self, stream: TextIO = sys.stdout, color: Optional[bool] = None, consecutive: Optional[int] = None):
        self.stream = stream
        self.color = stream.isatty() if color is None else color
        self.consecutive = consecutive
        self._last_row: Optional[str] = None
        self._header_shown = False
        self._last_print = 0.0
        self.engine_every_s = 5.0
        self.lines: list[str] = []

    def _c(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self.color else text

    def _print(self, text: str = "") -> None:
        self.lines.append(text)
        print(text, file=self.stream, flush=True)

    def step(self, number: int, total: int, title: str, why: str = "") -> None:
        self._print()
        self._print(self._c(BOLD, f"[{number}/{total}] {title}"))
        if why:
            for line in why.splitlines():
                self._print(self._c(DIM, f"      {line}"))
        self._header_shown = False
        self._last_row = None

    def note(self, text: str) -> None:
        self._print(f"      {text}")

    def ok(self, text: str) -> None:
        self._print(f"      {self._c(GREEN, 'ok')} {text}")

    def warn(self, text: str) -> None:
        self._print(f"      {self._c(YELLOW, '!!')} {text}")

    def error(self, text: str) -> None:
        self._print(self._c(RED, text))

    def event(self, type_: str, reason: str, message: str) -> None:
        color = YELLOW if type_ == "Warning" else DIM
        self._print(f"      {self._c(color, f'event {type_} {reason}')}: {message}")

    def table(self, snap: observe.Snapshot, force: bool = False) -> None:
        row = observe.row(snap, self.consecutive)
        # All but the time and a real engine's ever-moving counters: those print every engine_every_s at most.
        content = observe.row(dataclasses.replace(snap, at=0.0, engine={}), self.consecutive)
        now = time.monotonic()
        if not force and content == self._last_row and not (
                snap.engine and now - self._last_print >= self.engine_every_s):
            return
        self._last_print = now
        if not self._header_shown:
            self._print(self._c(DIM, "      " + observe.header()))
            self._header_shown = True
        self._last_row = content
        self._print("      " + row)
