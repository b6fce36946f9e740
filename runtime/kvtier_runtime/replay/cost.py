"""Turn cache hits into prefill time: what a loaded block saves against what its transfer costs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TierCost:
    block_bytes: int
    transfer_s_per_block: float | None  # None without a bandwidth for the tier
    recompute_s_per_block: float | None  # None without a prefill rate
    slower_than_recompute: bool | None
    prefill_seconds_saved: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "block_bytes": self.block_bytes,
            "transfer_seconds_per_block": self.transfer_s_per_block,
            "recompute_seconds_per_block": self.recompute_s_per_block,
            "slower_than_recompute": self.slower_than_recompute,
            "estimated_prefill_seconds_saved": self.prefill_seconds_saved,
        }


def tier_cost(block_tokens: int, kv_bytes_per_token: int, loaded_blocks: int,
              bandwidth_gb_s: float | None = None, prefill_tokens_per_s: float | None = None,
              latency_s: float = 0.0) -> TierCost:
    """Per-block transfer vs recompute time of one tier and the prefill time its loaded blocks save.

    A tier whose transfer is slower than recomputing is flagged; its saving is reported as the (negative)
    time loading would cost, which a cost-aware runtime avoids by recomputing instead.
    """
    block_bytes = block_tokens * kv_bytes_per_token
    transfer = None if not bandwidth_gb_s else latency_s + block_bytes / (bandwidth_gb_s * 1e9)
    recompute = None if not prefill_tokens_per_s else block_tokens / prefill_tokens_per_s
    slower = None if transfer is None or recompute is None else transfer > recompute
    saved = None
    if recompute is not None:
        saved = loaded_blocks * (recompute - (transfer or 0.0))
    return TierCost(block_bytes, transfer, recompute, slower, saved)
