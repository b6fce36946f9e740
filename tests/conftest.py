"""Test-wide configuration.

Every module in tests/plugins/ is registered as a pytest plugin, so each area of the project (control plane,
Prometheus, runtime fixtures) keeps its fixtures in a file of its own instead of growing one conftest.
"""
import pathlib

pytest_plugins = sorted(
    f"plugins.{path.stem}"
    for path in (pathlib.Path(__file__).parent / "plugins").glob("*.py")
    if path.stem != "__init__"
)
