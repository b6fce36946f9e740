"""Layout-aware codecs for KV chunks: scales that follow K and V, and an accuracy check judged on attention.

    layout = KVLayout(num_layers=2, block_tokens=256, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                      page_order="HKTD")
    codec = get_kv_codec("int4", layout)          # verify=True: over-budget chunks go to a wider codec
    out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8)
    n = codec.encode(chunk, out)                  # chunk: layout.nbytes of uint8/int8, or layout.numel of dtype
    codec.decode(out[:n], into)                   # into: a chunk-sized tensor (bytes or dtype), page order kept

Scales (scheme 1): K gets one scale per (layer, head, channel) and group of ``k_group`` tokens, V one per (layer,
head, token) and group of ``v_group`` channels (KIVI: K's outliers live in channels, V's in tokens). No scale
spans K and V, two layers or two heads. Scales are stored as bf16: int scales are rounded *up* (no code ever
clips), fp8 scales are powers of two (exact, and e4m3's precision does not depend on the scale).

Accuracy check (``verify=True``, the default): every chunk is decoded again and attention over the chunk is
computed for ``N_QUERIES`` probe queries per (layer, head), with the original and the decoded K and V; in chunks
of 256 tokens or more only over a sample of tokens (``VERIFY_TOKEN_STRIDE``, ``verify_sample``: every layer and
head, a quarter of each page's tokens plus its heavy ones). The chunk's
error is the worst relative error of the attention output over layers and heads; above the codec's budget
(``ATTENTION_BUDGETS``) the chunk is re-encoded with the next codec of ``FALLBACK_CHAINS`` (ending in ``none``,
which is exact) and counted in ``kvtier_runtime_codec_fallbacks_total{requested_codec, codec}``. Half of the
probe queries are isotropic normal, half are shaped like the chunk's K (scaled per channel by K's RMS), so that
queries that align with K's outlier channels, as real queries do, are probed too. docs/compression.md has the
evidence that this check tracks the attention of held-out queries.

Sparse K channels (scheme 2, int4 only, verified encodes only): a chunk whose K has outlier channels (a channel's
largest magnitude in a page over SPARSE_K_RATIO times the median channel's) keeps the ``n`` largest K channels of
every (layer, head, page) apart, exactly, in the chunk's dtype, with their indices (KVQuant's dense-and-sparse);
the rest is scheme 1's int4. With per-channel K scales an outlier channel does not widen the others' scales, but
its own int4 step is coarse in absolute terms, and the probe queries that follow K's channels multiply that error
into the logits: that, not the scales, is what made every outlier-K chunk fall back. The header's ``scheme`` is
``2 | n << 8``; a chunk with no outlier channel is written as scheme 1, byte for byte as before.

Blocks carry the layout in their header (flag ``FLAG_KV_LAYOUT``), so ``decode`` restores the page order the
chunk was written in; ``KVChunkCodec.decode`` also refuses a block written under another layout.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from . import kv_int4
from .base import CHUNK_ELEMS, as_byte_buffer, read_header
from .errors import CodecError
from .header import FLAG_FALLBACK, FLAG_KV_LAYOUT, HEADER_NBYTES, CodecHeader
from .kv_int4 import SCHEME_INT4_ROT, Int4Plan
from .layout import KVLayout
from .metrics import STATS
from .quant import Fp8Codec, Fp8E5M2Codec
from .scratch import ScratchPool

F32 = torch.float32
SCHEME_KIVI_BF16 = 1
# Scheme 1 plus, per (layer, head, page), the ``n`` K channels of largest magnitude stored apart exactly: int32
# indices [L, H, P, n], then the values [L, H, P, n, T] in the chunk's dtype, after scheme 1's payload. The header's
# scheme field holds ``SCHEME_SPARSE_K | n << 8``.
SCHEME_SPARSE_K = 2
# A K channel is an outlier when its largest magnitude in a page is over this many times the median channel's
# (normal keys: at most ~1.5x over 256 tokens, ~2.3x over 16). The encoder keeps the outlier count of the worst
# (layer, head, page), rounded up to SPARSE_K_STEP, apart in every one; at most head_dim / SPARSE_K_MAX_SHARE
# channels (past that a chunk is not "a few outlier channels" and falls back to int8 as before). A reader takes
# up to head_dim / 2 (the format's bound).
SPARSE_K_RATIO = 3.0
SPARSE_K_STEP = 4
SPARSE_K_MAX_SHARE = 8
KV_CODECS = ("none", "fp8", "fp8_e5m2", "int8", "int4")
# The next wider codec after a chunk over budget; "none" is exact and ends every chain.
FALLBACK_CHAINS: dict[str, tuple[str, ...]] = {
    "int4": ("int4", "int8", "fp8", "none"),
    "int8": ("int8", "fp8", "none"),
    "fp8": ("fp8", "int8", "none"),
    "fp8_e5m2": ("fp8_e5m2", "fp8", "int8", "none"),
    "none": ("none",),
}
# Largest relative error of the probe attention output a stored chunk may have, per codec. 0.14 is the error at
# which the cosine of two outputs drops to ~0.99 (cos ~ 1 - err^2 / 2); measured (bench/codecs.py --kv-proxy):
# every chunk under 0.14 kept a held-out cosine >= 0.992. A target on the attention output, not a property of the
# codec; docs/compression.md has the evidence per codec. fp8 (e4m3) is held to 0.08: it falls back to int8, which
# stores the same bytes, and on a trained model's KV (SmolLM2-135M, 2-8k tokens) e4m3's error on K's offset
# channels was 0.09-0.25 where int8's stayed under 0.035: at 0.14 the few e4m3 chunks kept moved perplexity by
# +0.16% where int8 moved it by +0.06% (kvtier accuracy, docs/compression.md). Normal data's e4m3 error is 0.04.
ATTENTION_BUDGETS: dict[str, float] = {"fp8": 0.08, "fp8_e5m2": 0.14, "int8": 0.14, "int4": 0.14, "none": 0.0}
# (K token group, V channel group); 0 = all tokens of a page / the whole head dim.
DEFAULT_GROUPS: dict[str, tuple[int, int]] = {"int4": (16, 16), "int8": (0, 0), "fp8": (0, 0), "fp8_e5m2": (0, 0)}
N_QUERIES = 16
# The attention check runs on every (layer, head) pair but on one token in VERIFY_TOKEN_STRIDE of each page (a
# phase that rotates from chunk to chunk): attention over those tokens, original against decoded K and V. K's
# scales span groups of tokens, so a token that inflates its group's scale damages the group's other tokens,
# which the sample sees; tokens whose keys are HEAVY_TOKEN times their head's mean dominate the softmax, so they
# are always in the sample. What it can miss is damage confined to ordinary unsampled tokens (a token whose own
# codes are off while its group's scale is fine), which codes never cause (scales are rounded up: no code clips);
# the rest is the difference between attention over the sample and over the page. Cost: about
# 1 / VERIFY_TOKEN_STRIDE of the full check's; a chunk of fewer than VERIFY_TOKEN_STRIDE * VERIFY_MIN_TOKENS
# tokens is checked whole. ``verify_sample=1`` checks every token.
VERIFY_TOKEN_STRIDE = 4
VERIFY_MIN_TOKENS = 64
HEAVY_TOKEN = 4.0
# A sample's error is an estimate: it is judged against this share of the budget, so that near the budget the
# sampled check errs towards the wider codec (measured: it never stored a narrower codec than the full check).
VERIFY_SAMPLE_MARGIN = 0.95
# The fp8 integer encoder and the decoder take up to this many elements a step (the fp32 encoders, int8 and int4,
# CHUNK_ELEMS): their passes are cheap enough that per-op dispatch (some 20 ops a step, ~10 us each on this CPU)
# is a large share of a step, so a 2 MiB bf16 chunk goes in one step, not two. Measured on the 2-core machine,
# loaded, 2 MiB chunks, 1 thread: fp8 encode 0.19-0.27 -> 0.30-0.32 of copy_, fp8 decode ~0.30 -> ~0.33; no
# gain for int8/int4 encode (their fp32 scratch is twice the bytes), so they keep CHUNK_ELEMS.
KV_STEP_ELEMS = 1 << 20
# The sampled check gathers the sampled tokens of up to this many values (K and V, every head) before it runs, so
# its fp32 buffers stay a few MiB per thread however many layers a chunk holds (a 2 MiB chunk is one check).
SAMPLE_BATCH_ELEMS = 1 << 19
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_TINY = torch.finfo(torch.float32).tiny
# dtype -> (its bits as an integer dtype, mantissa bits, magnitude mask) for the bit-level fp8 encoder
_FP8_BITS = {torch.bfloat16: (torch.int16, 7, 0x7FFF), torch.float32: (torch.int32, 23, 0x7FFFFFFF)}


# ---- per-codec element kernels (fp32 in, codes out, and back) ----------------------------------------------------

class _Quant:
    name = ""
    bits = 8
    post = 1.0      # decoded value = unscaled(codes) * scale * post

    def __init__(self, scratch: ScratchPool) -> None:
        self._scratch = scratch

    def buf(self, name, shape, dtype, dev):
        return self._scratch.get(f"{self.name}.{name}", shape, dtype, dev)

    def scales(self, amax: torch.Tensor) -> torch.Tensor:
        """bf16-exact scales (fp32 tensor) for the group maxima ``amax`` (modified in place and returned)."""
        raise NotImplementedError

    def quantize(self, a: torch.Tensor, codes: torch.Tensor) -> None:
        """``a`` [rows, D] fp32 already multiplied by ``1 / (scale * post)``; may be clobbered."""
        raise NotImplementedError

    def unscaled(self, codes: torch.Tensor, t: torch.Tensor) -> None:
        raise NotImplementedError


def _round_up_bf16(y: torch.Tensor) -> torch.Tensor:
    # bf16 spacing is <= 2^-7 relative, so rounding y * (1 + 2^-7) to nearest never lands below y.
    y.mul_(1.0 + 2.0 ** -7).clamp_(min=_TINY)
    return y.copy_(y.to(torch.bfloat16))


class _IntQuant(_Quant):
    name, qmax = "int8", 127.0

    def scales(self, amax):
        return _round_up_bf16(amax.mul_(1.0 / self.qmax))

    def quantize(self, a, codes):
        a.round_().clamp_(-127.0, 127.0)
        codes.view(torch.int8).copy_(a)

    def unscaled(self, codes, t):
        t.copy_(codes.view(torch.int8))


class _Int4Quant(_Quant):
    """16 levels, mid-rise: value = (nibble - 7.5) * scale; no level is wasted on symmetry around a zero code."""

    name, bits, qmax = "int4", 4, 7.5

    def scales(self, amax):
        return _round_up_bf16(amax.mul_(1.0 / self.qmax))

    def quantize(self, a, codes):
        rows, d = a.shape
        a.add_(8.0).floor_().clamp_(0.0, 15.0)
        q = self.buf("q", (rows, d), torch.uint8, a.device)
        q.copy_(a)
        torch.bitwise_left_shift(q[:, 1::2], 4, out=codes)
        codes.bitwise_or_(q[:, 0::2])

    def unscaled(self, codes, t):
        rows, half = codes.shape
        n = self.buf("n", (rows, half), torch.uint8, codes.device)
        torch.bitwise_and(codes, 0x0F, out=n)
        t[:, 0::2].copy_(n)
        torch.bitwise_right_shift(codes, 4, out=n)
        t[:, 1::2].copy_(n)
        t.sub_(7.5)


class _Fp8Quant(_Quant):
    """e4m3 through the bit-level fp16 path of ``Fp8Codec`` (subnormals exact); power-of-two scales."""

    name, fmax_exp, post = "fp8", 8, 256.0   # pow2 scale s: |x| / s < 2^8 <= 448
    codec_cls = Fp8Codec

    def __init__(self, scratch):
        super().__init__(scratch)
        self._codec = self.codec_cls()

    def scales(self, amax):
        _, e = torch.frexp(amax)            # amax < 2^e
        e.sub_(self.fmax_exp).clamp_(min=-126, max=127)
        return torch.ldexp(torch.ones_like(amax), e, out=amax)

    def quantize(self, a, codes):
        self._codec._quantize(a, codes)

    def unscaled(self, codes, t):
        rows, d = t.shape
        h = self.buf("h", (rows, d), torch.int16, t.device)
        h.copy_(codes.view(torch.int8))
        h.bitwise_left_shift_(7).bitwise_and_(-16385)
        t.copy_(h.view(torch.float16))


class _Fp8E5M2Quant(_Fp8Quant):
    codec_cls = Fp8E5M2Codec
    name, fmax_exp, post = "fp8_e5m2", 15, 1.0

    def unscaled(self, codes, t):
        rows, d = t.shape
        h = self.buf("h", (rows, d), torch.int16, t.device)
        h.copy_(codes)
        h.bitwise_left_shift_(8)
        t.copy_(h.view(torch.float16))


_QUANTS = {"int8": _IntQuant, "int4": _Int4Quant, "fp8": _Fp8Quant, "fp8_e5m2": _Fp8E5M2Quant}


class _SampleBatch:
    """How many layers of the sampled check's buffers one encode has filled (per encode: no shared state)."""

    __slots__ = ("layers",)

    def __init__(self) -> None:
        self.layers = 0


