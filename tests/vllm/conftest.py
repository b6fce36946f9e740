"""Tests against the real vLLM 0.33.0 package (marker ``vllm``), run from the env ``.ci/vllm-env`` builds.

Without vLLM each module skips itself (``pytest.importorskip``, the reason names .ci/vllm-env) -- unless ``KVTIER_REQUIRE_VLLM`` is
set (CI sets it), in which case a missing or broken vLLM fails the run instead of skipping it silently.
"""
from __future__ import annotations

import itertools
import os
import pathlib
import sys
import uuid

import pytest

_HERE = pathlib.Path(__file__).parent
# The shared driver (vllm_driver.py) sits beside the tests; it imports vllm, so it cannot be a tests/plugins module.
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

try:
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401  (the deepest module the tests import)

    VLLM_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a vLLM that fails while importing
    VLLM_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    if os.environ.get("KVTIER_REQUIRE_VLLM"):
        raise RuntimeError(
            f"KVTIER_REQUIRE_VLLM is set but vLLM's offloading modules do not import ({VLLM_IMPORT_ERROR}); "
            "build the env with .ci/vllm-env and run pytest with its python"
        ) from exc


def pytest_report_header(config: pytest.Config) -> str:
    if VLLM_IMPORT_ERROR is None:
        import vllm

        return f"vllm: {vllm.__version__} (tests/vllm enabled)"
    return f"vllm: not importable, tests/vllm skipped ({VLLM_IMPORT_ERROR})"


_engine_ids = itertools.count()


@pytest.fixture
def engine_id() -> str:
    """A unique engine id: vLLM's CPU tier maps /dev/shm/vllm_offload_<engine_id>.mmap."""
    return f"kvtier-test-{os.getpid()}-{next(_engine_ids)}-{uuid.uuid4().hex[:8]}"
