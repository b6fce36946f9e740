"""Moving KV pages between an engine's live cache tensors and kvtier's host rows (no vllm import).

The engine hands over its cache as a list of ``(num_blocks, page_bytes)`` int8 views (one per cache tensor) plus
the bytes of one block's page in each. A host row holds ``blocks_per_chunk`` consecutive blocks; within the row,
tensor ``t``'s pages sit at ``offset[t] + j * page[t]`` (j = block within the chunk), after ``rank_offset`` (this
worker's share of a tensor-parallel row).

Copies are one ``copy_`` per (tensor, block) between contiguous views: measured here, int8 advanced indexing
(``dst[idx] = src[idx]``) was 17x slower. On CPU the copies run synchronously in the engine's thread (a helper
thread would only compete for the same cores). On CUDA they run on a side stream into pinned host memory and
complete through events the worker polls, so the engine step never waits for them.

Seam for layout-aware codecs: :class:`KvLayout` describes the pages (layers, K/V, heads, head_dim, tokens per
block, dtype) and travels with the worker; a codec that compresses K per channel and V per token takes it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class KvLayout:
    """What one host row holds, for codecs that need the structure of the bytes (not only their dtype)."""

    num_layers: int
    kv_heads: int | None
    head_dim: int | None
    tokens_per_block: int
    blocks_per_chunk: int
    dtype: str  # vLLM's KV dtype name, e.g. "float32", "bfloat16", "fp8_e4m3"
    # Per cache tensor, bytes of one block's page (K and V of one layer, in the engine's own page layout).
    page_bytes: tuple[int, ...] = ()
    kv_cache_layout: str | None = None  # e.g. "NHD"/"HND" when the engine says so


@dataclass
class _Pending:
    job_id: int
    nbytes: int
    started: float
    event: object | None = None  # a torch.cuda.Event on CUDA


@dataclass
class CopyResult:
    job_id: int
    success: bool
    nbytes: int
    seconds: float


@dataclass
class PageCopier:
    """Per-block copies between ``kv`` (engine cache views) and ``host_rows`` (uint8 ``(n_rows, row_bytes)``)."""

    kv: Sequence[torch.Tensor]
    page_bytes: Sequence[int]
    host_rows: torch.Tensor
    blocks_per_chunk: int = 1
    rank_offset: int = 0
    _offsets: list[int] = field(init=False)
    _host_i8: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if len(self.kv) != len(self.page_bytes):
            raise ValueError("kv and page_bytes differ in length")
        self._offsets = []
        off = self.rank_offset
        for page in self.page_bytes:
            self._offsets.append(off)
            off += page * self.blocks_per_chunk
        if off > self.host_rows.shape[1]:
            raise ValueError(f"host row of {self.host_rows.shape[1]} bytes cannot hold {off} bytes of pages")
        self._host_i8 = self.host_rows.view(torch.int8)
        self.device = self.kv[0].device if self.kv else torch.device("cpu")
        self._pending: list[_Pending] = []
        self._done: list[CopyResult] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def chunk_bytes(self) -> int:
        return sum(self.page_bytes) * self.blocks_per_chunk

    def pairs(self, block_ids: Sequence[int], chunk_ids: Sequence[int], skip: int = 0) -> list[tuple[int, int, int]]:
        """(engine block, host row, index within the row) for each engine block, the first chunk entered at
        block ``skip`` (an engine load that starts inside a chunk)."""
        out = []
        bpc = self.blocks_per_chunk
        for n, block in enumerate(block_ids):
            s = skip + n
            out.append((int(block), int(chunk_ids[s // bpc]), s % bpc))
        return out

    def _copy(self, pairs: Sequence[tuple[int, int, int]], to_host: bool) -> int:
        nbytes = 0
        non_blocking = self._stream is not None
        for t, (kv, page) in enumerate(zip(self.kv, self.page_bytes)):
            base = self._offsets[t]
            for block, row, j in pairs:
                start = base + j * page
                host = self._host_i8[row, start:start + page]
                dev = kv[block, :page]
                if to_host:
                    host.copy_(dev, non_blocking=non_blocking)
                else:
                    dev.copy_(host, non_blocking=non_blocking)
                nbytes += page
        return nbytes

    def submit(self, job_id: int, pairs: Sequence[tuple[int, int, int]], to_host: bool) -> None:
        started = time.perf_counter()
        if self._stream is None:
            nbytes = self._copy(pairs, to_host)
            self._done.append(CopyResult(job_id, True, nbytes, time.perf_counter() - started))
            return
        # CUDA: order after what the engine queued so far (the pages it wrote), then copy on the side stream.
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            nbytes = self._copy(pairs, to_host)
            event = torch.cuda.Event()
            event.record(stream)
        self._pending.append(_Pending(job_id, nbytes, started, event))

    def finished(self) -> list[CopyResult]:
        """Jobs done since the last call (never blocks)."""
        still: list[_Pending] = []
        for p in self._pending:
            if p.event is not None and p.event.query():  # type: ignore[attr-defined]
                self._done.append(CopyResult(p.job_id, True, p.nbytes, time.perf_counter() - p.started))
            else:
                still.append(p)
        self._pending = still
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        for p in self._pending:
            if p.job_id in job_ids and p.event is not None:
                p.event.synchronize()  # type: ignore[attr-defined]
