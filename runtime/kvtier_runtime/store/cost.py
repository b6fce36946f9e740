"""Cost-aware promotion: promote a block only if moving it up is faster than recomputing its tokens.

Pure arithmetic, torch-free, so the rule is unit-tested directly and the operator can render the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class CostModel:
    """``link_bytes_per_s[t]`` is the bandwidth from tier ``t`` to the tier above it (e.g. fs->host, host->device);
    ``latency_s[t]`` a fixed per-block cost of that link (a disk seek, a launch). ``recompute_s_per_token`` is the
    prefill time per token of the served model and ``tokens_per_block`` the tokens one block holds."""

    link_bytes_per_s: Mapping[str, float]
    recompute_s_per_token: float
    tokens_per_block: int
    latency_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tier, bw in self.link_bytes_per_s.items():
            if not bw > 0:
                raise ValueError(f"link_bytes_per_s[{tier!r}]: {bw!r} must be > 0")
        for tier, lat in self.latency_s.items():
            if not lat >= 0:
                raise ValueError(f"latency_s[{tier!r}]: {lat!r} must be >= 0")
        if not self.recompute_s_per_token >= 0:
            raise ValueError(f"recompute_s_per_token: {self.recompute_s_per_token!r} must be >= 0")
        if isinstance(self.tokens_per_block, bool) or not isinstance(self.tokens_per_block, int) \
                or self.tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block: {self.tokens_per_block!r} must be a positive integer")

    def promotion_seconds(self, path: Sequence[str], nbytes: int) -> float:
        """Time to move ``nbytes`` up through the links named by ``path`` (source tier first).
        A link without a configured bandwidth counts as free (unknown is not a reason to skip)."""
        total = 0.0
        for tier in path:
            bw = self.link_bytes_per_s.get(tier)
            if bw is not None:
                total += nbytes / bw
            total += self.latency_s.get(tier, 0.0)
        return total

    def recompute_seconds(self, n_blocks: int = 1) -> float:
        return n_blocks * self.tokens_per_block * self.recompute_s_per_token

    def worth_promoting(self, path: Sequence[str], nbytes: int) -> bool:
        return self.promotion_seconds(path, nbytes) <= self.recompute_seconds()
