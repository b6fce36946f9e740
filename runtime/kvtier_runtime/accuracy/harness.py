"""The runs: one prefill of the longest prefix, then per context the reference continuation (exact cache) and,
per codec, the cache through the codec path and its continuation, scored against the reference."""
from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..codecs.kv import KV_CODECS
from .chunks import Geometry, RoundTrip, codec_for, roundtrip
from .scores import Scores, score

MAX_TEXT_BYTES = 64 << 20
MAX_CONTEXTS = 16
DEFAULT_CONTINUATION = 1024
MIN_CONTINUATION = 256


@dataclass(frozen=True)
class Tolerance:
    """What the user accepts: perplexity change (percent) and mean KL (nats) against the exact cache."""

    ppl_pct: float = 0.5
    kl: float = 1e-3

    def __post_init__(self) -> None:
        if not 0 <= self.ppl_pct <= 100:
            raise ValueError(f"--max-ppl-increase: {self.ppl_pct} must be a percentage in 0..100")
        if not 0 <= self.kl <= 10:
            raise ValueError(f"--max-kl: {self.kl} must be in 0..10 nats")

    def judge(self, s: Scores) -> str:
        """"" when within tolerance, else why not."""
        why = []
        if s.ppl_change_pct > self.ppl_pct:
            why.append(f"perplexity {s.ppl_change_pct:+.2f}% > +{self.ppl_pct:g}%")
        if s.mean_kl > self.kl:
            why.append(f"KL {s.mean_kl:.2g} > {self.kl:g}")
        return ", ".join(why)


