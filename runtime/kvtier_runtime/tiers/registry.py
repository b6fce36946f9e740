"""The tiers behind the host tier, by medium: what builds a tier from its config (the vLLM spec builds its ordered
tier list through :func:`build_tiers`, one :class:`TierPlan` per tier of the policy, in the policy's order). Pure at import: a medium's module (torch, and redis-py for ``remote``) is imported
only when a tier of it is built, so an engine without a remote tier never imports the Valkey/Redis client."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import Tier

__all__ = ["MEDIA", "TierPlan", "build_tier", "build_tiers", "tier_class"]

# medium -> the class of its tier, imported when first asked for: each class takes (config, block_shape, dtype,
# **options) and satisfies Tier. Plain import statements, so the import rules (tests/plugins/import_rules) and any
# import checker see which modules the registry reaches.


def _filesystem() -> type[Any]:
    from ..fs.tier import FilesystemTier

    return FilesystemTier


def _remote() -> type[Any]:
    from ..remote.tier import RemoteTier

    return RemoteTier


_CLASSES: dict[str, Callable[[], type[Any]]] = {"filesystem": _filesystem, "remote": _remote}
MEDIA = tuple(_CLASSES)


def tier_class(medium: str) -> type[Any]:
    """The class of ``medium``'s tier (its module is imported now). ValueError names the medium and the known ones."""
    try:
        load = _CLASSES[medium]
    except (KeyError, TypeError):
        raise ValueError(f"medium: {medium!r} is not a tier medium; known: {', '.join(MEDIA)}") from None
    cls = load()
    if cls.medium != medium:
        raise RuntimeError(f"medium: {cls.__module__}.{cls.__name__} says it is {cls.medium!r}, registered as "
                           f"{medium!r}")
    return cls


def build_tier(medium: str, config: Any, block_shape: Sequence[int], dtype: Any, **options: Any) -> Tier:
    """A tier of ``medium`` over ``config`` (that medium's config class), holding rows of ``block_shape`` and
    ``dtype``; ``options`` are the class's keyword options (name, peer, codec, on_complete, a remote tier's
    identity...)."""
    tier: Tier = tier_class(medium)(config, block_shape, dtype, **options)
    return tier


@dataclass(frozen=True)
class TierPlan:
    """One tier to build: its ``medium``, that medium's ``config``, the rows it holds (``block_shape``, ``dtype``)
    and the class's keyword ``options``."""

    medium: str
    config: Any
    block_shape: tuple[int, ...]
    dtype: Any
    options: Mapping[str, Any] = field(default_factory=dict)


def build_tiers(plans: Sequence[TierPlan]) -> list[Tier]:
    """One tier per plan, in the plans' order (the books' lookup order). Should one fail to build, the tiers
    already built are closed (their threads stopped) before the error propagates."""
    tiers: list[Tier] = []
    try:
        for plan in plans:
            tiers.append(build_tier(plan.medium, plan.config, plan.block_shape, plan.dtype, **plan.options))
    except BaseException:
        for tier in reversed(tiers):
            tier.close()
        raise
    return tiers
