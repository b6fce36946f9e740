"""Fixtures of the policy and trace-replay tests: where the shared Mooncake-style trace lives.

CI checks the trace out at ../shared/traces/ next to the repository root; KVTIER_TRACE_DIR overrides that.
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
    return pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "traces"


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
