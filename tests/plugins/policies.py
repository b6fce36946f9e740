"""Fixtures of the policy and trace-replay tests: the Mooncake-style trace in tests/data/, and generated traces.

Tests read nothing outside the repository; KVTIER_TRACE_DIR points at another folder holding the same file.
"""
from __future__ import annotations

import os
import pathlib

import pytest

TRACE_NAME = "mooncake-synthetic.jsonl"


def trace_dir() -> pathlib.Path:
    env = os.environ.get("KVTIER_TRACE_DIR")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="session")
def mooncake_trace_path() -> pathlib.Path:
    path = trace_dir() / TRACE_NAME
    if not path.is_file():
        pytest.skip(f"{TRACE_NAME} not found under {trace_dir()} (set KVTIER_TRACE_DIR)")
    return path


@pytest.fixture(scope="session")
def mooncake_trace(mooncake_trace_path):
    from kvtier_runtime.replay.trace import load_trace

    return load_trace(mooncake_trace_path)
