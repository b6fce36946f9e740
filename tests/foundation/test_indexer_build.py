"""e2e/indexer/run build without a usable Go module proxy: `.ci/test-envs` runs it beside the env installs of a
cold `make test`, so a proxy that never answers must fail the build with a message naming it, not hold the run, and
a proxy that refuses must say so too. Real parts: the script, the Go toolchain setup provides, a local TCP server
that accepts and never answers (a silent proxy) and a closed port (a refusing one); the build's caches are fresh
directories, so nothing is found already built or downloaded."""
from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "e2e" / "indexer" / "run"


def _build(tmp_path: Path, proxy: str, timeout_s: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "cache"), "GOMODCACHE": str(tmp_path / "mod"),
           "GOPROXY": proxy, "GOFLAGS": "", "KVTIER_INDEXER_FETCH_TIMEOUT": str(timeout_s)}
    # KVTIER_CACHE_DIR also holds the Go toolchain setup fetched where the machine's Go is too old: keep using it.
    home_go = Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier") / "go"
    if home_go.is_dir():
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "go").symlink_to(home_go)
    return subprocess.run([str(RUN), "build"], capture_output=True, text=True, env=env, timeout=120)


def test_a_silent_module_proxy_fails_the_build_naming_it(tmp_path: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)  # accepted by the kernel, never answered
        proxy = f"http://127.0.0.1:{server.getsockname()[1]}"
        proc = _build(tmp_path, proxy, timeout_s=2)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"from the Go module proxy ({proxy}) took over 2s" in proc.stderr, proc.stderr[-2000:]
    assert "KVTIER_INDEXER_FETCH_TIMEOUT" in proc.stderr
    assert not list((tmp_path / "cache" / "indexer").glob("*/indexer"))


def test_a_refusing_module_proxy_fails_the_build_naming_it(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once this block ends: connections are refused
    proxy = f"http://127.0.0.1:{port}"
    proc = _build(tmp_path, proxy, timeout_s=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"could not fetch the indexer's modules from the Go module proxy ({proxy})" in proc.stderr, \
        proc.stderr[-2000:]
    assert "connection refused" in proc.stderr


def test_the_fetch_limit_must_be_a_positive_number_of_seconds(tmp_path: Path) -> None:
    proc = _build(tmp_path, "http://127.0.0.1:9", timeout_s=0)
    assert proc.returncode == 1
    assert "KVTIER_INDEXER_FETCH_TIMEOUT: '0' must be a positive number of seconds" in proc.stderr, proc.stderr
