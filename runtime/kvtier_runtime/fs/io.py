"""The filesystem tier's block I/O (pool threads): encode with the tier's codec, write a checksummed file
atomically; read it back, verify header, length, CRC or MAC, and decode into the caller's tensor. A task never
raises: its outcome is an ``ok`` or an error kind for the key."""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..codecs import Codec, CodecError, KVChunkCodec, decode, peek_header
from ..config import ConfigError
from .fileio import AlignedBuffer, read_whole, write_atomic
from .format import (
    ALIGN,
    HEADER_BYTES,
    MAC_BYTES,
    MAC_OFFSET,
    FormatError,
    block_mac,
    checksum,
    file_bytes_for,
    mac_key_from_bytes,
    pack_header,
    parse_header,
    verify_mac,
    verify_payload,
)
from .health import _BACKOFF_KINDS, _IO_ERRNO_KIND
from .jobs import _Expired, _Job
from .paths import TMP_MARK


def _read_mac_key(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(4096)
    except OSError as exc:
        raise ConfigError(f"mac_key_file: {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return mac_key_from_bytes(raw, path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _may_fall_back(codec: Codec | KVChunkCodec) -> bool:
    """Whether a block may be stored with a wider codec than ``codec.name`` (the block's own header then says)."""
    if isinstance(codec, KVChunkCodec):  # the engine path's layout-aware codec: a verifying one walks its chain
        return len(codec.chain) > 1
    return bool(codec.fallback and codec.fallback_codec is not None)


class BlockIO:
    """Mixin of :class:`~.tier.FilesystemTier`: the write and read tasks and the file format around a block."""

    # ---- I/O tasks (pool threads) -----------------------------------------------------------------------
    def _staging(self) -> tuple[AlignedBuffer, torch.Tensor]:
        local = self._local
        if getattr(local, "buf", None) is None:
            local.buf = AlignedBuffer(self._buffer_bytes + ALIGN)
            local.tensor = torch.frombuffer(local.buf.mv, dtype=torch.uint8)
        return local.buf, local.tensor

    def _write_task(self, job: _Job, i: int, key: bytes, block: torch.Tensor, evicted: list[bytes]) -> bool:
        self._unlink_doomed(evicted)
        if self._stuck:
            self._retry_stuck()
        ok, kind = False, ""
        started = time.perf_counter()
        try:
            nbytes = self._write_block(job, key, block)
            ok = True
        except _Expired:
            kind = "timeout"
        except FormatError as exc:
            kind = exc.kind
        except OSError as exc:
            kind = _IO_ERRNO_KIND.get(exc.errno or 0, "other")
        except Exception:  # a codec or programming fault must not kill the pool thread or reach the engine
            kind = "other"
        late: list[bytes] = []
        with self._lock:
            self._policy.unpin(key)
            entry = self._index[key]
            if ok and file_bytes_for(nbytes) != entry.nbytes:
                # The codec fell back to a wider encoding: account the real size (this may evict more).
                self._policy.remove(key)
                more = self._policy.insert(key, file_bytes_for(nbytes))
                if more is None:
                    ok, kind = False, "no-room"
                    late = self._doom_locked([key])
                else:
                    entry.nbytes = file_bytes_for(nbytes)
                    late = self._doom_locked(more, evicted=True)
            if ok:
                entry.state = "ready"
            else:
                if kind != "no-room":
                    self._policy.remove(key)
                    del self._index[key]
                job.errors[i] = kind
        self._unlink_doomed(late)
        if ok:
            with self._lock:  # _record_io_failure updates it under the lock from other pool threads
                self._consecutive_failures = 0
            self._metrics.backoff(False)
            self._metrics.written(self.peer, block.numel() * block.element_size(), time.perf_counter() - started)
        else:
            if kind != "timeout":  # counted once, when the job expired
                self._metrics.error(kind)
            if kind == "enospc":
                self._make_real_room(file_bytes_for(self._codec.encoded_nbytes(self.block_shape, self.dtype)))
            if kind in _BACKOFF_KINDS and kind != "timeout":
                self._record_io_failure()
        self._update_occupancy()
        return ok

    def _write_block(self, job: _Job, key: bytes, block: torch.Tensor) -> int:
        buf, tensor = self._staging()
        with job.io_lock:  # the only read of the caller's tensor
            if job.expired:
                raise _Expired()
            src = block if block.is_contiguous() else block.contiguous()
            nbytes = self._codec.encode(src, tensor[HEADER_BYTES : HEADER_BYTES + self._max_payload])
        end = HEADER_BYTES + nbytes
        total = file_bytes_for(nbytes)
        if end < total:  # zero the padding so no stale bytes of an earlier block reach the disk
            tensor[end:total].zero_()
        crc = checksum(buf.mv[HEADER_BYTES:end])
        header = pack_header(
            # the codec actually used (after any fallback), from the blob's own header
            codec=self._written_codec(tensor[HEADER_BYTES:end]), dtype=self._dtype_name, shape=self.block_shape,
            payload_len=nbytes, payload_crc=crc, key=key,
        )
        buf.mv[:HEADER_BYTES] = header
        if self._mac_key is not None:
            buf.mv[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] = block_mac(self._mac_key, buf.mv, buf.mv[HEADER_BYTES:end])
        final = self.block_path(key)
        directory = os.path.dirname(final)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        tmp = f"{final}{TMP_MARK}{os.getpid()}.{next(self._tmp_ids)}"
        try:
            write_atomic(self._ops, tmp, final, buf.mv[:total], self.direct_io)
        except FileNotFoundError:  # the fan-out directory was removed behind our back: recreate it once
            os.makedirs(directory, exist_ok=True)
            write_atomic(self._ops, tmp, final, buf.mv[:total], self.direct_io)
        return nbytes

    def _written_codec(self, blob: torch.Tensor) -> str:
        # Parsing the blob's header costs ~0.4 ms of GIL-held Python per block (measured in the fs bench
        # breakdown); only a codec that can fall back needs it to learn what it wrote.
        if not _may_fall_back(self._codec):
            return self._codec.name
        return peek_header(blob).codec

    def _read_task(self, job: _Job, i: int, key: bytes, out: torch.Tensor) -> bool:
        started = time.perf_counter()
        kind = ""
        try:
            self._read_block(job, key, out)
        except _Expired:
            pass  # the caller gave up on this key: the block itself is fine
        except FormatError as exc:
            kind = exc.kind
        except FileNotFoundError:
            kind = "missing"
        except OSError as exc:
            kind = _IO_ERRNO_KIND.get(exc.errno or 0, "other")
        except CodecError:
            kind = "corrupt"
        except Exception:
            kind = "other"
        with self._lock:
            doomed = self._unpin_locked(key)
            if kind:
                job.errors[i] = kind
                # A block that failed to read is never served again: forget it and delete the file (at once,
                # or at the last unpin if another transfer still holds it).
                if key in self._index:
                    if self._policy.is_pinned(key):
                        self._bad.add(key)
                        del self._index[key]
                    else:
                        self._policy.remove(key)
                        doomed += self._doom_locked([key])
        self._unlink_doomed(doomed)
        if kind:
            self._metrics.error(kind)
            self._update_occupancy()
        else:
            self._metrics.read(self.peer, out.numel() * out.element_size(), time.perf_counter() - started)
        return not kind

    def _read_block(self, job: _Job, key: bytes, out: torch.Tensor) -> None:
        buf, tensor = self._staging()
        size = read_whole(self._ops, self.block_path(key), buf.mv, self.direct_io)
        header = parse_header(buf.mv[: min(size, HEADER_BYTES)])
        self._check_header(header, key)
        # With a MAC key the MAC is the integrity check (it catches every change a CRC catches), so the CRC pass
        # over the payload is skipped: one hash per block instead of two.
        verify_payload(header, size, buf.mv[HEADER_BYTES:], check_crc=self._mac_key is None)
        if header.payload_len > self._max_payload:
            raise FormatError("mismatch", f"payload of {header.payload_len} bytes exceeds {self._max_payload}")
        payload = buf.mv[HEADER_BYTES : HEADER_BYTES + header.payload_len]
        if self._mac_key is not None:
            verify_mac(self._mac_key, buf.mv[:HEADER_BYTES], payload)
        with job.io_lock:  # the only write of the caller's tensor
            if job.expired:
                raise _Expired()
            decode(tensor[HEADER_BYTES : HEADER_BYTES + header.payload_len], out=out)

    def _check_header(self, header: Any, key: bytes | None) -> None:
        if key is not None and header.key != key:
            raise FormatError("mismatch", "file holds another key")
        if header.shape != self.block_shape or header.dtype != self._dtype_name:
            raise FormatError(
                "mismatch", f"block is {header.dtype}{list(header.shape)}, tier is {self._dtype_name}{list(self.block_shape)}"
            )
