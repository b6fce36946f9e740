"""A small Llama with seeded random weights and a locally built WordLevel tokenizer, cached by content digest.

Random weights are enough for what the engine tests check: the same prompt gives the same greedy tokens whether
its KV came from vLLM's own cache, from kvtier's host tier or from its disk tier (in float32 the comparison is
deterministic), and the compute per token is realistic for the model's shape (8 layers x 512 hidden: prefill is
measurable on 2 cores, 29M parameters).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
import shutil
import tempfile

# Bump when the generation below changes, so cached models are regenerated.
GENERATOR_VERSION = 1
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 8
    intermediate_size: int = 1024
    vocab_words: int = 4000
    max_position_embeddings: int = 16384
    dtype: str = "float32"
    seed: int = 1234

    @property
    def vocab_size(self) -> int:
        return self.vocab_words + len(SPECIAL_TOKENS)

    def digest(self) -> str:
        doc = {"generator": GENERATOR_VERSION, **dataclasses.asdict(self)}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


DEFAULT_SPEC = ModelSpec()

def kv_bytes_per_token(spec: ModelSpec = DEFAULT_SPEC) -> int:
    """K and V of every layer for one token (32 KiB for the default float32 8 x 512 model)."""
    head_dim = spec.hidden_size // spec.num_heads
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[spec.dtype]
    return 2 * spec.num_layers * spec.num_kv_heads * head_dim * itemsize


def word(i: int) -> str:
    return f"w{i}"


def prompt_ids(n_tokens: int, seed: int, spec: ModelSpec = DEFAULT_SPEC) -> list[int]:
    """``n_tokens`` token ids of ordinary words (no special tokens), the same for the same seed."""
    rng = random.Random(seed)
    first = len(SPECIAL_TOKENS)
    return [first + rng.randrange(spec.vocab_words) for _ in range(n_tokens)]


def _build(spec: ModelSpec, out: pathlib.Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(spec.vocab_words):
        vocab[word(i)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.model_max_length = spec.max_position_embeddings
    fast.save_pretrained(out)

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    # A wider init than the default keeps greedy decoding away from near-ties, so equal KV gives equal tokens and
    # a wrong KV block gives visibly different ones.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)


def ensure_model(cache_dir: str | os.PathLike[str], **spec_fields: object) -> pathlib.Path:
    """The model directory for ``ModelSpec(**spec_fields)`` under ``cache_dir``, generated on first use."""
    spec = ModelSpec(**spec_fields)  # type: ignore[arg-type]
    cache = pathlib.Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"kvtier-llama-{spec.digest()}"
    if (final / "model.safetensors").exists():
        return final
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        _build(spec, tmp)
        (tmp / "kvtier-model-spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=1))
        try:
            tmp.rename(final)  # atomic: a concurrent builder's copy wins, ours is dropped
        except OSError:
            if not (final / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
