"""Seeded generator of Mooncake-format traces of other workload shapes, to test policies beyond one trace.

Shapes (each a plain function of a :class:`random.Random`, so a seed gives the same bytes every time):

* ``conversation`` -- multi-turn chat sessions with think time. A turn's prompt is the whole previous turn
  (prompt + answer) plus the new user message, so turn k reuses turn k-1's full blocks. Most sessions are one or
  two turns, a few run long; many apps share a short system prompt. Calibrated so that, as Alibaba's production
  characterisation ("KVCache Cache in the Wild", arXiv 2506.02634) and Mooncake's conversation trace show, about
  a quarter of blocks are ever reused and a large share (~40%) of reuses are a block's *first* reuse -- the next
  turn of the same session.
* ``agent`` -- tool/agent loops (Mooncake FAST'25 "tool&agent" trace): a handful of long system prompts (tool
  schemas, 4k-16k tokens) shared by every task of that agent, each task a loop of steps seconds apart whose
  context grows by the tool's output.
* ``document`` -- one-shot documents (RAG / summarisation): most documents are read once, a Zipf-popular few
  again and again, each with a short unique question after the document.
* ``mixture`` -- the three above interleaved on one timeline (a shared serving fleet).
* ``chat`` -- long multi-turn chats whose next turn follows within seconds (an assistant in a live session):
  each turn extends the previous one, so the most recent blocks are nearly always the next ones reused and plain
  recency is close to optimal. A shape where any learned protection of older blocks can only lose.
* ``sysprompt`` -- system-prompt-heavy traffic: a few hundred apps, each with a long system prompt shared by all
  its requests, popularity Zipf-distributed and shifting as apps come and go; the user part is short and one-shot.
* ``drift`` -- conversation, agent and document traffic whose shares change over time (conversation-heavy first,
  document-heavy last), so a policy that learned the first hour must unlearn it.

Block ids are prefix-chained like Mooncake's: block i's id names the whole prefix up to block i, the last
(partial) block of a prompt gets its own id, and ``len(hash_ids) == ceil(input_length / block_tokens)``.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHAPES = ("conversation", "agent", "document", "mixture", "chat", "sysprompt", "drift")
# Calibration (measured by tests/runtime/replay/test_replay_synth.py): ~24 blocks/request, ~41% of reuses first reuses,
# ~27% of blocks ever reused, infinite-cache hit ratio ~0.39 -- near Mooncake's conversation trace (24, 42%, 24%, 0.37).
CONV_MULTI, CONV_CONTINUE, CONV_FIRST, CONV_NEXT = 0.25, 0.55, 6000, 1500


@dataclass
class _Ids:
    """Fresh block ids: every new prefix gets a number never used before."""

    next_id: int = 0

    def take(self, n: int) -> list[int]:
        start = self.next_id
        self.next_id += n
        return list(range(start, start + n))


@dataclass
class _Request:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass
class _Context:
    """A growing prompt: its token count and the ids of its full blocks (the reusable part)."""

    tokens: int = 0
    full_blocks: list[int] = field(default_factory=list)

    def extend(self, ids: _Ids, new_tokens: int, block_tokens: int) -> tuple[int, list[int]]:
        """Append ``new_tokens``; the request's (input_length, hash_ids), the partial last block included."""
        self.tokens += new_tokens
        n_full = self.tokens // block_tokens
        if n_full > len(self.full_blocks):
            self.full_blocks += ids.take(n_full - len(self.full_blocks))
        tail = ids.take(1) if self.tokens % block_tokens else []
        return self.tokens, self.full_blocks + tail


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma))))


def _zipf_index(rng: random.Random, cumulative: list[float]) -> int:
    import bisect

    return bisect.bisect(cumulative, rng.random() * cumulative[-1])


def _zipf_cumulative(n: int, s: float) -> list[float]:
    out, total = [], 0.0
    for i in range(n):
        total += 1.0 / (i + 1) ** s
        out.append(total)
    return out


