"""Which chunks of a shared store are interchangeable: the model identity, and the store keys built from it (pure).

Keys are ``kvtier:<model identity>:<chunk key hex>``. The model identity is a digest of every fact that changes the
bytes of a chunk (the model, its KV dtype, block and chunk sizes, layers, KV heads, head size, parallelism, the
tier's codec), derived by the runtime from the engine's own configuration, never configured by hand: replicas of
one model compute the same identity and share, two different models or layouts never read each other's chunks.

No hash tag (``{...}``) is used, so Redis Cluster spreads one model's chunks over every slot, hence every node;
the per-model index (``kvtier:<identity>:index``, the capacity accounting) is one key on one slot.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

# Bumped when the facts' meaning (or the value format) changes, so old chunks are simply never found again.
IDENTITY_VERSION = 1
IDENTITY_HEX_CHARS = 32
KEY_PREFIX = "kvtier"


def model_identity(facts: Mapping[str, Any]) -> str:
    """A 128-bit hex digest of ``facts`` (a JSON-able mapping; key order does not matter)."""
    canonical = json.dumps({"identity_version": IDENTITY_VERSION, **facts}, sort_keys=True,
                           separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:IDENTITY_HEX_CHARS]


def key_prefix(identity: str) -> bytes:
    if len(identity) != IDENTITY_HEX_CHARS or any(c not in "0123456789abcdef" for c in identity):
        raise ValueError(f"identity: {identity!r} must be {IDENTITY_HEX_CHARS} lowercase hex characters")
    return f"{KEY_PREFIX}:{identity}:".encode()


def chunk_key(prefix: bytes, key: bytes) -> bytes:
    """The store key of the chunk whose offload key is ``key`` (vLLM's block hash + group index)."""
    return prefix + bytes(key).hex().encode()


def index_key(prefix: bytes) -> bytes:
    """The sorted set of one model's chunks kvtier wrote (member: chunk key hex, score: last write or read)."""
    return prefix + b"index"
