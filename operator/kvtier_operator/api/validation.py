"""Offline validation of KVCachePolicy objects: the same checks the API server runs.

Two passes, as on the server: the schema (types, enums, bounds, patterns; done by the pydantic models the schema
is generated from), then the CEL rules, evaluated with a CEL interpreter over the very
``x-kubernetes-validations`` in the generated CRD. So a rule is written once and cannot drift between
``kubectl apply`` and ``kvtier validate``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import celpy
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError
from pydantic import ValidationError

from . import v1alpha1 as api
from .crd import openapi_schema
from .metadata import metadata_problems
from .paths import RuleError
from .units import POSITIVE_QUANTITY_PATTERN, parse_quantity
from .yamlload import Budget, YAMLInputError, load_all


@dataclass(frozen=True)
class Problem:
    """One rejection: the field path and the rule it broke."""

    path: str
    message: str
    # "schema" (types, enums, bounds, patterns) or "cel" (an x-kubernetes-validations rule)
    source: str = "schema"

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.message else self.path


class PolicyInvalid(ValueError):
    """A policy broke one or more rules; ``problems`` lists them all."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def _format_loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _pydantic_problems(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors(include_url=False):
        # pydantic adds validator wrappers (e.g. "function-before[...]") to the location; users see fields only.
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        path = _format_loc(loc) or "(document)"
        kind, value = e["type"], e.get("input")
        if kind == "missing":
            message = "required"
        elif kind == "extra_forbidden":
            message = "unknown field"
        elif kind == "string_pattern_mismatch" and e.get("ctx", {}).get("pattern") == POSITIVE_QUANTITY_PATTERN:
            message = f"{value!r} is not a positive Kubernetes quantity (e.g. 16Gi, 500G)"
        elif kind == "value_error" and isinstance(e.get("ctx", {}).get("error"), RuleError):
            message = str(e["ctx"]["error"])  # word for word the CEL rule's message (the API server's)
        elif kind == "string_pattern_mismatch":
            message = f"{value!r} does not match {e['ctx']['pattern']}"
        else:
            message = f"{value!r}: {e['msg']}" if not isinstance(value, (dict, list)) else e["msg"]
        problems.append(Problem(path, message))
    return problems


def _cel_format(template: Any, args: Any) -> celpy.celtypes.StringType:
    """Kubernetes' CEL ``string.format(list)`` (the strings extension) for ``%d`` and ``%s``."""
    values = iter(args)
    out, text, i = [], str(template), 0
    while i < len(text):
        if text[i] == "%" and i + 1 < len(text) and text[i + 1] in "ds%":
            out.append("%" if text[i + 1] == "%" else str(next(values)))
            i += 2
        else:
            out.append(text[i])
            i += 1
    return celpy.celtypes.StringType("".join(out))


def _is_quantity(text: Any) -> celpy.celtypes.BoolType:
    try:
        parse_quantity(str(text))
    except ValueError:
        return celpy.celtypes.BoolType(False)
    return celpy.celtypes.BoolType(True)


def _quantity(text: Any) -> celpy.celtypes.IntType:
    """Kubernetes' CEL ``quantity()``, as the byte count (rounded up): all the rules here compare quantities.
    Clamped to int64 (CEL's int): every bound in the CRD is far below, so comparisons keep their answer."""
    return celpy.celtypes.IntType(min(parse_quantity(str(text)), 2**63 - 1))


_FUNCTIONS: dict[str, Any] = {
    "format": _cel_format,
    "isQuantity": _is_quantity,
    "quantity": _quantity,
    "isGreaterThan": lambda a, b: celpy.celtypes.BoolType(int(a) > int(b)),
    "isLessThan": lambda a, b: celpy.celtypes.BoolType(int(a) < int(b)),
    "asInteger": lambda a: celpy.celtypes.IntType(int(a)),
}


@functools.cache
def _program(expression: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression), functions=_FUNCTIONS)


