"""Per-thread, per-device scratch buffers that codecs reuse across calls.

Allocating a chunk-sized temporary per call costs more than the arithmetic on a CPU, and the filesystem tier
encodes from many writer threads at once, so each thread owns its buffers: no locks on the hot path and no
sharing between concurrent encodes.
"""
from __future__ import annotations

import math
import threading

import torch


class ScratchPool:
    """Named buffers that grow to the largest size asked for and are then reused.

    ``get`` hands out shaped views and caches them per shape: slicing and viewing cost about a microsecond each
    in eager torch, which adds up over a dozen buffers per chunk.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _state(self) -> tuple[dict, dict]:
        st = getattr(self._local, "state", None)
        if st is None:
            st = self._local.state = ({}, {})
        return st

    def get(self, name: str, shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffers, views = self._state()
        key = (name, shape, dtype, device)
        view = views.get(key)
        if view is not None:
            return view
        n = shape if isinstance(shape, int) else math.prod(shape)
        bkey = (name, dtype, device)
        buf = buffers.get(bkey)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, device=device)
            buffers[bkey] = buf
            for k in [k for k in views if k[0] == name and k[2] == dtype and k[3] == device]:
                del views[k]
        view = buf[:n] if isinstance(shape, int) else buf[:n].view(shape)
        if len(views) > 256:  # many distinct tail shapes: forget them rather than grow without bound
            views.clear()
        views[key] = view
        return view

    def nbytes(self) -> int:
        """Bytes held by the calling thread (tests use it to prove buffers are reused, not re-grown)."""
        buffers, _ = self._state()
        return sum(b.numel() * b.element_size() for b in buffers.values())
