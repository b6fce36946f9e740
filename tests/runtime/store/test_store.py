"""The engine path's store: the host tier's slot allocation, the metrics the dashboard reads, and the runtime's
import boundary. The books' behaviour (placement, write-through, promotion, resets, events) is tested in
tests/runtime/engines/test_engine_offload_books.py and tests/runtime/engines/test_engine_offload_contract.py; the filesystem tier in
tests/runtime/fs/test_fs_tier*.py.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
from kvtier_runtime.config import FilesystemTierConfig
from kvtier_runtime.store import HIT, RETRY, MemoryTier
from plugins.dashboard import dashboard_runtime_series, samples
from plugins.runtime import close_books, engine_books, key_of

SHAPE = (64, 256)
NB = 64 * 256 * 4  # bytes of one float32 block
ROW = 4096


def test_memory_tier_allocates_once_and_reuses_slots() -> None:
    tier = MemoryTier("host", SHAPE, torch.float32, 3 * NB + 100)
    assert tier.n_slots == 3 and tier.capacity_bytes == 3 * NB
    ptr = tier.slab.data_ptr()
    slots = set()
    for i in range(10):
        slot, victims = tier.reserve(key_of(i))
        slots.add(slot)
        assert len(victims) == (1 if i >= 3 else 0)
    assert slots == {0, 1, 2} and tier.slab.data_ptr() == ptr and len(tier) == 3
    with pytest.raises(ValueError, match="host.capacity_bytes"):
        MemoryTier("host", SHAPE, torch.float32, NB - 1)


def test_every_runtime_series_the_dashboard_reads_is_exported_by_the_engine_path(tmp_path) -> None:
    # A dashboard panel on a metric only a test harness exports shows nothing in production. Drive the engine
    # path's store (books over a host tier and a filesystem tier) through stores, evictions, a disk promotion and
    # lookups, and require a non-zero sample labelled with one of its tiers for every kvtier_runtime_* series the
    # dashboard queries (the remote tier's own series: tests/runtime/remote/test_remote_tier_faults.py, against a real store).
    host_name, fs_name = f"host-{time.monotonic_ns()}", f"fs-{time.monotonic_ns()}"
    cfg = FilesystemTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=1 << 20, n_read_threads=2,
                               n_write_threads=2)
    books, region = engine_books(tmp_path, 2, ROW, [(cfg, {"name": fs_name})], host_name=host_name)
    try:
        keys = [key_of(i) for i in range(4)]
        for key in keys:  # two host rows: the first two keys are evicted to the disk copy
            to_store, slots, _ = books.prepare_store([key])
            region.rows[slots[0]].fill_(key[-1])
            books.complete_store(to_store)
            books.drain()
        assert books.lookup(keys[-1]) == HIT
        assert books.lookup(keys[0]) == RETRY  # on disk only: promoted into a host row
        deadline = time.monotonic() + 10
        while books.lookup(keys[0]) != HIT and time.monotonic() < deadline:
            books.drain(1)
        assert books.lookup(keys[0]) == HIT
        mine = {host_name, fs_name}
        wanted = {s for s in dashboard_runtime_series() if not s.startswith("kvtier_runtime_remote_")}
        assert wanted, "the dashboard reads no kvtier_runtime_* series"
        for series in sorted(wanted):
            values = [v for labels, v in samples(series) if mine & set(labels.values())]
            assert values and max(values) > 0, f"{series}: no sample from the engine path's tiers"
        promoted = [v for labels, v in samples("kvtier_runtime_promotions_total")
                    if labels == {"src": fs_name, "dst": host_name}]
        assert promoted == [1.0], "a disk -> host promotion is labelled with the books' own host tier"
    finally:
        close_books(books, region)


def test_runtime_imports_neither_kopf_nor_kubernetes() -> None:
    import subprocess
    import sys

    # Every runtime module but the vLLM plug-ins (they need vllm; tests/vllm imports them) and the __main__ entry
    # points (importing runs them), so a new module that pulls in the operator's dependencies -- or vllm, which
    # this env does not have -- fails here.
    code = ("import importlib, pkgutil, sys, kvtier_runtime\n"
            "names = [m.name for m in pkgutil.walk_packages(kvtier_runtime.__path__, 'kvtier_runtime.')\n"
            "         if m.name != 'kvtier_runtime.engines.vllm_adapter'\n"
            "         and not m.name.startswith('kvtier_runtime.engines.vllm.') and not m.name.endswith('.__main__')]\n"
            "for name in names: importlib.import_module(name)\n"
            "assert len(names) > 30, names\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes')]\n"
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    light = subprocess.run([sys.executable, "-c", "import sys, kvtier_runtime, kvtier_runtime.config, "
                            "kvtier_runtime.fs, kvtier_runtime.fs.format; print('torch' in sys.modules)"],
                           capture_output=True, text=True, env=env, check=True)
    assert light.stdout.strip() == "False", "the package, its config and the fs format must not import torch"


def test_only_the_vllm_plug_ins_import_vllm() -> None:
    # The import walk above skips the plug-ins, so it cannot see a vllm import added to another module that is
    # only imported by the plug-ins. Read every runtime source instead.
    import kvtier_runtime

    root = Path(kvtier_runtime.__file__).parent
    allowed = {root / "engines" / "vllm_adapter.py", *(root / "engines" / "vllm").glob("*.py")}
    pattern = re.compile(r"^\s*(import vllm\b|from vllm[ .])", re.M)
    offenders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if p not in allowed and pattern.search(p.read_text()))
    assert offenders == [], "vllm is imported outside kvtier_runtime/engines/vllm/"
    # The pattern must match the plug-ins' own imports, or the check above could pass reading nothing (helpers in
    # engines/vllm/ such as caller_frames.py import no vllm themselves).
    assert any(pattern.search(p.read_text()) for p in (root / "engines" / "vllm").glob("*.py")), \
        "the check reads nothing"

