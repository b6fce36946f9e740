"""`kvtier replay recommend`: a KVCachePolicy sized from a trace -- it validates, stays within the budget, keeps what
the user wrote, and predicts what a plain `kvtier replay` at the chosen sizes measures."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kvtier_runtime.replay.cli import main as replay_main
from kvtier_runtime.replay.recommend import parse_quantity
from kvtier_runtime.replay.synth import generate, write_jsonl

ROOT = Path(__file__).resolve().parents[3]
SYNTHETIC = ROOT / "tests" / "data" / "mooncake-synthetic.jsonl"
ENV = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'runtime'}", "PATH": "/usr/bin:/bin"}
MiB = 2**20

POLICY = """\
# Llama on kvtier: written by hand, kept by recommend.
apiVersion: kvtier.io/v1alpha1
kind: KVCachePolicy
metadata:
  name: llama
  namespace: serving
  labels:
    team: inference  # who to call
spec:
  selector:
    matchLabels:
      app: llama
  backend: kvtier
  blockSize: 16
  tiers:
    - name: host
      medium: cpu
      size: 2Gi
      admission: none
    # The local disk.
    - name: nvme
      medium: filesystem
      size: 8Gi
      path: /mnt/kvcache
      volume:
        emptyDir:
          sizeLimit: 64Gi
      evictionPolicy: lru
      readThreads: 8
    - name: spare
      medium: filesystem
      size: 1Ti
      enabled: false
      path: /mnt/spare
      volume:
        emptyDir: {}
  offload:
    promptOnly: true
"""


def recommend(*args: str, capsys) -> tuple[int, str, str]:
    rc = replay_main(["recommend", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def kvtier_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier_operator", "validate", str(path)], env=ENV,
                          capture_output=True, text=True, timeout=120)


def predicted(text: str) -> tuple[float, dict[str, float], list[str]]:
    """The header's total and per-tier prefix hit ratios, and the replay command it names."""
    m = re.search(r"^# predicted prompt-token prefix hit ratio: ([0-9.]+) in all \((.*)\)$", text, re.M)
    assert m, text
    tiers = {k: float(v) for k, v in (p.split() for p in m.group(2).split(", "))}
    cmd = re.search(r"^# replay: kvtier replay (.*)$", text, re.M)
    return float(m.group(1)), tiers, cmd.group(1).split()


def tiers_of(text: str) -> dict[str, dict]:
    return {t["name"]: t for t in yaml.safe_load(text)["spec"]["tiers"]}


