"""The recorder's premise, checked against vLLM 0.33.0's real offloading scheduler: at a request's first lookup the
request context already holds every full chunk of the prompt, in order, with its end-token position -- which is
what kvtier's manager records (docs/replay.md, "Record your own traffic")."""
from __future__ import annotations

import pytest
from upstream import import_upstream

pytestmark = pytest.mark.vllm

utils = import_upstream("tests.v1.kv_connector.unit.offloading_connector.utils")
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    from vllm_cpu import model  # e2e/ is on the test path (pyproject: pythonpath)

    return model.ensure_model(tmp_path_factory.getbasetemp() / "models", hidden_size=64, num_layers=2, num_heads=2,
                              num_kv_heads=2, intermediate_size=128, vocab_words=200)


def test_the_first_lookup_of_a_request_sees_every_full_prompt_chunk_in_order(monkeypatch, local_model) -> None:
    # vLLM's runner builds its config for a hub model: a tiny local one instead (no network in tests), whose one
    # full-attention group does not take the hybrid KV cache manager the runner asks for.
    create = utils.create_vllm_config

    def local_config(**kwargs):
        return create(**{**kwargs, "model": str(local_model), "disable_hybrid_kv_cache_manager": True})

    monkeypatch.setattr(utils, "create_vllm_config", local_config)
    runner = utils.RequestRunner(block_size=4, num_gpu_blocks=100, async_scheduling=False)
    seen: dict[str, list[tuple[bytes, int]]] = {}

    def lookup(key, req_context):
        seen.setdefault(req_context.req_id, list(req_context._offload_key_positions.items()))
        return LookupResult.MISS

    runner.manager.lookup.side_effect = lookup
    runner.manager.prepare_store.side_effect = lambda keys, req_context: utils.generate_store_output(keys)
    runner.new_request(token_ids=list(range(1, 4 * 5 + 3)))  # 5 full chunks of 4 tokens and a 2-token tail
    runner.run(decoded_tokens=[utils.EOS_TOKEN_ID], expected_stored=(0, 1, 2, 3, 4))
    (positions,) = seen.values()
    assert [p for _, p in positions] == [4, 8, 12, 16, 20]
    assert len({k for k, _ in positions}) == 5