def _rules_by_path(schema: dict[str, Any]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(path pattern, schema node) for every node with CEL rules; ``'*'`` in a path stands for list items."""
    found: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def walk(node: dict[str, Any], path: tuple[Any, ...]) -> None:
        if node.get("x-kubernetes-validations"):
            found.append((path, node))
        for name, child in node.get("properties", {}).items():
            walk(child, path + (name,))
        if "items" in node:
            walk(node["items"], path + ("*",))

    walk(schema, ())
    return found


@functools.lru_cache(maxsize=1)
def _cel_nodes() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return _rules_by_path(openapi_schema())


def _values_at(doc: Any, pattern: tuple[Any, ...], path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if not pattern:
        yield path, doc
        return
    head, rest = pattern[0], pattern[1:]
    if head == "*":
        if isinstance(doc, list):
            for i, item in enumerate(doc):
                yield from _values_at(item, rest, path + (i,))
    elif isinstance(doc, dict) and head in doc:
        yield from _values_at(doc[head], rest, path + (head,))


def _cel_problems(doc: dict[str, Any], rules: Optional[Callable[[dict[str, Any]], bool]] = None) -> list[Problem]:
    problems = []
    for pattern, node in _cel_nodes():
        selected = [r for r in node["x-kubernetes-validations"] if rules is None or rules(r)]
        if not selected:
            continue
        for path, value in _values_at(doc, pattern):
            activation = {"self": json_to_cel(value)}
            for rule in selected:
                try:
                    result = _program(rule["rule"]).evaluate(activation)
                except CELEvalError as err:
                    result = err
                if isinstance(result, celpy.celtypes.BoolType) and bool(result):
                    continue
                field = (_format_loc(path) + rule.get("fieldPath", "")).lstrip(".") or "(document)"
                if not isinstance(result, celpy.celtypes.BoolType):
                    problems.append(Problem(field, f"rule could not be evaluated ({result}): {rule['rule']}", "cel"))
                elif "messageExpression" in rule:
                    message = str(_program(rule["messageExpression"]).evaluate(activation))
                    problems.append(Problem(field, message, "cel"))
                else:
                    problems.append(Problem(field, rule.get("message", f"failed rule: {rule['rule']}"), "cel"))
    return problems


def parse_policy(obj: dict[str, Any],
                 cel_rules: Optional[Callable[[dict[str, Any]], bool]] = None) -> api.KVCachePolicy:
    """A validated policy, or ``PolicyInvalid`` naming every field and rule that failed.

    ``cel_rules`` selects which CEL rules to evaluate (default all). The operator reads policies the API server
    has already checked with the same rules, and re-checks only the engine-dependent ones once it has detected
    the engine (evaluating CEL in Python costs ~0.1 s a policy).
    """
    if not isinstance(obj, dict):
        raise PolicyInvalid([Problem("(document)", "a KVCachePolicy must be a mapping")])
    meta_problems = [Problem(path, message) for path, message in metadata_problems(obj.get("metadata"))]
    try:
        policy = api.KVCachePolicy.model_validate({k: v for k, v in obj.items() if k != "status"})
    except ValidationError as err:
        raise PolicyInvalid(meta_problems + _pydantic_problems(err)) from None
    if meta_problems:
        raise PolicyInvalid(meta_problems)
    # Rules see the object as the API server does: defaults applied, unset optionals absent.
    problems = _cel_problems(policy.model_dump(by_alias=True, exclude_none=True, mode="json"), cel_rules)
    if problems:
        raise PolicyInvalid(problems)
    return policy


def load_documents(text: str, source: str = "<input>",
                   budget: Optional[Budget] = None) -> list[tuple[str, dict[str, Any]]]:
    """KVCachePolicy documents in a YAML stream, each with a label naming file and document index."""
    try:
        docs = [d for d in load_all(text, source, budget) if d is not None]
    except YAMLInputError as err:
        # The message already names the source (and line); the problem carries it whole.
        raise PolicyInvalid([Problem(str(err), "")]) from None
    out = []
    for i, doc in enumerate(docs):
        label = source if len(docs) == 1 else f"{source}[{i}]"
        if not isinstance(doc, dict):
            raise PolicyInvalid([Problem(label, "a document must be a mapping")])
        if doc.get("kind") == api.KIND:
            out.append((label, doc))
    return out


# Codecs the runtime refuses on a filesystem tier whose KV layout it cannot describe (runtime
# engines/chunk_layout.py FLAT_REFUSED: without the layout nothing checks them on attention), and what it stores.
LAYOUT_ONLY_CODECS: dict[str, str] = {"int4": "int8"}


def policy_warnings(policy: api.KVCachePolicy) -> list[str]:
    """What a valid policy asks for that the engine may not do (``path: why``): int4 on a filesystem tier is kept
    only where kvtier describes the engine's KV layout; elsewhere the tier stores int8, so the capacity planned
    for int4 holds about half the blocks."""
    spec = policy.spec
    out: list[str] = []
    if spec.backend != "kvtier" or spec.engine not in (None, "vllm"):
        return out
    for i, tier in enumerate(spec.tiers):
        instead = LAYOUT_ONLY_CODECS.get(tier.compression)
        if tier.medium != "cpu" and instead:
            out.append(f"spec.tiers[{i}].compression: {tier.compression} is stored only where kvtier describes the "
                       f"engine's KV layout (vLLM's CPU backend with its vec kernels, any tensor-parallel size); "
                       f"on GPU attention backends, MLA models or pipeline parallelism this tier stores {instead} "
                       f"instead (counted in kvtier_runtime_codec_refusals_total)")
    return out


def validate_text(text: str, source: str = "<input>", budget: Optional[Budget] = None,
                  warnings: Optional[list[str]] = None) -> list[str]:
    """Problems (``file: path: rule``) in every KVCachePolicy of a YAML stream; empty when all are valid.
    ``budget`` bounds the whole input (documents, bytes, values, time), shared across the streams of one run.
    ``warnings``, when given, receives ``file: path: why`` for what valid policies ask that may not be done
    (``policy_warnings``); they do not make the input invalid."""
    budget = budget if budget is not None else Budget()
    try:
        docs = load_documents(text, source, budget)
    except PolicyInvalid as err:
        return [str(p) for p in err.problems]
    if not docs:
        return [f"{source}: no KVCachePolicy (kind: {api.KIND}) in this file"]
    problems: list[str] = []
    for label, doc in docs:
        try:
            budget.check_time(label)
        except YAMLInputError as err:
            return problems + [str(err)]
        try:
            policy = parse_policy(doc)
            if warnings is not None:
                name = policy.metadata.get("name")
                where = f"{label} ({name})" if name else label
                warnings.extend(f"{where}: {w}" for w in policy_warnings(policy))
        except PolicyInvalid as err:
            name = doc.get("metadata", {}).get("name") if isinstance(doc.get("metadata"), dict) else None
            where = f"{label} ({name})" if name else label
            problems.extend(f"{where}: {p}" for p in err.problems)
    return problems
