"""Counters every codec updates, readable as a dict and exportable as Prometheus metrics.

The codecs must not depend on how the runtime serves metrics, so they only count; the runtime registers
``CodecMetricsCollector`` in whatever ``prometheus_client`` registry it serves (prometheus_client is imported
only when the collector is used) and may subscribe to fallbacks with ``add_fallback_listener``.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

FallbackListener = Callable[[str, str, float], None]
"""Called as ``listener(requested_codec, used_codec, measured_relative_error)`` when a block falls back."""


class CodecStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[FallbackListener] = []
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.blocks: dict[str, int] = defaultdict(int)
            self.input_bytes: dict[str, int] = defaultdict(int)
            self.encoded_bytes: dict[str, int] = defaultdict(int)
            self.fallbacks: dict[tuple[str, str], int] = defaultdict(int)
            self.decode_errors = 0
            self.refusals: dict[tuple[str, str, str], int] = defaultdict(int)

    def record_encode(self, codec: str, input_bytes: int, encoded_bytes: int) -> None:
        with self._lock:
            self.blocks[codec] += 1
            self.input_bytes[codec] += input_bytes
            self.encoded_bytes[codec] += encoded_bytes

    def record_fallback(self, requested: str, used: str, rel_error: float) -> None:
        with self._lock:
            self.fallbacks[(requested, used)] += 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener(requested, used, rel_error)

    def record_refusal(self, requested: str, used: str, reason: str) -> None:
        """A tier asked for ``requested`` where it cannot be checked (``reason``) and stores ``used`` instead."""
        with self._lock:
            self.refusals[(requested, used, reason)] += 1

    def record_decode_error(self) -> None:
        with self._lock:
            self.decode_errors += 1

    def add_fallback_listener(self, listener: FallbackListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_fallback_listener(self, listener: FallbackListener) -> None:
        with self._lock:
            self._listeners.remove(listener)

    def snapshot(self) -> dict[str, Any]:
        """A plain copy of every counter, keyed by the Prometheus metric name it is exported as."""
        with self._lock:
            return {
                "kvtier_runtime_codec_blocks_total": dict(self.blocks),
                "kvtier_runtime_codec_input_bytes_total": dict(self.input_bytes),
                "kvtier_runtime_codec_encoded_bytes_total": dict(self.encoded_bytes),
                "kvtier_runtime_codec_fallbacks_total": dict(self.fallbacks),
                "kvtier_runtime_codec_decode_errors_total": self.decode_errors,
                "kvtier_runtime_codec_refusals_total": dict(self.refusals),
            }


STATS = CodecStats()
add_fallback_listener = STATS.add_fallback_listener
remove_fallback_listener = STATS.remove_fallback_listener


class CodecMetricsCollector:
    """A ``prometheus_client`` custom collector over ``CodecStats``: ``registry.register(CodecMetricsCollector())``."""

    def __init__(self, stats: CodecStats = STATS) -> None:
        self._stats = stats

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily

        snap = self._stats.snapshot()
        per_codec = [
            ("kvtier_runtime_codec_blocks", "Blocks encoded, by the codec that stored them"),
            ("kvtier_runtime_codec_input_bytes", "Uncompressed bytes given to encode, by stored codec"),
            ("kvtier_runtime_codec_encoded_bytes", "Encoded bytes (header + payload) written, by stored codec"),
        ]
        for name, doc in per_codec:
            fam = CounterMetricFamily(name, doc, labels=["codec"])
            for codec, value in sorted(snap[f"{name}_total"].items()):
                fam.add_metric([codec], value)
            yield fam
        fam = CounterMetricFamily(
            "kvtier_runtime_codec_fallbacks",
            "Blocks whose measured error exceeded the requested codec's budget and were stored with a wider codec",
            labels=["requested_codec", "codec"])
        fallbacks: dict[tuple[str, str], int] = snap["kvtier_runtime_codec_fallbacks_total"]
        for (requested, used), value in sorted(fallbacks.items()):
            fam.add_metric([requested, used], value)
        yield fam
        fam = CounterMetricFamily(
            "kvtier_runtime_codec_refusals",
            "Tiers that asked for a codec that cannot be checked there (reason) and store a wider one (codec)",
            labels=["requested_codec", "codec", "reason"])
        refusals: dict[tuple[str, str, str], int] = snap["kvtier_runtime_codec_refusals_total"]
        for (requested, used, reason), value in sorted(refusals.items()):
            fam.add_metric([requested, used, reason], value)
        yield fam
        fam = CounterMetricFamily(
            "kvtier_runtime_codec_decode_errors", "Blocks rejected on decode (corrupt or foreign header, truncation)")
        fam.add_metric([], snap["kvtier_runtime_codec_decode_errors_total"])
        yield fam
