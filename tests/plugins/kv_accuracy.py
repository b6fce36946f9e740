"""Accuracy measures for compressed KV: attention over a chunk, and next-token logits of two engine runs.

``attention_cosine`` is the held-out measure the codec's own check (``kv.attention_errors``) is judged against:
fresh random queries, the worst cosine over layers and heads. ``compare_logits`` compares the next-token logits
of a run whose prefix was reloaded from a compressed tier with those of an uncompressed reload (same prompts,
same positions); the real-engine harness feeds it, and a deliberately broken layout must fail it.

Test and benchmark code (the runtime never calls it): tests import ``plugins.kv_accuracy``; benchmarks put
``tests/`` on ``sys.path`` first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from kvtier_runtime.codecs import kv
from kvtier_runtime.codecs.errors import CodecError
from kvtier_runtime.codecs.kv import KVChunkCodec, attention_errors, canonical, to_stage
from kvtier_runtime.codecs.layout import KVLayout


def attention_cosine(layout: KVLayout, original: torch.Tensor, decoded: torch.Tensor, *, n_queries: int = 64,
                     seed: int = 1234) -> float:
    """Worst cosine, over layers and heads, between the attention outputs (``n_queries`` random normal queries,
    softmax(q k^T / sqrt(D)) v over the chunk's tokens, each head's [n_queries, D] output taken as one vector)
    computed from ``original`` and from ``decoded``: two chunks in ``layout``'s order (its dtype, or bytes)."""
    lay = layout
    dtype = getattr(torch, lay.dtype)

    def as_kv(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1)
        if flat.dtype in (torch.uint8, torch.int8):
            flat = flat.view(torch.uint8).view(dtype)
        if flat.numel() != lay.numel:
            raise CodecError(f"chunk: {flat.numel()} elements, the layout holds {lay.numel}")
        stage = lay.stage_layout
        c = canonical(stage, to_stage(lay, flat), lay.num_layers).float()
        return c.reshape(lay.num_layers, 2, lay.num_kv_heads, lay.tokens, lay.head_dim)

    a, b = as_kv(original), as_kv(decoded)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((lay.num_layers, lay.num_kv_heads, n_queries, lay.head_dim), generator=gen)

    def attend(x: torch.Tensor) -> torch.Tensor:
        k, v = x[:, 0], x[:, 1]
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(lay.head_dim), dim=-1) @ v

    oa, ob = attend(a).flatten(2), attend(b).flatten(2)
    return float(torch.nn.functional.cosine_similarity(oa.double(), ob.double(), dim=-1).min())


# Provisional pass thresholds per codec for ``compare_logits`` (mean KL nats, top-1 agreement), to be calibrated
# on the real engine: a float32 model whose reload is exact gives KL 0 and agreement 1. On the toy decoder of
# tests/runtime/codecs/test_codecs_kv.py correct reloads scored KL <= 0.023 and top-1 >= 0.927, broken layouts KL >= 6.4 and
# top-1 0.01.
LOGIT_THRESHOLDS: dict[str, tuple[float, float]] = {
    "none": (1e-6, 1.0),
    "fp8": (0.05, 0.90),
    "fp8_e5m2": (0.1, 0.85),
    "int8": (0.02, 0.95),
    "int4": (0.1, 0.85),
}


@dataclass(frozen=True)
class LogitsComparison:
    positions: int
    mean_kl: float              # mean over positions of KL(reference || test), nats
    max_kl: float
    top1_agreement: float       # fraction of positions whose argmax token agrees
    max_abs_diff: float
    worst_position: int         # the position with the largest KL
    max_kl_allowed: float
    min_top1_allowed: float

    @property
    def passed(self) -> bool:
        return self.mean_kl <= self.max_kl_allowed and self.top1_agreement >= self.min_top1_allowed

    def summary(self) -> str:
        return (f"{self.positions} positions: mean KL {self.mean_kl:.3g} (max {self.max_kl:.3g} at "
                f"{self.worst_position}; allowed {self.max_kl_allowed:g}), top-1 agreement "
                f"{self.top1_agreement:.4f} (allowed >= {self.min_top1_allowed:g}), max |diff| "
                f"{self.max_abs_diff:.3g}: {'pass' if self.passed else 'FAIL'}")


