"""torch.compile'd chunk kernels, compiled off the hot path.

On CPU, inductor fuses fp8 encoding (amax, scale, cast) into one pass and measured 2.4x faster than the eager
kernels (bench/codecs.py --compile-probe, docs/performance.md); it is slower than the eager bit tricks
for decoding and for int4, so only fp8 encoding uses it. Compiling takes seconds and needs a C++ compiler, so
a codec built with ``compile=True`` keeps encoding eagerly while one background thread compiles a kernel per
chunk shape; ``Codec.warmup`` compiles synchronously for a known block shape. A compile failure (no compiler)
is logged once and the codec stays eager.
"""
from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

_TINY = torch.finfo(torch.float32).tiny
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _background() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-codec-compile")
        return _executor


def fp8_encode_e4m3(xc: torch.Tensor, codes: torch.Tensor, scale_out: torch.Tensor) -> None:
    xf = xc.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) * ((1.0 - 2.0 ** -20) / 448.0)).clamp_min(_TINY)
    a = (xf * (1.0 / scale)).clamp(-448.0, 448.0)
    codes.copy_(a.to(torch.float8_e4m3fn).view(torch.uint8))
    scale_out.copy_(scale)


def fp8_encode_e5m2(xc: torch.Tensor, codes: torch.Tensor, scale_out: torch.Tensor) -> None:
    xf = xc.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) * ((1.0 - 2.0 ** -20) / 57344.0)).clamp_min(_TINY)
    a = (xf * (1.0 / scale)).clamp(-57344.0, 57344.0)
    codes.copy_(a.to(torch.float8_e5m2).view(torch.uint8))
    scale_out.copy_(scale)


class CompiledKernels:
    """One compiled copy of ``fn`` per key (chunk shape, dtype, device), each with its own code object so that
    dynamo's per-code cache never grows while another thread runs a finished kernel."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn
        self._ready: dict[Hashable, Callable[..., None]] = {}
        self._pending: set[Hashable] = set()
        self._lock = threading.Lock()
        self.failed: str | None = None
        self.calls = 0

    def get(self, key: Hashable, example: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[..., None] | None:
        """The kernel for ``key`` if compiled, else None (and a background compile is queued)."""
        kern = self._ready.get(key)
        if kern is not None or self.failed:
            return kern
        with self._lock:
            if key in self._pending:
                return None
            self._pending.add(key)
        _background().submit(self._compile, key, example)
        return None

    def compile_now(self, key: Hashable, example: Callable[[], tuple[torch.Tensor, ...]]) -> bool:
        if key not in self._ready and not self.failed:
            self._compile(key, example)
        return key in self._ready

    def _compile(self, key: Hashable, example: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        try:
            code = self._fn.__code__.replace(co_name=f"{self._fn.__name__}_{abs(hash(key)):x}")
            fresh = types.FunctionType(code, self._fn.__globals__, code.co_name)
            kern = torch.compile(fresh, dynamic=False)
            kern(*example())
            self._ready[key] = kern
        except Exception as exc:  # no C++ compiler, unsupported backend: stay eager, say so once
            if self.failed is None:
                log.warning("codec kernel %s: torch.compile failed, encoding stays eager: %r", self._fn.__name__, exc)
            self.failed = repr(exc)