def conversation(rng: random.Random, ids: _Ids, n_requests: int, block_tokens: int,
                 duration_ms: float) -> list[_Request]:
    n_prompts = 40
    prompts = [ids.take(rng.randint(1, 3)) for _ in range(n_prompts)]  # app system prompts, whole blocks
    prompt_pop = _zipf_cumulative(n_prompts, 1.0)
    out: list[_Request] = []
    while len(out) < n_requests:
        start = rng.random() * duration_ms
        # Most sessions are one-shot questions; the rest are chats of ~5 turns with a long tail.
        turns = 1
        if rng.random() < CONV_MULTI:
            turns = 2
            while rng.random() < CONV_CONTINUE and turns < 40:
                turns += 1
        ctx = _Context()
        if rng.random() < 0.5:
            sys_ids = prompts[_zipf_index(rng, prompt_pop)]
            ctx.tokens, ctx.full_blocks = len(sys_ids) * block_tokens, list(sys_ids)
        t = start
        for turn in range(turns):
            if len(out) >= n_requests:
                break
            # The first message often carries a document; follow-ups are short.
            user = int(_lognormal(rng, CONV_FIRST if turn == 0 else CONV_NEXT, 1.0, 20, 60000))
            n_in, hash_ids = ctx.extend(ids, user, block_tokens)
            n_out = int(_lognormal(rng, 300, 0.8, 1, 4000))
            out.append(_Request(t, n_in, n_out, hash_ids))
            ctx.tokens += n_out  # the answer becomes context of the next turn
            # Generation time + the user's think time (seconds to minutes).
            t += n_out * 30 + _lognormal(rng, 40_000, 1.2, 2_000, 1_800_000)
    return out


def agent(rng: random.Random, ids: _Ids, n_requests: int, block_tokens: int,
          duration_ms: float) -> list[_Request]:
    n_agents = 12
    prompts = [ids.take(rng.randint(8, 32)) for _ in range(n_agents)]  # 4k-16k tokens of tool schemas
    pop = _zipf_cumulative(n_agents, 0.8)
    out: list[_Request] = []
    while len(out) < n_requests:
        t = rng.random() * duration_ms
        sys_ids = prompts[_zipf_index(rng, pop)]
        ctx = _Context(len(sys_ids) * block_tokens, list(sys_ids))
        ctx.extend(ids, int(_lognormal(rng, 400, 0.8, 10, 8000)), block_tokens)  # the task
        steps = 1 + int(_lognormal(rng, 4, 0.9, 0, 30))
        for _ in range(steps):
            if len(out) >= n_requests:
                break
            tool = int(_lognormal(rng, 600, 1.1, 10, 20000))
            n_in, hash_ids = ctx.extend(ids, tool, block_tokens)
            n_out = int(_lognormal(rng, 150, 0.7, 1, 2000))
            out.append(_Request(t, n_in, n_out, hash_ids))
            ctx.tokens += n_out
            t += n_out * 20 + _lognormal(rng, 3_000, 1.0, 100, 120_000)  # tool run time
    return out


def document(rng: random.Random, ids: _Ids, n_requests: int, block_tokens: int,
             duration_ms: float) -> list[_Request]:
    n_popular = 300
    popular = [ids.take(rng.randint(4, 40)) for _ in range(n_popular)]
    pop = _zipf_cumulative(n_popular, 1.1)
    out: list[_Request] = []
    for _ in range(n_requests):
        t = rng.random() * duration_ms
        doc = popular[_zipf_index(rng, pop)] if rng.random() < 0.35 else ids.take(int(_lognormal(rng, 12, 0.8, 1, 120)))
        ctx = _Context(len(doc) * block_tokens, list(doc))
        n_in, hash_ids = ctx.extend(ids, int(_lognormal(rng, 80, 0.8, 5, 2000)), block_tokens)
        out.append(_Request(t, n_in, int(_lognormal(rng, 200, 0.8, 1, 2000)), hash_ids))
    return out


def mixture(rng: random.Random, ids: _Ids, n_requests: int, block_tokens: int,
            duration_ms: float) -> list[_Request]:
    third = n_requests // 3
    return (conversation(rng, ids, third, block_tokens, duration_ms)
            + agent(rng, ids, third, block_tokens, duration_ms)
            + document(rng, ids, n_requests - 2 * third, block_tokens, duration_ms))


def chat(rng: random.Random, ids: _Ids, n_requests: int, block_tokens: int,
         duration_ms: float) -> list[_Request]:
    out: list[_Request] = []
    while len(out) < n_requests:
        t = rng.random() * duration_ms
        ctx = _Context()  # no shared system prompt: nothing is worth keeping but the live sessions
        turns = 2 + int(_lognormal(rng, 12, 0.7, 0, 80))
        for turn in range(turns):
            if len(out) >= n_requests:
                break
            user = int(_lognormal(rng, 2000 if turn == 0 else 250, 1.0, 5, 30000))
            n_in, hash_ids = ctx.extend(ids, user, block_tokens)
            n_out = int(_lognormal(rng, 250, 0.8, 1, 3000))
            out.append(_Request(t, n_in, n_out, hash_ids))
            ctx.tokens += n_out
            t += n_out * 30 + _lognormal(rng, 8_000, 1.2, 500, 600_000)  # the next turn within seconds, mostly
    return out


