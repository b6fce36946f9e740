"""The model side: transformers, imported only here and only when a model is loaded (``pip install
'kvtier[accuracy]'``). A causal LM whose cache is one K and one V tensor per layer ([batch, KV heads, tokens, head
dim], post-RoPE, as Hugging Face's ``DynamicCache`` holds them for Llama-style models) is what the engines page."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch

MISSING = ("kvtier accuracy needs transformers (and tokenizers): pip install 'kvtier[accuracy]'")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError(f"{MISSING} ({err})") from None
    return transformers


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    device: torch.device


def load(model_dir: str | pathlib.Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A local Hugging Face model directory (never the hub: ``local_files_only``)."""
    tf = _transformers()
    path = pathlib.Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: {model_dir} is not a Hugging Face model directory (no config.json)")
    tok = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not (kv_heads and head_dim and layers):
        raise ValueError(f"--model: {model_dir}'s config has no num_hidden_layers / num_key_value_heads / head_dim")
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "kv_lora_rank", None):
        raise ValueError(f"--model: {model_dir} uses a sliding window or a latent (MLA) cache; only a full K and V "
                         "per layer is judged here")
    return LoadedModel(model, tok, int(layers), int(kv_heads), int(head_dim),
                       int(getattr(cfg, "max_position_embeddings", 0) or 0), torch.device(device))


def tokenize(lm: LoadedModel, text: str) -> torch.Tensor:
    ids: torch.Tensor = lm.tokenizer(text, return_tensors="pt", add_special_tokens=True).input_ids[0]
    return ids


@torch.no_grad()
def prefill(lm: LoadedModel, ids: torch.Tensor, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix's KV, [L, H, N, D] each, rounded to the engine's KV dtype (what an engine holds and offloads)."""
    out = lm.model.model(ids.unsqueeze(0).to(lm.device), use_cache=True)
    cache = out.past_key_values
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != lm.num_layers:
        raise ValueError("the model's cache is not one K and V per layer (DynamicCache layers)")
    k = torch.stack([layer.keys[0] for layer in layers]).to(kv_dtype)
    v = torch.stack([layer.values[0] for layer in layers]).to(kv_dtype)
    if k.shape[1] != lm.num_kv_heads or k.shape[3] != lm.head_dim:
        raise ValueError(f"cache of {k.shape[1]} heads x {k.shape[3]}, the config says {lm.num_kv_heads} x "
                         f"{lm.head_dim}")
    return k, v


@torch.no_grad()
def continuation_logits(lm: LoadedModel, k: torch.Tensor, v: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Logits [len(cont), vocab] of the continuation tokens ``cont`` teacher-forced after a prefix whose KV is
    ``k``, ``v`` ([L, H, N, D]); position i predicts cont[i + 1] (the last row predicts the token after)."""
    tf = _transformers()
    cache = tf.DynamicCache(config=lm.model.config)
    dtype = next(lm.model.parameters()).dtype
    for layer in range(lm.num_layers):
        cache.update(k[layer].unsqueeze(0).to(dtype), v[layer].unsqueeze(0).to(dtype), layer)
    out = lm.model(cont.unsqueeze(0).to(lm.device), past_key_values=cache, use_cache=True)
    logits: torch.Tensor = out.logits[0].float().cpu()
    return logits
