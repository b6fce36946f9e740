"""The kvtier CLI as a user runs it: exit codes, one line per problem on stderr, never a traceback."""
import json
import pathlib
import subprocess
import sys

import yaml
from foundation.policies import cpu, policy

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'runtime'}", "PATH": "/usr/bin:/bin"}


def kvtier(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "kvtier_operator", *args], env=ENV, input=stdin,
                          capture_output=True, text=True, timeout=60)


def write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc) if isinstance(doc, dict) else doc)
    return str(path)


def test_validate_ok_and_invalid(tmp_path):
    good = write(tmp_path, "good.yaml", policy())
    bad = write(tmp_path, "bad.yaml", policy(offload={"chunkTokens": 100}, tiers=[cpu(), cpu(name="x")]))
    ok = kvtier("validate", good)
    assert ok.returncode == 0 and ok.stderr == ""
    out = kvtier("validate", good, bad)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == [
        f"{bad} (llama): spec.tiers: at most one cpu tier",
        f"{bad} (llama): spec.offload.chunkTokens: 100 is not a multiple of spec.blockSize (16)",
    ]
    assert "Traceback" not in out.stderr


def test_validate_warns_of_a_codec_the_engine_may_refuse_without_failing(tmp_path):
    """int4 on a filesystem tier is kept only where kvtier describes the engine's KV layout; elsewhere (every GPU
    attention backend today) the runtime stores int8. A valid policy asking for it gets a warning naming the
    field, exit 0; codecs that are always kept, other backends and non-filesystem tiers get none."""
    from foundation.policies import disk

    asks = write(tmp_path, "int4.yaml", policy(backend="kvtier", tiers=[cpu(), disk(compression="fp8"),
                                                                       disk("cold", compression="int4")]))
    out = kvtier("validate", asks)
    assert out.returncode == 0 and "1 file(s) valid" in out.stdout
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"warning: {asks} (llama): spec.tiers[2].compression: int4 ") and "int8" in line
    for codec in ("fp8", "int8", "none"):
        fine = write(tmp_path, f"{codec}.yaml", policy(backend="kvtier", tiers=[cpu(), disk(compression=codec)]))
        out = kvtier("validate", fine)
        assert out.returncode == 0 and out.stderr == "", (codec, out.stderr)


def test_validate_missing_file_and_garbage(tmp_path):
    out = kvtier("validate", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "No such file" in out.stderr and "Traceback" not in out.stderr
    out = kvtier("validate", write(tmp_path, "g.yaml", "spec: [\n"))
    assert out.returncode == 1 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr


def test_validate_reads_stdin():
    out = kvtier("validate", "-", stdin=yaml.safe_dump(policy()))
    assert out.returncode == 0


def test_render_json_shape(tmp_path):
    out = kvtier("render", write(tmp_path, "p.yaml", policy()), "--output", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {"engine", "args", "env", "files", "volumes", "volumeMounts", "resources"} <= set(doc)
    assert doc["engine"] == "vllm" and "engine.yaml" in doc["files"]


def test_render_yaml_args_and_tier_subset(tmp_path):
    path = write(tmp_path, "p.yaml", policy())
    out = kvtier("render", path)
    assert out.returncode == 0 and out.stdout.startswith("# engine.yaml\n")
    assert "TieringOffloadingSpec" in out.stdout
    out = kvtier("render", path, "--tiers", "host")
    assert "TieringOffloadingSpec" not in out.stdout and "CPUOffloadingSpec" in out.stdout
    out = kvtier("render", path, "-o", "args")
    assert out.stdout.startswith("--block-size 16 ") and "--kv-transfer-config '{" in out.stdout


def test_render_errors_are_messages(tmp_path):
    out = kvtier("render", write(tmp_path, "p.yaml", policy(engine=None, backend="lmcache")), "--engine", "trtllm")
    assert out.returncode == 1 and "engine trtllm does not support backend lmcache" in out.stderr
    out = kvtier("render", write(tmp_path, "v.yaml", policy(engine="vllm")), "--engine", "trtllm")
    assert out.returncode == 1 and "--engine trtllm contradicts spec.engine: vllm" in out.stderr
    out = kvtier("render", write(tmp_path, "n.yaml", policy(engine=None)))
    assert out.returncode == 1 and "spec.engine" in out.stderr and "Traceback" not in out.stderr


def test_crd_prints_the_checked_in_crd():
    out = kvtier("crd")
    assert out.returncode == 0
    assert out.stdout == (ROOT / "crds" / "kvtier.io_kvcachepolicies.yaml").read_text()


def test_no_command_prints_help():
    out = kvtier()
    assert out.returncode == 2 and "validate" in out.stdout