@pytest.fixture
def policy_file(tmp_path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """The policy sized on the shared synthetic trace within cpu=1Gi,nvme=6Gi (one run for the tests reading it)."""
    folder = tmp_path_factory.mktemp("synthetic")
    (folder / "policy.yaml").write_text(POLICY)
    out_file = folder / "out.yaml"
    rc = replay_main(["recommend", "--trace", str(SYNTHETIC), "--policy", str(folder / "policy.yaml"),
                      "--block-bytes", str(MiB), "--budget", "cpu=1Gi,nvme=6Gi", "-o", str(out_file)])
    assert rc == 0
    return out_file


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "conversation.jsonl"
    write_jsonl(generate("conversation", 600, seed=3), path)
    return path


def test_recommends_a_valid_policy_within_the_budget_that_keeps_what_the_user_wrote(synthetic):
    text = synthetic.read_text()
    tiers = tiers_of(text)
    assert parse_quantity(tiers["host"]["size"], "size") <= 1 * 2**30
    assert parse_quantity(tiers["nvme"]["size"], "size") <= 6 * 2**30
    assert re.fullmatch(r"[0-9]+(Gi|Mi)", tiers["host"]["size"]) and re.fullmatch(r"[0-9]+(Gi|Mi)",
                                                                                  tiers["nvme"]["size"])
    assert {tiers["host"]["evictionPolicy"], tiers["nvme"]["evictionPolicy"]} <= {"lru", "arc", "s3fifo", "prefix2q",
                                                                                 "adaptive"}
    # Every field and comment the user wrote is still there; the disabled tier is untouched.
    doc = yaml.safe_load(text)
    assert doc["metadata"]["labels"] == {"team": "inference"}
    assert doc["spec"]["offload"] == {"promptOnly": True} and doc["spec"]["blockSize"] == 16
    assert tiers["nvme"]["readThreads"] == 8 and tiers["nvme"]["volume"] == {"emptyDir": {"sizeLimit": "64Gi"}}
    assert tiers["spare"] == yaml.safe_load(POLICY)["spec"]["tiers"][2]
    for comment in ("# Llama on kvtier: written by hand, kept by recommend.", "# who to call", "# The local disk."):
        assert comment in text
    assert "# kvtier replay recommend:" in text.split("- name: nvme")[1]  # figures per tier
    result = kvtier_validate(synthetic)
    assert result.returncode == 0, result.stderr


def test_the_figures_match_a_plain_replay_at_the_chosen_sizes(synthetic, capsys):
    text = synthetic.read_text()
    total, per_tier, cmd = predicted(text)
    tiers = tiers_of(text)
    # The replay command printed is the one the sizes and policies describe.
    caps = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--capacity"]
    policies = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--policy"]
    assert caps == [str(parse_quantity(tiers[n]["size"], "size") // MiB) for n in ("host", "nvme")]
    assert policies == [tiers[n]["evictionPolicy"] for n in ("host", "nvme")]
    assert replay_main([*cmd, "--json", "--no-opt"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert total == pytest.approx(plain["total"]["prefix_hit_ratio"], abs=1e-4)
    assert [per_tier["host"], per_tier["nvme"]] == pytest.approx([t["prefix_hit_ratio"] for t in plain["tiers"]],
                                                                 abs=1e-4)


def test_a_larger_budget_never_predicts_a_lower_hit_ratio(policy_file, generated, tmp_path, capsys):
    totals = []
    for cpu, disk in (("64Mi", "256Mi"), ("128Mi", "512Mi"), ("512Mi", "2Gi"), ("4Gi", "16Gi")):
        out_file = tmp_path / f"{cpu}.yaml"
        rc, _, err = recommend("--trace", str(generated), "--policy", str(policy_file), "--block-bytes", str(MiB),
                               "--budget", f"cpu={cpu},filesystem={disk}", "-o", str(out_file), capsys=capsys)
        assert rc == 0, err
        text = out_file.read_text()
        tiers = tiers_of(text)
        assert parse_quantity(tiers["host"]["size"], "size") <= parse_quantity(cpu, "cpu")
        assert parse_quantity(tiers["nvme"]["size"], "size") <= parse_quantity(disk, "disk")
        totals.append(predicted(text)[0])
    assert totals == sorted(totals), totals
    assert totals[-1] > totals[0]  # the budgets are far enough apart to matter on this trace
    result = kvtier_validate(tmp_path / "4Gi.yaml")
    assert result.returncode == 0, result.stderr


def test_without_a_budget_the_current_sizes_are_the_budget(policy_file, generated, capsys):
    rc, text, err = recommend("--trace", str(generated), "--policy", str(policy_file), "--block-bytes", str(MiB),
                              capsys=capsys)
    assert rc == 0, err
    tiers = tiers_of(text)
    assert parse_quantity(tiers["host"]["size"], "size") <= 2 * 2**30
    assert parse_quantity(tiers["nvme"]["size"], "size") <= 8 * 2**30


def test_a_recording_supplies_tokens_and_bytes_per_block(policy_file, generated, tmp_path, capsys):
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "trace-000.jsonl").write_text(generated.read_text())
    meta = {"tokens_per_block": 512, "block_bytes": 2 * MiB, "tiers": [
        {"name": "host", "medium": "cpu", "capacity_blocks": 1024, "eviction_policy": "adaptive"}]}
    (rec / "trace-meta.json").write_text(json.dumps(meta))
    rc, text, err = recommend("--trace", str(rec), "--policy", str(policy_file), capsys=capsys)
    assert rc == 0, err
    assert f"# block bytes: {2 * MiB} (the recording's sidecar" in text
    # Without block_bytes in the sidecar: the policy's cpu size over the recorded host tier's blocks.
    del meta["block_bytes"]
    (rec / "trace-meta.json").write_text(json.dumps(meta))
    rc, text, err = recommend("--trace", str(rec), "--policy", str(policy_file), capsys=capsys)
    assert rc == 0, err
    assert f"# block bytes: {2 * 2**30 // 1024} (derived" in text


@pytest.mark.parametrize("args, field", [
    (["--budget", "gpu=1Gi"], "--budget: 'gpu'"),
    (["--budget", "cpu=lots"], "--budget cpu: 'lots'"),
    (["--budget", "filesystem=1Gi"], None),  # one enabled filesystem tier: accepted
    (["--budget", "remote=1Gi"], "--budget: remote: the policy has no enabled remote tier"),
    (["--trace", "/nonexistent/t.jsonl"], "cannot read the trace"),
    (["--policy", "NOT-A-POLICY"], "not a KVCachePolicy"),
    (["--policy", "NO-TIERS"], "spec.tiers"),
    (["--policy", "NO-SIZE"], "spec.tiers[0].size: required"),
    (["--no-block-bytes"], "--block-bytes: required"),
])
def test_bad_input_is_one_line_naming_the_field(args, field, policy_file, generated, tmp_path, capsys):
    base = {"--trace": str(generated), "--policy": str(policy_file), "--block-bytes": str(MiB)}
    extra: list[str] = []
    for i in range(0, len(args), 2):
        key = args[i]
        if key == "--no-block-bytes":
            del base["--block-bytes"]
            continue
        value = args[i + 1]
        if value == "NOT-A-POLICY":
            (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
            value = str(tmp_path / "cm.yaml")
        elif value == "NO-TIERS":
            doc = yaml.safe_load(POLICY)
            doc["spec"]["tiers"] = []
            (tmp_path / "empty.yaml").write_text(yaml.safe_dump(doc))
            value = str(tmp_path / "empty.yaml")
        elif value == "NO-SIZE":
            doc = yaml.safe_load(POLICY)
            del doc["spec"]["tiers"][0]["size"]
            (tmp_path / "nosize.yaml").write_text(yaml.safe_dump(doc))
            value = str(tmp_path / "nosize.yaml")
        if key in base:
            base[key] = value
        else:
            extra += [key, value]
    argv = [a for kv in base.items() for a in kv] + extra
    rc, _, err = recommend(*argv, capsys=capsys)
    if field is None:
        assert rc == 0, err
        return
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("kvtier replay recommend: error: ") and field in err, err


def test_a_flow_style_policy_is_rewritten_from_its_data_and_says_its_comments_are_dropped(generated, tmp_path,
                                                                                          capsys):
    doc = yaml.safe_load(POLICY)
    path = tmp_path / "flow.yaml"
    path.write_text("# a comment that cannot survive\n" + yaml.safe_dump(doc, default_flow_style=True))
    rc, text, err = recommend("--trace", str(generated), "--policy", str(path), "--block-bytes", str(MiB),
                              "--budget", "cpu=256Mi,nvme=1Gi", capsys=capsys)
    assert rc == 0, err
    assert "its comments are dropped" in text and "a comment that cannot survive" not in text
    out = yaml.safe_load(text)
    assert out["metadata"] == doc["metadata"] and out["spec"]["offload"] == doc["spec"]["offload"]
    assert parse_quantity(tiers_of(text)["host"]["size"], "size") <= 256 * MiB


def test_a_bad_block_bytes_in_the_sidecar_names_the_field(policy_file, generated, tmp_path, capsys):
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "trace-000.jsonl").write_text(generated.read_text())
    (rec / "trace-meta.json").write_text(json.dumps({"tokens_per_block": 512, "block_bytes": -1, "tiers": [
        {"name": "host", "medium": "cpu", "capacity_blocks": 1024}]}))
    rc, _, err = recommend("--trace", str(rec), "--policy", str(policy_file), capsys=capsys)
    assert rc == 2 and "block_bytes: -1 must be a positive integer" in err


def test_the_kvtier_command_runs_recommend():
    out = subprocess.run([sys.executable, "-m", "kvtier_operator", "replay", "recommend", "--help"], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--budget" in out.stdout and "kvtier replay recommend" in out.stdout