def compare_logits(reference: torch.Tensor, test: torch.Tensor, *, codec: str = "none",
                   max_mean_kl: float | None = None, min_top1: float | None = None) -> LogitsComparison:
    """Compare next-token logits ``[positions, vocab]`` of an uncompressed reload (``reference``) and a reload
    through ``codec`` (``test``). Thresholds default to ``LOGIT_THRESHOLDS[codec]``."""
    if not isinstance(reference, torch.Tensor) or not isinstance(test, torch.Tensor):
        raise CodecError("logits: reference and test must be torch.Tensors")
    if reference.dim() != 2 or reference.shape != test.shape or reference.shape[0] == 0:
        raise CodecError(f"logits: shapes {tuple(reference.shape)} and {tuple(test.shape)} must be one non-empty "
                         "[positions, vocab]")
    if codec not in LOGIT_THRESHOLDS:
        raise CodecError(f"codec: {codec!r} is not one of {', '.join(LOGIT_THRESHOLDS)}")
    kl_max, top1_min = LOGIT_THRESHOLDS[codec]
    kl_max = kl_max if max_mean_kl is None else max_mean_kl
    top1_min = top1_min if min_top1 is None else min_top1
    ref, tst = reference.double(), test.double()
    if not torch.isfinite(ref).all():
        raise CodecError("logits: the reference holds non-finite values")
    lp, lq = torch.log_softmax(ref, dim=-1), torch.log_softmax(tst, dim=-1)
    # a non-finite test logit is a failed run, not a number to average
    kl = torch.where(torch.isfinite(lq).all(dim=-1), (lp.exp() * (lp - lq)).sum(dim=-1), math.inf)
    agree = (ref.argmax(dim=-1) == tst.argmax(dim=-1)).double().mean()
    diff = (ref - tst).abs().nan_to_num(nan=math.inf).max()
    return LogitsComparison(
        positions=int(ref.shape[0]), mean_kl=float(kl.mean()), max_kl=float(kl.max()),
        top1_agreement=float(agree), max_abs_diff=float(diff), worst_position=int(kl.argmax()),
        max_kl_allowed=kl_max, min_top1_allowed=top1_min)


def chunk_error(layout: KVLayout, original: torch.Tensor, decoded: torch.Tensor) -> float:
    """The worst relative error, over layers and heads, of the codec check's probe attention
    (``kv.attention_errors``) between two chunks in ``layout``'s byte order."""
    codec = KVChunkCodec("none", layout, verify=False)
    a, b = codec._as_chunk(original, "original"), codec._as_chunk(decoded, "decoded")
    if layout.staged:
        a, b = to_stage(layout, a), to_stage(layout, b)
    lay = layout.stage_layout
    a, b = canonical(lay, a, lay.num_layers).float(), canonical(lay, b, lay.num_layers).float()
    shape = (lay.num_layers, 2, lay.num_kv_heads, lay.tokens, lay.head_dim)
    rel = attention_errors(a.reshape(shape), b.reshape(shape))
    return float(rel.max()) if rel.numel() else 0.0


def reference_check_error(layout: KVLayout, original: torch.Tensor, decoded: torch.Tensor, phase: int,
                          stride: int | None = None) -> float:
    """The codec's attention check written out plainly, from the chunk and its decoded copy (chunk byte order):
    the error a verifying ``KVChunkCodec`` judges against its budget for the chunk it encodes with sample phase
    ``phase`` (its encodes so far, modulo the stride). One token in ``stride`` of each page (``VERIFY_TOKEN_STRIDE``
    when None) plus every heavy token, judged with ``VERIFY_SAMPLE_MARGIN``; every token, unmargined, when the
    chunk is short, the heavy tokens are over half a page or a key is not finite. Any non-finite value: inf.
    A fast path of the check must give the same verdict as this on every chunk (tests/runtime/codecs)."""
    codec = KVChunkCodec("none", layout, verify=False)
    a, b = codec._as_chunk(original, "original"), codec._as_chunk(decoded, "decoded")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    if layout.staged:
        a, b = to_stage(layout, a), to_stage(layout, b)
    lay = layout.stage_layout
    ca, cb = canonical(lay, a, lay.num_layers).float(), canonical(lay, b, lay.num_layers).float()   # [L,2,H,P,T,D]
    stride = kv.VERIFY_TOKEN_STRIDE if stride is None else stride
    t = lay.block_tokens
    idx = None
    if stride > 1 and stride <= t and lay.tokens // stride >= kv.VERIFY_MIN_TOKENS:
        mask = torch.zeros(t, dtype=torch.bool)
        mask[phase % stride::stride] = True
        peak = ca[:, 0].abs().amax(dim=4)                                   # [L, H, P, T]
        mask |= (peak > kv.HEAVY_TOKEN * peak.mean(dim=3, keepdim=True)).flatten(0, 2).any(dim=0)
        if int(mask.sum()) * 2 <= t:
            idx = mask.nonzero().view(-1)
    lg, _, h, p, _, d = ca.shape
    if idx is None:
        shape = (lg, 2, h, p * t, d)
        return float(attention_errors(ca.reshape(shape), cb.reshape(shape)).max())
    sa, sb = ca.index_select(4, idx), cb.index_select(4, idx)
    n = p * idx.numel()
    rel = kv.attention_rel(*(s[:, i].reshape(lg * h, n, d) for s in (sa, sb) for i in (0, 1)))
    return float(rel.max()) / kv.VERIFY_SAMPLE_MARGIN