def sysprompt(rng: random.Random, ids: _Ids, n_requests: int, block_tokens: int,
              duration_ms: float) -> list[_Request]:
    n_apps = 300
    prompts = [ids.take(int(_lognormal(rng, 6, 0.7, 2, 40))) for _ in range(n_apps)]
    pop = _zipf_cumulative(n_apps, 0.9)
    out: list[_Request] = []
    for i in range(n_requests):
        t = duration_ms * i / n_requests
        # Apps come and go: the popularity ranking rotates by one app every 1% of the trace.
        app = (_zipf_index(rng, pop) + i * 100 // n_requests) % n_apps
        ctx = _Context(len(prompts[app]) * block_tokens, list(prompts[app]))
        n_in, hash_ids = ctx.extend(ids, int(_lognormal(rng, 300, 1.0, 5, 6000)), block_tokens)
        out.append(_Request(t, n_in, int(_lognormal(rng, 200, 0.8, 1, 2000)), hash_ids))
    return out


def drift(rng: random.Random, ids: _Ids, n_requests: int, block_tokens: int,
          duration_ms: float) -> list[_Request]:
    # Three phases of equal length; within each, the share of each kind is fixed, and the shares move from
    # conversation-heavy to document-heavy. Each phase's requests are generated on the phase's own timeline.
    shares = ((0.7, 0.2, 0.1), (0.3, 0.4, 0.3), (0.1, 0.2, 0.7))
    phase_ms = duration_ms / len(shares)
    out: list[_Request] = []
    for p, (c, a, _d) in enumerate(shares):
        n = n_requests // len(shares) if p < len(shares) - 1 else n_requests - len(out)
        n_c, n_a = int(n * c), int(n * a)
        part = (conversation(rng, ids, n_c, block_tokens, phase_ms) + agent(rng, ids, n_a, block_tokens, phase_ms)
                + document(rng, ids, n - n_c - n_a, block_tokens, phase_ms))
        for r in part:
            r.timestamp_ms = p * phase_ms + min(r.timestamp_ms, phase_ms - 1)
        out += part
    return out


_GENERATORS: dict[str, Callable[..., list[_Request]]] = {
    "conversation": conversation, "agent": agent, "document": document, "mixture": mixture,
    "chat": chat, "sysprompt": sysprompt, "drift": drift,
}


def generate(shape: str, n_requests: int = 2000, seed: int = 0, block_tokens: int = 512,
             duration_ms: float | None = None) -> list[dict[str, Any]]:
    """Requests of ``shape`` as Mooncake-format dicts in timestamp order (same seed, same list)."""
    if shape not in _GENERATORS:
        raise ValueError(f"shape: {shape!r} is not one of {', '.join(SHAPES)}")
    if isinstance(n_requests, bool) or not isinstance(n_requests, int) or n_requests <= 0:
        raise ValueError(f"requests: {n_requests!r} must be a positive integer")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens: {block_tokens!r} must be a positive integer")
    # ~1 request/s on average keeps think times and arrivals on one realistic scale.
    duration = float(duration_ms) if duration_ms is not None else n_requests * 1000.0
    rng = random.Random(f"kvtier-synth/{shape}/{seed}")
    reqs = _GENERATORS[shape](rng, _Ids(), n_requests, block_tokens, duration)
    reqs.sort(key=lambda r: r.timestamp_ms)  # stable: a session's same-instant turns keep their order
    return [{"timestamp": int(r.timestamp_ms), "input_length": r.input_length, "output_length": r.output_length,
             "hash_ids": r.hash_ids} for r in reqs]


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(", ", ": ")) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier_runtime.replay.synth --shape conversation --requests 3000 --seed 1 --out FILE``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m kvtier_runtime.replay.synth", description=__doc__.splitlines()[0])
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")  # type: ignore[method-assign]
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write")
    args = parser.parse_args(argv)
    try:
        rows = generate(args.shape, args.requests, args.seed, args.block_tokens)
        write_jsonl(rows, args.out)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: --{str(exc).replace('_', '-')}\n")
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: --out: {args.out}: {exc.strerror or exc}\n")
    print(f"wrote {len(rows)} {args.shape} requests to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
