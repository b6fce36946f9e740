"""Per-thread, per-device scratch buffers that codecs reuse across calls.

Allocating a chunk-sized temporary per call costs more than the arithmetic on a CPU, and the filesystem tier
encodes from many writer threads at once, so each thread owns its buffers: no locks on the hot path and no
sharing between concurrent encodes.
"""
from __future__ import annotations

import threading

import torch


class ScratchPool:
    """Named 1-D buffers that grow to the largest size asked for and are then reused."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] | None = getattr(
            self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        key = (name, dtype, device)
        buf = buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, device=device)
            buffers[key] = buf
        return buf[:n]

    def nbytes(self) -> int:
        """Bytes held by the calling thread (tests use it to prove buffers are reused, not re-grown)."""
        buffers = getattr(self._local, "buffers", {})
        return sum(b.numel() * b.element_size() for b in buffers.values())
