"""The fixture's pure helpers: reading crds/ (which may be empty or missing) and reading CRD conditions."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugins.controlplane import ControlPlaneError, is_established, manifest_documents, namespace_name_hint


def test_missing_or_empty_manifest_directory_yields_nothing(tmp_path: Path) -> None:
    assert manifest_documents(tmp_path / "absent") == []
    assert manifest_documents(tmp_path) == []


def test_manifests_are_read_in_file_order_skipping_empty_documents(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n")
    (tmp_path / "a.yml").write_text(
        "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: a1}\n---\n---\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a2}\n"
    )
    (tmp_path / "notes.txt").write_text("not a manifest")
    assert [d["metadata"]["name"] for d in manifest_documents(tmp_path)] == ["a1", "a2", "b"]


def test_a_document_that_is_not_an_object_names_file_and_index(tmp_path: Path) -> None:
    (tmp_path / "crd.yaml").write_text("apiVersion: v1\nkind: ConfigMap\n---\n- just\n- a list\n")
    with pytest.raises(ControlPlaneError, match=r"crd\.yaml document 1: not a Kubernetes object"):
        manifest_documents(tmp_path)


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ([{"type": "NamesAccepted", "status": "True"}, {"type": "Established", "status": "True"}], True),
        ([{"type": "Established", "status": "False"}], False),
        ([], False),
        (None, False),
    ],
)
def test_is_established(conditions: list[dict[str, str]] | None, expected: bool) -> None:
    assert is_established({"status": {"conditions": conditions}}) is expected
    assert is_established({}) is False


def test_namespace_name_hint_is_a_valid_label_value() -> None:
    assert namespace_name_hint("test_x[param-1]") == "test_x-param-1"
    assert len(namespace_name_hint("t" * 100)) == 63
    assert namespace_name_hint("[]") == "test"
