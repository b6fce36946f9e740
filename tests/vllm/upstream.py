"""Where vLLM's own tests are, and how kvtier's objects are built in their place (tests/vllm/test_vllm_upstream_*).

``.ci/vllm-env`` extracts ``tests/`` of the pinned vllm==0.33.0 sdist (checked by sha256) into the env, at
``<env>/upstream-tests``; ``KVTIER_VLLM_UPSTREAM_TESTS`` points elsewhere. Their modules are imported unchanged
(``tests.v1...``, as vLLM's own CI imports them); only the factories they build their object under test with are
replaced, per *variant*:

* ``vllm`` -- vLLM's own object (the control: every test must pass here, or the harness is wrong);
* ``kvtier-spec`` -- kvtier's ``KvtierOffloadingSpec`` built by vLLM's ``OffloadingSpecFactory`` from
  ``spec_name``/``spec_module_path``, and its manager;
* ``kvtier-policy`` -- vLLM's ``CPUOffloadingManager`` with kvtier's ``CachePolicy`` plug-in
  (``cache_policy_module_path``);
* ``kvtier-tier`` -- vLLM's tiering manager with kvtier's ``SecondaryTierManager`` plug-in (``module_path``).

An exclusion is data, never a silent skip: each test module holds a table ``{(test, variant): reason}``, and
:func:`apply_exclusion` skips with that reason (``pytest -ra`` prints it). A kvtier behaviour that deliberately
differs from vLLM's is named in docs/vllm.md, and the reason names it.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import sys
from types import ModuleType

import pytest

VLLM_TESTS_VERSION = "0.33.0"
ADAPTER = "kvtier_runtime.engines.vllm_adapter"


def upstream_root() -> pathlib.Path:
    configured = os.environ.get("KVTIER_VLLM_UPSTREAM_TESTS")
    return pathlib.Path(configured) if configured else pathlib.Path(sys.prefix) / "upstream-tests"


def import_upstream(module: str) -> ModuleType:
    """Import one of vLLM's test modules (``tests.v1.kv_offload.cpu.test_manager``) from the extracted sdist; skip
    (or fail, under ``KVTIER_REQUIRE_VLLM``) when the env has none."""
    root = upstream_root()
    path = root / (module.replace(".", "/") + ".py")
    if not path.is_file():
        reason = (f"vLLM {VLLM_TESTS_VERSION}'s own tests are not at {root} (.ci/vllm-env extracts them from the "
                  "pinned sdist; KVTIER_VLLM_UPSTREAM_TESTS overrides the place)")
        if os.environ.get("KVTIER_REQUIRE_VLLM"):
            raise RuntimeError(reason)
        pytest.skip(reason, allow_module_level=True)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    loaded = sys.modules.get("tests")
    if loaded is not None and getattr(loaded, "__file__", None) is None:
        # pytest's importlib mode made this project's tests/ the namespace package ``tests``: vLLM's ``tests.v1``
        # is found by adding vLLM's tests/ to it (the two trees share no subpackage name).
        upstream_tests = str(root / "tests")
        if upstream_tests not in list(loaded.__path__):
            loaded.__path__.append(upstream_tests)
    elif loaded is not None and not str(loaded.__file__).startswith(str(root)):
        raise RuntimeError(f"a module named 'tests' is already imported from {loaded!r}; vLLM's tests need the name")
    return importlib.import_module(module)


def apply_exclusion(table: dict[tuple[str, str], str], request: pytest.FixtureRequest, variant: str) -> None:
    """Skip the running test with the reason the module's table gives for (test, variant) or (test, "*")."""
    node = request.node
    name = getattr(node, "originalname", node.name)
    cls = node.cls.__name__ + "." if node.cls is not None else ""
    params = getattr(getattr(node, "callspec", None), "params", {})
    names = [f"{cls}{name}[{k}={v}]" for k, v in params.items() if k != "variant"] + [cls + name]
    if cls:
        names.append(cls.rstrip("."))
    for key in [(n, v) for n in names for v in (variant, "*")]:
        reason = table.get(key)
        if reason:
            pytest.skip(f"not applicable to {variant}: {reason}")
