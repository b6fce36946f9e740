"""Scaled quantizing codecs: fp8 (e4m3 / e5m2), int8 and int4.

Payload layout: ``[fp32 scale x n_scales][codes]``. Scales belong to groups of ``group_size`` consecutive
elements of the flattened block (the last group may be shorter), or, for int8 with ``scales="channel"``, to each
index of the last dimension (outlier channels of K get their own scale instead of inflating a whole group).

Work runs over chunks of ``CHUNK_ELEMS`` elements through per-thread scratch buffers and ``out=`` kernels, so
an encode or decode allocates nothing proportional to the block.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from .base import Codec, chunk_elems, numel_of
from .header import CodecError, CodecHeader

if TYPE_CHECKING:
    from .compiled import CompiledKernels

# Chunk size of the compiled fp8 encoder on CPU: 2^20 measured 15-20% faster than 2^18 (fewer calls).
COMPILED_CHUNK_ELEMS = 1 << 20

F32 = torch.float32
_TINY = torch.finfo(torch.float32).tiny
# Scales are shrunk by 2^-20 (far below any codec's resolution) so that the largest code times its scale,
# after float rounding, never exceeds the group's max: a group at fp32's or bf16's max must not decode to inf.
_SHRINK = 1.0 - 2.0 ** -20


def _scales(amax: torch.Tensor, qmax: float, scale: torch.Tensor,
            inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch.mul(amax, _SHRINK / qmax, out=scale)
    # An all-zero group gets the smallest normal scale: its codes are 0 and 1/scale stays finite.
    scale.clamp_(min=_TINY)
    torch.reciprocal(scale, out=inv)
    return scale, inv


class ScaledCodec(Codec):
    qmax: float = 1.0
    pre_scale: float = 1.0
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
    def _buf(self, name: str, shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._scratch.get(name, shape, dtype, device)

    # ---- kernels (subclasses) --------------------------------------------------------------------------------
    def _quantize(self, a: torch.Tensor, codes: torch.Tensor) -> None:
        """Write the codes of ``a`` (fp32, already divided by its scales; may be clobbered) into ``codes``."""
        raise NotImplementedError

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[k, w] = codes * scale`` (scale broadcasts: [k, 1] per group or [1, w] per channel)."""
        raise NotImplementedError

    def _codes_view(self, data: torch.Tensor, first: int, k: int, width: int) -> torch.Tensor:
        """Codes of ``k`` rows of ``width`` elements starting at element ``first``."""
        start = first * self.bits // 8
        nbytes = width * self.bits // 8
        return data[start:start + k * nbytes].view(k, nbytes)

    def _f32_target(self, dst: torch.Tensor) -> torch.Tensor:
        """Where a kernel computes in fp32: ``dst`` itself when it is fp32, else a scratch buffer."""
        if dst.dtype == F32:
            return dst
        k, w = dst.shape
        return self._buf("dq", (k, w), F32, dst.device)

    # ---- chunk loops -----------------------------------------------------------------------------------------
    def _chunks(self, numel: int, shape: Sequence[int], group_size: int, per_channel: bool, device: torch.device,
                chunk: int = 0):
        """Yield (first_element, rows, width, first_scale): row-blocks of the flattened tensor that share scales
        per row (group mode) or per column (channel mode)."""
        chunk = chunk or chunk_elems(device)
        if per_channel:
            width = shape[-1] if shape else 1
            rows_total = numel // width
            step = max(1, chunk // max(width, 1))
            for r0 in range(0, rows_total, step):
                k = min(step, rows_total - r0)
                yield r0 * width, k, width, 0
            return
        g = group_size
        full = numel // g
        step = max(1, chunk // g)
        for i0 in range(0, full, step):
            k = min(step, full - i0)
            yield i0 * g, k, g, i0
        tail = numel - full * g
        if tail:
            yield full * g, 1, tail, full

    def _as_f32(self, xc: torch.Tensor) -> torch.Tensor:
        """The chunk in fp32 (fp16/bf16 mixed-dtype kernels are several times slower than a copy + fp32 op)."""
        if xc.dtype == F32:
            return xc
        k, w = xc.shape
        xf = self._buf("xf", (k, w), F32, xc.device)
        xf.copy_(xc)
        return xf

    def _encode_payload(self, flat, shape, payload, measure):
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
        compiled = self._compiled if (self.compiled_kernels and acc is None and chan_inv is None) else None
        # A compiled kernel keeps no chunk-sized intermediates, so it takes 4x larger chunks (fewer calls).
        chunk = COMPILED_CHUNK_ELEMS if compiled is not None and dev.type == "cpu" else 0
        for first, k, width, s0 in self._chunks(numel, shape, self.group_size, self.per_channel, dev, chunk):
            xc = flat[first:first + k * width].view(k, width)
            if compiled is not None:
                kern = compiled.get((xc.dtype, k, width, dev), partial(self._example, xc.dtype, k, width, dev))
                if kern is not None:
                    scale = self._buf("scale", (k, 1), F32, dev)
                    kern(xc, self._codes_view(data, first, k, width), scale)
                    scale_bytes[4 * s0:4 * (s0 + k)].view(k, 4).copy_(scale.view(torch.uint8))
                    compiled.calls += 1
                    continue
            xf = self._as_f32(xc)
            a = self._buf("a", (k, width), F32, dev)
            if chan_inv is None:
                torch.abs(xf, out=a)
                amax = self._buf("amax", (k, 1), F32, dev)
                torch.amax(a, dim=1, keepdim=True, out=amax)
                scale, inv = _scales(amax, self.qmax, self._buf("scale", (k, 1), F32, dev),
                                     self._buf("inv", (k, 1), F32, dev))
                scale_bytes[4 * s0:4 * (s0 + k)].view(k, 4).copy_(scale.view(torch.uint8))
            else:
                assert chan_scale is not None  # set together with chan_inv above
                scale, inv = chan_scale, chan_inv
            if self.pre_scale != 1.0:
                pinv = self._buf("pinv", tuple(inv.shape), F32, dev)
                torch.mul(inv, self.pre_scale, out=pinv)
                inv = pinv
            torch.mul(xf, inv, out=a)
            codes = self._codes_view(data, first, k, width)
            self._quantize(a, codes)
            if acc is not None:
                rec = self._buf("rec", (k, width), F32, dev)
                self._dequantize(codes, scale, rec)
                flat_rec = rec.view(-1)
                flat_rec.sub_(xf.reshape(-1))
                acc[0] += torch.dot(flat_rec, flat_rec)
                flat_x = xf.reshape(-1)
                acc[1] += torch.dot(flat_x, flat_x)
        if acc is None:
            return None
        err_sq, norm_sq = acc.tolist()
        if norm_sq == 0.0:
            return 0.0 if err_sq == 0.0 else math.inf
        return math.sqrt(err_sq / norm_sq)

    # ---- optional compiled kernels (fp8 only, see compiled.py) ------------------------------------------------
    compiled_kernels: CompiledKernels | None = None

    @property
    def _compiled(self):
        return self.compiled_kernels

    def _example(self, dtype: torch.dtype, k: int, width: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.randn(k, width, device=dev).to(dtype), torch.empty(k, width, dtype=torch.uint8, device=dev),
                torch.empty(k, 1, device=dev))

    def warmup(self, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu") -> bool:
        """Compile, now, the kernels a block of ``shape`` needs (a no-op without ``compile=True``); True when
        every chunk of such a block will run compiled."""
        if self.compiled_kernels is None or self.per_channel:
            return False
        dev = torch.device(device)
        ok = True
        chunk = COMPILED_CHUNK_ELEMS if dev.type == "cpu" else 0
        for _, k, width, _ in self._chunks(numel_of(shape), shape, self.group_size, False, dev, chunk):
            ok &= self.compiled_kernels.compile_now((dtype, k, width, dev),
                                                    partial(self._example, dtype, k, width, dev))
        return ok

    def _channel_scales(self, flat: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = shape[-1] if shape else 1
        dev = flat.device
        amax = self._buf("chan_amax", width, F32, dev)
        amax.zero_()
        col = self._buf("chan_col", width, F32, dev)
        for first, k, w, _ in self._chunks(flat.numel(), shape, 0, True, dev):
            xf = self._as_f32(flat[first:first + k * w].view(k, w))
            a = self._buf("a", (k, w), F32, dev)
            torch.abs(xf, out=a)
            torch.amax(a, dim=0, out=col)
            torch.maximum(amax, col, out=amax)
        return _scales(amax, self.qmax, self._buf("chan_scale", width, F32, dev),
                       self._buf("chan_inv", width, F32, dev))

    def _decode_payload(self, payload, header, dst):
        numel = dst.numel()
        if numel == 0:
            return
        dev = dst.device
        n_scales = self._n_scales(header.shape, header.group_size, header.per_channel)
        data = payload[4 * n_scales:]
        chan = None
        if header.per_channel:
            chan = self._buf("dec_scale", n_scales, F32, dev)
            chan.view(torch.uint8).copy_(payload[:4 * n_scales])
            chan = chan.view(1, -1)
        for first, k, width, s0 in self._chunks(numel, header.shape, header.group_size, header.per_channel, dev):
            if chan is None:
                # Scales are copied out per chunk (the payload may sit at any byte offset, so it cannot be
                # viewed as fp32 in place), keeping the buffer chunk-sized whatever the block size.
                scale = self._buf("dec_scale", (k, 1), F32, dev)
                scale.view(torch.uint8).copy_(payload[4 * s0:4 * (s0 + k)].view(k, 4))
            else:
                scale = chan
            self._dequantize(self._codes_view(data, first, k, width), scale,
                             dst[first:first + k * width].view(k, width))


class Fp8Codec(ScaledCodec):
    """fp8 e4m3: 3 mantissa bits, max 448 (scaled values are clamped before the cast: never NaN)."""

    name = "fp8"
    fp8_dtype = torch.float8_e4m3fn
    qmax = 448.0
    error_budget = 0.04
    default_group_size = 128

    # torch's float -> e4m3 cast runs at ~2 Gelem/s on CPU, half the time of a whole encode; rounding fp16 bits
    # in int16 lanes is ~2x faster. Ties round away from zero (torch's cast rounds to even): same error bound.
    # The encode loop multiplies by ``inv * pre_scale`` so the fp16 exponent lines up with the fp8 one.
    pre_scale = 1.0 / 256.0

    def _quantize(self, a, codes):
        k, w = a.shape
        lim = self.qmax * self.pre_scale
        a.clamp_(-lim, lim)
        h16 = self._buf("h16", (k, w), torch.float16, a.device)
        h16.copy_(a)
        h = h16.view(torch.int16)
        # e4m3 code = fp16 bits >> 7 (exponents differ by the 2^-8 pre-scale), sign moved from bit 15 to bit 7;
        # adding half an e4m3 ulp (0x40) first rounds; it cannot carry into the sign for |a| <= 448 / 256.
        h.add_(0x40)
        sign = self._buf("sign", (k, w), torch.int16, a.device)
        torch.bitwise_right_shift(h, 8, out=sign)
        sign.bitwise_and_(0x80)
        h.bitwise_right_shift_(7).bitwise_and_(0x7F).bitwise_or_(sign)
        codes.copy_(h)

    def _dequantize(self, codes, scale, dst):
        # torch's e4m3 -> float cast is ~10x slower than this on CPU: e4m3 bits shifted left by 7 are an fp16 of
        # the same sign and mantissa with an exponent bias 8 lower (subnormals included), i.e. value / 256.
        k, w = dst.shape
        h = self._buf("i16", (k, w), torch.int16, dst.device)
        h.copy_(codes.view(torch.int8))           # sign-extends: a negative code becomes 0xff80 | bits
        h.bitwise_left_shift_(7).bitwise_and_(-16385)   # 0xbfff clears the extended sign's copy in bit 14
        t = self._f32_target(dst)
        t.copy_(h.view(torch.float16))
        s = self._buf("s256", tuple(scale.shape), F32, dst.device)
        torch.mul(scale, 256.0, out=s)
        t.mul_(s)
        if t is not dst:
            dst.copy_(t)


class Fp8E5M2Codec(Fp8Codec):
    """fp8 e5m2: 2 mantissa bits, overflows to inf past 57344, so the scaled values are clamped to it."""

    name = "fp8_e5m2"
    fp8_dtype = torch.float8_e5m2
    qmax = 57344.0
    error_budget = 0.08

    pre_scale = 1.0

    def _quantize(self, a, codes):
        # e5m2 is the top byte of an fp16: round the low byte away (half away from zero) and keep the top one.
        k, w = a.shape
        a.clamp_(-self.qmax, self.qmax)
        h16 = self._buf("h16", (k, w), torch.float16, a.device)
        h16.copy_(a)
        h = h16.view(torch.int16)
        h.add_(0x80)    # cannot carry into the sign: |a| <= 57344 is 0x7b00
        h.bitwise_right_shift_(8)
        codes.copy_(h)  # int16 -> uint8 keeps the low byte: sign at bit 7, exponent and mantissa below

    def _dequantize(self, codes, scale, dst):
        # e5m2 is the top byte of an fp16: shifting the code left by 8 decodes it exactly.
        k, w = dst.shape
        h = self._buf("i16", (k, w), torch.int16, dst.device)
        h.copy_(codes)
        h.bitwise_left_shift_(8)
        t = self._f32_target(dst)
        t.copy_(h.view(torch.float16))
        t.mul_(scale)
        if t is not dst:
            dst.copy_(t)


class Int8Codec(ScaledCodec):
    """Symmetric int8, codes in [-127, 127], one scale per group or per channel."""

    name = "int8"
    qmax = 127.0
    error_budget = 0.03
    default_group_size = 128

    def _quantize(self, a, codes):
        # No clamp: |a| <= 127 * (1 + 2^-20) by construction of the scales (_SHRINK), which rounds to 127.
        a.round_()
        codes.view(torch.int8).copy_(a)

    def _dequantize(self, codes, scale, dst):
        t = self._f32_target(dst)
        t.copy_(codes.view(torch.int8))
        t.mul_(scale)
        if t is not dst:
            dst.copy_(t)


class Int4Codec(ScaledCodec):
    """Symmetric int4, codes in [-7, 7] as two's complement nibbles, two per byte (even element low)."""

    name = "int4"
    bits = 4
    qmax = 7.0
    error_budget = 0.2
    default_group_size = 32

    def _data_nbytes(self, numel: int, group_size: int) -> int:
        # Groups have an even size, so only the last, shorter group can end in half a byte.
        return (numel + 1) // 2

    def _check_src_shape(self, shape: tuple[int, ...]) -> None:
        if self.per_channel and (shape[-1] if shape else 1) % 2:
            raise CodecError(f"src: shape {shape}: int4 with scales='channel' needs an even last dimension")

    def check_header(self, header: CodecHeader) -> None:
        super().check_header(header)
        if header.per_channel and header.numel and (header.shape[-1] if header.shape else 1) % 2:
            raise CodecError("header.shape: int4 with per-channel scales needs an even last dimension")
        if not header.per_channel and header.group_size % 2:
            raise CodecError(f"header.group_size: {header.group_size} must be even for int4")

    def _codes_view(self, data, first, k, width):
        start = first // 2
        nbytes = (width + 1) // 2
        return data[start:start + k * nbytes].view(k, nbytes)

    def _quantize(self, a, codes):
        k, w = a.shape
        dev = a.device
        a.round_()   # |a| <= 7 * (1 + 2^-20) by construction of the scales: rounds into [-7, 7], no clamp
        we = w + (w & 1)
        q = self._buf("q8", (k, we), torch.int8, dev)
        if we != w:
            q[:, w:].zero_()
        q[:, :w].copy_(a)
        # Packing in int16 lanes: each lane holds an (even, odd) pair of int8 codes, little endian, so the
        # low nibble of the even code and the low nibble of the odd code (at bits 8..11) are a mask/shift away.
        pair = q.view(torch.int16)
        lo = self._buf("p_lo", (k, we // 2), torch.int16, dev)
        hi = self._buf("p_hi", (k, we // 2), torch.int16, dev)
        torch.bitwise_and(pair, 0x0F, out=lo)
        torch.bitwise_right_shift(pair, 4, out=hi)
        hi.bitwise_and_(0xF0)
        lo.bitwise_or_(hi)
        codes.copy_(lo)

    def _dequantize(self, codes, scale, dst):
        k, w = dst.shape
        dev = dst.device
        half = codes.shape[1]
        hi = self._buf("u_hi", (k, half), torch.int16, dev)
        lo = self._buf("u_lo", (k, half), torch.int16, dev)
        hi.copy_(codes.view(torch.int8))                         # sign-extends the high nibble's byte
        torch.bitwise_left_shift(hi, 12, out=lo)
        lo.bitwise_right_shift_(12).bitwise_and_(0xFF)           # sign-extended low nibble, as one byte
        hi.bitwise_right_shift_(4).bitwise_left_shift_(8)        # sign-extended high nibble, in the upper byte
        hi.bitwise_or_(lo)
        q = hi.view(torch.int8)                                  # int8 codes, interleaved back in order
        t = self._f32_target(dst)
        t.copy_(q if 2 * half == w else q[:, :w])
        t.mul_(scale)
        if t is not dst:
            dst.copy_(t)
