"""The engine's ``--config`` file, rendered by kvtier's operator exactly as it renders it for a pod.

Imports ``kvtier_operator.render`` in-process (it needs pydantic, pyyaml and cel-python, which the engine env
carries); nothing here imports vLLM.
"""
from __future__ import annotations

import copy
import pathlib
from typing import Any

BASE_POLICY: dict[str, Any] = {
    "apiVersion": "kvtier.io/v1alpha1",
    "kind": "KVCachePolicy",
    "metadata": {"name": "engine-test", "namespace": "default"},
    "spec": {
        "selector": {"matchLabels": {"app": "engine-test"}},
        "engine": "vllm",
        "backend": "kvtier",
        "blockSize": 32,  # vLLM's CPU attention takes multiples of 32
        "offload": {"promptOnly": True},
        "tiers": [],
    },
}


def policy_document(**spec: Any) -> dict[str, Any]:
    """A KVCachePolicy with ``spec`` keys overriding :data:`BASE_POLICY`'s."""
    doc = copy.deepcopy(BASE_POLICY)
    doc["spec"].update(copy.deepcopy(spec))
    return doc


def host_tier(size: str | int, **kw: Any) -> dict[str, Any]:
    return {"name": "host", "medium": "cpu", "size": size, **kw}


def fs_tier(path: str, size: str | int, name: str = "disk", **kw: Any) -> dict[str, Any]:
    return {"name": name, "medium": "filesystem", "size": size, "path": path, "volume": {"emptyDir": {}}, **kw}


def rendered_files(policy: dict[str, Any]) -> dict[str, str]:
    """The files of the rendered ConfigMap (``engine.yaml`` and, for lmcache, its own file)."""
    from kvtier_operator.api.validation import parse_policy
    from kvtier_operator.render import render

    return dict(render(parse_policy(policy)).files)


def render_engine_config(policy: dict[str, Any], out_path: str | pathlib.Path) -> pathlib.Path:
    """Write the rendered ``engine.yaml`` of ``policy`` to ``out_path`` (for ``vllm serve --config``)."""
    from kvtier_operator.render import CONFIG_FILE

    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(rendered_files(policy)[CONFIG_FILE])
    return out
