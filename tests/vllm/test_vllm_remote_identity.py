"""The remote tier's keys are vLLM's block hashes: replicas share a store only if they hash alike, and a store is
shared only under a collision-resistant hash (a chosen-prompt collision under xxhash would serve one client's KV for
another's tokens on every replica)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm.config
from kvtier_runtime.config import ConfigError
from kvtier_runtime.engines.vllm import remote_identity

pytestmark = pytest.mark.vllm


def with_algo(monkeypatch, algo: str) -> None:
    current = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo), model_config=None)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_a_non_cryptographic_prefix_hash_refuses_the_remote_tier_naming_the_flag(monkeypatch, algo):
    with_algo(monkeypatch, algo)
    with pytest.raises(ConfigError, match=r"prefix_caching_hash_algo: .* \(--prefix-caching-hash-algo sha256_cbor"):
        remote_identity._hash_facts()


def test_the_hash_function_and_its_seed_are_part_of_the_identity(monkeypatch):
    with_algo(monkeypatch, "sha256_cbor")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cbor = remote_identity._hash_facts()
    assert cbor == {"hash_algo": "sha256_cbor", "hash_seed": None}
    with_algo(monkeypatch, "sha256")
    assert remote_identity._hash_facts() != cbor
    with_algo(monkeypatch, "sha256_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert remote_identity._hash_facts() == {"hash_algo": "sha256_cbor", "hash_seed": "7"}
