"""The engine metrics every backend's plug-in exports are defined once (kvtier_runtime.engines.metric_defs): the
definitions are consistent, pure to import, and the operator's SLO reader queries the names they define."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from kvtier_runtime.engines import metric_defs as M
from kvtier_runtime.engines.metric_defs import EngineMetric, prometheus_pattern

ALL = M.SPEC_METRICS + M.FS_TIER_METRICS


def test_every_metric_has_one_name_across_backends():
    names = [d.name for d in ALL]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_module_level_definition_is_in_a_backend_set():
    defined = {v for v in vars(M).values() if isinstance(v, EngineMetric)}
    assert defined == set(ALL), sorted(d.name for d in defined ^ set(ALL))


@pytest.mark.parametrize("metric", ALL, ids=lambda d: d.name)
def test_definition_is_a_valid_vllm_metric(metric: EngineMetric):
    assert re.fullmatch(r"vllm:kv_offload_kvtier_[a-z_]+", metric.name)
    assert not metric.name.endswith("_total"), "vLLM's exporter adds _total to a counter's samples"
    assert metric.help.endswith("."), "a help text is a sentence"
    assert len(set(metric.labels)) == len(metric.labels)
    assert all(re.fullmatch(r"[a-z_]+", label) for label in metric.labels)


def test_native_backend_tier_metrics_are_labelled_by_directory():
    assert all(d.labels[0] == M.ROOT_LABEL and d.name.startswith("vllm:kv_offload_kvtier_fs_")
               for d in M.FS_TIER_METRICS)


def test_flat_codec_help_names_every_reason():
    for reason in M.FLAT_REASONS:
        assert reason in M.FLAT_CODEC_TIERS.help


def test_a_kind_other_than_gauge_or_counter_is_refused():
    with pytest.raises(ValueError, match="kind: 'histogram' of x must be 'gauge' or 'counter'"):
        EngineMetric("x", "histogram", "X.")  # type: ignore[arg-type]


def test_sample_names_and_patterns_match_both_exporter_spellings():
    assert M.HIT_TOKENS.sample_name == "vllm:kv_offload_kvtier_hit_tokens_total"
    assert M.HOST_USED_BYTES.sample_name == "vllm:kv_offload_kvtier_host_used_bytes"
    pattern = re.compile(prometheus_pattern(M.HIT_TOKENS))
    assert pattern.fullmatch("vllm:kv_offload_kvtier_hit_tokens_total")
    assert pattern.fullmatch("vllm_kv_offload_kvtier_hit_tokens_total")
    assert not pattern.fullmatch("vllm:kv_offload_kvtier_hit_tokens")
    assert not pattern.fullmatch("vllm:kv_offload_kvtier_lookup_tokens_total")


def test_operator_slo_reader_queries_the_defined_counters():
    from kvtier_operator.slo import hit_ratios

    assert re.fullmatch(hit_ratios.HIT_TOKENS, M.HIT_TOKENS.sample_name)
    assert re.fullmatch(hit_ratios.LOOKUP_TOKENS, M.LOOKUP_TOKENS.sample_name)


def test_importing_the_definitions_imports_neither_torch_nor_vllm():
    code = ("import sys, kvtier_runtime.engines.metric_defs; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
