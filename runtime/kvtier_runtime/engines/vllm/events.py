"""KV cache events as vLLM's publisher takes them (``OffloadingEvent``), for both plug-ins that publish them
(the offloading spec's manager and the filesystem secondary tier): whether the engine and a tier enable them,
and events built with only the fields this vLLM has."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import OffloadingEvent, OffloadingSpec

from ...config import ConfigError


def kv_events_enabled(spec: OffloadingSpec) -> bool:
    """vLLM's ``--kv-events-config enable_kv_cache_events`` as the spec sees it (0.33: ``kv_events_config``)."""
    events = getattr(spec, "kv_events_config", None)
    if events is not None:
        return bool(events.enable_kv_cache_events)
    return bool(getattr(spec.config, "enable_kv_cache_events", False))


def tier_kv_events(extra: Mapping[str, Any], index: int | None = None) -> bool:
    """A tier's ``enable_kv_events`` (vLLM's secondary-tier key; default false): its events are published only when
    this and the engine's KV events are both on."""
    value = extra.get("enable_kv_events", False)
    if not isinstance(value, bool):
        where = f"tiers[{index}].config" if index is not None else "secondary_tiers[]"
        raise ConfigError(f"kv_connector_extra_config.{where}.enable_kv_events: {value!r} must be true or false")
    return value


_EVENT_FIELDS = frozenset(getattr(OffloadingEvent, "__dataclass_fields__", ()))


def offloading_event(**fields: Any) -> OffloadingEvent:
    """An OffloadingEvent with the fields this vLLM has (0.32 has no locality/ownership/metadata_only)."""
    if fields.get("metadata_only") and "metadata_only" not in _EVENT_FIELDS:
        fields["removed"] = True
    return OffloadingEvent(**{k: v for k, v in fields.items() if k in _EVENT_FIELDS})
