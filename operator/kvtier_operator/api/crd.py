"""Generate the KVCachePolicy CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema with ``$ref``s and ``anyOf: [X, null]`` for optional fields; the API server wants a
structural schema (everything inline, one type per node). This module converts one into the other, keeping
descriptions, defaults, enums, bounds and the CEL rules declared on the models.
"""
from __future__ import annotations

import copy
from typing import Any

import yaml

from . import v1alpha1 as api

_KEEP = {
    "type", "description", "default", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "pattern", "maxLength", "minLength", "maxItems", "minItems", "items", "properties", "required",
    "additionalProperties", "x-kubernetes-validations", "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "format",
}


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = copy.deepcopy(node)
    if "$ref" in node:
        ref = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        merged = copy.deepcopy(ref)
        # A field's own description/default wins over the referenced model's.
        merged.update(node)
        node = merged
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) == 1:
            inner = _structural(options[0], defs)
            inner.update({k: v for k, v in node.items() if k != "default" or v is not None})
            node = inner
        else:
            node["anyOf"] = options
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP and key != "anyOf":
            continue
        if key == "default" and value is None:
            continue
        if key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key in ("items",) or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = _structural(value, defs)
        elif key == "additionalProperties" and isinstance(value, bool):
            continue  # structural schemas prune unknown fields; a boolean here is not allowed
        else:
            out[key] = value
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # JSON Schema 2020 writes exclusive bounds as numbers; OpenAPI v3.0 (the API server) as booleans.
        if isinstance(out.get(flag), (int, float)) and not isinstance(out.get(flag), bool):
            out[bound] = out[flag]
            out[flag] = True
    if out.get("x-kubernetes-int-or-string"):
        # The one anyOf a structural schema allows; value validations stay on the node (as controller-gen
        # emits for resource.Quantity), where the pattern applies to the string form only.
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        out["minimum"] = 1  # applies to the integer form: quantities here are positive
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
        out["type"] = "object"
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    return out


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the CRD's single version."""
    raw = api.KVCachePolicy.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    schema = _structural(raw, defs)
    props = schema["properties"]
    props["metadata"] = {"type": "object"}
    props["apiVersion"] = {"type": "string", "description": "APIVersion of this object (kvtier.io/v1alpha1)."}
    props["kind"] = {"type": "string", "description": "Kind of this object (KVCachePolicy)."}
    schema["required"] = ["spec"]
    return schema


PRINTER_COLUMNS = [
    {"name": "Engine", "type": "string", "jsonPath": ".status.engine", "description": "Serving engine."},
    {"name": "Tiers", "type": "string", "jsonPath": ".status.activeTiers", "description": "Enabled tiers."},
    {"name": "SLO", "type": "string", "jsonPath": ".status.sloState", "description": "SLO guard state."},
    {"name": "Hits", "type": "string", "jsonPath": ".status.hitRatios",
     "description": "Hit ratio per tier over spec.slo.window (gpu: the engine's own prefix cache)."},
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status",
     "description": "Whether the policy is applied to all its targets."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "annotations": {"kvtier.io/generated-by": "kvtier crd"},
        },
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["kvtier"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `kvtier crd` from operator/kvtier_operator/api/v1alpha1.py. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
