"""What the operator writes into a Deployment or StatefulSet, and what it reads from one.

Everything applied goes through server-side apply under ``FIELD_MANAGER`` without force, and holds only items of
map-keyed lists (volumes and initContainers by name, volumeMounts by mountPath, env by name, containers by name)
and map keys (annotations, labels). Such items can be co-owned with the user's manager (Argo CD, Flux, kubectl),
so applying them never conflicts with a GitOps tool that re-applies the user's manifest.

Two fields are scalars or atomic lists that the user usually owns: the container's ``args`` and
``resources.limits.memory``. The operator applies ``limits.memory`` only when no other manager owns it; when
another one does, the user's limit must already fit the cpu tier (else the target is refused and the condition
gives the number to write). ``args`` is written only with ``spec.injection.args: managed``, as a
resourceVersion-guarded strategic-merge update (an Update never conflicts; it is for clusters without GitOps).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from .api.units import format_quantity, parse_quantity
from .render import RenderedConfig, TargetFacts
from .render.model import SHM_VOLUME
from .settings import CONFIG_HASH_ANNOTATION, FIELD_MANAGER, POLICY_LABEL

KINDS = {"Deployment": "deployments", "StatefulSet": "statefulsets"}
CLEANUP_CONTAINER = "kvtier-shm-cleanup"
CLEANUP_SCRIPT = "rm -f /dev/shm/vllm_offload_*.mmap"


@dataclass(frozen=True)
class Workload:
    """The parts of a Deployment or StatefulSet the operator reasons about."""

    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        kind: str = self.obj["kind"]
        return kind

    @property
    def name(self) -> str:
        name: str = self.obj["metadata"]["name"]
        return name

    @property
    def namespace(self) -> str:
        namespace: str = self.obj["metadata"].get("namespace", "")
        return namespace

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def labels(self) -> dict[str, str]:
        return self.obj["metadata"].get("labels") or {}

    @property
    def applied_by(self) -> Optional[str]:
        """Policy whose configuration the workload carries (our label), if any."""
        return self.labels.get(POLICY_LABEL)

    @property
    def containers(self) -> list[dict[str, Any]]:
        return self.obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []

    def container(self, name: Optional[str]) -> Optional[dict[str, Any]]:
        if not self.containers:
            return None
        if name is None:
            return self.containers[0]
        return next((c for c in self.containers if c.get("name") == name), None)

    @property
    def config_hash(self) -> Optional[str]:
        template_meta = self.obj.get("spec", {}).get("template", {}).get("metadata") or {}
        return (template_meta.get("annotations") or {}).get(CONFIG_HASH_ANNOTATION)

    def rolled_out(self) -> bool:
        """Whether the controller has caught up with the current pod template (no rollout in progress)."""
        meta, status = self.obj["metadata"], self.obj.get("status") or {}
        if status.get("observedGeneration", 0) < meta.get("generation", 0):
            return False
        replicas: int = self.obj.get("spec", {}).get("replicas", 1)
        updated: int = status.get("updatedReplicas", 0)
        return updated >= replicas

    def field_owners(self, path: Iterable[str]) -> set[str]:
        """Managers owning ``path`` (fieldsV1 keys, e.g. ``f:spec``, ``k:{"name":"vllm"}``)."""
        path = list(path)
        owners = set()
        for entry in self.obj["metadata"].get("managedFields") or []:
            if entry.get("subresource"):
                continue
            node = entry.get("fieldsV1") or {}
            for key in path:
                node = _child(node, key)
                if node is None:
                    break
            else:
                owners.add(entry.get("manager", ""))
        return owners


def _child(node: dict[str, Any], key: str) -> Optional[dict[str, Any]]:
    if key in node:
        child: Optional[dict[str, Any]] = node[key]
        return child
    if key.startswith("k:"):
        # Keys of keyed list items are JSON objects; compare them parsed, not as text.
        want = json.loads(key[2:])
        for k, v in node.items():
            if k.startswith("k:") and json.loads(k[2:]) == want:
                found: Optional[dict[str, Any]] = v
                return found
    return None


def container_path(container: str, *rest: str) -> list[str]:
    return ["f:spec", "f:template", "f:spec", "f:containers", "k:" + json.dumps({"name": container},
                                                                                 separators=(",", ":")), *rest]


def facts_of(container: dict[str, Any]) -> TargetFacts:
    return TargetFacts(container_name=container.get("name", ""), image=container.get("image", ""),
                       command=tuple(container.get("command") or ()), args=tuple(container.get("args") or ()))


# ---------------------------------------------------------------------------------------------- arguments


def _normalized(words: list[str]) -> list[str]:
    out: list[str] = []
    for w in words:
        if w.startswith("--") and "=" in w:
            out += w.split("=", 1)
        else:
            out.append(w)
    return out


def _pairs(config_args: list[str]) -> list[list[str]]:
    """``config_args`` as its (flag, value) pairs: each must be passed, in any order and place."""
    return [config_args[i:i + 2] for i in range(0, len(config_args), 2)]


def _passes(words: list[str], pair: list[str]) -> bool:
    n = len(pair)
    return any(words[i:i + n] == pair for i in range(len(words) - n + 1))


def has_config_args(container: dict[str, Any], config_args: list[str]) -> bool:
    """Whether command+args pass every (flag, value) pair of ``config_args`` (``--config X`` or ``--config=X``),
    each anywhere."""
    words = _normalized(list(container.get("command") or []) + list(container.get("args") or []))
    return all(_passes(words, pair) for pair in _pairs(config_args))


def with_config_args(args: list[str], config_args: list[str]) -> list[str]:
    """``args`` with the pairs of ``config_args`` they lack appended."""
    out = list(args)
    for pair in _pairs(config_args):
        if not _passes(_normalized(out), pair):
            out += pair
    return out


def without_config_args(args: list[str], config_args: list[str]) -> list[str]:
    out = list(args)
    for pair in _pairs(config_args):
        n, kept, i = len(pair), [], 0
        while i < len(out):
            if out[i:i + n] == pair:
                i += n
                continue
            kept.append(out[i])
            i += 1
        out = kept
    return out


# ---------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryPlan:
    """Outcome of the headroom check: refuse (with the reason), or the limit to apply (None: leave it)."""

    refused: Optional[str] = None
    apply_limit: Optional[str] = None


def plan_memory(workload: Workload, container: dict[str, Any], rendered: RenderedConfig,
                node_allocatable: Optional[int]) -> MemoryPlan:
    if rendered.host_memory is None:
        return MemoryPlan()
    increase, cpu = rendered.host_memory.limit_increase_bytes, rendered.host_memory.cpu_tier_bytes
    resources = container.get("resources") or {}
    request_raw = (resources.get("requests") or {}).get("memory")
    limit_raw = (resources.get("limits") or {}).get("memory")
    request = parse_quantity(request_raw) if request_raw is not None else 0
    need = request + increase
    name = container.get("name", "")
    sums = (f"memory request {format_quantity(request)} + cpu tier {format_quantity(cpu)} + headroom "
            f"{format_quantity(increase - cpu)} = {format_quantity(need)}")
    if limit_raw is None:
        # No limit: adding one would only constrain the pod. The node is the bound, when we can see nodes.
        if node_allocatable is not None and need > node_allocatable:
            return MemoryPlan(refused=f"container {name!r} needs {sums}, more than the largest node's allocatable "
                                      f"memory {format_quantity(node_allocatable)}; shrink the cpu tier")
        return MemoryPlan()
    limit = parse_quantity(limit_raw)
    owners = workload.field_owners(container_path(name, "f:resources", "f:limits", "f:memory"))
    others = owners - {FIELD_MANAGER}
    if others:
        if need > limit:
            return MemoryPlan(refused=(
                f"container {name!r} needs {sums}, but its memory limit is {format_quantity(limit)} (owned by "
                f"{', '.join(sorted(others))}); set resources.limits.memory to at least {format_quantity(need)} in "
                f"the workload's manifest, or shrink the cpu tier"))
        return MemoryPlan()
    if node_allocatable is not None and need > node_allocatable:
        return MemoryPlan(refused=f"container {name!r} needs {sums}, more than the largest node's allocatable "
                                  f"memory {format_quantity(node_allocatable)}; shrink the cpu tier")
    # Nobody else owns the limit: we keep it sized for the tier (never below a limit nobody claims).
    return MemoryPlan(apply_limit=format_quantity(need if FIELD_MANAGER in owners else max(need, limit)))


# ---------------------------------------------------------------------------------------------- patches


def apply_patch(workload: Workload, container: str, rendered: RenderedConfig, *, policy: str, config_hash: str,
                cleanup_image: str, memory_limit: Optional[str] = None) -> dict[str, Any]:
    """The complete set of fields the operator owns on ``workload`` (server-side apply body)."""
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(rendered.env.items())]
    env += [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": path}}}
            for k, path in sorted(rendered.env_fields.items())]
    main: dict[str, Any] = {"name": container, "volumeMounts": rendered.volume_mounts}
    if env:
        main["env"] = env
    if memory_limit is not None:
        main["resources"] = {"limits": {"memory": memory_limit}}
    pod_spec: dict[str, Any] = {"containers": [main], "volumes": rendered.volumes}
    if any(v["name"] == SHM_VOLUME for v in rendered.volumes):
        # vLLM's cpu tier is an mmap in /dev/shm; a file left by a crashed engine would be reused half-written.
        pod_spec["initContainers"] = [{
            "name": CLEANUP_CONTAINER,
            "image": cleanup_image,
            "command": ["sh", "-c", CLEANUP_SCRIPT],
            "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
        }]
    return {
        "apiVersion": "apps/v1",
        "kind": workload.kind,
        "metadata": {"name": workload.name, "namespace": workload.namespace, "labels": {POLICY_LABEL: policy}},
        "spec": {"template": {"metadata": {"annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
                              "spec": pod_spec}},
    }


_MERGE_KEYS = ("name", "mountPath")
_QUANTITY_KEYS = {"sizeLimit", "memory"}


def _contains(have: Any, want: Any, key: str = "") -> bool:
    """Whether ``have`` already holds everything in ``want`` (lists matched by their merge key)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and _contains(have[k], v, k) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        for item in want:
            merge_key = next((k for k in _MERGE_KEYS if isinstance(item, dict) and k in item), None)
            if merge_key is None:
                return have == want
            match = next((h for h in have if isinstance(h, dict) and h.get(merge_key) == item[merge_key]), None)
            if match is None or not _contains(match, item):
                return False
        return True
    if key in _QUANTITY_KEYS and have != want:
        try:  # the server stores quantities canonically (18253611008 -> 17Gi)
            return bool(parse_quantity(str(have)) == parse_quantity(str(want)))
        except ValueError:
            return False
    return bool(have == want)


def already_applied(workload: Workload, body: dict[str, Any]) -> bool:
    """True when the workload already carries ``body`` and the operator's apply entry exists: applying again
    would be a no-op, so the write is skipped (a changed or removed item makes this False, and it is re-applied)."""
    ours = any(m.get("manager") == FIELD_MANAGER and m.get("operation") == "Apply" and not m.get("subresource")
               for m in workload.obj["metadata"].get("managedFields") or [])
    return ours and _contains(workload.obj, {"metadata": body["metadata"], "spec": body["spec"]})


def removal_patch(workload: Workload) -> dict[str, Any]:
    """Applying this as ``FIELD_MANAGER`` releases every field the operator owns; unshared ones disappear."""
    return {"apiVersion": "apps/v1", "kind": workload.kind,
            "metadata": {"name": workload.name, "namespace": workload.namespace}}


def args_update(workload: Workload, container: str, args: list[str]) -> dict[str, Any]:
    """Strategic-merge patch replacing one container's args, guarded by the observed resourceVersion."""
    return {
        "metadata": {"resourceVersion": workload.obj["metadata"]["resourceVersion"]},
        "spec": {"template": {"spec": {"containers": [{"name": container, "args": args}]}}},
    }
