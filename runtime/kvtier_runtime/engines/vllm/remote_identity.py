"""The model identity of kvtier's remote tier, derived from vLLM's own configuration (never configured by hand):
replicas of one model agree on it and share the store, any difference that changes a chunk's bytes separates them
(:mod:`kvtier_runtime.remote.identity`)."""
from __future__ import annotations

import logging
import os
from typing import Any

from ...config import ConfigError
from ...remote.identity import model_identity
from .model_config import model_kv_shape
from .secondary_tier import run_identity

_log = logging.getLogger(f"vllm.{__name__}")


def _model_dtype(config: Any) -> str | None:
    """The model's compute dtype where the process has vLLM's config (the KV dtype is in the offloading config)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        if current is not None and current.model_config is not None:
            return str(current.model_config.dtype).removeprefix("torch.")
    except Exception as exc:  # an older vLLM: the KV dtype (which follows it unless set) still separates
        _log.debug("kvtier: no current vLLM config for the model dtype (%s)", exc)
    return None


# Prefix-caching hashes a shared store may be keyed by: collision-resistant ones only. With a non-cryptographic hash
# (xxhash) a client who can choose prompts can make one with another's block hash, and every replica sharing the
# store would then load that client's KV for the other's tokens.
SHARED_HASH_ALGOS = ("sha256", "sha256_cbor")


def _hash_facts() -> dict[str, Any]:
    """The block-hash function, which the store's keys are: replicas agree on keys only if they agree on it. vLLM
    seeds the first block's parent hash from PYTHONHASHSEED when set, so that is part of it too."""
    algo = None
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        if current is not None and current.cache_config is not None:
            algo = str(current.cache_config.prefix_caching_hash_algo)
    except Exception as exc:  # an older vLLM: its default, sha256
        _log.debug("kvtier: no current vLLM config for the prefix-caching hash (%s)", exc)
    if algo is not None and algo not in SHARED_HASH_ALGOS:
        raise ConfigError(f"prefix_caching_hash_algo: {algo!r} is not collision resistant; a remote tier shares "
                          f"blocks between replicas by their hash, so it needs one of {', '.join(SHARED_HASH_ALGOS)} "
                          "(--prefix-caching-hash-algo sha256_cbor, as kvtier's operator renders)")
    return {"hash_algo": algo or "sha256", "hash_seed": os.environ.get("PYTHONHASHSEED")}


def remote_facts(spec: Any, codec: str) -> dict[str, Any]:
    """Every fact that changes the bytes of one chunk row of kvtier's host tier (which holds all TP ranks' slices
    of a chunk, so one value serves a whole engine of the same parallelism)."""
    config = spec.config
    heads, head_size = model_kv_shape(config)
    groups = [{"tokens_per_block": g.tokens_per_block, "layers": len(g.layer_names)} for g in config.groups]
    parallel = config.parallel
    return {
        # vLLM's own run identity (its fs tier separates directories by it): model, KV dtype, tokens per hash,
        # blocks per chunk, KV cache groups and layer names, parallelism.
        "run": run_identity(spec, "/"),
        "model": str(config.model.name),
        "model_dtype": _model_dtype(config),
        "kv_cache_dtype": str(config.model.dtype),
        "block_tokens": groups[0]["tokens_per_block"] if groups else 0,
        "blocks_per_chunk": int(spec.blocks_per_chunk),
        "layers": sum(g["layers"] for g in groups),
        "groups": groups,
        "kv_heads": heads,
        "head_size": head_size,
        "tp_size": int(parallel.tp_size),
        "pp_size": int(parallel.pp_size),
        "world_size": int(parallel.world_size),
        "rank": int(parallel.rank),
        "kv_cache_layout": getattr(config, "kv_cache_layout", None),
        "row_bytes": int(spec.row_bytes),
        "codec": codec,
        **_hash_facts(),
    }


def remote_identity(spec: Any, codec: str) -> str:
    return model_identity(remote_facts(spec, codec))
