"""Every hostile or careless policy in hostile_policies.yaml is refused by `kvtier validate` and `kvtier render`
with one line per problem naming the field and the rule (never a traceback, bounded time and memory), and by the
real API server at admission; near misses are accepted by all three."""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtier_operator import cli
from kvtier_operator.kube import ApiError, Kube, policy_path
from security.corpus import ACCEPT, CASES, document, file_bytes, ids, server_document

REPO = Path(__file__).resolve().parents[2]


def test_the_corpus_is_large_and_its_ids_unique():
    assert len(CASES) >= 100
    assert len(set(ids(CASES + ACCEPT))) == len(CASES + ACCEPT)


def _run(capsys, tmp_path, case, *command) -> tuple[int, str, str, float]:
    path = tmp_path / f"{case['id']}.yaml"
    path.write_bytes(file_bytes(case))
    started = time.monotonic()
    try:
        rc = cli.main([*command, str(path)])
    except SystemExit as exit_:  # how the CLI ends on an unreadable file: one line printed, then the exit code
        rc = exit_.code
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    return rc, out, err.replace(str(path), "FILE"), took


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_validate_refuses_with_one_line_per_problem(capsys, tmp_path, case):
    rc, out, err, took = _run(capsys, tmp_path, case, "validate")
    assert rc in (cli.EXIT_INVALID, cli.EXIT_USAGE), (rc, out, err)
    assert case["expect"] in err, err
    lines = err.splitlines()
    assert lines and all(line.startswith(("FILE", "kvtier: FILE")) for line in lines), err
    assert "Traceback" not in err and "valid" not in out
    assert took < 10, f"{took:.1f}s"


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_render_refuses_too(capsys, tmp_path, case):
    rc, out, err, _ = _run(capsys, tmp_path, case, "render")
    assert rc in (cli.EXIT_INVALID, cli.EXIT_USAGE), (rc, out)
    assert err.strip() and "Traceback" not in err and out == ""


@pytest.mark.parametrize("case", ACCEPT, ids=ids(ACCEPT))
def test_near_misses_validate_and_render(capsys, tmp_path, case):
    rc, out, err, _ = _run(capsys, tmp_path, case, "validate")
    assert rc == 0, err
    rc, out, err, _ = _run(capsys, tmp_path, case, "render")
    assert rc == 0 and out, err


BOMBS = [c for c in CASES if "generate" in c or c["id"].startswith("yaml-recursive")]


@pytest.mark.parametrize("case", BOMBS, ids=ids(BOMBS))
def test_the_cli_process_stays_within_one_gib_and_ten_seconds(tmp_path, case):
    # A separate process under an address-space limit: the 8-level bomb took 3 GiB and then hung.
    path = tmp_path / "input.yaml"
    path.write_bytes(file_bytes(case))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}
    proc = subprocess.run([sys.executable, "-m", "kvtier_operator.cli", "validate", str(path)], capture_output=True,
                          text=True, timeout=60, preexec_fn=limit, env=env, cwd=tmp_path)
    assert proc.returncode in (1, 2), proc.stderr
    assert case["expect"] in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


# ---------------------------------------------------------------------------------------------- the API server

SERVER_CASES = [c for c in CASES if c.get("server", "reject") == "reject"]


def _field(expect: str) -> str:
    """The field path an expected message starts with (``spec.tiers[1].path: ...`` -> ``spec.tiers[1].path``)."""
    match = re.match(r"^((?:spec|metadata)[A-Za-z0-9_.\[\]]*)", expect)
    assert match, f"name the field in server_expect: {expect!r}"
    return match.group(1).rstrip("[")


def _dry_run_create(kube: Kube, namespace: str, doc: dict) -> None:
    meta = doc.get("metadata")
    if isinstance(meta, dict) and "namespace" not in meta:
        meta["namespace"] = namespace
    # fieldValidation=Strict, as kubectl sends it: unknown fields are errors, not silently pruned.
    kube.request("POST", policy_path(namespace), query=[("dryRun", "All"), ("fieldValidation", "Strict")], body=doc)


@pytest.mark.controlplane
def test_the_api_server_rejects_every_case_validate_rejects(kube, namespace):
    wrong = []
    for case in SERVER_CASES:
        try:
            _dry_run_create(kube, namespace, server_document(case))
        except ApiError as err:
            field = case.get("server_expect") or _field(case["expect"])
            # Decoding errors name the Go struct field (ObjectMeta.annotations) instead of the path.
            names = {field, field.replace("metadata.", "ObjectMeta.").replace("metadata", "ObjectMeta")}
            if not any(n in err.message for n in names):
                wrong.append(f"{case['id']}: rejected, but the message does not name {field!r}: {err.message}")
            continue
        wrong.append(f"{case['id']}: the API server accepted what validate rejects ({case['expect']})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.controlplane
def test_the_api_server_accepts_the_near_misses(kube, namespace):
    refused = []
    for case in ACCEPT:
        try:
            _dry_run_create(kube, namespace, document(case))
        except ApiError as err:
            refused.append(f"{case['id']}: {err.message}")
    assert not refused, "\n".join(refused)
