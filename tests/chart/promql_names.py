"""Metric names a PromQL expression reads, for checking dashboards and rules against what is exported.

Not a PromQL parser: it removes strings, label matchers, ranges and grouping clauses, then takes the identifiers
that are not functions, aggregations or keywords. A selector written as ``{__name__=~"vllm[:_]x"}`` counts as
both ``vllm:x`` and ``vllm_x``; any other ``__name__`` regex is rejected, since it could match anything.
"""
from __future__ import annotations

import re

FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "count_over_time", "day_of_month", "day_of_week", "delta", "deriv", "exp", "floor", "histogram_quantile",
    "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln",
    "log2", "log10", "max_over_time", "min_over_time", "minute", "month", "predict_linear", "quantile_over_time",
    "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "stddev_over_time",
    "stdvar_over_time", "sum_over_time", "time", "timestamp", "vector", "year",
}
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_NAME_REGEX = re.compile(r'__name__\s*=~?\s*"([^"]*)"')
_EITHER_SPELLING = re.compile(r"^([a-z]+)\[:_\]([a-zA-Z0-9_]+)$")


class UncheckableName(ValueError):
    """A ``__name__`` matcher that is not a literal name or the ``prefix[:_]name`` form."""


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()
    for pattern in _NAME_REGEX.findall(expr):
        match = _EITHER_SPELLING.match(pattern)
        if match:
            names |= {f"{match[1]}:{match[2]}", f"{match[1]}_{match[2]}"}
        elif re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", pattern):
            names.add(pattern)
        else:
            raise UncheckableName(f"__name__ matcher {pattern!r} in {expr!r}")
    text = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers (their strings included)
    text = _STRING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\$\{?[a-zA-Z_][a-zA-Z0-9_]*\}?", " ", text)  # Grafana variables
    text = re.sub(r"(?<![a-zA-Z_:])[0-9][0-9.]*([eE][+-]?[0-9]+)?(ms|[smhdwy])?", " ", text)  # numbers, durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    for token in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        if token in FUNCTIONS or token in AGGREGATIONS or token.lower() in KEYWORDS:
            continue
        names.add(token)
    return names
