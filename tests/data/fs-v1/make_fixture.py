"""Writes the format-v1 block files under tests/data/fs-v1/ with the filesystem tier as it was before format v2
(run at commit ca7674e, the last v1 writer: ``.venv/bin/python tests/data/fs-v1/make_fixture.py``).

Kept for provenance only: the current tier writes v2, so running this now would write v2 files.
Three tiers of 16x64 float32 blocks, keys ``key_of(i)`` of tests/plugins/runtime.py, values ``block_for(key, SHAPE)``:
``plain/`` codec none (keys 1, 2), ``fp8/`` codec fp8 (key 3), ``mac/`` codec none with the MAC key in ``mac.key``
(key 4).
"""
import os
import pathlib
import shutil
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for plugins.runtime

from kvtier_runtime.config import FilesystemTierConfig  # noqa: E402
from kvtier_runtime.fs import FilesystemTier  # noqa: E402
from plugins.runtime import block_for, key_of  # noqa: E402
from plugins.tier_sync import store_blocks  # noqa: E402

SHAPE = (16, 64)


def write(name: str, keys: list[int], **cfg) -> None:
    root = HERE / name
    shutil.rmtree(root, ignore_errors=True)
    tier = FilesystemTier(FilesystemTierConfig(root_dir=str(root), capacity_bytes=1 << 20, **cfg), SHAPE,
                          torch.float32, direct_io=False)
    try:
        ks = [key_of(i) for i in keys]
        assert store_blocks(tier, ks, [block_for(k, SHAPE) for k in ks]).success
    finally:
        tier.close()


if __name__ == "__main__":
    write("plain", [1, 2])
    write("fp8", [3], codec="fp8")
    (HERE / "mac.key").write_bytes(b"kvtier-fixture-mac-key-0123456789abcdef\n")
    write("mac", [4], mac_key_file=str(HERE / "mac.key"))
    for d, _, names in os.walk(HERE):
        for n in names:
            if n.endswith(".kvb"):
                p = os.path.join(d, n)
                print(os.path.relpath(p, HERE), os.path.getsize(p))