@dataclass(frozen=True)
class Run:
    model_dir: pathlib.Path
    text: pathlib.Path
    codecs: tuple[str, ...] = ("fp8", "int8", "int4")
    contexts: tuple[int, ...] = (2048, 6144)
    continuation: int = DEFAULT_CONTINUATION   # at most; see ``continuation_for``
    offset: int = 0
    geometry: Geometry = field(default_factory=Geometry)
    verify: bool = True
    device: str = "cpu"
    tolerance: Tolerance = field(default_factory=Tolerance)

    def __post_init__(self) -> None:
        bad = [c for c in self.codecs if c not in KV_CODECS]
        if bad or not self.codecs or len(set(self.codecs)) != len(self.codecs):
            raise ValueError(f"--codecs: {','.join(self.codecs)} must be distinct names from {', '.join(KV_CODECS)}")
        if not self.contexts or len(self.contexts) > MAX_CONTEXTS or any(not 16 <= n <= 1 << 20 for n in self.contexts):
            raise ValueError(f"--context: {self.contexts} must be 1 to {MAX_CONTEXTS} token counts in 16..1048576")
        if not 2 <= self.continuation <= 65536:
            raise ValueError(f"--continuation: {self.continuation} must be in 2..65536")
        if not 0 <= self.offset <= 1 << 24:
            raise ValueError(f"--offset: {self.offset} must be in 0..16777216")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device: {self.device!r} must be cpu, cuda or cuda:N")

    def continuation_for(self, context: int, max_positions: int) -> int:
        """Tokens scored after a prefix of ``context``: a quarter of the prefix, at least MIN_CONTINUATION, at most
        ``continuation``, and within the model's positions (512 after 2,048; 1,024 after 6,144; 192 after 8,000 in
        an 8k model)."""
        m = min(self.continuation, max(MIN_CONTINUATION, context // 4))
        if max_positions:
            m = min(m, max_positions - context)
        return m


@dataclass
class Row:
    codec: str
    scores: Scores
    trip: RoundTrip
    verdict: str          # "" when within tolerance


@dataclass
class ContextResult:
    context: int
    continuation: int
    chunked_tokens: int    # tokens that went through the codec (whole chunks)
    reference_ppl: float
    rows: list[Row]


@dataclass
class Result:
    run: Run
    model: dict[str, Any]
    layout: str
    contexts: list[ContextResult]


def read_text(path: pathlib.Path) -> str:
    try:
        size = path.stat().st_size
    except OSError as err:
        raise ValueError(f"--text: {path}: {err.strerror}") from None
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"--text: {path} is {size} bytes, at most {MAX_TEXT_BYTES}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--text: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def execute(run: Run, progress: Callable[[int, str], None] | None = None, lm: Any = None) -> Result:
    """Run everything; ``progress(steps, what)`` is called as work is done (``plan_steps`` in all). ``lm``: a
    loaded model (``model.load``) to reuse."""
    from ..codecs.layout import describe
    from . import model as mdl

    tick = progress or (lambda n, what: None)
    text = read_text(run.text)
    if lm is None:
        lm = mdl.load(run.model_dir, run.device)
    ids = mdl.tokenize(lm, text)
    layout = run.geometry.layout(lm.num_layers, lm.num_kv_heads, lm.head_dim)
    plans = []
    for n in run.contexts:
        if lm.max_positions and n >= lm.max_positions:
            raise ValueError(f"--context: {n} tokens leave no room for a continuation in the model's "
                             f"{lm.max_positions} positions")
        m = run.continuation_for(n, lm.max_positions)
        if m < 2:
            raise ValueError(f"--context: {n} leaves {m} positions to score")
        need = run.offset + n + m + 1
        if need > ids.numel():
            raise ValueError(f"--text: {ids.numel()} tokens; --offset {run.offset} + --context {n} + {m} continuation "
                             f"tokens + 1 need {need}")
        plans.append((n, m))
    longest = max(n for n, _ in plans)
    tick(0, f"prefill {longest} tokens")
    k_all, v_all = mdl.prefill(lm, ids[run.offset:run.offset + longest], run.geometry.torch_dtype)
    tick(1, "prefill")
    results = []
    for n, m in plans:
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        cont = ids[run.offset + n:run.offset + n + m]
        targets = ids[run.offset + n + 1:run.offset + n + m + 1]
        ref = mdl.continuation_logits(lm, k, v, cont)
        tick(1, f"{n}: reference")
        rows = []
        for name in run.codecs:
            codec = codec_for(name, layout, verify=run.verify)
            def chunk_done(i: int, n: int = n, name: str = name) -> None:
                tick(i, f"{n}: {name} chunks")
            k2, v2, trip = roundtrip(codec, k, v, progress=chunk_done)
            test = mdl.continuation_logits(lm, k2, v2, cont)
            s = score(ref, test, targets)
            rows.append(Row(name, s, trip, run.tolerance.judge(s)))
            tick(1, f"{n}: {name} scored")
        chunked = (n // layout.tokens) * layout.tokens
        results.append(ContextResult(n, m, chunked, rows[0].scores.ppl_ref if rows else 0.0, rows))
    info = {"layers": lm.num_layers, "kv_heads": lm.num_kv_heads, "head_dim": lm.head_dim,
            "max_positions": lm.max_positions, "text_tokens": int(ids.numel())}
    return Result(run, info, describe(layout), results)


def plan_steps(run: Run, chunk_tokens: int) -> int:
    """Progress steps of ``execute``: the prefill, per context the reference, per codec its chunks and its scoring."""
    return 1 + sum(1 + len(run.codecs) * (n // chunk_tokens + 1) for n in run.contexts)


def verdict_line(ctx: ContextResult, tol: Tolerance) -> str:
    safe = [r.codec for r in ctx.rows if not r.verdict]
    unsafe = [f"{r.codec} ({r.verdict})" for r in ctx.rows if r.verdict]
    head = f"at {ctx.context} tokens, within +{tol.ppl_pct:g}% perplexity and KL {tol.kl:g}: "
    return head + (", ".join(safe) or "none") + ("; not: " + "; ".join(unsafe) if unsafe else "")


def to_json(result: Result) -> dict[str, Any]:
    run = result.run
    return {
        "model": str(run.model_dir), "text": str(run.text), "offset": run.offset, "device": run.device,
        "verify": run.verify, "layout": result.layout, "model_info": result.model,
        "geometry": {"block_tokens": run.geometry.block_tokens, "chunk_tokens": run.geometry.chunk_tokens,
                     "backend": run.geometry.backend, "kv_cache_layout": run.geometry.kv_cache_layout,
                     "kv_dtype": run.geometry.kv_dtype},
        "tolerance": {"ppl_pct": run.tolerance.ppl_pct, "kl": run.tolerance.kl},
        "contexts": [{
            "context": c.context, "continuation": c.continuation, "chunked_tokens": c.chunked_tokens,
            "reference_ppl": c.reference_ppl, "verdict": verdict_line(c, run.tolerance),
            "codecs": [{
                "codec": r.codec, "ppl": r.scores.ppl_test, "ppl_change_pct": r.scores.ppl_change_pct,
                "mean_kl": r.scores.mean_kl, "top1_agreement": r.scores.top1, "positions": r.scores.positions,
                "stored_as": dict(r.trip.stored), "chunks": r.trip.chunks, "bytes_ratio": r.trip.bytes_ratio,
                "encode_gbps": r.trip.encode_gbps, "decode_gbps": r.trip.decode_gbps, "safe": not r.verdict,
                "why_not": r.verdict,
            } for r in c.rows]} for c in result.contexts],
    }


def table(result: Result) -> str:
    run = result.run
    lines = [f"# {run.model_dir.name}, text {run.text.name} (offset {run.offset}), {result.layout}, "
             f"verification {'on' if run.verify else 'off'}, device {run.device}",
             "| context | continuation | codec | stored as (chunks) | bytes / raw | perplexity change | KL | top-1 "
             "agreement | encode GB/s | decode GB/s |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in result.contexts:
        for r in c.rows:
            stored = ", ".join(f"{k} {v}" for k, v in sorted(r.trip.stored.items(), key=lambda kv: -kv[1]))
            lines.append(f"| {c.context} | {c.continuation} | {r.codec} | {stored} | {r.trip.bytes_ratio:.3f} | "
                         f"{r.scores.ppl_change_pct:+.2f}% | {r.scores.mean_kl:.2g} | {r.scores.top1:.3f} | "
                         f"{r.trip.encode_gbps:.2f} | {r.trip.decode_gbps:.2f} |")
    for c in result.contexts:
        lines.append(f"# reference perplexity at {c.context}: {c.reference_ppl:.3f} over {c.continuation} tokens; "
                     f"{c.chunked_tokens} of {c.context} prefix tokens through the codec (whole chunks)")
    for c in result.contexts:
        lines.append("verdict: " + verdict_line(c, run.tolerance))
    return "\n".join(lines)
