"""The chart's PrometheusRule groups: valid for promtool, unit-tested with `promtool test rules`, and matching
the same series the guard's default queries match."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kvtier_operator.slo.queries import ENGINE_METRICS

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "charts" / "kvtier" / "files" / "prometheus-rules.yaml"
RULE_TESTS = sorted((REPO / "tests" / "promtool").glob("*.test.yaml"))

pytestmark = pytest.mark.prometheus


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: apt-get install -y --no-install-recommends prometheus")
    return path


def test_rules_pass_promtool_check():
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_rule_unit_tests(test_file):
    result = subprocess.run([promtool(), "test", "rules", test_file.name], cwd=test_file.parent,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_use_the_guards_metric_regexes():
    text = RULES.read_text()
    for engine, names in ENGINE_METRICS.items():
        for regex in (names.ttft_bucket, names.itl_bucket, names.requests_count):
            assert f'__name__=~"{regex}"' in text, (engine, regex)


def test_rules_file_is_only_groups_so_the_chart_can_embed_it():
    data = yaml.safe_load(RULES.read_text())
    assert list(data) == ["groups"]
    assert {g["name"] for g in data["groups"]} == {"kvtier-slo.rules", "kvtier-slo.alerts"}
