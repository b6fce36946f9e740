"""`kvtier validate` is bounded for the whole input, not only per document (issue 24, class F): a thousand
near-limit documents cost minutes of CPU when only each one was bounded."""
from __future__ import annotations

import time

from kvtier_operator import cli
from kvtier_operator.api import yamlload

POLICY = """apiVersion: kvtier.io/v1alpha1
kind: KVCachePolicy
metadata: {name: p%d}
spec:
  selector: {matchLabels: {app: llm}}
  tiers:
  - {name: host, medium: cpu, size: 4Gi}
  - {name: nvme, medium: filesystem, size: 100Gi, path: /mnt/kv, volume: {emptyDir: {}}}
"""


def _validate(capsys, *paths) -> tuple[int, str, float]:
    started = time.monotonic()
    rc = cli.main(["validate", *map(str, paths)])
    return rc, capsys.readouterr().err, time.monotonic() - started


def test_class_f_validate_refuses_a_thousand_documents_quickly(capsys, tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("---\n".join(POLICY % i for i in range(1000)))  # ~250 KiB: under the per-file bound
    rc, err, took = _validate(capsys, path)
    assert rc == 1 and f"more than {yamlload.MAX_DOCUMENTS} documents in all" in err, err
    assert took < 15, took


def test_class_f_the_bound_is_for_the_whole_invocation_not_each_file(capsys, tmp_path):
    paths = []
    for f in range(5):
        path = tmp_path / f"part{f}.yaml"
        path.write_text("---\n".join(POLICY % i for i in range(60)))  # 60 each: every file alone is fine
        paths.append(path)
    rc, err, _ = _validate(capsys, *paths)
    assert rc == 1 and f"more than {yamlload.MAX_DOCUMENTS} documents in all" in err, err
    rc, err, _ = _validate(capsys, paths[0])
    assert rc == 0, err


def test_class_f_the_time_bound_stops_validation(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(yamlload, "MAX_SECONDS", 0.0)
    path = tmp_path / "few.yaml"
    path.write_text("---\n".join(POLICY % i for i in range(3)))
    rc, err, _ = _validate(capsys, path)
    assert rc == 1 and "stopped after 0s" in err, err
