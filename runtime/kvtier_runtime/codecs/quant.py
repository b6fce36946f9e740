"""Scaled quantizing codecs: fp8 (e4m3 / e5m2), int8 and int4.

Payload layout: ``[fp32 scale x n_scales][codes]``. Scales belong to groups of ``group_size`` consecutive
elements of the flattened block (the last group may be shorter), or, for int8 with ``scales="channel"``, to each
index of the last dimension (outlier channels of K get their own scale instead of inflating a whole group).

Work runs over chunks of ``CHUNK_ELEMS`` elements through per-thread scratch buffers and ``out=`` kernels, so
an encode or decode allocates nothing proportional to the block.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .base import CHUNK_ELEMS, Codec, numel_of
from .header import CodecError, CodecHeader

F32 = torch.float32
_TINY = torch.finfo(torch.float32).tiny
# Scales are shrunk by 2^-20 (far below any codec's resolution) so that the largest code times its scale,
# after float rounding, never exceeds the group's max: a group at fp32's or bf16's max must not decode to inf.
_SHRINK = 1.0 - 2.0 ** -20


def _scales(amax: torch.Tensor, qmax: float, scale: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch.mul(amax, _SHRINK / qmax, out=scale)
    # An all-zero group gets the smallest normal scale: its codes are 0 and 1/scale stays finite.
    scale.clamp_(min=_TINY)
    torch.reciprocal(scale, out=inv)
    return scale, inv


class ScaledCodec(Codec):
    qmax: float = 1.0
    bits: int = 8
    default_group_size = 128

    # ---- layout ----------------------------------------------------------------------------------------------
    def _n_scales(self, shape: Sequence[int], group_size: int, per_channel: bool) -> int:
        n = numel_of(shape)
        if n == 0:
            return 0
        if per_channel:
            return shape[-1] if shape else 1
        return -(-n // group_size)

    def _data_nbytes(self, numel: int, group_size: int) -> int:
        return numel * self.bits // 8

    def _payload_for(self, shape: Sequence[int], group_size: int, per_channel: bool) -> int:
        return 4 * self._n_scales(shape, group_size, per_channel) + self._data_nbytes(numel_of(shape), group_size)

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self._payload_for(shape, self.group_size, self.per_channel)

    def check_header(self, header: CodecHeader) -> None:
        super().check_header(header)
        if header.per_channel:
            if header.group_size != 0:
                raise CodecError("header.group_size: must be 0 with per-channel scales")
        elif header.group_size <= 0:
            raise CodecError(f"header.group_size: {header.group_size} must be positive for codec {self.name!r}")
        expected = self._payload_for(header.shape, header.group_size, header.per_channel)
        if header.payload_nbytes != expected:
            raise CodecError(
                f"header.payload_nbytes: {header.payload_nbytes}, codec {self.name!r} stores {expected} for "
                f"shape {header.shape}")

    # ---- scratch helpers -------------------------------------------------------------------------------------
    def _buf(self, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._scratch.get(name, n, dtype, device)

    def _scales_from_amax(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, dev = amax.numel(), amax.device
        return _scales(amax, self.qmax, self._buf("scale", k, F32, dev), self._buf("inv", k, F32, dev))

    def _group_scales(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, dev = xc.shape[0], xc.device
        mn = self._buf("min", k, xc.dtype, dev)
        mx = self._buf("max", k, xc.dtype, dev)
        torch.aminmax(xc, dim=1, out=(mn, mx))
        amax = self._buf("amax", k, F32, dev)
        torch.maximum(mn.neg_(), mx, out=amax)
        return self._scales_from_amax(amax)

    # ---- kernels (subclasses) --------------------------------------------------------------------------------
    def _quantize(self, xc: torch.Tensor, inv: torch.Tensor, codes: torch.Tensor) -> None:
        raise NotImplementedError

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def _codes_view(self, data: torch.Tensor, first: int, k: int, width: int) -> torch.Tensor:
        """Codes of ``k`` rows of ``width`` elements starting at element ``first`` (row starts are even for int4)."""
        start = first * self.bits // 8
        nbytes = -(-width * self.bits // 8)
        return data[start:start + k * nbytes].view(k, nbytes)

    # ---- chunk loops -----------------------------------------------------------------------------------------
    def _chunks(self, numel: int, shape: Sequence[int], group_size: int, per_channel: bool):
        """Yield (first_element, rows, width, first_scale): row-blocks of the flattened tensor that share scales
        per row (group mode) or per column (channel mode)."""
        if per_channel:
            width = shape[-1] if shape else 1
            rows_total = numel // width
            step = max(1, CHUNK_ELEMS // max(width, 1))
            for r0 in range(0, rows_total, step):
                k = min(step, rows_total - r0)
                yield r0 * width, k, width, 0
            return
        g = group_size
        full = numel // g
        step = max(1, CHUNK_ELEMS // g)
        for i0 in range(0, full, step):
            k = min(step, full - i0)
            yield i0 * g, k, g, i0
        tail = numel - full * g
        if tail:
            yield full * g, 1, tail, full

    def _encode_payload(self, flat, shape, payload, measure):  # type: ignore[override]
        numel = flat.numel()
        if numel == 0:
            return 0.0 if measure else None
        dev = flat.device
        n_scales = self._n_scales(shape, self.group_size, self.per_channel)
        scale_bytes, data = payload[:4 * n_scales], payload[4 * n_scales:]
        acc = None
        if measure:
            acc = self._buf("acc", 2, torch.float64, dev)
            acc.zero_()
        chan_scale = chan_inv = None
        if self.per_channel:
            chan_scale, chan_inv = self._channel_scales(flat, shape)
            scale_bytes.copy_(chan_scale.view(torch.uint8))
            chan_scale, chan_inv = chan_scale.view(1, -1), chan_inv.view(1, -1)
        for first, k, width, s0 in self._chunks(numel, shape, self.group_size, self.per_channel):
            xc = flat[first:first + k * width].view(k, width)
            if chan_inv is None:
                scale, inv = self._group_scales(xc)
                scale_bytes[4 * s0:4 * (s0 + k)].copy_(scale.view(torch.uint8))
                scale, inv = scale.view(k, 1), inv.view(k, 1)
            else:
                scale, inv = chan_scale, chan_inv
            codes = self._codes_view(data, first, k, width)
            self._quantize(xc, inv, codes)
            if acc is not None:
                rec = self._buf("rec", k * width, F32, dev).view(k, width)
                self._dequantize(codes, scale, rec)
                torch.sub(rec, xc, out=rec)
                flat_rec = rec.view(-1)
                acc[0] += torch.dot(flat_rec, flat_rec)
                rec.copy_(xc)
                acc[1] += torch.dot(flat_rec, flat_rec)
        if acc is None:
            return None
        err_sq, norm_sq = acc.tolist()
        if norm_sq == 0.0:
            return 0.0 if err_sq == 0.0 else math.inf
        return math.sqrt(err_sq / norm_sq)

    def _channel_scales(self, flat: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = shape[-1] if shape else 1
        dev = flat.device
        amax = self._buf("chan_amax", width, F32, dev)
        amax.zero_()
        mn = self._buf("chan_min", width, flat.dtype, dev)
        mx = self._buf("chan_max", width, flat.dtype, dev)
        for first, k, w, _ in self._chunks(flat.numel(), shape, 0, True):
            torch.aminmax(flat[first:first + k * w].view(k, w), dim=0, out=(mn, mx))
            torch.maximum(mn.neg_(), mx, out=mx)
            torch.maximum(amax, mx, out=amax)
        return _scales(amax, self.qmax, self._buf("chan_scale", width, F32, dev),
                       self._buf("chan_inv", width, F32, dev))

    def _decode_payload(self, payload, header, dst):  # type: ignore[override]
        numel = dst.numel()
        if numel == 0:
            return
        dev = dst.device
        n_scales = self._n_scales(header.shape, header.group_size, header.per_channel)
        scales = self._buf("dec_scale", n_scales, F32, dev)
        scales.view(torch.uint8).copy_(payload[:4 * n_scales])
        data = payload[4 * n_scales:]
        chan = scales.view(1, -1) if header.per_channel else None
        for first, k, width, s0 in self._chunks(numel, header.shape, header.group_size, header.per_channel):
            scale = chan if chan is not None else scales[s0:s0 + k].view(k, 1)
            self._dequantize(self._codes_view(data, first, k, width), scale,
                             dst[first:first + k * width].view(k, width))


class Fp8Codec(ScaledCodec):
    """fp8 e4m3: 3 mantissa bits, saturates at 448 (values are clamped before the cast, never NaN)."""

    name = "fp8"
    fp8_dtype = torch.float8_e4m3fn
    qmax = 448.0
    error_budget = 0.04
    default_group_size = 128

    def _quantize(self, xc, inv, codes):  # type: ignore[override]
        k, w = xc.shape
        y = self._buf("y", k * w, F32, xc.device).view(k, w)
        torch.mul(xc, inv, out=y)
        y.clamp_(-self.qmax, self.qmax)
        codes.view(self.fp8_dtype).copy_(y)

    def _dequantize(self, codes, scale, dst):  # type: ignore[override]
        if dst.dtype == F32:
            dst.copy_(codes.view(self.fp8_dtype))
            dst.mul_(scale)
            return
        k, w = dst.shape
        y = self._buf("dq", k * w, F32, dst.device).view(k, w)
        y.copy_(codes.view(self.fp8_dtype))
        torch.mul(y, scale, out=dst)


class Fp8E5M2Codec(Fp8Codec):
    """fp8 e5m2: 2 mantissa bits, overflows to inf past 57344, so the scaled values are clamped to it."""

    name = "fp8_e5m2"
    fp8_dtype = torch.float8_e5m2
    qmax = 57344.0
    error_budget = 0.08


class Int8Codec(ScaledCodec):
    """Symmetric int8, codes in [-127, 127], one scale per group or per channel."""

    name = "int8"
    qmax = 127.0
    error_budget = 0.03
    default_group_size = 128

    def _quantize(self, xc, inv, codes):  # type: ignore[override]
        k, w = xc.shape
        y = self._buf("y", k * w, F32, xc.device).view(k, w)
        torch.mul(xc, inv, out=y)
        y.round_().clamp_(-self.qmax, self.qmax)
        codes.view(torch.int8).copy_(y)

    def _dequantize(self, codes, scale, dst):  # type: ignore[override]
        if dst.dtype == F32:
            dst.copy_(codes.view(torch.int8))
            dst.mul_(scale)
            return
        k, w = dst.shape
        y = self._buf("dq", k * w, F32, dst.device).view(k, w)
        y.copy_(codes.view(torch.int8))
        torch.mul(y, scale, out=dst)


class Int4Codec(ScaledCodec):
    """Symmetric int4, codes in [-7, 7] stored offset by 8, two per byte (even element in the low nibble)."""

    name = "int4"
    bits = 4
    qmax = 7.0
    error_budget = 0.2
    default_group_size = 32

    def _data_nbytes(self, numel: int, group_size: int) -> int:
        # Groups have an even size, so only the last, shorter group can end in half a byte.
        return (numel + 1) // 2

    def _codes_view(self, data, first, k, width):  # type: ignore[override]
        start = first // 2
        nbytes = (width + 1) // 2
        return data[start:start + k * nbytes].view(k, nbytes)

    def _quantize(self, xc, inv, codes):  # type: ignore[override]
        k, w = xc.shape
        dev = xc.device
        we = w + (w & 1)
        y = self._buf("y", k * we, F32, dev).view(k, we)
        torch.mul(xc, inv, out=y[:, :w])
        if we != w:
            y[:, w:].zero_()
        y.round_().clamp_(-self.qmax, self.qmax)
        h = self._buf("h", k * we // 2, F32, dev).view(k, we // 2)
        torch.add(y[:, 0::2], y[:, 1::2], alpha=16.0, out=h)
        h.add_(8.0 + 16.0 * 8.0)
        codes.copy_(h)

    def _dequantize(self, codes, scale, dst):  # type: ignore[override]
        k, w = dst.shape
        dev = dst.device
        half = codes.shape[1]
        # XOR 0x88 turns both offset-by-8 nibbles into two's complement; arithmetic shifts of the int8 view
        # then sign-extend them. Decoding as code * scale (not nibble * scale - 8 * scale) cannot overflow.
        t = self._buf("t", k * half, torch.uint8, dev).view(k, half)
        torch.bitwise_xor(codes, 0x88, out=t)
        hi = self._buf("hi", k * half, torch.int8, dev).view(k, half)
        torch.bitwise_right_shift(t.view(torch.int8), 4, out=hi)
        lo = self._buf("lo", k * half, torch.uint8, dev).view(k, half)
        torch.bitwise_left_shift(t, 4, out=lo)
        lo_s = lo.view(torch.int8)
        torch.bitwise_right_shift(lo_s, 4, out=lo_s)
        f = self._buf("dq", k * half * 2, F32, dev).view(k, half, 2)
        f[:, :, 0].copy_(lo_s)
        f[:, :, 1].copy_(hi)
        f2 = f.view(k, 2 * half)
        if 2 * half == w:
            torch.mul(f2, scale, out=dst)
        else:
            f2.mul_(scale)
            dst.copy_(f2[:, :w])
