"""The vLLM adapter's pure helpers (no vllm import): they run in every environment."""
from __future__ import annotations

import pytest
import torch
from kvtier_runtime.config import ConfigError
from kvtier_runtime.engines.vllm_support import (
    POLICY_REFUSALS,
    block_view_dtype,
    job_outcome,
    kv_torch_dtype,
    namespace_suffix,
)


def test_a_store_refused_by_policy_still_succeeds_but_an_io_fault_fails_it():
    refused = job_outcome([True, False, False], {1: "not-admitted", 2: "no-room"}, is_promotion=False)
    assert refused.success and refused.n_ok == 1
    assert refused.refused == {"not-admitted": 1, "no-room": 1} and refused.failed == {}
    faulted = job_outcome([True, False, False], {1: "not-admitted", 2: "enospc"}, is_promotion=False)
    assert not faulted.success and faulted.failed == {"enospc": 1} and faulted.refused == {"not-admitted": 1}
    assert "enospc" not in POLICY_REFUSALS and "corrupt" not in POLICY_REFUSALS


def test_a_load_succeeds_only_when_every_key_loaded():
    partial = job_outcome([True, False], {1: "corrupt"}, is_promotion=True)
    assert not partial.success and partial.n_ok == 1 and partial.failed == {"corrupt": 1}
    assert job_outcome([True, True], {}, is_promotion=True).success
    # A load never turns a failure into a refusal, whatever the reason says.
    assert job_outcome([False], {0: "busy"}, is_promotion=True).failed == {"busy": 1}
    assert job_outcome([False], {}, is_promotion=True).failed == {"other": 1}


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), ("half", torch.float16),
     ("float32", torch.float32), (torch.bfloat16, torch.bfloat16), ("fp8", None), ("auto", None), (None, None),
     (torch.uint8, None)],
)
def test_kv_dtype_spellings(spelling, dtype):
    assert kv_torch_dtype(spelling) == dtype


def test_codec_none_stores_any_kv_dtype_exactly_through_a_16_bit_view():
    assert block_view_dtype("none", "fp8", 4096) == torch.float16
    assert block_view_dtype("none", None, 4096) == torch.float16


def test_a_lossy_codec_needs_a_float_kv_dtype_and_says_so():
    assert block_view_dtype("int4", "bfloat16", 4096) == torch.bfloat16
    with pytest.raises(ConfigError, match=r"codec: 'int4'.*'fp8_e4m3'.*use codec 'none'"):
        block_view_dtype("int4", "fp8_e4m3", 4096)


def test_a_row_that_is_not_whole_values_is_rejected():
    with pytest.raises(ConfigError, match="primary_kv_view"):
        block_view_dtype("none", "bfloat16", 4095)
    with pytest.raises(ConfigError, match="primary_kv_view"):
        block_view_dtype("fp8", "float32", 4098)


def test_namespace_suffix_is_stable_and_separates_runs():
    a = {"model_name": "m", "dtype": "bfloat16", "tokens_per_hash": 16}
    assert namespace_suffix(a) == namespace_suffix(dict(reversed(list(a.items()))))
    assert len(namespace_suffix(a)) == 8
    assert namespace_suffix(a) != namespace_suffix({**a, "model_name": "other"})
    assert namespace_suffix(a) != namespace_suffix({**a, "dtype": "float16"})
