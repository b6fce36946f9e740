"""Fixtures and helpers of the runtime's store and filesystem-tier tests."""
from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator

import pytest


def block_for(key: bytes, shape: tuple[int, ...] = (64, 256)):
    """A block whose values are a pure function of its key, so any test can tell a wrong block from a right one."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(key))
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def sentinel(shape: tuple[int, ...] = (64, 256)):
    """An output buffer no stored block equals: a read that did not happen (or wrote other bytes) shows.

    Never page-aligned (it starts one float into its storage), so a filesystem tier always loads into it through
    its staging buffer and a failed load leaves it untouched; a page-aligned row may be read into directly, and
    then only "never reported loaded" holds (tests/runtime/fs/test_fs_tier_aligned_format.py)."""
    import math

    import torch

    return torch.full((math.prod(shape) + 1,), 12345.0)[1:].view(shape)


def key_of(i: int) -> bytes:
    """A vLLM-like key: 32-byte hash + 4-byte big-endian group index."""
    import hashlib

    return hashlib.sha256(str(i).encode()).digest() + (0).to_bytes(4, "big")


def tier_bytes_for(n_blocks: int, file_bytes: int) -> int:
    """A filesystem tier capacity with room for exactly ``n_blocks`` files of ``file_bytes`` and their fan-out
    directories (the tier charges those too: kvtier_runtime.fs.tier.file_budget)."""
    from kvtier_runtime.fs.tier import DIRECTORY_BYTES

    return n_blocks * (file_bytes + 2 * DIRECTORY_BYTES) + 2 * DIRECTORY_BYTES


def block_file_bytes(shape: tuple[int, ...] = (64, 256), codec: str = "none") -> int:
    """Bytes one float32 block of ``shape`` takes in the filesystem tier."""
    import torch
    from kvtier_runtime.codecs import get_codec
    from kvtier_runtime.fs.format import file_bytes_for

    return file_bytes_for(get_codec(codec).encoded_nbytes(shape, torch.float32))


def seq_key(i: int) -> bytes:
    """A vLLM offload key whose hash part is ``i`` (readable in failures; ``key_of`` is the hashed kind)."""
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def engine_books(tmp_path, n_rows: int, row_bytes: int, fs=(), *, view_dtype=None, key_suffix: bytes = b"run",
                 enable_events: bool = False, host_name: str = "host", **host_options):
    """The engine path's store as kvtier's offloading spec builds it: a shared host region of ``n_rows`` rows of
    ``row_bytes``, a host MemoryTier over it, and one FilesystemTier per entry of ``fs`` -- a
    FilesystemTierConfig, or ``(config, FilesystemTier keyword arguments)`` -- reading the rows as ``view_dtype``
    (float16 unless given). Returns ``(books, region)``; :func:`close_books` closes both."""
    import time

    import torch
    from kvtier_runtime.engines.host_region import HostRegion
    from kvtier_runtime.fs import FilesystemTier
    from kvtier_runtime.store import MemoryTier, OffloadBooks

    region = HostRegion(str(tmp_path / "shm"), f"books-{time.monotonic_ns()}", n_rows, row_bytes)
    host = MemoryTier(host_name, (row_bytes,), torch.uint8, n_rows * row_bytes, slab=region.rows, **host_options)
    view = region.rows.view(view_dtype or torch.float16)
    tiers = []
    for entry in fs:
        cfg, options = entry if isinstance(entry, tuple) else (entry, {})
        options = {"name": f"t{time.monotonic_ns()}", **options}
        tiers.append(FilesystemTier(cfg, (view.shape[1],), view.dtype, **options))
    books = OffloadBooks(host, tiers, rows=[view] * len(tiers), key_suffix=key_suffix,
                         enable_events=enable_events)
    return books, region


def close_books(books, region) -> None:
    books.close()
    region.close(unlink=True)


def metric_value(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def fs_tier_factory(tmp_path) -> Iterator[Callable[..., object]]:
    """Builds FilesystemTier instances on tmp_path (64x256 float32 blocks) and closes them after the test."""
    import torch
    from kvtier_runtime.config import FilesystemTierConfig
    from kvtier_runtime.fs import FilesystemTier

    made: list[FilesystemTier] = []

    def make(capacity_blocks: int = 16, root: str | None = None, shape=(64, 256), **options) -> FilesystemTier:
        cfg_keys = {k: options.pop(k) for k in ("eviction_policy", "admission", "codec", "n_read_threads",
                                                 "n_write_threads", "mac_key_file", "io_timeout_s") if k in options}
        if "codec_obj" in options:  # a Codec instance overriding the configured one
            options["codec"] = options.pop("codec_obj")
        cfg_keys.setdefault("eviction_policy", "lru")
        cfg_keys.setdefault("n_read_threads", 4)
        cfg_keys.setdefault("n_write_threads", 4)
        per_block = block_file_bytes(shape, cfg_keys.get("codec", "none"))
        cfg = FilesystemTierConfig(root_dir=root or str(tmp_path / "fs"),
                                   capacity_bytes=tier_bytes_for(capacity_blocks, per_block), **cfg_keys)
        tier = FilesystemTier(cfg, shape, torch.float32, **options)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def run_in_threads(worker: Callable[[int], None], n: int = 4) -> None:
    """Run ``worker(seed)`` for seeds 0..n-1 in concurrent threads; re-raise what any of them raised."""
    errors: list[BaseException] = []

    def guarded(seed: int) -> None:
        try:
            worker(seed)
        except BaseException as exc:  # surfaced in the test's own thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(seed,)) for seed in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def configmap_update(root, files: dict[str, str], version: int) -> None:
    """Write ``files`` under ``root`` the way the kubelet updates a ConfigMap volume: a new timestamped directory,
    ``..data`` swapped to it by one rename of a symlink, the old directory removed; each file a symlink through
    ``..data`` (made once). A file left out of ``files`` then dangles, as a key removed from the ConfigMap does."""
    import os
    import shutil

    new = f"..2026_12_02_06_00_{version:02d}.{version}"
    os.makedirs(root / new)
    for name, text in files.items():
        (root / new / name).write_text(text)
    old = os.readlink(root / "..data") if (root / "..data").is_symlink() else None
    os.symlink(new, root / "..data_tmp")
    os.rename(root / "..data_tmp", root / "..data")  # the atomic swap
    for name in files:
        if not (root / name).is_symlink():
            os.symlink(f"..data/{name}", root / name)
    if old is not None:
        shutil.rmtree(root / old)


class ManualClock:
    """A clock the test moves: ``clock()`` reads it, ``clock.advance(dt)`` moves it."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
