"""The hostile-policy corpus (hostile_policies.yaml): each case as the bytes of a policy file."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CORPUS = Path(__file__).with_name("hostile_policies.yaml")
_DATA = yaml.safe_load(CORPUS.read_text())  # our own file: the loader under test is not needed to read it
BASE: dict[str, Any] = _DATA["base"]
CASES: list[dict[str, Any]] = _DATA["cases"]
ACCEPT: list[dict[str, Any]] = _DATA["accept"]
HEAD = "apiVersion: kvtier.io/v1alpha1\nkind: KVCachePolicy\n"


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


def document(case: dict[str, Any]) -> dict[str, Any]:
    """The policy object of a base+patch case."""
    doc = copy.deepcopy(BASE)
    if "metadata" in case:
        doc["metadata"] = copy.deepcopy(case["metadata"])
    if "spec_raw" in case:
        doc["spec"] = copy.deepcopy(case["spec_raw"])
    _merge(doc["spec"], case.get("spec") or {})
    return doc


def _alias_bomb(levels: int, where: str = "metadata") -> str:
    lines = ["  a0: &a0 [" + ", ".join(['"lol"'] * 9) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    body = "\n".join(lines)
    if where == "spec":
        return HEAD + "metadata: {name: bomb}\nspec:\n  selector: {matchLabels: {a: b}}\n" + body + "\n"
    return HEAD + "metadata:\n  name: bomb\n" + body + "\nspec: {selector: {matchLabels: {a: b}}}\n"


def _generate(recipe: dict[str, Any]) -> bytes:
    kind = recipe["kind"]
    if kind == "alias_bomb":
        return _alias_bomb(recipe["levels"], recipe.get("where", "metadata")).encode()
    if kind == "nested_list":
        d = recipe["depth"]
        return (HEAD + "metadata: {name: deep}\nspec: " + "[" * d + "]" * d + "\n").encode()
    if kind == "nested_block":
        d = recipe["depth"]
        return (HEAD + "metadata: {name: deep}\nspec:\n" +
                "".join(" " * (i + 1) + f"k{i}:\n" for i in range(d)) + " " * (d + 1) + "v\n").encode()
    if kind == "deep_annotation":
        d = recipe["depth"]
        return (HEAD + "metadata:\n  name: deep\n  annotations:\n    x: " + "{a: " * d + "1" + "}" * d +
                "\nspec: {selector: {matchLabels: {a: b}}}\n").encode()
    if kind == "deep_aliases":
        # Each anchor nests the previous one `depth` levels down: small and shallow as written, deep expanded.
        lines = ["  l0: &l0 x"]
        for i in range(1, recipe["levels"] + 1):
            lines.append(f"  l{i}: &l{i} " + "[" * recipe["depth"] + f"*l{i - 1}" + "]" * recipe["depth"])
        return (HEAD + "metadata:\n  name: deep\n" + "\n".join(lines) + "\nspec: {}\n").encode()
    if kind == "latin1":
        return (HEAD + "metadata: {name: caf\xe9}\nspec: {}\n").encode("latin-1")
    if kind == "utf16":
        return (HEAD + "metadata: {name: x}\n").encode("utf-16-le")
    if kind == "huge":
        return (HEAD + "# " + "x" * recipe["bytes"] + "\n").encode()
    if kind == "nul":
        return (HEAD + "metadata: {name: a\x00b}\n").encode()
    if kind == "big_annotations":
        size, n = recipe["bytes"], 5
        notes = "".join(f"    a{i}: {'x' * (size // n)}\n" for i in range(n))
        return (HEAD + "metadata:\n  name: big\n  annotations:\n" + notes +
                "spec:\n  selector: {matchLabels: {app: llm}}\n  engine: vllm\n").encode()
    raise ValueError(f"unknown recipe {kind!r}")


def file_bytes(case: dict[str, Any]) -> bytes:
    if "text" in case:
        return case["text"].encode()
    if "generate" in case:
        return _generate(case["generate"])
    return yaml.safe_dump(document(case), sort_keys=False).encode()


def server_document(case: dict[str, Any]) -> dict[str, Any]:
    """What kubectl would send for a case (the file parsed as YAML; generated cases included)."""
    if "generate" in case or "text" in case:
        return yaml.safe_load(file_bytes(case))
    return document(case)


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c["id"] for c in cases]
