"""Which chunks of a shared store are interchangeable: the model identity, and the store keys built from it (pure).

Keys are ``kvtier:<scope>:<model identity>:<chunk key hex>``. The scope is the tenant's (the policy's namespace,
:func:`kvtier_runtime.config.check_remote_scope`: a DNS label, so no ``:``, glob character or ``{``): a store ACL
user per tenant confined to ``~kvtier:<scope>:*`` reaches its own keys and no other tenant's, and each scope has its
own index and budget. The model identity is a digest of every fact that changes the
bytes of a chunk (the model, its KV dtype, block and chunk sizes, layers, KV heads, head size, parallelism, the
tier's codec), derived by the runtime from the engine's own configuration, never configured by hand: replicas of
one model compute the same identity and share, two different models or layouts never read each other's chunks.

No hash tag (``{...}``) is used, so Redis Cluster spreads one model's chunks over every slot, hence every node;
the per-scope, per-model index (``kvtier:<scope>:<identity>:index``, the capacity accounting) is one key on one
slot. A command never spans two keys (GET/SET/EXISTS/DEL of one chunk, the index alone), so cluster mode needs no
two keys on one slot.

The chunk key is vLLM's offload key (``make_offload_key``: the block hash + the KV cache group index). vLLM's
per-request ``cache_salt`` enters the hash of a request's first block (``generate_block_hash_extra_keys`` in
vllm/v1/core/kv_cache_utils.py) and every later block's hash chains from its parent, so requests with different
salts never produce the same chunk key. The salt is a client-chosen value, not a tenant boundary: the scope and
the tenant's key are.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..config import check_remote_scope

# Bumped when the facts' meaning (or the value format) changes, so old chunks are simply never found again.
IDENTITY_VERSION = 1
IDENTITY_HEX_CHARS = 32
KEY_PREFIX = "kvtier"


def model_identity(facts: Mapping[str, Any]) -> str:
    """A 128-bit hex digest of ``facts`` (a JSON-able mapping; key order does not matter)."""
    canonical = json.dumps({"identity_version": IDENTITY_VERSION, **facts}, sort_keys=True,
                           separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:IDENTITY_HEX_CHARS]


def key_prefix(scope: str, identity: str) -> bytes:
    """``kvtier:<scope>:<identity>:``; ConfigError (scope) or ValueError (identity) names the bad part."""
    check_remote_scope("scope", scope)
    if len(identity) != IDENTITY_HEX_CHARS or any(c not in "0123456789abcdef" for c in identity):
        raise ValueError(f"identity: {identity!r} must be {IDENTITY_HEX_CHARS} lowercase hex characters")
    return f"{KEY_PREFIX}:{scope}:{identity}:".encode()


def scope_pattern(scope: str) -> str:
    """The ACL key pattern (``ACL SETUSER ... ~<pattern>``) that holds exactly one scope's keys."""
    check_remote_scope("scope", scope)
    return f"{KEY_PREFIX}:{scope}:*"


# The commands the remote tier sends, as an ACL rule (docs/remote.md's recipe): the mode probe (INFO), the health
# check (PING), a chunk's EXISTS/GET/SET/DEL, the index's ZADD/ZCARD/ZPOPMIN, and while the engine publishes KV events
# the shared log's XADD/XRANGE/XREVRANGE and the index's ZRANGE (remote/changes.py). In cluster mode also redis-py's
# slot discovery and command table (ACL_CLUSTER_COMMANDS). redis-py's CLIENT SETINFO on connect (Redis 7.2+) may be
# refused: redis-py ignores that.
ACL_COMMANDS = ("-@all", "+ping", "+info", "+exists", "+get", "+set", "+del", "+zadd", "+zcard", "+zpopmin",
                "+zrange", "+xadd", "+xrange", "+xrevrange")
ACL_CLUSTER_COMMANDS = ("+cluster|slots", "+command")


def acl_rule(scope: str) -> list[str]:
    """The ACL SETUSER arguments (after the user's name and password) that confine a user to one scope's keys and the
    commands the tier sends: a tenant's user in docs/remote.md's recipe."""
    return ["resetkeys", f"~{scope_pattern(scope)}", "resetchannels", *ACL_COMMANDS]


def chunk_key(prefix: bytes, key: bytes) -> bytes:
    """The store key of the chunk whose offload key is ``key`` (vLLM's block hash + group index)."""
    return prefix + bytes(key).hex().encode()


def index_key(prefix: bytes) -> bytes:
    """The sorted set of one scope's chunks of one model kvtier wrote (member: chunk key hex, score: last write or
    read)."""
    return prefix + b"index"
