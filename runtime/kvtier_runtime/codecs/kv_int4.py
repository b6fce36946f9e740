"""int4 scheme 3: the layout-aware int4 that holds on a trained model's KV at long context.

Measured on SmolLM2-135M-Instruct's real KV (docs/compression.md, "int4 on a trained model"): what moved the
continuation's KL was, in this order, (1) the attention-sink tokens (a token nearly every later query attends to;
its K and V must be near exact), (2) K's precision (K's error costs 4-5x V's), (3) V's outlier channels. Schemes 1
and 2 (symmetric 4-bit K per channel, sparse outlier channels) gave KL 2-5e-3; this one gives 2-6e-4 at about a
third of the raw bytes. Per chunk:

- **K**: per (layer, head, channel) and group of ``k_group`` tokens (which may span pages), the group's own range:
  its midpoint (bf16) and a step (bf16, rounded up so that the midpoint's rounding is covered and no code clips);
  codes of ``k_bits`` bits, mid-rise around the midpoint (6 bits when a group holds >= 64 tokens, else 5: the
  range then costs at most 2 bits per value), stored as a nibble plane plus a plane of the high bits. A range per
  channel follows K's offset channels (a large constant plus a small variation, the usual shape of K's outlier
  channels) without keeping anything apart.
- **V**: each token's head vector rotated by a block-diagonal Hadamard matrix (blocks of ``v_group`` channels),
  then symmetric mid-rise 4-bit codes per group of ``v_group`` channels with a bf16 scale: the rotation spreads V's
  outlier channels over the group, so a scale per 32 channels does what one per 16 did without it (QuaRot's observation, here for V only: on K a
  rotation lost to per-channel ranges).
- **Sinks**: tokens whose V is tiny (under ``SINK_V_RATIO`` of its (layer, head)'s median norm over the chunk) in
  more than ``SINK_SHARE`` of the chunk's (layer, head) pairs, at most ``MAX_SINKS`` per chunk, are stored exactly
  (their K and V, every layer and head, in the chunk's dtype) and kept out of the groups' ranges. A trained
  model's first token is such a token (tiny V in 61-63 of SmolLM2's 90 pairs, no other token over 23); random or
  synthetic data has none, and then the section is empty.

Payload (every section layer-major, so a run of layers is one slice of each): K midpoints bf16 [L, H, G, D], K
steps bf16 [L, H, G, D], V scales bf16 [L, H, N, D / v_group], K low nibbles [L, H, N, D / 2],
K high bits [L, H, N, D * (k_bits - 4) / 8], V nibbles [L, H, N, D / 2], then the sinks' token indices (int32
[S], positions 0..N-1 in the chunk's token order: page, then token within the page) and their values (chunk dtype,
[L, 2, H, S, D], K then V). N = tokens of the chunk, G = N / k_group. The header's group_size holds k_group |
v_group << 16 and its scheme ``3 | S << 8 | k_bits << 16``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import CodecError
from .layout import KVLayout
from .scratch import ScratchPool

SCHEME_INT4_ROT = 3
F32 = torch.float32
_TINY = torch.finfo(torch.float32).tiny
# K tokens per range (capped at the chunk's tokens; must divide them): 64 holds the range's cost to half a bit per
# value with 6-bit codes; a shorter chunk gets 5-bit codes over all its tokens.
K_GROUP = 64
K_BITS_LONG, K_BITS_SHORT = 6, 5
V_GROUP = 32
# Sinks: V under this share of its (layer, head)'s median norm, in more than SINK_SHARE of the pairs.
SINK_V_RATIO = 0.3
SINK_SHARE = 0.5
MAX_SINKS = 4
# A layer run holds up to this many values (K and V) in the fp32 working buffers.
STEP_ELEMS = 1 << 20


def hadamard_block(head_dim: int) -> int:
    """Size of the Hadamard blocks V is rotated by: V_GROUP, or the largest power of two dividing the head dim when
    that is smaller. A rotation only has to spread an outlier channel over the channels sharing its scale (measured
    on SmolLM2: blocks of 32 as good as the whole head of 64), and a block of 32 costs a quarter of 128's."""
    return min(head_dim & -head_dim, V_GROUP)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of size ``n`` (a power of two), fp32, cached per device."""
    key = (n, device)
    h = _HADAMARD.get(key)
    if h is None:
        m = torch.ones(1, 1)
        while m.shape[0] < n:
            m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
        h = _HADAMARD[key] = (m / math.sqrt(n)).to(device)
    return h


@dataclass(frozen=True)
class Int4Plan:
    """Scheme 3's parameters for one layout (``k_group``, ``k_bits``, ``v_group``) and the sizes they give."""

    layout: KVLayout
    k_group: int
    k_bits: int
    v_group: int

    @classmethod
    def for_layout(cls, layout: KVLayout, k_group: int | None = None, v_group: int | None = None) -> Int4Plan:
        n, d = layout.tokens, layout.head_dim
        kg = k_group
        if kg is None:
            kg = min(K_GROUP, n)
            kg = kg if n % kg == 0 else math.gcd(n, kg)
        hb = hadamard_block(d)
        vg = min(V_GROUP, hb) if v_group is None else v_group
        return cls(layout, kg, K_BITS_LONG if kg >= 64 else K_BITS_SHORT, vg)

    def check(self) -> str | None:
        """Why this plan cannot encode its layout (then the codec uses scheme 1), or None."""
        lay = self.layout
        n, d = lay.tokens, lay.head_dim
        if not 0 < self.k_group <= n or n % self.k_group:
            return f"k_group {self.k_group} does not divide the chunk's {n} tokens"
        if self.k_bits not in (K_BITS_SHORT, K_BITS_LONG):
            return f"k_bits {self.k_bits} is not {K_BITS_SHORT} or {K_BITS_LONG}"
        if self.v_group <= 0 or self.v_group % 2 or hadamard_block(d) % self.v_group:
            return f"v_group {self.v_group} must be even and divide the Hadamard block {hadamard_block(d)}"
        if (lay.num_kv_heads * n * d * (self.k_bits - 4)) % 8:
            return "a layer's K high bits do not fill whole bytes"
        return None

    # ---- sizes (per layer, then the chunk) -------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.layout.tokens // self.k_group

    def section_sizes(self) -> list[int]:
        """Bytes per layer of each dense section, in payload order."""
        lay = self.layout
        h, n, d = lay.num_kv_heads, lay.tokens, lay.head_dim
        g = self.groups
        return [2 * h * g * d, 2 * h * g * d, 2 * h * n * (d // self.v_group), h * n * d // 2,
                h * n * d * (self.k_bits - 4) // 8, h * n * d // 2]

    @property
    def dense_nbytes(self) -> int:
        return self.layout.num_layers * sum(self.section_sizes())

    def sink_nbytes(self, sinks: int) -> int:
        lay = self.layout
        return sinks * (4 + lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * lay.itemsize)

    def payload_nbytes(self, sinks: int) -> int:
        return self.dense_nbytes + self.sink_nbytes(sinks)

    def scheme(self, sinks: int) -> int:
        return SCHEME_INT4_ROT | sinks << 8 | self.k_bits << 16

    def sections(self, payload: torch.Tensor, l0: int, l1: int) -> list[torch.Tensor]:
        """The slices of layers l0..l1 of each dense section of ``payload``."""
        out, base = [], 0
        nl = self.layout.num_layers
        for size in self.section_sizes():
            out.append(payload[base + l0 * size:base + l1 * size])
            base += nl * size
        return out

    def layer_step(self) -> int:
        lay = self.layout
        per_layer = 2 * lay.num_kv_heads * lay.tokens * lay.head_dim
        if lay.outer == "PL":   # a page-major chunk's layers are not contiguous: one run
            return lay.num_layers
        return max(1, min(lay.num_layers, STEP_ELEMS // per_layer))


def plan_from_header(layout: KVLayout, group_size: int, scheme: int) -> Int4Plan:
    """The plan a scheme 3 header describes; raises ``CodecError`` for fields that cannot belong together."""
    kg, vg, bits = group_size & 0xFFFF, group_size >> 16, (scheme >> 16) & 0xFF
    plan = Int4Plan(layout, kg, bits, vg)
    why = plan.check()
    if why is not None:
        raise CodecError(f"header.group_size/scheme: {why}")
    sinks = (scheme >> 8) & 0xFF
    if sinks > max_sinks(layout) or scheme >> 24:
        raise CodecError(f"header.scheme: {sinks} sinks, at most {max_sinks(layout)} for this layout")
    return plan


# ---- views -----------------------------------------------------------------------------------------------------

def _canonical(lay: KVLayout, flat: torch.Tensor) -> torch.Tensor:
    """[L, 2, H, P, T, D] view of a chunk held in ``lay``'s (unstaged) order."""
    outer = (lay.num_layers, lay.pages) if lay.outer == "LP" else (lay.pages, lay.num_layers)
    return flat.view(outer + lay.page_shape).permute(lay.canonical_permutation())


def max_sinks(lay: KVLayout) -> int:
    """Sinks a chunk of ``lay`` may keep: MAX_SINKS, and at most one in 8 of its tokens."""
    return min(MAX_SINKS, lay.tokens // 8)


def find_sinks(lay: KVLayout, flat: torch.Tensor) -> torch.Tensor:
    """Token positions (0..N-1, chunk token order) of the chunk's sinks, sorted; empty when it has none."""
    most = max_sinks(lay)
    if not most:
        return torch.empty(0, dtype=torch.long, device=flat.device)
    v = _canonical(lay, flat)[:, 1]                                     # [L, H, P, T, D]
    vn = torch.linalg.vector_norm(v, dim=4, dtype=F32).flatten(2)      # [L, H, N]
    med = vn.median(dim=2, keepdim=True).values
    low = (vn < SINK_V_RATIO * med).float().mean(dim=(0, 1))           # [N]: share of pairs with a tiny V
    cand = (low > SINK_SHARE).nonzero().view(-1)
    if cand.numel() > most:
        cand = low.topk(most).indices
    ordered: torch.Tensor = cand.sort().values
    return ordered


def _neighbours(n: int, sinks: torch.Tensor) -> torch.Tensor:
    """For each sink position, the nearest position that is not a sink (it stands in for the sink in the ranges)."""
    taken = set(sinks.tolist())
    out = []
    for s in sinks.tolist():
        step = 1
        while True:
            if s + step < n and s + step not in taken:
                out.append(s + step)
                break
            if s - step >= 0 and s - step not in taken:
                out.append(s - step)
                break
            step += 1
    return torch.tensor(out, dtype=torch.long, device=sinks.device)


# ---- bit packing -----------------------------------------------------------------------------------------------

def _pack_nibbles_f32(codes: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> None:
    """codes fp32 [..., D] (integers 0..15) -> out uint8 [..., D / 2]: the byte lo + 16 hi computed in fp32 (exact)
    and narrowed once, cheaper on CPU than integer shifts over uint8 lanes."""
    torch.add(codes[..., 0::2], codes[..., 1::2], alpha=16.0, out=tmp)
    out.copy_(tmp)


def _split_bytes(packed: torch.Tensor, b: torch.Tensor, hi: torch.Tensor, lo_out: torch.Tensor,
                 hi_out: torch.Tensor) -> None:
    """Bytes ``packed`` (uint8) -> their low nibbles into ``lo_out`` and high nibbles into ``hi_out`` (fp32 views of
    ``packed``'s shape); ``b`` and ``hi`` are fp32 scratch of that shape."""
    b.copy_(packed)
    torch.mul(b, 1.0 / 16.0, out=hi).floor_()
    hi_out.copy_(hi)
    torch.sub(b, hi, alpha=16.0, out=lo_out)


def _add_high(packed: torch.Tensor, bits: int, codes: torch.Tensor, scratch: ScratchPool) -> None:
    """Add 16 x the high bits of each code (``bits`` per code, ``8 / bits`` codes per byte, the first in the low
    bits: the encoder's layout) to ``codes`` (fp32, flat order), in fp32 arithmetic."""
    per = 8 // bits
    step = float(1 << bits)
    cv = codes.view(-1, per)
    r = scratch.get("dhr", (packed.numel(),), F32, codes.device)
    q = scratch.get("dhq", (packed.numel(),), F32, codes.device)
    r.copy_(packed)
    for j in range(per):   # r = high bits of codes j.. ; its remainder by 2^bits is code j's
        if j < per - 1:
            torch.mul(r, 1.0 / step, out=q).floor_()
            cv[:, j].add_(r.sub_(q, alpha=step), alpha=16.0)
            r.copy_(q)
        else:
            cv[:, j].add_(r, alpha=16.0)


def _round_up_bf16(y: torch.Tensor) -> torch.Tensor:
    y.mul_(1.0 + 2.0 ** -7).clamp_(min=_TINY)
    return y.copy_(y.to(torch.bfloat16))


# ---- encode / decode -------------------------------------------------------------------------------------------

# (original K, original V, decoded K, decoded V), fp32 [pairs, tokens, D] each -> relative error per pair [pairs]
Check = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def encode(plan: Int4Plan, flat: torch.Tensor, payload: torch.Tensor, sinks: torch.Tensor,
           scratch: ScratchPool, check: Check | None = None, tokens: torch.Tensor | slice | None = None) -> float:
    """Write scheme 3's payload for the chunk ``flat`` (its elements in the plan's layout order, any float dtype)
    with the sink positions ``sinks``; ``payload`` is exactly ``plan.payload_nbytes(len(sinks))`` bytes. With
    ``check``: the worst of ``check`` over every (layer, head), on the chunk's ``tokens`` (positions 0..N-1, or a
    slice of every page's positions; None: all) as they decode (rebuilt from the codes here, rounded to the chunk's dtype: what ``decode`` gives, without
    unpacking), against the original; inf when a value is not finite. Without it, 0."""
    lay = plan.layout
    nl, h, p, t, d = lay.num_layers, lay.num_kv_heads, lay.pages, lay.block_tokens, lay.head_dim
    n, kg, g, vg, kb = lay.tokens, plan.k_group, plan.groups, plan.v_group, plan.k_bits
    dev = flat.device
    c = _canonical(lay, flat)
    hb = hadamard_block(d)
    hm = hadamard(hb, dev)
    ns = sinks.numel()
    nb = _neighbours(n, sinks) if ns else None
    step = plan.layer_step()
    worst = 0.0
    sel: slice | None = None
    if check is not None:
        if tokens is None or isinstance(tokens, slice):
            sel = tokens if tokens is not None else slice(None)
            tk = pidx = tidx = gidx = is_sink = None
        else:
            tk = tokens
            pidx, tidx = tk // t, tk % t
            gidx = tk // kg
            # the sampled positions that are sinks: their decoded values are the originals
            is_sink = torch.isin(tk, sinks) if ns else None
    for l0 in range(0, nl, step):
        l1 = min(nl, l0 + step)
        lg = l1 - l0
        kx = scratch.get("k", (lg, h, n, d), F32, dev)
        vx = scratch.get("v", (lg, h, n, d), F32, dev)
        kx.view(lg, h, p, t, d).copy_(c[l0:l1, 0])
        vx.view(lg, h, p, t, d).copy_(c[l0:l1, 1])
        if ns:   # the sinks are stored apart: their neighbours stand in for them in the ranges and the codes
            kx[:, :, sinks] = kx[:, :, nb]
            vx[:, :, sinks] = vx[:, :, nb]
        mid_k, step_k, vscale, k_lo, k_hi, v_codes = plan.sections(payload, l0, l1)
        # K: per group and channel, the midpoint (bf16) and a step covering the half range plus the midpoint's
        # rounding; codes c give mid + (c - half) * step
        half = ((1 << kb) - 1) / 2.0
        kgv = kx.view(lg, h, g, kg, d)
        gmid = scratch.get("gmid", (lg, h, g, 1, d), F32, dev)
        gstep = scratch.get("gstep", (lg, h, g, 1, d), F32, dev)
        glo = scratch.get("glo", (lg, h, g, 1, d), F32, dev)
        # (amax and amin over the group's tokens: aminmax over a middle dim measured 10x slower here)
        torch.amax(kgv, dim=3, keepdim=True, out=gstep)
        torch.amin(kgv, dim=3, keepdim=True, out=glo)
        torch.add(gstep, glo, out=gmid).mul_(0.5)
        gmid.copy_(gmid.to(torch.bfloat16))
        gstep.sub_(gmid)
        torch.maximum(gstep, glo.sub_(gmid).neg_(), out=gstep)   # the half range around the bf16 midpoint
        gstep.mul_(1.0 / half)
        _round_up_bf16(gstep)
        mid_k.copy_(gmid.view(-1).to(torch.bfloat16).view(torch.uint8))
        step_k.copy_(gstep.view(-1).to(torch.bfloat16).view(torch.uint8))
        # (x - mid) / step + half as x * (1 / step) + (half - mid / step): two passes over K instead of three
        torch.reciprocal(gstep, out=glo)
        gb = scratch.get("gb", (lg, h, g, 1, d), F32, dev)
        torch.mul(gmid, glo, out=gb).neg_().add_(half)
        kgv.mul_(glo).add_(gb).round_().clamp_(0, (1 << kb) - 1)
        # codes = 16 * high + low: the high bits in fp32, then the nibbles, each narrowed to bytes once
        khi = scratch.get("khi", (lg, h, n, d), F32, dev)
        torch.mul(kx, 1.0 / 16.0, out=khi).floor_()
        klo = scratch.get("klo", (lg, h, n, d), F32, dev)
        torch.sub(kx, khi, alpha=16.0, out=klo)
        half_buf = scratch.get("half", (lg, h, n, d // 2), F32, dev)
        _pack_nibbles_f32(klo, k_lo.view(lg, h, n, d // 2), half_buf)
        per = 8 // (kb - 4)
        hv = khi.view(-1, per)
        hb8 = scratch.get("hb8", (hv.shape[0],), F32, dev)
        hb8.copy_(hv[:, 0])
        for j in range(1, per):
            hb8.add_(hv[:, j], alpha=float(1 << (j * (kb - 4))))
        k_hi.copy_(hb8)
        # V: rotate each token's head vector by the Hadamard blocks, then 4-bit codes per group of vg channels
        vr = scratch.get("vr", (lg, h, n, d), F32, dev)
        torch.matmul(vx.view(-1, d // hb, hb), hm, out=vr.view(-1, d // hb, hb))
        vgv = vr.view(lg, h, n, d // vg, vg)
        vs = scratch.get("vs", (lg, h, n, d // vg, 1), F32, dev)
        vmin = scratch.get("vmin", (lg, h, n, d // vg, 1), F32, dev)
        torch.amax(vgv, dim=4, keepdim=True, out=vs)
        torch.amin(vgv, dim=4, keepdim=True, out=vmin)
        torch.maximum(vs, vmin.neg_(), out=vs)
        vs.mul_(1.0 / 7.5)
        _round_up_bf16(vs)
        vscale.copy_(vs.view(-1).to(torch.bfloat16).view(torch.uint8))
        # floor(x / s) is in -8..7 (s is rounded up: |x| / s <= 7.5); the nibble is that + 8, added when packing
        torch.reciprocal(vs, out=vmin)
        vgv.mul_(vmin).floor_()
        torch.add(vr[..., 0::2], vr[..., 1::2], alpha=16.0, out=half_buf).add_(136.0)
        v_codes.view(lg, h, n, d // 2).copy_(half_buf)
        if check is not None:
            if not (bool(torch.isfinite(gstep).all()) and bool(torch.isfinite(gmid).all())
                    and bool(torch.isfinite(vs).all())):
                return math.inf
            if sel is not None:
                err = _checked_pages(check, c[l0:l1], kx, vr, gmid, gstep, vs, hm, half, plan, sel,
                                     sinks.tolist(), flat.dtype)
            else:
                # a tensor of sampled tokens (not a slice): the indices above were all computed from it
                assert tk is not None and pidx is not None and tidx is not None and gidx is not None
                err = _checked(check, c[l0:l1], kx, vr, gmid, gstep, vs, hm, half, plan, tk, pidx, tidx, gidx,
                               is_sink, flat.dtype)
            worst = max(worst, err)
    if ns:
        sec = payload[plan.dense_nbytes:]
        sec[:4 * ns].copy_(sinks.to(torch.int32).view(torch.uint8))
        vals = c.flatten(3, 4)[:, :, :, sinks]                            # [L, 2, H, S, D]
        sec[4 * ns:].copy_(vals.contiguous().view(-1).view(torch.uint8))
    return worst


def _checked_pages(check: Check, c: torch.Tensor, codes_k: torch.Tensor, codes_v: torch.Tensor, gmid: torch.Tensor,
                   gstep: torch.Tensor, vs: torch.Tensor, hm: torch.Tensor, half: float, plan: Int4Plan, sel: slice,
                   sinks: list[int], dtype: torch.dtype) -> float:
    """``_checked`` for a regular sample: the positions ``sel`` of every page, taken as strided views (no
    gathers). K is rebuilt for every token (two passes), V only for the sample (its rotation is the costly part)."""
    lg, h, n, d = codes_k.shape
    lay = plan.layout
    p, t, g, kg, vg, hb = lay.pages, lay.block_tokens, plan.groups, plan.k_group, plan.v_group, hm.shape[0]
    rk = torch.addcmul(gmid - half * gstep, codes_k.view(lg, h, g, kg, d), gstep).view(lg, h, p, t, d)[:, :, :, sel]
    rv0 = codes_v.view(lg, h, p, t, d)[:, :, :, sel] + 0.5          # floor(x / s) + 8 - 7.5
    ts = rv0.shape[3]
    rv0.view(lg, h, p, ts, d // vg, vg).mul_(vs.view(lg, h, p, t, d // vg, 1)[:, :, :, sel])
    rv = torch.matmul(rv0.view(-1, d // hb, hb), hm.t()).view(lg, h, p, ts, d)
    ok = c[:, 0][:, :, :, sel].float()                                  # [lg, H, P, ts, D]
    ov = c[:, 1][:, :, :, sel].float()
    rk, rv = rk.to(dtype).float(), rv.to(dtype).float()
    start, _, stride = sel.indices(t)
    for s in sinks:   # a sampled sink decodes to its original values
        pg, tt = divmod(s, t)
        if tt >= start and (tt - start) % stride == 0 and (tt - start) // stride < ts:
            j = (tt - start) // stride
            rk[:, :, pg, j] = ok[:, :, pg, j]
            rv[:, :, pg, j] = ov[:, :, pg, j]
    b = lg * h
    return float(check(ok.reshape(b, p * ts, d), ov.reshape(b, p * ts, d), rk.reshape(b, p * ts, d),
                       rv.reshape(b, p * ts, d)).max())


def _checked(check: Check, c: torch.Tensor, codes_k: torch.Tensor, codes_v: torch.Tensor, gmid: torch.Tensor,
             gstep: torch.Tensor, vs: torch.Tensor, hm: torch.Tensor, half: float, plan: Int4Plan,
             tk: torch.Tensor, pidx: torch.Tensor, tidx: torch.Tensor, gidx: torch.Tensor,
             is_sink: torch.Tensor | None, dtype: torch.dtype) -> float:
    """``check``'s worst pair for a run of layers: the tokens ``tk`` rebuilt from their codes (K codes [lg, H, N,
    D] and V's floor(x / s), both fp32; K's midpoints and steps [lg, H, G, 1, D], V's scales [lg, H, N, D / vg, 1])
    against the originals in ``c`` ([lg, 2, H, P, T, D])."""
    lg, h, _, d = codes_k.shape
    s, vg, hb = tk.numel(), plan.v_group, hm.shape[0]
    rk = codes_k[:, :, tk].sub_(half)
    rk.mul_(gstep.view(lg, h, -1, d)[:, :, gidx]).add_(gmid.view(lg, h, -1, d)[:, :, gidx])
    rv0 = codes_v[:, :, tk].add_(0.5)           # floor(x / s) + 8 - 7.5
    rv0.view(lg, h, s, d // vg, vg).mul_(vs[:, :, tk])
    rv = torch.matmul(rv0.view(-1, d // hb, hb), hm.t()).view(lg, h, s, d)
    ok = c[:, 0][:, :, pidx, tidx].float()                               # [lg, H, S, D]
    ov = c[:, 1][:, :, pidx, tidx].float()
    rk, rv = rk.to(dtype).float(), rv.to(dtype).float()
    if is_sink is not None and bool(is_sink.any()):
        rk[:, :, is_sink] = ok[:, :, is_sink]
        rv[:, :, is_sink] = ov[:, :, is_sink]
    b = lg * h
    return float(check(ok.view(b, s, d), ov.view(b, s, d), rk.view(b, s, d), rv.view(b, s, d)).max())


def decode(plan: Int4Plan, sinks: int, dtype: torch.dtype, payload: torch.Tensor, flat: torch.Tensor,
           scratch: ScratchPool) -> None:
    """Fill ``flat`` (the chunk's elements in the plan's layout order, any float dtype) from scheme 3's
    ``payload`` (exactly ``plan.payload_nbytes(sinks)`` bytes, header checked). A sink index outside the chunk's
    tokens is refused."""
    lay = plan.layout
    nl, h, p, t, d = lay.num_layers, lay.num_kv_heads, lay.pages, lay.block_tokens, lay.head_dim
    n, kg, g, vg, kb = lay.tokens, plan.k_group, plan.groups, plan.v_group, plan.k_bits
    dev = flat.device
    c = _canonical(lay, flat)
    hb = hadamard_block(d)
    hm = hadamard(hb, dev)
    idx = None
    if sinks:
        sec = payload[plan.dense_nbytes:]
        idx32 = torch.empty(sinks, dtype=torch.int32, device=dev)
        idx32.view(torch.uint8).copy_(sec[:4 * sinks])
        if bool(((idx32 < 0) | (idx32 >= n)).any()):
            raise CodecError(f"payload: a sink token index is outside the chunk's {n} tokens")
        idx = idx32.long()
    step = plan.layer_step()
    for l0 in range(0, nl, step):
        l1 = min(nl, l0 + step)
        lg = l1 - l0
        mid_k, step_k, vscale, k_lo, k_hi, v_codes = plan.sections(payload, l0, l1)
        # unpacked in fp32 arithmetic (a byte b is lo + 16 hi: hi = floor(b / 16)), cheaper on CPU than integer
        # shifts and masks over uint8 lanes
        kx = scratch.get("k", (lg, h, n, d), F32, dev)
        half_f = scratch.get("dhalf", (lg, h, n, d // 2), F32, dev)
        hi_f = scratch.get("dhi", (lg, h, n, d // 2), F32, dev)
        _split_bytes(k_lo.view(lg, h, n, d // 2), half_f, hi_f, kx[..., 0::2], kx[..., 1::2])
        _add_high(k_hi, kb - 4, kx, scratch)
        sb = scratch.get("sb", (2, lg * h * g * d), torch.bfloat16, dev)
        sb[0].view(torch.uint8).copy_(mid_k)
        sb[1].view(torch.uint8).copy_(step_k)
        kgv = kx.view(lg, h, g, kg, d)
        kgv.sub_(((1 << kb) - 1) / 2.0).mul_(sb[1].view(lg, h, g, 1, d)).add_(sb[0].view(lg, h, g, 1, d))
        vr = scratch.get("vr", (lg, h, n, d), F32, dev)
        _split_bytes(v_codes.view(lg, h, n, d // 2), half_f, hi_f, vr[..., 0::2], vr[..., 1::2])
        vr.sub_(7.5)
        vs = scratch.get("vsb", (lg * h * n * (d // vg),), torch.bfloat16, dev)
        vs.view(torch.uint8).copy_(vscale)
        vr.view(lg, h, n, d // vg, vg).mul_(vs.view(lg, h, n, d // vg, 1))
        vx = scratch.get("v", (lg, h, n, d), F32, dev)
        torch.matmul(vr.view(-1, d // hb, hb), hm.t(), out=vx.view(-1, d // hb, hb))
        c[l0:l1, 0].copy_(kx.view(lg, h, p, t, d))
        c[l0:l1, 1].copy_(vx.view(lg, h, p, t, d))
    if idx is not None:
        vals = torch.empty((nl, 2, h, sinks, d), dtype=dtype, device=dev)
        vals.view(-1).view(torch.uint8).copy_(payload[plan.dense_nbytes + 4 * sinks:])
        for j, s in enumerate(idx.tolist()):
            pg, tk = divmod(s, t)
            c[:, :, :, pg, tk].copy_(vals[:, :, :, j])
