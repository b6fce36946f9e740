"""kvtier's offloading spec under vLLM 0.33: a tier the control file disables leaves a router's index even on an
idle engine. The class of defect: vLLM publishes KV events only from a scheduler step and an idle engine core blocks
on its input queue, so a disabled tier stayed announced until the next request -- the request a router then sends
to this replica for a prefix it would recompute. The manager wakes the engine core (vLLM's WAKEUP sentinel into its
input queue) and asks for steps until the books have announced the change."""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import time

import pytest
from upstream import ADAPTER, import_upstream

pytestmark = pytest.mark.vllm

import_upstream("tests.v1.kv_offload.conftest")
from tests.v1.kv_offload.conftest import make_offloading_config  # noqa: E402
from vllm.v1.engine import EngineCoreRequestType  # noqa: E402
from vllm.v1.kv_offload.base import Medium, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402


class EngineCore:
    """What vLLM's engine core holds while it builds the scheduler (and so the manager): its input queue."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue = queue.Queue()

    def build(self, config):
        return OffloadingSpecFactory.create_spec(config).get_manager()


def write_control(path, disabled: list[str], generation: int) -> None:
    """As the kubelet updates a ConfigMap volume: a new file swapped in by a rename."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(json.dumps({"disabledTiers": disabled, "generation": generation}))
    os.replace(tmp, path)


def storage_events(manager, removed: bool, timeout_s: float = 10.0) -> list:
    """The STORAGE events the engine publishes while its manager asks vLLM to keep stepping (an idle engine steps
    only then), until one of the wanted kind came."""
    out: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if manager.has_pending_work():
            with manager.lock:
                out += [e for e in manager.take_events() if e.medium == Medium.STORAGE and e.removed == removed]
            if out:
                return out
        time.sleep(0.05)
    return out


def test_an_idle_engine_is_woken_to_announce_a_tier_the_control_file_disables_and_re_enables(tmp_path) -> None:
    control = tmp_path / "control.json"
    write_control(control, [], 1)
    extra = {"spec_module_path": ADAPTER, "host_shm_dir": str(tmp_path / "shm"), "control_file": str(control),
             "tier_names": ["cpu", "nvme"],
             "fs_tiers": [{"root_dir": str(tmp_path / "fs"), "capacity_bytes": 1 << 20, "enable_kv_events": True,
                           "n_read_threads": 1, "n_write_threads": 1}]}
    config = dataclasses.replace(
        make_offloading_config(spec_name="KvtierOffloadingSpec", cpu_bytes_to_use=4 * 8, worker_kv_bytes_per_block=8,
                               engine_id=f"wake-{os.getpid()}", extra_config=extra),
        enable_kv_cache_events=True)
    core = EngineCore()
    manager = core.build(config)
    try:
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
        ctx = ReqContext(req_id="r1")
        with manager.lock:
            manager.prepare_store(keys, ctx)
            manager.complete_store(keys, ctx)
        manager.books.drain()
        stored = storage_events(manager, removed=False)
        assert [list(e.keys) for e in stored] == [keys]
        while manager.has_pending_work():  # the engine goes idle: nothing more to step for
            with manager.lock:
                list(manager.take_events())
            time.sleep(0.05)
        assert core.input_queue.empty()
        write_control(control, ["nvme"], 2)  # the guard disables nvme
        assert core.input_queue.get(timeout=5) == (EngineCoreRequestType.WAKEUP, None)
        gone = storage_events(manager, removed=True)
        assert [list(e.keys) for e in gone] == [keys]
        # Re-enabled: woken again; the tier is on probation (half-open: one probe load a second) and is announced
        # only once its probes pass (tests/runtime/engines/test_engine_offload_breaker.py), so a router does not
        # send a replica's traffic to a tier that may still be slow.
        write_control(control, [], 3)
        assert core.input_queue.get(timeout=5) == (EngineCoreRequestType.WAKEUP, None)
        assert storage_events(manager, removed=False, timeout_s=3) == []
        assert manager.books.breakers[1].state == "half_open"
    finally:
        manager.shutdown()
