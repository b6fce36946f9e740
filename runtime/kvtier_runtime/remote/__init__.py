"""kvtier's remote tier: KV chunks in a Valkey/Redis store (standalone or cluster mode) shared by every replica of
a model (docs/remote.md).

Modules: :mod:`.identity` (model identity, store keys; pure), :mod:`.format` (the value: header, payload, MAC or
CRC; pure), :mod:`.client` (redis-py, mode detection, password file, fault kinds), :mod:`.tier` (the tier the books
drive: presence cache, batched pipelines on worker threads, capacity index). Importing this package imports
neither torch nor redis; ``RemoteTier`` does.
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
