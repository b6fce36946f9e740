"""Moving KV pages between an engine's live cache tensors and kvtier's host rows (no vllm import).

The engine hands over its cache as a list of ``(num_blocks, page_bytes)`` int8 views (one per cache tensor) plus
the bytes of one block's page in each. A host row holds ``blocks_per_chunk`` consecutive blocks; within the row,
tensor ``t``'s pages sit at ``offset[t] + j * page[t]`` (j = block within the chunk), after ``rank_offset`` (this
worker's share of a tensor-parallel row).

Three copy paths, chosen per job:

* *runs* (CPU): one copy per (tensor, run of consecutive blocks) between plain (contiguous or row-strided)
  views. Measured here: int8 advanced indexing (``dst[idx] = src[idx]``) was 17x slower, and torch's two views
  and ``copy_`` per block cost ~0.2-0.3x of a raw copy in dispatch overhead -- so scattered blocks (runs of one)
  were slow. On CPU the copies therefore go through numpy views of the same memory made once per copier: one
  slice assignment per (tensor, run) costs about a microsecond, and never waits at an OpenMP barrier (torch's
  ``copy_`` with more intra-op threads than free cores measured 10-20x slower). Block and row ids are checked
  against the tensors first: numpy slices, like torch's, clip out-of-range ids instead of failing.
  Without numpy views (numpy missing, a tensor numpy cannot view) the same runs go through torch ``copy_``.
* *gather* (CPU, scattered blocks): per cache tensor, one ``index_select`` of the engine pages and one
  ``index_copy_`` into the host rows (or the reverse for a load), on the widest integer view the page size allows
  (int64 for pages of a multiple of 8 bytes), so a job costs two calls per tensor whatever its fragmentation.
  Measured idle (``bench/engine_offload.py --copy-only``, 3 runs): 0.35-0.58 of a raw ``copy_`` against
  0.69-0.73 for one torch ``copy_`` per block (numpy slices per block: 0.97-0.98 on a busy 2-core machine, where
  torch's per-block path measured 0.82), so the default is ``scatter="runs"``; ``"gather"`` stays for
  benchmarks and for hosts where its two calls per tensor win.
* *batched* (CUDA, when the engine gives a batched block-copy op, e.g. vLLM's ``ops.swap_blocks_batch``): one
  call per job for every (tensor, block), from address/size arrays, on a side stream into the pinned host rows.
  Without the op: one ``copy_`` per (tensor, block) on the side stream.

On CPU the copies run synchronously in the engine's thread (a helper thread would only compete for the same
cores). On CUDA they run on a side stream into pinned host memory and complete through events the worker polls,
so the engine step never waits for them.

Seam for layout-aware codecs: :class:`KvLayout` describes the pages (layers, K/V, heads, head_dim, tokens per
block, dtype) and travels with the worker; a codec that compresses K per channel and V per token takes it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    keep: object | None = None  # address arrays a batched copy reads until the event fires


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
    # The CPU path for scattered blocks: "runs" (one copy_ per run of blocks) or "gather" (see the docstring).
    scatter: str = "runs"
    # CUDA: fn(src_addrs, dst_addrs, sizes, is_src_access_order_any=bool), int64 CPU tensors (vLLM's
    # ops.swap_blocks_batch); None = one copy_ per (tensor, block) on the side stream.
    batch_copy: Callable[..., Any] | None = None
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
        if self.scatter not in ("runs", "gather"):
            raise ValueError(f"scatter: {self.scatter!r} is not one of runs, gather")
        self._host_i8 = self.host_rows.view(torch.int8)
        # Per tensor: (engine pages, host rows) seen as the widest integer dtype their page size, offsets and row
        # stride allow, for the gather path (fewer, wider elements per index_select/index_copy_).
        self._wide: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        row_bytes = int(self.host_rows.shape[1]) if self.host_rows.dim() == 2 else 0
        for kv, page, off in zip(self.kv, self.page_bytes, self._offsets):
            width = 8
            while width > 1 and (page % width or off % width or row_bytes % width
                                 or kv.stride(0) % width or kv.storage_offset() % width
                                 or self._host_i8.storage_offset() % width):
                width //= 2
            dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[width]
            try:
                kv_w = kv[:, :page].view(dtype) if width > 1 else kv[:, :page]
                host_w = self._host_i8.view(dtype) if width > 1 else self._host_i8
            except RuntimeError:  # a view the dtype cannot express: bytes
                kv_w, host_w, width = kv[:, :page], self._host_i8, 1
            self._wide.append((kv_w, host_w, off // width, page // width))
        self.device = self.kv[0].device if self.kv else torch.device("cpu")
        self._pending: list[_Pending] = []
        self._done: list[CopyResult] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # CPU: (engine pages per tensor, host rows) as numpy arrays over the same memory, for the runs path.
        self._np_views = self._numpy_views() if self.device.type == "cpu" else None

    def _numpy_views(self) -> tuple[list[Any], Any] | None:
        try:
            import numpy  # noqa: F401 - only whether it is there: Tensor.numpy() needs it

            kv_np = [kv.detach().numpy() for kv in self.kv]
            host_np = self._host_i8.detach().numpy()
        except (ImportError, RuntimeError, TypeError, ValueError):  # e.g. a tensor off the CPU, a dtype numpy lacks
            return None
        if not host_np.flags.writeable or not all(a.flags.writeable for a in kv_np):
            return None
        return kv_np, host_np

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

    @staticmethod
    def runs(pairs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        """(first block, first row, index in row, length) of maximal runs where the engine block and the host row
        both step by one (index in row 0 only, i.e. one block per chunk): each run is one strided ``copy_``."""
        out: list[tuple[int, int, int, int]] = []
        for block, row, j in pairs:
            if out and j == 0 and out[-1][2] == 0:
                b0, r0, _, n = out[-1]
                if block == b0 + n and row == r0 + n:
                    out[-1] = (b0, r0, 0, n + 1)
                    continue
            out.append((block, row, j, 1))
        return out

    def _gather(self, pairs: Sequence[tuple[int, int, int]], to_host: bool) -> int:
        """Scattered blocks: one index_select + one index_copy_ per cache tensor."""
        blocks = torch.tensor([b for b, _, _ in pairs], dtype=torch.int64, device=self.device)
        rows = torch.tensor([r for _, r, _ in pairs], dtype=torch.int64)
        within = {j for _, _, j in pairs}
        nbytes = 0
        for t, (kv_w, host_w, base, page_w) in enumerate(self._wide):
            page = self.page_bytes[t]
            for j in sorted(within):  # one column band of the host rows per block-in-chunk index
                sel = [i for i, (_, _, jj) in enumerate(pairs) if jj == j] if len(within) > 1 else None
                b = blocks if sel is None else blocks[sel]
                r = rows if sel is None else rows[sel]
                band = host_w.narrow(1, base + j * page_w, page_w)
                if to_host:
                    band.index_copy_(0, r, kv_w.index_select(0, b))
                else:
                    kv_w.index_copy_(0, b, band.index_select(0, r))
                nbytes += page * int(b.numel())
        return nbytes

    def _batched(self, pairs: Sequence[tuple[int, int, int]], to_host: bool) -> tuple[int, object]:
        """CUDA: every (tensor, block) of the job in one call of the engine's batched block-copy op."""
        import numpy as np

        blocks = np.fromiter((b for b, _, _ in pairs), dtype=np.int64, count=len(pairs))
        rows = np.fromiter((r for _, r, _ in pairs), dtype=np.int64, count=len(pairs))
        within = np.fromiter((j for _, _, j in pairs), dtype=np.int64, count=len(pairs))
        host_base = self._host_i8.data_ptr()
        host_stride = self._host_i8.stride(0)
        srcs, dsts, sizes = [], [], []
        for kv, page, off in zip(self.kv, self.page_bytes, self._offsets):
            dev = kv.data_ptr() + blocks * kv.stride(0) * kv.element_size()
            host = host_base + rows * host_stride + off + within * page
            srcs.append(dev if to_host else host)
            dsts.append(host if to_host else dev)
            sizes.append(np.full(len(pairs), page, dtype=np.int64))
        src = torch.from_numpy(np.concatenate(srcs))
        dst = torch.from_numpy(np.concatenate(dsts))
        size = torch.from_numpy(np.concatenate(sizes))
        # Engine -> host reads the live cache the compute stream writes: keep stream order (not "any").
        self.batch_copy(src, dst, size, is_src_access_order_any=not to_host)  # type: ignore[misc]
        return int(size.sum()), (src, dst, size)

    def _copy(self, pairs: Sequence[tuple[int, int, int]], to_host: bool) -> int:
        nbytes = 0
        non_blocking = self._stream is not None
        # On CUDA every copy stays contiguous on both sides: a strided host destination would make torch stage it
        # through a temporary and lose the asynchronous pinned-memory path.
        if self._stream is None and self.kv and self.scatter == "gather":
            return self._gather(pairs, to_host)
        if self.blocks_per_chunk == 1 and self._stream is None:
            runs = self.runs(pairs)
        else:
            runs = [(b, r, j, 1) for b, r, j in pairs]
        if self._np_views is not None and self._stream is None:
            return self._copy_numpy(runs, to_host)
        for t, (kv, page) in enumerate(zip(self.kv, self.page_bytes)):
            base = self._offsets[t]
            for block, row, j, n in runs:
                start = base + j * page
                # Contiguous or row-strided views on both sides: one plain copy_, never advanced indexing.
                host = self._host_i8[row:row + n, start:start + page]
                dev = kv[block:block + n, :page]
                if to_host:
                    host.copy_(dev, non_blocking=non_blocking)
                else:
                    dev.copy_(host, non_blocking=non_blocking)
                nbytes += page * n
        return nbytes

    def _copy_numpy(self, runs: Sequence[tuple[int, int, int, int]], to_host: bool) -> int:
        """CPU: one numpy slice assignment per (tensor, run), on views made once (see the module's docstring)."""
        assert self._np_views is not None
        kv_np, host_np = self._np_views
        if runs:
            first_block = min(r[0] for r in runs)
            end_block = max(r[0] + r[3] for r in runs)
            first_row = min(r[1] for r in runs)
            end_row = max(r[1] + r[3] for r in runs)
            if first_row < 0 or end_row > host_np.shape[0]:
                raise ValueError(f"host row ids: {first_row}..{end_row - 1} must lie in [0, {host_np.shape[0]})")
            if first_block < 0 or any(end_block > pages.shape[0] for pages in kv_np):
                raise ValueError(f"engine block ids: {first_block}..{end_block - 1} must lie in "
                                 f"[0, {min(pages.shape[0] for pages in kv_np)})")
        nbytes = 0
        for pages, page, base in zip(kv_np, self.page_bytes, self._offsets):
            for block, row, j, n in runs:
                start = base + j * page
                if to_host:
                    host_np[row:row + n, start:start + page] = pages[block:block + n, :page]
                else:
                    pages[block:block + n, :page] = host_np[row:row + n, start:start + page]
                nbytes += page * n
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
        keep = None
        with torch.cuda.stream(stream):
            if self.batch_copy is not None and pairs:
                nbytes, keep = self._batched(pairs, to_host)
            else:
                nbytes = self._copy(pairs, to_host)
            event = torch.cuda.Event()
            event.record(stream)
        self._pending.append(_Pending(job_id, nbytes, started, event, keep))

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
