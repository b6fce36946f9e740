"""kvtier's remote tier: KV chunks in a Valkey/Redis store (standalone or cluster mode) shared by every replica of
a model (docs/remote.md).

Modules: :mod:`.identity` (model identity, store keys; pure), :mod:`.format` (the value: header, sealed payload;
pure), :mod:`.client` (redis-py, mode detection, password and CA files, fault kinds), :mod:`.wire` (the RESP2
connections standalone loads read values off), :mod:`.tier` (the tier the books drive, which only routes) and its
parts: :mod:`.health` (connection and health), :mod:`.presence` (the presence cache), :mod:`.index` (capacity index
and trim), :mod:`.batches` (batched pipelines, on :mod:`.lane`), :mod:`.values` (a chunk's value from and into a
row). Importing this package imports neither torch nor redis; ``RemoteTier`` does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tier import RemoteTier

__all__ = ["RemoteTier"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import tier

        return getattr(tier, name)
    raise AttributeError(name)
