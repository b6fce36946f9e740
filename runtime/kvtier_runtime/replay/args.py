"""Command-line pieces that ``kvtier replay`` and ``kvtier replay recommend`` share (in a module of their own so
that neither command's module imports the other's)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

PROG = "kvtier replay"
DEFAULT_BLOCK_TOKENS = 512


def number_arg(name: str, cast: type[int] | type[float] = float, *,
               allow_zero: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number > 0 (or >= 0) whose error names the option."""
    what = "an integer" if cast is int else "a number"
    rule = "a finite number >= 0" if allow_zero else ("a positive integer" if cast is int else "a finite number > 0")

    def parse(text: str) -> float:
        try:
            value: float = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {text!r} is not {what}") from None
        if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):  # NaN fails both
            raise argparse.ArgumentTypeError(f"{name}: {text!r} must be {rule}")
        return value
    return parse


def one_line_error(parser: argparse.ArgumentParser) -> Callable[[str], NoReturn]:
    """argparse's ``error`` without the usage block: the docs promise one line on stderr and exit status 2."""
    def error(message: str) -> NoReturn:
        parser.exit(2, f"{PROG}: error: {message} (see {PROG} --help)\n")
    return error
