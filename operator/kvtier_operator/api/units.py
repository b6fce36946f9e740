"""Kubernetes quantities and Go-style durations, parsed the way the API server and the engines read them."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY: dict[str, int] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, Decimal | int] = {"m": Decimal("0.001"), "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}

# A strictly positive quantity: the CRD uses the same pattern, so the API server and `kvtier validate` agree.
POSITIVE_QUANTITY_PATTERN = (
    r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
)
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([a-zA-Z]*)$")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_quantity(value: str | int) -> int:
    """Bytes in a Kubernetes quantity (``16Gi``, ``500G``, ``1.5Gi``, ``1073741824``), rounded up to a byte."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a quantity (e.g. 16Gi, 500G)")
    number, suffix = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a quantity (e.g. 16Gi, 500G)") from None
    if suffix in _BINARY:
        scaled = amount * _BINARY[suffix]
    elif suffix in _DECIMAL:
        scaled = amount * _DECIMAL[suffix]
    else:
        raise ValueError(f"{value!r} has an unknown suffix {suffix!r}")
    whole = int(scaled)
    return whole if whole == scaled else whole + 1


def format_quantity(n_bytes: int) -> str:
    """The shortest exact binary-suffixed form (``17179869184`` -> ``16Gi``), else plain bytes."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _BINARY[suffix]
        if n_bytes and n_bytes % unit == 0:
            return f"{n_bytes // unit}{suffix}"
    return str(n_bytes)


def parse_duration(value: str) -> float:
    """Seconds in a Go-style duration (``150ms``, ``2s``, ``5m``, ``1h30m``)."""
    text = str(value).strip()
    if not re.match(DURATION_PATTERN, text):
        raise ValueError(f"{value!r} is not a duration (e.g. 150ms, 2s, 5m, 1h)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))