class _TokenSample:
    """The page positions a chunk's sampled check covers: ``idx`` (sorted), and when they are one stride (no
    heavy tokens: the usual case) ``first``/``step``/``span`` for strided views instead of gathers."""

    __slots__ = ("idx", "first", "step", "span")

    def __init__(self, idx: torch.Tensor) -> None:
        self.idx, self.first, self.step, self.span = idx, 0, 0, 0
        pos = idx.tolist()
        if len(pos) > 1:
            step = pos[1] - pos[0]
            if step > 0 and pos[-1] == pos[0] + step * (len(pos) - 1):
                self.first, self.step, self.span = pos[0], step, step * (len(pos) - 1) + 1


# ---- the codec -------------------------------------------------------------------------------------------------

class KVChunkCodec:
    """Encodes chunks of one ``KVLayout`` with ``name`` (falling back along ``FALLBACK_CHAINS`` when verifying)."""

    def __init__(self, name: str, layout: KVLayout, *, k_group: int | None = None, v_group: int | None = None,
                 verify: bool = True, budgets: dict[str, float] | None = None,
                 verify_sample: int | None = None, sparse_k: bool = True, int4_scheme: int = 3) -> None:
        if name not in FALLBACK_CHAINS:
            raise CodecError(f"codec: {name!r} is not one of {', '.join(FALLBACK_CHAINS)}")
        if not isinstance(layout, KVLayout):
            raise CodecError(f"layout: {type(layout).__name__} is not a KVLayout")
        if not isinstance(verify, bool):
            raise CodecError(f"verify: {verify!r} must be a bool")
        if not isinstance(sparse_k, bool):
            raise CodecError(f"sparse_k: {sparse_k!r} must be a bool")
        if isinstance(int4_scheme, bool) or int4_scheme not in (1, SCHEME_INT4_ROT):
            raise CodecError(f"int4_scheme: {int4_scheme!r} must be 3 (the default) or 1 (the previous int4, with "
                             "sparse K channels as scheme 2 when sparse_k)")
        # ``declared`` is the chunk's real order (the header records it); ``layout`` is what the kernels see:
        # the same, or for a staged order (K or V not [T][D]) the order its chunks are gathered into first.
        self.name, self.declared, self.layout, self.verify = name, layout, layout.stage_layout, verify
        self.chain = FALLBACK_CHAINS[name] if verify else (name,)
        # outlier K channels kept apart (int4 only): only when verifying, since the check is what decides
        self.sparse_k_max = max(1, layout.head_dim // SPARSE_K_MAX_SHARE) if sparse_k and verify else 0
        # int4 scheme 3 (kv_int4.py) unless asked for scheme 1 or the layout cannot take it; k_group / v_group of a
        # requested int4 are scheme 3's then (its K groups may span pages)
        self.int4_plan: Int4Plan | None = None
        if "int4" in self.chain and int4_scheme == SCHEME_INT4_ROT:
            plan = Int4Plan.for_layout(layout.stage_layout, k_group if name == "int4" else None,
                                       v_group if name == "int4" else None)
            why = plan.check()
            if why is not None and name == "int4" and (k_group is not None or v_group is not None):
                raise CodecError(f"k_group/v_group: {why}")
            self.int4_plan = plan if why is None else None
        self.budgets = dict(ATTENTION_BUDGETS)
        for key, value in (budgets or {}).items():
            if key not in ATTENTION_BUDGETS or key == "none":
                raise CodecError(f"budgets: {key!r} is not one of {', '.join(c for c in KV_CODECS if c != 'none')}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise CodecError(f"budgets[{key!r}]: {value!r} must be a number in (0, 1)")
            self.budgets[key] = float(value)
        own = name != "int4" or self.int4_plan is None
        self.groups = {c: self._groups(c, k_group if c == name and own else None,
                                       v_group if c == name and own else None)
                       for c in self.chain if c != "none"}
        self.dtype = _TORCH_DTYPES[layout.dtype]
        self._scratch = ScratchPool()
        self._quants = {c: _QUANTS[c](self._scratch) for c in self.chain if c != "none"}
        heads_tokens_dims = 2 * layout.num_kv_heads * layout.tokens * layout.head_dim
        self._layers_per_step = max(1, min(layout.num_layers, CHUNK_ELEMS // heads_tokens_dims))
        self._layers_per_bits_step = max(1, min(layout.num_layers, KV_STEP_ELEMS // heads_tokens_dims))
        if verify_sample is None:
            verify_sample = VERIFY_TOKEN_STRIDE
        if isinstance(verify_sample, bool) or not isinstance(verify_sample, int) or verify_sample < 1:
            raise CodecError(f"verify_sample: {verify_sample!r} must be an integer >= 1 (1: every token)")
        # the attention check takes one token in ``verify_sample`` of each page; every one when that would leave
        # fewer than VERIFY_MIN_TOKENS of the chunk's (attention over a few tokens is a different quantity)
        keep = verify_sample <= layout.block_tokens and layout.tokens // verify_sample >= VERIFY_MIN_TOKENS
        self.verify_sample = verify_sample if keep else 1
        self._chunks = itertools.count()

    def __repr__(self) -> str:
        return f"KVChunkCodec({self.name!r}, {self.declared}, verify={self.verify})"

    def _sample(self, flat: torch.Tensor) -> _TokenSample | None:
        """The tokens of a page this chunk's attention check covers; ``None``: all of them. One in
        ``verify_sample`` (a phase rotating from chunk to chunk), plus every heavy token: a page position where
        some (layer, head, page) has a key HEAVY_TOKEN times its mean key magnitude (such tokens dominate the
        softmax, so their own error decides the output's: the sample must not miss them)."""
        stride, lay = self.verify_sample, self.layout
        if stride == 1:
            return None
        k = canonical(lay, flat, lay.num_layers)[:, 0]                          # [L, H, P, T, D]
        bits = _FP8_BITS.get(flat.dtype)
        if bits is None:
            peak = self._scratch.get("vpeak", k.shape[:4], k.dtype, flat.device)
            torch.amax(k.abs(), dim=4, out=peak)
            return self._sample_of(peak)
        # |K| as integer bits (non-negative floats order like their bit patterns): one integer mask and an
        # integer max, several times cheaper than abs + amax in bf16; the same peaks, bit for bit
        int_dtype, _, mag_mask = bits
        m = self._scratch.get("vmag", k.shape, int_dtype, flat.device)
        torch.bitwise_and(k.view(int_dtype), mag_mask, out=m)
        return self._sample_of_magnitudes(m, flat.dtype)

    def _sample_of_magnitudes(self, m: torch.Tensor, dtype: torch.dtype) -> _TokenSample | None:
        """``_sample`` from K's magnitudes as integer bits, [L, H, P, T, D] (``m & mag_mask`` of ``dtype``)."""
        peak = self._scratch.get("vpeak", m.shape[:4], m.dtype, m.device)
        torch.amax(m, dim=4, out=peak)
        return self._sample_of(peak.view(dtype))

    def _sample_of(self, peak: torch.Tensor) -> _TokenSample | None:
        """``_sample`` from each key's largest magnitude, [L, H, P, T] (takes the chunk's phase)."""
        lay = self.layout
        stride = self.verify_sample
        # on the chunk's device: the sample indexes the chunk's tensors (CUDA ones too)
        mask = torch.zeros(lay.block_tokens, dtype=torch.bool, device=peak.device)
        mask[next(self._chunks) % stride::stride] = True
        peak = peak.float()
        heavy = peak > HEAVY_TOKEN * peak.mean(dim=3, keepdim=True)
        mask |= heavy.flatten(0, 2).any(dim=0)
        if not torch.isfinite(peak).all() or int(mask.sum()) * 2 > lay.block_tokens:
            return None
        return _TokenSample(mask.nonzero().view(-1))

    @staticmethod
    def _take(t: torch.Tensor, dim: int, sample: _TokenSample) -> torch.Tensor:
        """``t``'s entries ``sample`` along ``dim``: a strided view when the sample is one stride (no heavy
        tokens: the usual case), a gather otherwise."""
        if sample.step:
            return t.narrow(dim, sample.first, sample.span)[(slice(None),) * dim + (slice(None, None, sample.step),)]
        return t.index_select(dim, sample.idx)

    def _sampled_error(self, q: _Quant, codes: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor,
                       x: torch.Tensor, l0: int, lg: int, sample: _TokenSample | None,
                       batch: _SampleBatch | None = None) -> float:
        """The attention check of layers l0..l0+lg. Whole (``sample`` None): every token dequantised and checked
        here. Sampled: only the sampled tokens of every page and head are gathered (codes, their scales, the
        original values) into ``batch``'s contiguous buffers; the check runs (``_sample_error``) when the next
        layers would not fit (SAMPLE_BATCH_ELEMS) and, by the caller, after the last step, so that a 2 MiB chunk
        is one check. Returns the error of a check run here, else 0. ``codes`` [rows, D * bits / 8] and ``x``
        (the chunk's elements, any float dtype) in chunk order; sk [lg, H, P * T / kg, D], sv [lg, H, P * T,
        D / vg] fp32 (clobbered)."""
        lay = self.layout
        h, p, t, d = lay.num_kv_heads, lay.pages, lay.block_tokens, lay.head_dim
        if sample is None:
            rec = self._scratch.get("rec", lg * lay.page_numel * p, F32, codes.device)
            dequantize(lay, q, codes, sk, sv, rec, lg)
            return float(attention_errors(canonical(lay, x, lg), canonical(lay, rec, lg)).max())
        assert batch is not None, "a sampled check gathers into the caller's batch"
        ts, cw, dev = sample.idx.numel(), codes.shape[1], codes.device
        kg, g = p * t // sk.shape[2], sv.shape[3]
        cap = self._sample_cap(ts)
        err = 0.0
        if batch.layers + lg > cap:
            err = self._sample_error(q, sample, kg, d // g, batch)
        b0, b1 = batch.layers, batch.layers + lg
        batch.layers = b1
        # contiguous, K then V: codes [2, cap, H, P, ts, cw], the original values [2, cap, H, P, ts, D] in fp32 (so
        # that K, and V, of the batch's layers and heads are each one [layers * H, P * ts, D] batch), the scales
        # of the sampled tokens (each its group's)
        vc = self._scratch.get("vc", (2, cap, h, p, ts, cw), torch.uint8, dev)
        vc[:, b0:b1].copy_(self._take(_canonical_as(lay, codes.view(-1), lg, cw), 4, sample).transpose(0, 1))
        vx = self._scratch.get("vx", (2, cap, h, p, ts, d), F32, dev)
        vx[:, b0:b1].copy_(self._take(canonical(lay, x, lg), 4, sample).transpose(0, 1))
        if kg == t:   # one K scale per page and channel (fp8, int8): it broadcasts over the sampled tokens
            self._scratch.get("vsk", (cap, h, p, 1, d), F32, dev)[b0:b1].copy_(sk.view(lg, h, p, 1, d))
        else:
            torch.index_select(sk.view(lg, h, p, t // kg, d), 3, sample.idx // kg if kg > 1 else sample.idx,
                               out=self._scratch.get("vsk", (cap, h, p, ts, d), F32, dev)[b0:b1])
        vsv = self._scratch.get("vsv", (cap, h, p, ts, g), F32, dev)
        vsv[b0:b1].copy_(self._take(sv.view(lg, h, p, t, -1), 3, sample))
        return err

    def _sample_cap(self, ts: int) -> int:
        """Layers the sampled check gathers before it runs: SAMPLE_BATCH_ELEMS sampled values (K and V), and at
        least one encoder step's layers."""
        lay = self.layout
        step = lay.num_layers if lay.outer == "PL" else max(self._layers_per_step, self._layers_per_bits_step)
        per_layer = 2 * lay.num_kv_heads * lay.pages * ts * lay.head_dim
        return min(lay.num_layers, max(step, SAMPLE_BATCH_ELEMS // per_layer))

    def _sample_error(self, q: _Quant, sample: _TokenSample, kg: int, vg: int, batch: _SampleBatch) -> float:
        """The sampled attention check over the layers ``_sampled_error`` gathered into ``batch`` (emptied): the
        sampled tokens dequantised (each with its group's scale), then one batched attention for those layers and
        every head, original against decoded, judged against VERIFY_SAMPLE_MARGIN of the budget."""
        lay = self.layout
        h, p, d, nl = lay.num_kv_heads, lay.pages, lay.head_dim, batch.layers
        if not nl:
            return 0.0
        batch.layers = 0
        ts, dev = sample.idx.numel(), sample.idx.device
        cap, cw, g = self._sample_cap(ts), d * q.bits // 8, d // vg
        vc = self._scratch.get("vc", (2, cap, h, p, ts, cw), torch.uint8, dev)
        vx = self._scratch.get("vx", (2, cap, h, p, ts, d), F32, dev)
        vsk = self._scratch.get("vsk", (cap, h, p, 1 if kg == lay.block_tokens else ts, d), F32, dev)[:nl]
        vsv = self._scratch.get("vsv", (cap, h, p, ts, g), F32, dev)[:nl]
        vrec = self._scratch.get("vrec", (2, cap, h, p, ts, d), F32, dev)   # only the sample is dequantised
        if nl == cap:   # K and V of every layer in one go
            q.unscaled(vc.view(-1, cw), vrec.view(-1, d))
        else:
            for kv in (0, 1):
                q.unscaled(vc[kv, :nl].reshape(-1, cw), vrec[kv, :nl].view(-1, d))
        rk, rv = vrec[0, :nl], vrec[1, :nl]
        if q.post != 1.0:
            vsk.mul_(q.post)
            vsv.mul_(q.post)
        rk.mul_(vsk)   # [nl, h, p, ts, d] by [nl, h, p, ts or 1, d]
        rv.view(nl, h, p, ts, g, d // g).mul_(vsv.unsqueeze(5))
        b, n = nl * h, p * ts
        rel = attention_rel(vx[0, :nl].view(b, n, d), vx[1, :nl].view(b, n, d), rk.view(b, n, d), rv.view(b, n, d))
        return float(rel.max()) / VERIFY_SAMPLE_MARGIN

    def _groups(self, codec: str, k_group: int | None, v_group: int | None) -> tuple[int, int]:
        n, d = self.layout.block_tokens, self.layout.head_dim   # K groups never straddle pages
        dk, dv = DEFAULT_GROUPS[codec]
        out = []
        for label, given, default, total in (("k_group", k_group, dk, n), ("v_group", v_group, dv, d)):
            if given is None:
                g = default if default and total % default == 0 else total
            else:
                if isinstance(given, bool) or not isinstance(given, int) or given <= 0 or total % given:
                    raise CodecError(f"{label}: {given!r} must be a positive divisor of {total}")
                g = given
            if codec == "int4" and label == "v_group" and g % 2:
                raise CodecError(f"{label}: {g} must be even for int4")
            out.append(g)
        return out[0], out[1]

    # ---- sizes -----------------------------------------------------------------------------------------------
    def _scale_counts(self, codec: str) -> tuple[int, int]:
        """(K scales, V scales) per layer."""
        lay = self.layout
        kg, vg = self.groups[codec]
        h, n, d = lay.num_kv_heads, lay.tokens, lay.head_dim
        return h * (n // kg) * d, h * n * (d // vg)

    def payload_nbytes(self, codec: str, sparse: int = 0) -> int:
        """Payload bytes of a chunk stored with ``codec`` (``sparse``: K channels kept apart, int4 only)."""
        lay = self.layout
        if codec == "none":
            return lay.nbytes
        if codec == "int4" and self.int4_plan is not None:
            return self.int4_plan.payload_nbytes(sparse)
        return self._s1_payload_nbytes(codec, sparse)

    def _s1_payload_nbytes(self, codec: str, sparse: int = 0) -> int:
        """Payload bytes of a chunk stored with scheme 1 (int4 with ``sparse`` K channels: scheme 2), fp8 or int8."""
        lay = self.layout
        nk, nv = self._scale_counts(codec)
        return lay.num_layers * (2 * (nk + nv)) + lay.numel * _QUANTS[codec].bits // 8 + sparse_nbytes(lay, sparse)

    def encoded_nbytes(self, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> int:
        """Bytes of a chunk stored with the requested codec (no fallback). ``shape``/``dtype`` (optional, as the
        flat ``Codec`` takes them, so a tier can hold either kind) must describe the layout's chunk."""
        self._check_shape(shape, dtype)
        return HEADER_NBYTES + self.payload_nbytes(self.name)

    def max_encoded_nbytes(self, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> int:
        """Bytes ``out`` must hold: the widest codec of the fallback chain."""
        self._check_shape(shape, dtype)
        sinks = kv_int4.max_sinks(self.layout) if self.int4_plan is not None else 0
        return HEADER_NBYTES + max(self.payload_nbytes(c, sinks if c == "int4" else 0) for c in self.chain)

    def _check_shape(self, shape: Sequence[int] | None, dtype: torch.dtype | None) -> None:
        if shape is None:
            return
        itemsize = 1 if dtype in (torch.uint8, torch.int8) else self.layout.itemsize
        nbytes = math.prod(shape) * itemsize
        if dtype not in (None, torch.uint8, torch.int8, self.dtype) or nbytes != self.layout.nbytes:
            raise CodecError(f"shape: {tuple(shape)} {dtype} is not a chunk of {self.layout.nbytes} bytes "
                             f"({self.layout.dtype})")

    # ---- views -----------------------------------------------------------------------------------------------
    def _as_chunk(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """``t`` as a flat tensor of the layout's dtype (uint8/int8 byte views are reinterpreted)."""
        if not isinstance(t, torch.Tensor):
            raise CodecError(f"{name}: {type(t).__name__} is not a torch.Tensor")
        if not t.is_contiguous():
            raise CodecError(f"{name}: must be contiguous")
        lay = self.layout
        if t.dtype in (torch.uint8, torch.int8):
            if t.numel() != lay.nbytes:
                raise CodecError(f"{name}: {t.numel()} bytes, layout {lay.page_order} needs {lay.nbytes}")
            return t.reshape(-1).view(torch.uint8).view(self.dtype)
        if t.dtype != self.dtype:
            raise CodecError(f"{name}: dtype {t.dtype}, the layout says {lay.dtype}")
        if t.numel() != lay.numel:
            raise CodecError(f"{name}: {t.numel()} elements, the layout holds {lay.numel}")
        return t.reshape(-1)

    # ---- encode ----------------------------------------------------------------------------------------------
    def encode(self, src: torch.Tensor, out: torch.Tensor) -> int:
        """Write header + payload for the chunk ``src`` into ``out`` (1-D uint8, ``max_encoded_nbytes`` when
        verifying); return the bytes written."""
        flat = self._as_chunk(src, "src")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1:
            raise CodecError("out: must be a 1-D torch.uint8 tensor")
        if out.device != flat.device:
            raise CodecError(f"out: on {out.device}, src is on {flat.device}; both must be on one device")
        need = self.max_encoded_nbytes() if self.verify else self.encoded_nbytes()
        if out.numel() < need:
            raise CodecError(f"out: {out.numel()} bytes, codec {self.name!r} needs {need} for this layout")
        if self.declared.staged:
            stage = self._scratch.get("stage", flat.numel(), flat.dtype, flat.device)
            gather_staged(self.declared, flat, stage)
            flat = stage
        err = 0.0
        # the fp8 integer encoder masks K's magnitudes anyway: when it takes the chunk in one step it picks the
        # check's sample from them (the same sample, one pass over K less); otherwise it is picked here
        sample: _TokenSample | None = None
        pick = False    # the fp8 integer encoder picks the sample
        if self.verify and self.verify_sample > 1:
            one_step = self.layout.outer == "PL" or self._layers_per_bits_step >= self.layout.num_layers
            pick = self.chain[0] == "fp8" and self.dtype in _FP8_BITS and one_step
            if not pick:
                sample = self._sample(flat)
        for codec in self.chain:
            n = HEADER_NBYTES + self.payload_nbytes(codec)
            payload = out[HEADER_NBYTES:n]
            sparse = 0
            if codec == "none":
                payload.copy_(flat.view(torch.uint8))
                err = 0.0
            else:
                measure = self.verify
                if codec == "int4" and self.int4_plan is not None:
                    sinks = kv_int4.find_sinks(self.layout, flat)
                    sparse = sinks.numel()
                    n = HEADER_NBYTES + self.int4_plan.payload_nbytes(sparse)
                    err = self._encode_int4_rot(flat, out[HEADER_NBYTES:n], sinks, sample, measure)
                    if measure and not err <= self.budgets[codec] and self.sparse_k_max:
                        # over budget: the previous int4 (scheme 1, or 2 with K's outlier channels kept apart), then
                        # the chain's next codec
                        err, n, sparse = self._encode_int4_s1(flat, out, sample, measure)
                        if not err <= self.budgets[codec]:
                            continue
                        self._write_header(out, codec, n, sparse, scheme1=True)
                        STATS.record_encode(codec, self.layout.nbytes, n)
                        return n
                    if measure and not err <= self.budgets[codec]:
                        continue
                    self._write_header(out, codec, n, sparse)
                    if codec != self.name:
                        STATS.record_fallback(self.name, codec, err)
                    STATS.record_encode(codec, self.layout.nbytes, n)
                    return n
                if codec == "int4" and self.sparse_k_max:
                    sparse, amax = self._sparse_count(flat)
                if sparse and amax is not None:
                    n = HEADER_NBYTES + self.payload_nbytes(codec, sparse)
                    err = self._encode_sparse(flat, out[HEADER_NBYTES:n], sparse, amax, sample)
                elif codec == "fp8" and self.dtype in _FP8_BITS:
                    err, sample = self._encode_fp8_bits(flat, payload, measure, sample, pick)
                else:
                    err = self._encode_payload(codec, flat, payload, measure, sample)
                # ``not <=``: a NaN error (non-finite input) falls back too; ``none`` keeps the bytes as they are.
                if measure and not err <= self.budgets[codec]:
                    continue
            self._write_header(out, codec, n, sparse)
            if codec != self.name:
                STATS.record_fallback(self.name, codec, err)
            STATS.record_encode(codec, self.layout.nbytes, n)
            return n
        raise AssertionError("every fallback chain ends in 'none'")

    def _encode_int4_s1(self, flat: torch.Tensor, out: torch.Tensor, sample: _TokenSample | None,
                        measure: bool) -> tuple[float, int, int]:
        """int4 as scheme 1 (2 with sparse K channels): (check error, bytes with the header, sparse channels)."""
        sparse, amax = self._sparse_count(flat)
        if sparse and amax is not None:
            n = HEADER_NBYTES + self._s1_payload_nbytes("int4", sparse)
            return self._encode_sparse(flat, out[HEADER_NBYTES:n], sparse, amax, sample), n, sparse
        n = HEADER_NBYTES + self._s1_payload_nbytes("int4")
        return self._encode_payload("int4", flat, out[HEADER_NBYTES:n], measure, sample), n, 0

    def _header(self, codec: str, n: int, sparse: int = 0, scheme1: bool = False) -> CodecHeader:
        lay = self.declared
        if codec == "int4" and self.int4_plan is not None and not scheme1:
            plan = self.int4_plan
            return CodecHeader(
                codec=codec, codec_version=1, dtype=self.dtype, shape=lay.chunk_shape,
                group_size=plan.k_group | (plan.v_group << 16), payload_nbytes=n - HEADER_NBYTES,
                requested_codec=self.name, flags=FLAG_KV_LAYOUT | (FLAG_FALLBACK if codec != self.name else 0),
                layout_code=lay.code, scheme=plan.scheme(sparse))
        kg, vg = self.groups.get(codec, (0, 0))
        flags = FLAG_KV_LAYOUT | (FLAG_FALLBACK if codec != self.name else 0)
        return CodecHeader(
            codec=codec, codec_version=1, dtype=self.dtype, shape=lay.chunk_shape, group_size=kg | (vg << 16),
            payload_nbytes=n - HEADER_NBYTES, requested_codec=self.name, flags=flags, layout_code=lay.code,
            scheme=SCHEME_SPARSE_K | sparse << 8 if sparse else SCHEME_KIVI_BF16,
        )

    def _write_header(self, out: torch.Tensor, codec: str, n: int, sparse: int = 0, scheme1: bool = False) -> None:
        header = self._header(codec, n, sparse, scheme1).pack()
        out[:HEADER_NBYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    # ---- int4 scheme 3 (kv_int4.py) --------------------------------------------------------------------------
    def _encode_int4_rot(self, flat: torch.Tensor, payload: torch.Tensor, sinks: torch.Tensor,
                         sample: _TokenSample | None, measure: bool) -> float:
        """Scheme 3's payload; when ``measure``, the attention check's error of the chunk as it decodes (the
        measure of ``_sample_error``: the sampled tokens, or every token when ``sample`` is None)."""
        plan, lay = self.int4_plan, self.layout
        assert plan is not None
        if not measure:
            kv_int4.encode(plan, flat, payload, sinks, self._scratch)
            return 0.0
        tokens: torch.Tensor | slice | None = None
        if sample is not None and sample.step:   # one stride: the same positions of every page, as a slice
            tokens = slice(sample.first, sample.first + sample.span, sample.step)
        elif sample is not None:   # heavy tokens too: the sampled positions of every page, as chunk positions
            t = lay.block_tokens
            tokens = (torch.arange(lay.pages, device=flat.device).unsqueeze(1) * t + sample.idx).view(-1)
        err = kv_int4.encode(plan, flat, payload, sinks, self._scratch, attention_rel, tokens)
        return err if sample is None else err / VERIFY_SAMPLE_MARGIN

    # ---- sparse K channels (scheme 2) ------------------------------------------------------------------------
    def _sparse_count(self, flat: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """(K channels to keep apart per (layer, head, page), K's channel maxima [L, H, P, D] in fp32): the
        outlier count (SPARSE_K_RATIO) of the worst (layer, head, page), rounded up to SPARSE_K_STEP, at most
        ``sparse_k_max``; 0 when K has no outlier channel or a non-finite value (scheme 1 then judges it)."""
        lay = self.layout
        k = canonical(lay, flat, lay.num_layers)[:, 0]                          # [L, H, P, T, D]
        bits = _FP8_BITS.get(flat.dtype)
        if bits is None:
            amax = k.abs().amax(dim=3).float()
        else:   # |K| as integer bits, as ``_sample`` does: the same maxima at a fraction of abs + amax's cost
            int_dtype, _, mag_mask = bits
            m = self._scratch.get("smag", k.shape, int_dtype, flat.device)
            torch.bitwise_and(k.view(int_dtype), mag_mask, out=m)
            amax = m.amax(dim=3).view(flat.dtype).float()
        if not bool(torch.isfinite(amax).all()):
            return 0, None
        median = amax.median(dim=3, keepdim=True).values
        count = int((amax > SPARSE_K_RATIO * median).sum(dim=3).max())
        if not count:
            return 0, None
        return min(self.sparse_k_max, -(-count // SPARSE_K_STEP) * SPARSE_K_STEP), amax

    def _encode_sparse(self, flat: torch.Tensor, payload: torch.Tensor, sparse: int, amax: torch.Tensor,
                       sample: _TokenSample | None) -> float:
        """int4 with the ``sparse`` largest K channels of each (layer, head, page) kept apart; returns the
        attention check's error of the chunk as it decodes (the same measure as ``_sample_error``, on the
        sampled tokens, or every token when ``sample`` is None)."""
        lay, dev = self.layout, flat.device
        dense = self._s1_payload_nbytes("int4")
        self._encode_payload("int4", flat, payload[:dense], False)
        idx = amax.topk(sparse, dim=3).indices.sort(dim=3).values                # [L, H, P, n]
        write_sparse(lay, flat, idx, payload[dense:])
        rec = self._scratch.get("sparse_rec", flat.numel(), F32, dev)
        _decode_into(lay, self._header("int4", HEADER_NBYTES + payload.numel(), sparse, scheme1=True), payload, rec)
        if not bool(torch.isfinite(rec).all()):
            return math.inf
        xc, rc = canonical(lay, flat, lay.num_layers), canonical(lay, rec, lay.num_layers)
        if sample is None:
            return float(attention_errors(xc, rc).max())
        err = attention_errors(self._take(xc, 4, sample), self._take(rc, 4, sample))
        return float(err.max()) / VERIFY_SAMPLE_MARGIN

    def _steps(self, bits: bool = False):
        """(first layer, end layer, first element, end element) of each run of layers encoded at once (``bits``:
        the fp8 integer encoder's longer runs, KV_STEP_ELEMS): layers are contiguous only in layer-major chunks,
        page-major ones go whole."""
        lay = self.layout
        per_layer = lay.numel // lay.num_layers
        step = (self._layers_per_bits_step if bits else self._layers_per_step) if lay.outer == "LP" else lay.num_layers
        for l0 in range(0, lay.num_layers, step):
            l1 = min(lay.num_layers, l0 + step)
            yield l0, l1, l0 * per_layer, l1 * per_layer

    def _split(self, codec: str, payload: torch.Tensor, l0: int, l1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale bytes, code bytes) of layers l0..l1 in ``payload``."""
        return split_payload(self.layout, codec, self.groups[codec], payload, l0, l1)

    def _encode_payload(self, codec: str, flat: torch.Tensor, payload: torch.Tensor, measure: bool,
                        sample: _TokenSample | None = None) -> float:
        lay, q, dev = self.layout, self._quants[codec], flat.device
        h, n, d = lay.num_kv_heads, lay.tokens, lay.head_dim
        kg, vg = self.groups[codec]
        nk, nv = self._scale_counts(codec)
        worst = 0.0
        batch = _SampleBatch()
        for l0, l1, e0, e1 in self._steps():
            lg, ne = l1 - l0, e1 - e0
            # Elementwise work runs in the chunk's own (contiguous) order; only scales use the canonical view.
            xf = self._scratch.get("xf", ne, F32, dev)
            xf.copy_(flat[e0:e1])
            a = self._scratch.get("a", ne, F32, dev)
            torch.abs(xf, out=a)
            ac = canonical(lay, a, lg)
            sk = self._scratch.get("sk", (lg, h, n // kg, d), F32, dev)
            sv = self._scratch.get("sv", (lg, h, n, d // vg), F32, dev)
            torch.amax(k_groups(ac, kg), dim=4, out=sk.view(lg, h, lay.pages, -1, d))
            torch.amax(v_groups(ac, vg), dim=5, out=sv.view(lg, h, lay.pages, lay.block_tokens, -1))
            if measure and not (bool(torch.isfinite(sk).all()) and bool(torch.isfinite(sv).all())):
                return math.inf     # a non-finite value anywhere, sampled or not: only ``none`` keeps it as it is
            q.scales(sk)
            q.scales(sv)
            scale_bytes, code_bytes = self._split(codec, payload, l0, l1)
            sb = self._scratch.get("sb", (lg, nk + nv), torch.bfloat16, dev)
            sb[:, :nk].copy_(sk.view(lg, nk))
            sb[:, nk:].copy_(sv.view(lg, nv))
            scale_bytes.copy_(sb.view(torch.uint8).view(-1))
            inv_k = self._scratch.get("ik", (lg, h, lay.pages, lay.block_tokens // kg, 1, d), F32, dev)
            torch.reciprocal(k_scale_view(lay, sk), out=inv_k).mul_(1.0 / q.post)
            inv_v = self._scratch.get("iv", (lg, h, lay.pages, lay.block_tokens, d // vg, 1), F32, dev)
            torch.reciprocal(v_scale_view(lay, sv), out=inv_v).mul_(1.0 / q.post)
            xc = canonical(lay, xf, lg)
            torch.mul(k_groups(xc, kg), inv_k, out=k_groups(ac, kg))
            torch.mul(v_groups(xc, vg), inv_v, out=v_groups(ac, vg))
            codes = code_bytes.view(ne // d, d * q.bits // 8)
            q.quantize(a.view(ne // d, d), codes)
            if measure:
                worst = max(worst, self._sampled_error(q, codes, sk, sv, xf, l0, lg, sample, batch))
        if measure and sample is not None:
            worst = max(worst, self._sample_error(q, sample, kg, vg, batch))
        return worst

    def _encode_fp8_bits(self, flat: torch.Tensor, payload: torch.Tensor, measure: bool,
                         sample: _TokenSample | None = None,
                         pick_sample: bool = False) -> tuple[float, _TokenSample | None]:
        """fp8 (e4m3) from bf16/fp32 without float conversions: with a power-of-two scale, e4m3 is the input's
        sign, its exponent minus a per-group bias and its top 3 mantissa bits, rounded: a handful of integer
        passes instead of converting through fp32 and fp16. Scaled values below e4m3's smallest normal (2^-6,
        i.e. under 2^-14 of the group's max) land within 2^-6 of themselves (no exact subnormals), far inside
        fp8's error; zeros stay zero. Returns the check's error and its sample (with ``pick_sample``, for a
        chunk of one step, the sample is picked here from K's magnitudes, as ``_sample`` picks it)."""
        lay, dev = self.layout, flat.device
        h, n, d = lay.num_kv_heads, lay.tokens, lay.head_dim
        kg, vg = self.groups["fp8"]
        nk, nv = self._scale_counts("fp8")
        int_dtype, mant, mag_mask = _FP8_BITS[self.dtype]
        bits = flat.view(int_dtype)
        worst = 0.0
        batch = _SampleBatch()
        for l0, l1, e0, e1 in self._steps(bits=True):
            lg, ne = l1 - l0, e1 - e0
            m = self._scratch.get("fm", ne, int_dtype, dev)
            torch.bitwise_and(bits[e0:e1], mag_mask, out=m)
            mc = canonical(lay, m, lg)
            if pick_sample:
                assert (l0, l1) == (0, lay.num_layers), "the sample covers every layer: one step only"
                sample = self._sample_of_magnitudes(mc[:, 0], flat.dtype)
            ek = self._scratch.get("fek", (lg, h, n // kg, d), int_dtype, dev)
            ev = self._scratch.get("fev", (lg, h, n, d // vg), int_dtype, dev)
            # positive floats order like their bit patterns: the max magnitude is the max of the masked bits
            torch.amax(k_groups(mc, kg), dim=4, out=ek.view(lg, h, lay.pages, -1, d))
            torch.amax(v_groups(mc, vg), dim=5, out=ev.view(lg, h, lay.pages, lay.block_tokens, -1))
            # magnitudes at or above inf's bit pattern are inf or NaN: only ``none`` keeps those as they are
            if measure and max(int(ek.max()), int(ev.max())) >= 0xFF << mant:
                return math.inf, sample
            scale_bytes, code_bytes = self._split("fp8", payload, l0, l1)
            sb = self._scratch.get("fsb", (lg, nk + nv), torch.int16, dev)
            for e, sl in ((ek, slice(0, nk)), (ev, slice(nk, nk + nv))):
                # E = the group max's biased exponent (>= 15: a group of zeros keeps a normal scale, and the bias
                # below stays positive so zeros clamp to 0); scale 2^(E - 134) is the bf16 with exponent E - 7.
                if mant == 7:   # bf16: E << 7 is the max's exponent bits in place, so no shifts are needed
                    e.bitwise_and_(0x7F80).clamp_(min=15 << 7)
                    torch.sub(e.view(lg, -1), 7 << 7, out=sb[:, sl])
                    # (E - 14) << 7 minus half an e4m3 ulp (see below), in one subtraction
                    e.sub_((14 << 7) + (1 << 3))
                    continue
                e.bitwise_right_shift_(mant).clamp_(min=15)
                sb[:, sl].copy_(e.view(lg, -1)).sub_(7).bitwise_left_shift_(7)
                # subtracted from the magnitude: re-biases the exponent to e4m3's, minus half an e4m3 ulp to round
                e.sub_(14).bitwise_left_shift_(mant).sub_(1 << (mant - 4))
            scale_bytes.copy_(sb.view(torch.uint8).view(-1))
            k_groups(mc, kg).sub_(k_scale_view(lay, ek))
            v_groups(mc, vg).sub_(v_scale_view(lay, ev))
            m.clamp_(min=0).bitwise_right_shift_(mant - 3)
            # the sign: an arithmetic shift leaves -1 (negative) or 0, and m - 128 has m | 0x80 as its low byte,
            # which is all the narrowing to uint8 keeps
            sign = self._scratch.get("fs", ne, int_dtype, dev)
            torch.bitwise_right_shift(bits[e0:e1], 8 * flat.element_size() - 1, out=sign)
            m.add_(sign, alpha=128)
            codes = code_bytes.view(ne)
            codes.copy_(m)
            if measure:
                sk = self._scratch.get("sk", (lg, h, n // kg, d), F32, dev)
                sv = self._scratch.get("sv", (lg, h, n, d // vg), F32, dev)
                sbf = sb.view(torch.bfloat16)
                sk.view(lg, nk).copy_(sbf[:, :nk])
                sv.view(lg, nv).copy_(sbf[:, nk:])
                worst = max(worst, self._sampled_error(self._quants["fp8"], codes.view(-1, d), sk, sv,
                                                       flat[e0:e1], l0, lg, sample, batch))
        if measure and sample is not None:
            worst = max(worst, self._sample_error(self._quants["fp8"], sample, kg, vg, batch))
        return worst, sample

    # ---- decode ----------------------------------------------------------------------------------------------
    def decode(self, buf: torch.Tensor | bytes | bytearray | memoryview, out: torch.Tensor) -> torch.Tensor:
        """Decode a block into ``out`` (a chunk of this codec's layout: bytes or its dtype). A block written under
        another layout (or a plain, non-layout block) raises ``CodecError``: a worker must not mix them up."""
        data = as_byte_buffer(buf)
        try:
            header = read_header(data)
            if header.kv_layout:
                check_kv_header(header)
        except CodecError:
            STATS.record_decode_error()
            raise
        if not header.kv_layout:
            raise CodecError("buf: not a KV-layout block (written by the flat API)")
        written = KVLayout.from_code(header.layout_code, header.shape, str(header.dtype).removeprefix("torch."))
        if written != self.declared:
            STATS.record_decode_error()
            raise CodecError(f"buf: written under layout {written}, this codec reads {self.declared}")
        decode_kv_block(data, header, self._as_chunk(out, "out"))
        return out


def _staged_views(declared: KVLayout, chunk: torch.Tensor, stage: torch.Tensor):
    """(K as the engine keeps it, K in the stage order) as [pages of all layers, H, T, D] views; V is laid out
    alike in both orders and is copied whole."""
    lay, lp = declared, declared.num_layers * declared.pages
    h, t, d = lay.num_kv_heads, lay.block_tokens, lay.head_dim
    assert lay.page_order == "CPU_VEC"
    engine_k = chunk.view(lp, h, 2, t * d)[:, :, 0].view(lp, h, d, t).transpose(2, 3)   # K stored [D][T]
    stage_k = stage.view(lp, h, 2, t, d)[:, :, 0]
    return engine_k, stage_k, chunk.view(lp, h, 2, t * d)[:, :, 1], stage.view(lp, h, 2, t * d)[:, :, 1]


def gather_staged(declared: KVLayout, chunk: torch.Tensor, stage: torch.Tensor) -> None:
    """Copy a chunk in a staged order (``CPU_VEC``) into its stage order (``HKTD``)."""
    engine_k, stage_k, engine_v, stage_v = _staged_views(declared, chunk, stage)
    stage_k.copy_(engine_k)
    stage_v.copy_(engine_v)


def scatter_staged(declared: KVLayout, stage: torch.Tensor, chunk: torch.Tensor) -> None:
    engine_k, stage_k, engine_v, stage_v = _staged_views(declared, chunk, stage)
    engine_k.copy_(stage_k)
    engine_v.copy_(stage_v)


def _canonical_as(lay: KVLayout, t: torch.Tensor, num_layers: int, width: int) -> torch.Tensor:
    """``canonical`` for a tensor whose innermost dim is ``width`` per head dim (e.g. int4 codes: D / 2 bytes)."""
    sizes = {"K": 2, "H": lay.num_kv_heads, "T": lay.block_tokens, "D": width}
    outer = (num_layers, lay.pages) if lay.outer == "LP" else (lay.pages, num_layers)
    return t.view(outer + tuple(sizes[c] for c in lay.page_order)).permute(lay.canonical_permutation())


def canonical(layout: KVLayout, t: torch.Tensor, num_layers: int) -> torch.Tensor:
    """A ``[L, 2, H, P, T, D]`` view (K then V) of ``num_layers`` layers of a chunk held in ``layout``'s order."""
    lay = layout
    outer = (num_layers, lay.pages) if lay.outer == "LP" else (lay.pages, num_layers)
    return t.view(outer + lay.page_shape).permute(lay.canonical_permutation())


def k_groups(c: torch.Tensor, kg: int) -> torch.Tensor:
    """K of a canonical view as [L, H, P, T / kg, kg, D]: one scale per group of kg tokens (within a page) and
    channel; the scales tensor [L, H, P * T / kg, D] broadcasts as [L, H, P, T / kg, 1, D]."""
    lg, _, h, p, t, d = c.shape
    return c[:, 0].view(lg, h, p, t // kg, kg, d)


def v_groups(c: torch.Tensor, vg: int) -> torch.Tensor:
    """V of a canonical view as [L, H, P, T, D / vg, vg]: one scale per token and group of vg channels."""
    lg, _, h, p, t, d = c.shape
    return c[:, 1].view(lg, h, p, t, d // vg, vg)


def split_payload(lay: KVLayout, codec: str, groups: tuple[int, int], payload: torch.Tensor, l0: int,
                  l1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale bytes, code bytes) of layers l0..l1. Payload: bf16 scales of every layer (K then V per layer),
    then the codes in the chunk's own element order."""
    kg, vg = groups
    h, n, d = lay.num_kv_heads, lay.tokens, lay.head_dim
    per_layer_scales = 2 * (h * (n // kg) * d + h * n * (d // vg))
    bits = _QUANTS[codec].bits
    per_layer_codes = lay.numel // lay.num_layers * bits // 8
    scales_end = lay.num_layers * per_layer_scales
    if lay.outer == "PL":   # codes follow the chunk's order, so a page-major chunk's layers interleave
        assert (l0, l1) == (0, lay.num_layers)
    return (payload[l0 * per_layer_scales:l1 * per_layer_scales],
            payload[scales_end + l0 * per_layer_codes:scales_end + l1 * per_layer_codes])


def k_scale_view(lay: KVLayout, sk: torch.Tensor) -> torch.Tensor:
    """K scales [L, H, P * T / kg, D] as [L, H, P, T / kg, 1, D], to broadcast over ``k_groups``."""
    lg, h, _, d = sk.shape
    return sk.view(lg, h, lay.pages, -1, 1, d)


def v_scale_view(lay: KVLayout, sv: torch.Tensor) -> torch.Tensor:
    """V scales [L, H, P * T, D / vg] as [L, H, P, T, D / vg, 1], to broadcast over ``v_groups``."""
    lg, h, _, g = sv.shape
    return sv.view(lg, h, lay.pages, lay.block_tokens, g, 1)


def dequantize(lay: KVLayout, q: _Quant, codes: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor,
               rec: torch.Tensor, lg: int) -> None:
    """rec (flat fp32, chunk order) from codes [rows, D * bits / 8] and fp32 scales sk [lg, H, P*T/kg, D],
    sv [lg, H, P*T, D/vg] (both clobbered)."""
    d = lay.head_dim
    q.unscaled(codes, rec.view(-1, d))
    if q.post != 1.0:
        sk.mul_(q.post)
        sv.mul_(q.post)
    c = canonical(lay, rec, lg)
    k_groups(c, lay.block_tokens * lay.pages * d // sk[0, 0].numel()).mul_(k_scale_view(lay, sk))
    v_groups(c, d // sv.shape[3]).mul_(v_scale_view(lay, sv))


def attention_errors(x: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
    """Relative error per (layer, head), flattened [L * H], of softmax(q k^T / sqrt(D)) v for ``N_QUERIES`` probe
    queries (half isotropic normal, half scaled per channel like K), original ``x`` against decoded ``rec``: canonical
    views [L, 2, H, N, D] (or [L, 2, H, P, T, D]), K then V, any float dtype."""
    if x.dim() == 6:
        x, rec = x.flatten(3, 4), rec.flatten(3, 4)   # copies when pages are not adjacent: fine here
    lg, _, h, n, d = x.shape
    k, v, k2, v2 = (t.reshape(lg * h, n, d).float() for t in (x[:, 0], x[:, 1], rec[:, 0], rec[:, 1]))
    return attention_rel(k, v, k2, v2)


def attention_rel(k: torch.Tensor, v: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
    """``attention_errors``' measure on fp32 batches [B, N, D] (a (layer, head) pair each): original k, v against
    decoded k2, v2. Returns the relative error per pair [B]."""
    b, n, d = k.shape
    qs = probe_queries(d, k.device)
    half = qs.shape[0] // 2
    # K-shaped queries: channel c weighted by K's RMS in c, normalised to the mean square, per (layer, head)
    w = k.square().mean(dim=1, keepdim=True)
    w.div_(w.mean(dim=2, keepdim=True).clamp_(min=_TINY)).sqrt_()
    q = torch.cat([qs[:half].expand(b, half, d), qs[half:] * w], dim=1)
    # scores as [B, N, queries] (K's rows against the few queries: the faster bmm orientation), softmax over N
    qt, scale = q.transpose(1, 2), 1.0 / math.sqrt(d)
    o = torch.bmm(torch.softmax(torch.bmm(k, qt).mul_(scale), dim=1).transpose(1, 2), v)
    o2 = torch.bmm(torch.softmax(torch.bmm(k2, qt).mul_(scale), dim=1).transpose(1, 2), v2)
    num = (o2 - o).square().sum(dim=(1, 2))
    den = o.square().sum(dim=(1, 2))
    rel = torch.where(den > 0, num / den.clamp(min=_TINY), torch.where(num > 0, math.inf, 0.0)).sqrt_()
    # non-finite input (or output) in a pair: only ``none`` keeps such a chunk as it is. A sum is non-finite when
    # any of its terms is (or when finite terms overflow it: then the error is not measurable either), and costs
    # a fraction of ``isfinite().all()``
    ok = torch.isfinite(o.sum(dim=(1, 2))) & torch.isfinite(o2.sum(dim=(1, 2)))
    return torch.where(ok, rel, math.inf)


_PROBES: dict[tuple[int, torch.device], torch.Tensor] = {}


def probe_queries(d: int, device: torch.device) -> torch.Tensor:
    """The fixed probe queries for head dim ``d`` (seeded: the same chunk always gets the same verdict)."""
    key = (d, device)
    qs = _PROBES.get(key)
    if qs is None:
        gen = torch.Generator().manual_seed(0x6B76 + d)
        qs = _PROBES[key] = torch.randn((N_QUERIES, d), generator=gen).to(device)
    return qs


_DECODE_SCRATCH = ScratchPool()
_DECODE_QUANTS: dict[str, _Quant] = {}


def decode_kv_block(data: torch.Tensor, header: CodecHeader, flat: torch.Tensor) -> None:
    """Fill ``flat`` (the chunk's elements in its page order) from a KV-layout block whose header is valid."""
    declared = KVLayout.from_code(header.layout_code, header.shape, str(header.dtype).removeprefix("torch."))
    lay = declared.stage_layout
    payload = data[HEADER_NBYTES:header.total_nbytes]
    if declared.staged:   # decode in the gathered order, then put K and V back where the engine keeps them
        stage = _DECODE_SCRATCH.get("stage", flat.numel(), flat.dtype, flat.device)
        _decode_into(lay, header, payload, stage)
        scatter_staged(declared, stage, flat)
    else:
        _decode_into(lay, header, payload, flat)


def _decode_into(lay: KVLayout, header: CodecHeader, payload: torch.Tensor, flat: torch.Tensor) -> None:
    if header.codec == "none":
        flat.view(torch.uint8).copy_(payload)
        return
    if header.scheme & 0xFF == SCHEME_INT4_ROT:
        plan = kv_int4.plan_from_header(lay, header.group_size, header.scheme)
        kv_int4.decode(plan, (header.scheme >> 8) & 0xFF, header.dtype, payload, flat, _DECODE_SCRATCH)
        return
    q = _DECODE_QUANTS.get(header.codec)
    if q is None:
        q = _DECODE_QUANTS[header.codec] = _QUANTS[header.codec](_DECODE_SCRATCH)
    kg, vg = header.group_size & 0xFFFF, header.group_size >> 16
    h, n, d = lay.num_kv_heads, lay.tokens, lay.head_dim
    nk, nv = h * (n // kg) * d, h * n * (d // vg)
    dev = flat.device
    per_layer = lay.numel // lay.num_layers
    step = max(1, min(lay.num_layers, KV_STEP_ELEMS // per_layer)) if lay.outer == "LP" else lay.num_layers
    for l0 in range(0, lay.num_layers, step):
        l1 = min(lay.num_layers, l0 + step)
        lg = l1 - l0
        scale_bytes, code_bytes = split_payload(lay, header.codec, (kg, vg), payload, l0, l1)
        sb = _DECODE_SCRATCH.get("sb", (lg, nk + nv), torch.bfloat16, dev)
        sb.view(torch.uint8).view(-1).copy_(scale_bytes)
        sk = _DECODE_SCRATCH.get("sk", (lg, h, n // kg, d), F32, dev)
        sv = _DECODE_SCRATCH.get("sv", (lg, h, n, d // vg), F32, dev)
        sk.view(lg, nk).copy_(sb[:, :nk])
        sv.view(lg, nv).copy_(sb[:, nk:])
        dst = flat[l0 * per_layer:l1 * per_layer]
        rec = dst if dst.dtype == F32 else _DECODE_SCRATCH.get("rec", lg * per_layer, F32, dev)
        dequantize(lay, q, code_bytes.view(-1, d * q.bits // 8), sk, sv, rec, lg)
        if rec is not dst:
            dst.copy_(rec)
    sparse = header.scheme >> 8
    if sparse:
        dense = lay.num_layers * 2 * (nk + nv) + lay.numel * q.bits // 8
        read_sparse(lay, sparse, header.dtype, payload[dense:], flat)


def sparse_nbytes(lay: KVLayout, sparse: int) -> int:
    """Bytes of ``sparse`` K channels kept apart per (layer, head, page): int32 indices, then the values in the
    chunk's dtype."""
    return lay.num_layers * lay.num_kv_heads * lay.pages * sparse * (4 + lay.block_tokens * lay.itemsize)


def write_sparse(lay: KVLayout, flat: torch.Tensor, idx: torch.Tensor, section: torch.Tensor) -> None:
    """Write K's channels ``idx`` [L, H, P, n] of every (layer, head, page) of ``flat`` (the chunk's elements)
    into ``section``: the indices as int32, then the values [L, H, P, n, T]."""
    nl, h, p, n = idx.shape
    t = lay.block_tokens
    k = canonical(lay, flat, lay.num_layers)[:, 0]                              # [L, H, P, T, D]
    vals = k.gather(4, idx.unsqueeze(3).expand(nl, h, p, t, n)).transpose(3, 4)
    ni = idx.numel() * 4
    section[:ni].copy_(idx.to(torch.int32).view(torch.uint8).view(-1))
    section[ni:].copy_(vals.contiguous().view(torch.uint8).view(-1))


def read_sparse(lay: KVLayout, sparse: int, dtype: torch.dtype, section: torch.Tensor, flat: torch.Tensor) -> None:
    """Put the K channels kept apart (``write_sparse``'s ``section``) back into ``flat`` (the chunk's elements,
    any float dtype); an index outside the head dim is refused."""
    nl, h, p, t, d = lay.num_layers, lay.num_kv_heads, lay.pages, lay.block_tokens, lay.head_dim
    ni = nl * h * p * sparse * 4
    idx = torch.empty((nl, h, p, sparse), dtype=torch.int32, device=flat.device)
    idx.view(torch.uint8).view(-1).copy_(section[:ni])
    if bool(((idx < 0) | (idx >= d)).any()):
        raise CodecError(f"payload: a sparse K channel index is outside head_dim {d}")
    vals = torch.empty((nl, h, p, sparse, t), dtype=dtype, device=flat.device)
    vals.view(torch.uint8).view(-1).copy_(section[ni:])
    src = vals.transpose(3, 4)
    k = canonical(lay, flat, nl)[:, 0]
    k.scatter_(4, idx.long().unsqueeze(3).expand(nl, h, p, t, sparse), src if src.dtype == flat.dtype
               else src.to(flat.dtype))


def check_kv_header(header: CodecHeader) -> None:
    """Reject a KV-layout header whose fields cannot belong together (called before anything is allocated)."""
    scheme, sparse = header.scheme & 0xFF, header.scheme >> 8
    if scheme == SCHEME_INT4_ROT:
        if header.codec != "int4":
            raise CodecError(f"header.scheme: scheme 3 is int4's, not {header.codec!r}'s")
        lay3 = KVLayout.from_code(header.layout_code, header.shape, str(header.dtype).removeprefix("torch."))
        plan = kv_int4.plan_from_header(lay3.stage_layout, header.group_size, header.scheme)
        expected3 = plan.payload_nbytes((header.scheme >> 8) & 0xFF)
        if header.payload_nbytes != expected3:
            raise CodecError(f"header.payload_nbytes: {header.payload_nbytes}, int4 scheme 3 stores {expected3} for "
                             f"layout {lay3.page_order} {header.shape}")
        return
    if scheme not in (SCHEME_KIVI_BF16, SCHEME_SPARSE_K) or (scheme == SCHEME_KIVI_BF16 and sparse):
        raise CodecError(f"header.scheme: {header.scheme} is unknown")
    if scheme == SCHEME_SPARSE_K and header.codec != "int4":
        raise CodecError(f"header.scheme: sparse K channels (scheme 2) are int4's, not {header.codec!r}'s")
    if header.codec not in KV_CODECS:
        raise CodecError(f"header.codec: {header.codec!r} has no KV-layout form")
    dtype = str(header.dtype).removeprefix("torch.")
    lay = KVLayout.from_code(header.layout_code, header.shape, dtype)
    if header.codec == "none":
        if header.group_size:
            raise CodecError("header.group_size: codec 'none' has no groups")
        expected = lay.nbytes
    else:
        kg, vg = header.group_size & 0xFFFF, header.group_size >> 16
        if not kg or not vg or lay.block_tokens % kg or lay.head_dim % vg or (header.codec == "int4" and vg % 2):
            raise CodecError(f"header.group_size: groups K {kg} / V {vg} do not divide tokens {lay.block_tokens} / "
                             f"head_dim {lay.head_dim}")
        h, n, d = lay.num_kv_heads, lay.tokens, lay.head_dim
        nk, nv = h * (n // kg) * d, h * n * (d // vg)
        expected = lay.num_layers * 2 * (nk + nv) + lay.numel * _QUANTS[header.codec].bits // 8
        if scheme == SCHEME_SPARSE_K:
            if not 1 <= sparse <= lay.head_dim // 2:
                raise CodecError(f"header.scheme: {sparse} sparse K channels, 1 to head_dim / 2 "
                                 f"({lay.head_dim // 2}) are allowed")
            expected += sparse_nbytes(lay, sparse)
    if header.payload_nbytes != expected:
        raise CodecError(f"header.payload_nbytes: {header.payload_nbytes}, codec {header.codec!r} stores {expected} "
                         f"for layout {lay.page_order} {header.shape}")


def get_kv_codec(name: str, layout: KVLayout, *, k_group: int | None = None, v_group: int | None = None,
                 verify: bool = True, budgets: dict[str, float] | None = None,
                 verify_sample: int | None = None, sparse_k: bool = True, int4_scheme: int = 3) -> KVChunkCodec:
    """The layout-aware codec ``name`` for chunks of ``layout``; see the module docstring."""
    return KVChunkCodec(name, layout, k_group=k_group, v_group=v_group, verify=verify, budgets=budgets,
                        verify_sample=verify_sample, sparse_k=sparse_k, int4_scheme=int4_scheme)


def to_stage(layout: KVLayout, chunk: torch.Tensor) -> torch.Tensor:
    """A copy of a chunk in ``layout.stage_layout``'s order (itself when the layout is not staged)."""
    if not layout.staged:
        return chunk
    stage = torch.empty_like(chunk)
    gather_staged(layout, chunk, stage)
    return stage
