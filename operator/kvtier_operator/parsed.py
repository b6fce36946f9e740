"""Policies as stored by the API server, parsed once per spec content; the reconcile and the SLO guard share it.

Objects read from the API server passed the CRD's CEL rules at admission; re-running them in Python would cost
~0.1 s a reconcile, so a stored object gets the schema pass only. Raw objects (tests, files) get every rule. An
engine detected from the container (the server saw none) re-checks only the rules declared for that engine
(``api.ENGINE_RULES``), once per spec.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from .api import v1alpha1 as api
from .api.validation import parse_policy


def _no_rule(rule: dict[str, Any]) -> bool:
    return False


def key(policy_obj: Mapping[str, Any]) -> str:
    """What a parse depends on (kind, namespace, name and spec): the cache key, computed once per object.

    The namespace is part of the parse, not only of the key: the renderer reads it from the parsed metadata (it is
    the tenant scope of the remote tiers), so two policies of one name and spec in two namespaces are two parses."""
    meta = policy_obj["metadata"]
    doc = {"apiVersion": policy_obj.get("apiVersion", api.API_VERSION), "kind": policy_obj.get("kind", api.KIND),
           "metadata": {"name": meta["name"], **({"namespace": meta["namespace"]} if meta.get("namespace") else {})},
           "spec": policy_obj.get("spec")}
    return json.dumps(doc, sort_keys=True)


@functools.lru_cache(maxsize=4096)
def parse(doc_key: str, server_validated: bool = True) -> api.KVCachePolicy:
    """The policy behind ``key(obj)``; raises ``PolicyInvalid``."""
    return parse_policy(json.loads(doc_key), cel_rules=_no_rule if server_validated else None)


@functools.lru_cache(maxsize=4096)
def with_engine(doc_key: str, engine: str) -> api.KVCachePolicy:
    """The policy with ``spec.engine`` set to a detected engine, checked against that engine's rules."""
    doc = json.loads(doc_key)
    doc["spec"]["engine"] = engine
    rules = api.ENGINE_RULES.get(engine, set())
    return parse_policy(doc, cel_rules=lambda rule: rule["rule"] in rules)
