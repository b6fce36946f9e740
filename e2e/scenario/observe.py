"""What the scenario looks at, gathered in one snapshot, and the status table printed from it.

A snapshot reads the policy (status.tiers, sloState, the guard's last p99s and thresholds, the target's config
hash), the ConfigMap's engine.yaml, the Deployment's ``kvtier.io/config-hash`` and the configuration each
running pod actually loaded, so the scenario can check that all of them agree.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml
from kvtier_operator.kube import Kube, config_map_path, policy_path, workload_path
from kvtier_operator.reconcile import config_map_name
from kvtier_operator.render import CONFIG_FILE, CONTROL_FILE
from kvtier_operator.settings import CONFIG_HASH_ANNOTATION
from kvtier_runtime.store.control import ControlError, parse_control


def _strings(node: Any) -> Iterable[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _keys(node: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k), v
            yield from _keys(v)
    elif isinstance(node, list):
        for v in node:
            yield from _keys(v)


def tiers_in_config(config: Optional[dict[str, Any]], tiers: list[dict[str, Any]]) -> list[str]:
    """Which of the policy's tiers an engine config carries: a cpu tier by a non-zero cpu size key, a
    filesystem tier by its path (vLLM's secondary_tiers root_dir, TensorRT-LLM's disk_cache_path, ...)."""
    if not config:
        return []
    strings = set(_strings(config))
    cpu = any("cpu" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
              for k, v in _keys(config))
    out = []
    for t in tiers:
        if t.get("medium") == "cpu" and cpu or t.get("medium") == "filesystem" and t.get("path") in strings:
            out.append(t["name"])
    return out


@dataclass
class Snapshot:
    at: float
    policy: Optional[dict[str, Any]]
    config_map: Optional[dict[str, Any]]
    workload: Optional[dict[str, Any]]
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod name -> config it loaded
    engine: dict[str, Any] = field(default_factory=dict)  # a real engine's metrics, as Prometheus has them

    # -- policy
    @property
    def status(self) -> dict[str, Any]:
        return (self.policy or {}).get("status") or {}

    @property
    def declared_tiers(self) -> list[dict[str, Any]]:
        return ((self.policy or {}).get("spec") or {}).get("tiers") or []

    def condition(self, type_: str) -> dict[str, Any]:
        return next((c for c in self.status.get("conditions") or [] if c.get("type") == type_), {})

    @property
    def ready(self) -> bool:
        return self.condition("Ready").get("status") == "True"

    @property
    def tier_states(self) -> dict[str, str]:
        return {t["name"]: t.get("state", "?") for t in self.status.get("tiers") or []}

    @property
    def enabled_tiers(self) -> list[str]:
        return [n for n, s in self.tier_states.items() if s == "Enabled"]

    @property
    def slo_state(self) -> str:
        return self.status.get("sloState") or "-"

    @property
    def slo_last(self) -> dict[str, Any]:
        return (self.status.get("slo") or {}).get("last") or {}

    @property
    def breaches(self) -> int:
        return int((self.status.get("slo") or {}).get("consecutiveBreaches") or 0)

    @property
    def status_hash(self) -> Optional[str]:
        targets = self.status.get("targets") or []
        return targets[0].get("configHash") if targets else None

    # -- workload and config
    @property
    def workload_hash(self) -> Optional[str]:
        template = ((self.workload or {}).get("spec") or {}).get("template") or {}
        return ((template.get("metadata") or {}).get("annotations") or {}).get(CONFIG_HASH_ANNOTATION)

    @property
    def workload_volumes(self) -> dict[str, dict[str, Any]]:
        spec = (((self.workload or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        return {v["name"]: v for v in spec.get("volumes") or []}

    @property
    def workload_mounts(self) -> dict[str, str]:
        """mountPath -> volume name, over the template's containers."""
        spec = (((self.workload or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        return {m["mountPath"]: m["name"] for c in spec.get("containers") or [] for m in c.get("volumeMounts") or []}

    @property
    def rendered(self) -> Optional[dict[str, Any]]:
        text = ((self.config_map or {}).get("data") or {}).get(CONFIG_FILE)
        return yaml.safe_load(text) if text else None

    @property
    def rendered_tiers(self) -> list[str]:
        return tiers_in_config(self.rendered, self.declared_tiers)

    @property
    def bypassed_tiers(self) -> list[str]:
        """Rendered tiers the ConfigMap's control file disables (the guard's decisions, applied live)."""
        return control_tiers(((self.config_map or {}).get("data") or {}).get(CONTROL_FILE))

    @property
    def live_tiers(self) -> list[str]:
        """Rendered tiers the engine may use: the rendered ones less the bypassed ones."""
        return [t for t in self.rendered_tiers if t not in self.bypassed_tiers]

    def pod_tiers(self) -> dict[str, list[str]]:
        return {name: tiers_in_config(cfg, self.declared_tiers) for name, cfg in self.pods.items()}

    def agreement(self) -> list[str]:
        """Every way the policy status, the ConfigMap, the workload and the running pods disagree ([] = agree)."""
        problems = []
        enabled, rendered = self.enabled_tiers, self.rendered_tiers
        if self.live_tiers != enabled:
            problems.append(f"ConfigMap renders tiers {rendered} (bypassed live: {self.bypassed_tiers}), "
                            f"status.tiers enables {enabled}")
        if not self.status_hash or self.workload_hash != self.status_hash:
            problems.append(f"workload config-hash {self.workload_hash} != status {self.status_hash}")
        for pod, tiers in self.pod_tiers().items():
            if tiers != rendered:
                problems.append(f"pod {pod} loaded tiers {tiers}, the ConfigMap renders {rendered}")
        if not self.pods:
            problems.append("no pod is running")
        for t in self.declared_tiers:
            if t.get("medium") == "filesystem":
                mounted = t["path"] in self.workload_mounts
                if mounted != (t["name"] in rendered):
                    problems.append(f"tier {t['name']}: volume at {t['path']} "
                                    f"{'still mounted' if mounted else 'missing'} while it is "
                                    f"{'not rendered' if mounted else 'rendered'}")
        return problems


def control_tiers(text: Optional[str]) -> list[str]:
    """The tiers a control file's text disables (the runtime's own parser), [] without a file."""
    if not text:
        return []
    try:
        return sorted(parse_control(text.encode()).disabled)
    except ControlError:
        return []


def snapshot(kube: Kube, namespace: str, policy: str, workload: str, at: float,
             pods: Optional[dict[str, dict[str, Any]]] = None, engine: Optional[dict[str, Any]] = None) -> Snapshot:
    return Snapshot(
        at=at,
        policy=kube.get(policy_path(namespace, policy)),
        config_map=kube.get(config_map_path(namespace, config_map_name(policy))),
        workload=kube.get(workload_path("Deployment", namespace, workload)),
        pods=dict(pods or {}),
        engine=dict(engine or {}),
    )


# ---------------------------------------------------------------------------------------------- a real engine

def _metric(name: str) -> str:
    # Prometheus 2.x stores vLLM's `vllm:` names as `vllm_` (OpenMetrics negotiation); match both.
    return f'{{__name__=~"vllm[:_]{name}"'


def engine_queries(namespace: str, window: str) -> dict[str, str]:
    sel = f'namespace="{namespace}"'
    return {
        "ttft_p99": f"histogram_quantile(0.99, sum by (le) (rate({_metric('time_to_first_token_seconds_bucket')},"
                    f"{sel}}}[{window}])))",
        "stored_bytes": f"sum({_metric('kv_offload_store_bytes_total')},{sel}}})",
        "loaded_bytes": f"sum({_metric('kv_offload_load_bytes_total')},{sel}}})",
        "cached_device": f"sum({_metric('prompt_tokens_cached_by_source_total')},{sel},source=\"device\"}})",
        "cached_host": f"sum({_metric('prompt_tokens_cached_by_source_total')},{sel},source=\"host\"}})",
        "cached_disk": f"sum({_metric('prompt_tokens_cached_by_source_total')},{sel},source=\"disk\"}})",
    }


def engine_cells(engine: dict[str, Any]) -> str:
    """The real engine's columns: its p99 TTFT, KV bytes offloaded and loaded back, prompt tokens cached by
    source (device = vLLM's own cache, host and disk = kvtier's tiers)."""
    if not engine:
        return ""

    def mib(key: str) -> str:
        v = engine.get(key)
        return "-" if v is None else f"{v / 2**20:.0f}"

    def tok(key: str) -> str:
        v = engine.get(key)
        return "-" if v is None else f"{v:.0f}"
    ttft = engine.get("ttft_p99")
    return (f"engine p99 TTFT {_seconds(ttft)}; kv_offload MiB stored/loaded {mib('stored_bytes')}/"
            f"{mib('loaded_bytes')}; cached_by_source tokens device/host/disk {tok('cached_device')}/"
            f"{tok('cached_host')}/{tok('cached_disk')}")


# ---------------------------------------------------------------------------------------------- the table

COLUMNS = ("time", "policy", "tiers", "SLO", "p99 TTFT", "p99 ITL", "breaches", "config hash", "pod: tiers loaded")
WIDTHS = (5, 8, 26, 10, 16, 16, 8, 11, 0)


def _seconds(value: Any) -> str:
    if value is None or value != value:  # None or NaN (no requests in the window)
        return "-"
    v = float(value)
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s"


def _vs(value: Any, threshold: Any) -> str:
    if value is None:
        return "-"
    mark = " !" if threshold is not None and float(value) > float(threshold) else ""
    return f"{_seconds(value)}/{_seconds(threshold)}{mark}" if threshold is not None else _seconds(value)


def _row(cells: Iterable[str]) -> str:
    parts = []
    for cell, width in zip(cells, WIDTHS):
        parts.append(cell.ljust(width) if width else cell)
    return "  ".join(parts).rstrip()


def header() -> str:
    return _row(COLUMNS)


def row(s: Snapshot, consecutive_needed: Optional[int] = None) -> str:
    last = s.slo_last
    thresholds = last.get("thresholds") or {}
    tiers = " ".join(f"{n}={st}" for n, st in s.tier_states.items()) or "-"
    if s.bypassed_tiers:
        tiers += f" (live off: {','.join(s.bypassed_tiers)})"
    pods = ", ".join(f"{name}: {'+'.join(t) or 'gpu only'}"
                     for name, t in s.pod_tiers().items()) or "-"
    need = f"/{consecutive_needed}" if consecutive_needed else ""
    ready = "Ready" if s.ready else (s.condition("Ready").get("reason") or "-")
    line = _row((f"{s.at:4.0f}s", ready[:8], tiers, s.slo_state,
                 _vs(last.get("ttftP99"), thresholds.get("ttftP99")),
                 _vs(last.get("itlP99"), thresholds.get("itlP99")), f"{s.breaches}{need}",
                 (s.workload_hash or "-")[:10], pods))
    if s.engine:
        line += "\n" + " " * (6 + WIDTHS[0] + 2) + engine_cells(s.engine)  # under the row, which Reporter indents by 6
    return line
