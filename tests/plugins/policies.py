"""Fixtures of the policy and trace-replay tests: the public Mooncake trace the repository carries.

`tests/data/mooncake-synthetic.jsonl` is Mooncake's FAST'25 synthetic trace (Apache-2.0, `tests/data/LICENSE-mooncake`).
It is part of the repository, so a missing file is a broken checkout and fails the test instead of skipping it.
"""
from __future__ import annotations

import pathlib

import pytest

TRACE_NAME = "mooncake-synthetic.jsonl"
DATA_DIR = pathlib.Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="session")
def mooncake_trace_path() -> pathlib.Path:
    path = DATA_DIR / TRACE_NAME
    assert path.is_file(), f"{path} is missing: it is part of the repository (git checkout -- tests/data)"
    return path


@pytest.fixture(scope="session")
def mooncake_trace(mooncake_trace_path):
    from kvtier_runtime.replay.trace import load_trace

    return load_trace(mooncake_trace_path)
