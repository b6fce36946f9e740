"""Blocking store/load for tests and benchmarks, on top of a tier's public job API.

The filesystem and remote tiers (:class:`kvtier_runtime.fs.FilesystemTier`, :class:`kvtier_runtime.remote.tier.
RemoteTier`) never block their caller: ``submit_store``/``submit_load`` return a job id, ``get_finished()`` hands each
result out once, ``drain`` waits for every job. Tests and benchmarks mostly want one job's result, so this module
waits for it -- a test-side helper, not product code (bench/ imports it from tests/plugins, as it does other
harnesses).

``wait_job`` polls ``tier.get_finished()`` (blocking in ``tier.drain`` between polls, so a lone job is seen the
moment it finishes). Results of other jobs that a poll hands out are kept here, per tier, for the caller that asks
for them: a later ``wait_job``, or ``finished(tier)``, which a test that also collects results itself calls instead
of ``tier.get_finished()``. Deadlines are the tier's own: ``get_finished``/``drain`` expire a job past its
``io_timeout_s`` (a load reading straight into the caller's memory stays open until that read returns), so with
``timeout=None`` the wait is bounded exactly as the tier bounds the job.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

# Longest block in tier.drain between two polls of get_finished (drain returns at once when nothing is pending).
_POLL_S = 0.005

_lock = threading.Lock()
_states: weakref.WeakKeyDictionary[Any, _Results] = weakref.WeakKeyDictionary()


class _Results:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_job: dict[int, Any] = {}

    def collect(self, tier: Any) -> None:
        for result in tier.get_finished():
            self.by_job[result.job_id] = result


def _results(tier: Any) -> _Results:
    with _lock:
        state = _states.get(tier)
        if state is None:
            state = _states[tier] = _Results()
        return state


def wait_job(tier: Any, job_id: int, timeout: float | None = None) -> Any:
    """Block until ``job_id`` of ``tier`` finished and return its result (then no one else gets it). ``timeout``:
    raise TimeoutError after that long (the job goes on; its result stays collectable). ``timeout=None``: as long as
    the tier lets the job run (its ``io_timeout_s``). KeyError if no job of that id is running or left a result
    here (unknown, or already taken, e.g. by a direct ``tier.get_finished()``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    state = _results(tier)
    idle = False
    while True:
        with state.lock:
            state.collect(tier)
            if job_id in state.by_job:
                return state.by_job.pop(job_id)
        if idle:  # nothing was pending, and everything that finished has been collected
            raise KeyError(f"job_id: {job_id} is unknown or its result was already taken")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"job {job_id} did not finish within {timeout}s")
        try:
            tier.drain(timeout=_POLL_S if left is None else min(_POLL_S, left))
            idle = True
        except TimeoutError:
            pass


def finished(tier: Any) -> list[Any]:
    """``tier.get_finished()`` for a test that also waits with this module: the results of jobs nobody waited for,
    including those a ``wait_job`` poll already took from the tier. Each result is returned once."""
    state = _results(tier)
    with state.lock:
        state.collect(tier)
        out = list(state.by_job.values())
        state.by_job.clear()
    return out


def store_blocks(tier: Any, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
                 timeout: float | None = 60) -> Any:
    """``submit_store`` and wait for its result."""
    return wait_job(tier, tier.submit_store(keys, blocks), timeout)


def load_blocks(tier: Any, keys: Sequence[bytes], outs: Sequence[torch.Tensor], timeout: float | None = 60) -> Any:
    """``submit_load`` and wait for its result."""
    return wait_job(tier, tier.submit_load(keys, outs), timeout)


def connected(tier: Any, timeout_s: float = 10.0) -> bool:
    """Block until a remote tier's first connection attempt is over; True if the store is up."""
    deadline = time.monotonic() + timeout_s
    while tier.health == "connecting" and time.monotonic() < deadline:
        time.sleep(0.005)
    return tier.health == "up"


def settled_state(tier: Any, key: bytes, timeout_s: float = 10.0) -> Any:
    """A remote tier's ``state(key)`` once its probe answered (``PENDING`` only after ``timeout_s``)."""
    from kvtier_runtime.fs import KeyState

    deadline = time.monotonic() + timeout_s
    while True:
        st = tier.state(key)
        if st is not KeyState.PENDING or time.monotonic() > deadline:
            return st
        time.sleep(0.001)
