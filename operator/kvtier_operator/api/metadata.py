"""The checks the API server makes on a KVCachePolicy's ``metadata``, made offline by ``kvtier validate``.

The CRD cannot declare ``metadata`` (the API server validates ObjectMeta itself), so these rules are Kubernetes'
own, restated: a name that is a DNS-1123 subdomain, a namespace that is a DNS-1123 label, string-only labels and
annotations with valid keys and label values. The 63-character limit on names is kvtier's, a CEL rule on the
object (the name becomes a label value), so it is not repeated here.
"""
from __future__ import annotations

import re
from typing import Any

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
MAX_ANNOTATIONS_BYTES = 256 * 1024  # TotalAnnotationSizeLimitB in apimachinery


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key_problem(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return "the prefix before '/' must be a DNS-1123 subdomain of at most 253 characters"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return "the name must be 1-63 characters of [A-Za-z0-9-_.], starting and ending alphanumeric"
    return None


def metadata_problems(meta: Any) -> list[tuple[str, str]]:
    """``(field path, rule)`` for every way ``meta`` breaks the API server's ObjectMeta rules."""
    if meta is None:
        return [("metadata.name", "required")]
    if not isinstance(meta, dict):
        return [("metadata", "must be a mapping")]
    out: list[tuple[str, str]] = []
    name = meta.get("name")
    if name is None:
        if not meta.get("generateName"):
            out.append(("metadata.name", "required"))
    elif not isinstance(name, str):
        out.append(("metadata.name", f"{_short(name)} must be a string"))
    elif len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        out.append(("metadata.name", f"{_short(name)} must be a DNS-1123 subdomain (lower case alphanumerics, "
                                     "'-' and '.', starting and ending alphanumeric)"))
    namespace = meta.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or len(namespace) > 63
                                  or not DNS1123_LABEL.match(namespace)):
        out.append(("metadata.namespace", f"{_short(namespace)} must be a DNS-1123 label (at most 63 lower case "
                                          "alphanumerics or '-')"))
    for field in ("labels", "annotations"):
        items = meta.get(field)
        if items is None:
            continue
        if not isinstance(items, dict):
            out.append((f"metadata.{field}", "must be a mapping of strings to strings"))
            continue
        size = 0
        for key, value in items.items():
            where = f"metadata.{field}[{_short(key)}]"
            if not isinstance(key, str):
                out.append((where, "keys must be strings"))
                continue
            problem = _key_problem(key)
            if problem:
                out.append((where, problem))
            if value is None:  # the API server reads null as "" (Go's JSON decoding), so it is no error there
                continue
            if not isinstance(value, str):
                out.append((where, f"{_short(value)} must be a string (quote it)"))
                continue
            size += len(key) + len(value)
            if field == "labels" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                out.append((where, f"{_short(value)} must be at most 63 characters of [A-Za-z0-9-_.], starting "
                                   "and ending alphanumeric"))
        if field == "annotations" and size > MAX_ANNOTATIONS_BYTES:
            out.append(("metadata.annotations", f"may hold at most {MAX_ANNOTATIONS_BYTES} bytes in total"))
    return out
