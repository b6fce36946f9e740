"""``kvtier accuracy``: what kvtier's KV codecs do to a model's next-token predictions, measured on real KV.

For a Hugging Face model directory and any text: prefill a prefix, cut its real (post-RoPE) KV into the chunks an
engine's offloading worker hands kvtier (the engine's page order, block and chunk sizes: ``chunks.py``), send every
chunk through the product's codec path in prefix order (``engines.chunk_layout.tier_codec``: the layout-aware
codec with its verification and fallback, as a tier builds it), put the decoded chunks back into the cache and
score the continuation against the exact cache's (``scores.py``: perplexity change, KL, top-1 agreement). A
partial last chunk stays exact, as the engine offloads only whole chunks.

Modules: ``scores`` (the measures; torch only), ``chunks`` (KV <-> engine chunks through the codec), ``model``
(transformers, imported lazily), ``harness`` (the runs), ``report`` (table, JSON, verdicts), ``cli``.
This package imports torch; transformers only when a model is loaded (the ``accuracy`` extra).
"""
