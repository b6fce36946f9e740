"""What a pass reports about a policy, as plain values: a status condition and a Kubernetes Event.

Shared by the reconcile (``reconcile``, ``status``) and the SLO guard's step (``slo_tick``) so that the guard
imports nothing from the controller: it returns these, and the pass turns them into its one status write and its
Events (``controller``, ``handlers``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cond:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str
