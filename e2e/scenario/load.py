"""The load: a small, bounded client replaying prefix-sharing requests from a Mooncake-format trace.

Mooncake's trace gives each request the hash ids of its prompt's blocks; requests that share a prefix share the
leading ids. Here each hash id becomes a fixed block of the model's token ids of prose (the same id, the same
tokens; ``vllm_cpu.prose.block``), so prefix reuse in the trace is prefix reuse in the engine. Only the requests whose first block another request shares are
replayed (they are what a KV-cache tier is for), in trace order, capped at ``max_blocks`` blocks, one at a
time at most ``rate`` a second. The client measures each request's time to first token from the stream.
"""
from __future__ import annotations

import collections
import json
import math
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

BLOCK_TOKENS = 32


def trace_prompts(path: Path, limit: int, max_blocks: int, corpus: list[int],
                  block_tokens: int = BLOCK_TOKENS) -> list[list[int]]:
    """The prompts (token ids) of the trace's prefix-sharing requests, each block a block of ``corpus`` (the
    model's token ids of ``vllm_cpu.prose``)."""
    from kvtier_runtime.replay.trace import load_trace  # the one Mooncake reader (TraceError names the line)
    from vllm_cpu.prose import block

    rows = [ids for ids in load_trace(path).requests if ids]
    firsts = collections.Counter(ids[0] for ids in rows)
    shared = [ids for ids in rows if firsts[ids[0]] >= 2][:limit]
    blocks: dict[int, list[int]] = {}
    prompts = []
    for ids in shared:
        prompt: list[int] = []
        for h in ids[:max_blocks]:
            if h not in blocks:
                blocks[h] = block(corpus, h, block_tokens)
            prompt += blocks[h]
        prompts.append(prompt)
    return prompts


@dataclass
class Sample:
    at: float
    phase: str
    ttft: Optional[float]  # None: failed (no pod serving, or an error)
    error: str = ""


@dataclass
class TraceLoad:
    prompts: list[list[int]]
    url: Callable[[], Optional[str]]   # the serving pod's URL now (None while none serves)
    rate: float = 1.0
    max_tokens: int = 2
    timeout_s: float = 60.0
    phase: str = "warm-up"
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._next = 0
        self._lock = threading.Lock()

    def start(self) -> TraceLoad:
        self._thread = threading.Thread(target=self._run, name="trace-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 5)

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            url = self.url()
            phase = self.phase
            if url is None:
                self._stop.wait(0.5)
                continue
            prompt = self.prompts[self._next % len(self.prompts)]
            self._next += 1
            try:
                ttft = self._request(url, prompt)
                sample = Sample(time.monotonic(), phase, ttft)
            except (OSError, ValueError) as err:
                sample = Sample(time.monotonic(), phase, None, str(err)[:200])
                self._stop.wait(1.0)
            with self._lock:
                self.samples.append(sample)
            self._stop.wait(max(0.0, 1.0 / self.rate - (time.monotonic() - began)))

    def _request(self, url: str, prompt: list[int]) -> float:
        body = {"model": "model", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    ttft = time.monotonic() - t0
                    for _ in r:  # drain the rest of the stream
                        pass
                    return ttft
        raise ValueError("the stream ended without a token")

    # -- results
    def ttfts(self, phase: str) -> list[float]:
        with self._lock:
            return [s.ttft for s in self.samples if s.phase == phase and s.ttft is not None]

    def summary(self, phase: str) -> PhaseStats:
        return PhaseStats.of(phase, self.ttfts(phase))


@dataclass
class PhaseStats:
    phase: str
    n: int
    p50: Optional[float]
    p99: Optional[float]

    @classmethod
    def of(cls, phase: str, values: list[float]) -> PhaseStats:
        if not values:
            return cls(phase, 0, None, None)
        v = sorted(values)
        return cls(phase, len(v), statistics.median(v), v[math.ceil(0.99 * len(v)) - 1])  # nearest rank

    def __str__(self) -> str:
        if not self.n:
            return f"{self.phase}: no completed request"
        return f"{self.phase}: p50 {self.p50:.2f}s, p99 {self.p99:.2f}s over {self.n} requests"


def p99_back_under(samples: list[Sample], since: float, budget: float, window: float) -> Optional[float]:
    """Seconds from ``since`` (a slowdown) until the p99 TTFT of the requests completed in the trailing ``window``
    (the SLO guard's window, measured by the client) is at or under ``budget`` for good: at the first completion
    after the last one whose window was over it. A failed request counts as over. 0.0 when no window after
    ``since`` was over; None when the last one still is."""
    ordered = sorted(samples, key=lambda x: x.at)
    verdicts = []
    for x in ordered:
        if x.at < since:
            continue
        ttfts = [math.inf if y.ttft is None else y.ttft for y in ordered if x.at - window < y.at <= x.at]
        p99 = PhaseStats.of("", ttfts).p99
        verdicts.append((x.at, p99 is not None and p99 <= budget))
    over = [i for i, (_, ok) in enumerate(verdicts) if not ok]
    if not over:
        return 0.0
    after = verdicts[over[-1] + 1:]
    return after[0][0] - since if after else None
