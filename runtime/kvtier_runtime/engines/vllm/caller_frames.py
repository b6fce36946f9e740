"""What vLLM does not hand an offloading spec, read from the frames that call it.

vLLM builds the offloading manager and announces requests to it without some facts the manager needs (the device
block count, a request's prompt length, the engine core's input queue); the vLLM code calling it holds them in its
locals a few frames up. :func:`find_in_callers` is the one place that walks those frames: read-only, bounded, and
None where a vLLM calls the manager some other way, so every caller has a fallback.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

T = TypeVar("T")


def find_in_callers(pick: Callable[[dict[str, object]], T | None], start: int, max_frames: int) -> T | None:
    """The first non-None ``pick(frame.f_locals)`` walking up from ``start`` frames above the function calling
    this one (1: its caller), over at most ``max_frames`` frames; None if none has it."""
    try:
        frame: FrameType | None = sys._getframe(start + 1)
    except ValueError:  # fewer frames than start
        return None
    for _ in range(max_frames):
        if frame is None:
            return None
        found = pick(frame.f_locals)
        if found is not None:
            return found
        frame = frame.f_back
    return None


def positive_int(value: object, minimum: int) -> int | None:
    """``value`` if it is an int (not a bool) of at least ``minimum``, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    return None
