"""Trace replay and sizing (``kvtier replay``): Mooncake traces through the runtime's own policies, vs OPT.

Torch-free: only the policies, the standard library, and (for --sweep / analyze progress) matplotlib and tqdm.
"""
from .engine import PolicySpec, ReplayError, ReplayResult, capacity_blocks, replay, replay_recorded, replay_single
from .opt import next_uses, opt_hits
from .trace import Trace, TraceError, load_trace

__all__ = ["PolicySpec", "ReplayError", "ReplayResult", "Trace", "TraceError", "capacity_blocks", "load_trace",
           "next_uses", "opt_hits", "replay", "replay_recorded", "replay_single"]
