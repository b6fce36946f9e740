"""Reading the served model's KV facts for kvtier's offloading spec: the KV layout of a chunk, the model's KV heads
and head size (vLLM's current config, else the model's ``config.json``), and the CPU attention backend's ISA --
what a lossy filesystem tier needs to quantise K and V per head."""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..chunk_layout import ChunkFacts
from ..page_copy import KvLayout
from ..vllm_support import kv_torch_dtype

# Under vLLM's logger tree: vLLM's handlers print only that tree, and this is where the engine's operators read.
_log = logging.getLogger(f"vllm.{__name__}")


def kv_layout(config: Any, page_bytes: tuple[int, ...] = ()) -> KvLayout:
    layer_names = [n for g in config.groups for n in g.layer_names]
    return KvLayout(
        num_layers=len(layer_names),
        kv_heads=None,
        head_dim=None,
        tokens_per_block=config.groups[0].tokens_per_block if config.groups else 0,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        dtype=str(config.model.dtype),
        page_bytes=page_bytes,
        kv_cache_layout=getattr(config, "kv_cache_layout", None),
    )


def model_kv_shape(config: Any) -> tuple[int | None, int | None]:
    """(KV heads per worker, head size) as vLLM's ``ModelConfig`` derives them. The spec only receives vLLM's
    ``OffloadingConfig`` (no model facts), so: the current ``VllmConfig`` where the process has one set, else the
    model's ``config.json`` (a local directory, or the Hugging Face cache vLLM filled at start-up; never the
    network), read as vLLM reads a plain decoder's: ``num_key_value_heads`` (default ``num_attention_heads``)
    divided over tensor-parallel ranks, ``head_dim`` (default ``hidden_size / num_attention_heads``). ``(None,
    None)`` when neither works; ``chunk_layout`` cross-checks both against the bytes vLLM reports per block."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None and vllm_config.model_config is not None:
            mc = vllm_config.model_config
            return mc.get_num_kv_heads(vllm_config.parallel_config), mc.get_head_size()
    except Exception as exc:  # a vLLM without these helpers: read the model's config below
        _log.debug("kvtier: no current vLLM config (%s)", exc)
    name = str(config.model.name)
    try:
        local = os.path.join(name, "config.json")
        path: str | None = local if os.path.isfile(local) else None
        if path is None:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, "config.json")
            path = found if isinstance(found, str) else None
        if path is None:
            raise FileNotFoundError("no config.json in the model directory or the Hugging Face cache")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        text = doc.get("text_config") or doc
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        tp = max(1, int(config.parallel.tp_size))
        return max(1, kv_heads // tp), head_dim
    except Exception as exc:  # another config format, remote code: the flat codec, with the reason logged
        _log.info("kvtier: cannot read the KV heads/head size of %s: %s", name, exc)
        return None, None


def _attention_backend(dtype: str, block_tokens: int, head_dim: int | None) -> tuple[str | None, str | None]:
    """(backend name, CPU ISA). On the CPU platform vLLM 0.32 has one backend, and its ISA is chosen by
    ``cpu_attn._get_attn_isa`` from dtype, block size and head size alone, so the scheduler computes the same
    value. GPU backends are chosen in the worker from more than the scheduler knows: unknown here."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None, None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        torch_dtype = kv_torch_dtype(dtype)
        if torch_dtype is None or head_dim is None:
            return "CPU_ATTN", None
        return "CPU_ATTN", str(_get_attn_isa(torch_dtype, block_tokens, head_dim, None))
    except Exception as exc:
        _log.info("kvtier: cannot determine vLLM's attention backend/ISA here: %s", exc)
        return None, None


def chunk_facts(config: Any) -> ChunkFacts:
    layer_names = [n for g in config.groups for n in g.layer_names]
    block_tokens = config.groups[0].tokens_per_block if config.groups else 0
    dtype = str(config.model.dtype)
    heads, head_dim = model_kv_shape(config)
    backend, isa = _attention_backend(dtype, block_tokens, head_dim)
    return ChunkFacts(
        num_layers=len(layer_names), block_tokens=block_tokens, blocks_per_chunk=config.cache.blocks_per_chunk,
        kv_dtype=dtype, worker_kv_bytes_per_block=int(config.worker_kv_bytes_per_block),
        world_size=max(1, int(config.parallel.world_size)), num_groups=len(config.groups), num_kv_heads=heads,
        head_dim=head_dim, backend=backend, kv_cache_layout=getattr(config, "kv_cache_layout", None),
        cpu_attn_isa=isa)
