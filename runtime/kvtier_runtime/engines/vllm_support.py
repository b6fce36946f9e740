"""Pure helpers of the vLLM adapter (no vllm import, so they are testable anywhere)."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ConfigError

# Store refusals that are decisions, not faults: no I/O was attempted, so vLLM's back-pressure detector must not
# count them as failed stores. Everything else a store or load reports (enospc, eio, corrupt, ...) is a failure.
POLICY_REFUSALS = frozenset({"not-admitted", "no-room", "backoff", "busy"})

# vLLM's ``OffloadingModelConfig.dtype`` spellings of the KV dtypes a lossy codec can quantize.
_FLOAT_KV_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
}

NAMESPACE_SUFFIX_BYTES = 8


@dataclass(frozen=True)
class JobOutcome:
    """How one finished tier job reads for vLLM."""

    success: bool
    n_ok: int
    refused: Mapping[str, int] = field(default_factory=dict)
    failed: Mapping[str, int] = field(default_factory=dict)


def job_outcome(ok: Sequence[bool], errors: Mapping[int, str], is_promotion: bool) -> JobOutcome:
    """A store succeeds unless a key failed for a reason other than a policy refusal; a load only if all loaded."""
    refused: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for i, good in enumerate(ok):
        if good:
            continue
        reason = errors.get(i, "other")
        if not is_promotion and reason in POLICY_REFUSALS:
            refused[reason] += 1
        else:
            failed[reason] += 1
    n_ok = sum(1 for good in ok if good)
    success = not failed if not is_promotion else n_ok == len(ok)
    return JobOutcome(success, n_ok, dict(refused), dict(failed))


def kv_torch_dtype(kv_dtype: Any) -> torch.dtype | None:
    """vLLM's KV dtype (a string like ``"bfloat16"``/``"torch.float16"`` or a torch dtype) if it is a float type."""
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype if kv_dtype in _FLOAT_KV_DTYPES.values() else None
    if not isinstance(kv_dtype, str):
        return None
    return _FLOAT_KV_DTYPES.get(kv_dtype.removeprefix("torch."))


def block_view_dtype(codec: str, kv_dtype: Any, row_bytes: int) -> torch.dtype:
    """The dtype the tier sees a primary-tier row as.

    ``none`` copies bytes, so any KV dtype (fp8 included) is stored exactly through a float16 view. A lossy
    codec quantizes values, so it needs the engine's real float KV dtype.
    """
    if codec == "none":
        dtype = torch.float16
    else:
        found = kv_torch_dtype(kv_dtype)
        if found is None:
            raise ConfigError(
                f"codec: {codec!r} quantizes float16/bfloat16/float32 KV blocks, but this engine's KV cache dtype "
                f"is {kv_dtype!r}; use codec 'none'"
            )
        dtype = found
    itemsize = torch.empty((), dtype=dtype).element_size()
    if row_bytes <= 0 or row_bytes % itemsize:
        raise ConfigError(f"primary_kv_view: a chunk of {row_bytes} bytes is not a whole number of {dtype} values")
    return dtype


def namespace_suffix(identity: Mapping[str, Any]) -> bytes:
    """A short digest of the run identity, appended to every key (placed last so the hash bytes still lead the
    file fan-out)."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).digest()[:NAMESPACE_SUFFIX_BYTES]
