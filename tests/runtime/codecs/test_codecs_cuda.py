"""Codecs on CUDA tensors. Marked ``cuda`` and skipped without a CUDA device (none in CI or on the dev machine;
run them on a lent GPU with ``pytest -m cuda tests/runtime/codecs/test_codecs_cuda.py``)."""
from __future__ import annotations

import pytest
import torch
from kvtier_runtime.codecs import ERROR_BUDGETS, CodecError, decode, get_codec, peek_header
from kvtier_runtime.config import CODECS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(16, 8, 128), (3, 7, 5), (1,), (0, 4), (1000, 33), (4096, 8, 128)]


def normal(shape, dtype, device="cuda"):
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def rel_err(x, y):
    x, y = x.double().cpu(), y.double().cpu()
    n = x.norm().item()
    return (x - y).norm().item() / n if n else (x - y).norm().item()


def roundtrip(codec, x):
    out = torch.empty(codec.max_encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8, device=x.device)
    n = codec.encode(x, out)
    return out[:n], decode(out[:n])


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_round_trip(name, dtype, shape):
    x = normal(shape, dtype)
    buf, y = roundtrip(get_codec(name), x)
    assert buf.is_cuda and y.is_cuda and y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    if name == "none":
        assert torch.equal(x, y)
    elif x.numel():
        assert rel_err(x, y) <= ERROR_BUDGETS[name]


@pytest.mark.parametrize("name", [c for c in CODECS if c != "none"])
def test_blocks_move_between_cuda_and_cpu(name):
    """A block encoded on the GPU is read back on the host (and the reverse): same format, same values."""
    x = normal((64, 8, 128), torch.bfloat16)
    codec = get_codec(name)
    gpu_buf, _ = roundtrip(codec, x)
    cpu_buf, _ = roundtrip(codec, x.cpu())
    y_from_gpu_on_cpu = decode(gpu_buf.cpu())
    y_from_cpu_on_gpu = decode(cpu_buf.cuda())
    assert rel_err(x, y_from_gpu_on_cpu) <= ERROR_BUDGETS[name]
    assert rel_err(x, y_from_cpu_on_gpu) <= ERROR_BUDGETS[name]
    # identical IEEE arithmetic on both devices: the codes should agree (all but rounding-boundary cases)
    same = (gpu_buf.cpu() == cpu_buf).float().mean().item()
    assert same > 0.999


@pytest.mark.parametrize("name", CODECS)
def test_cuda_extremes_stay_finite(name):
    for dtype in DTYPES:
        fi = torch.finfo(dtype)
        x = torch.tensor([[fi.max, -fi.max, fi.tiny, 0.0] * 8, [0.0] * 32], dtype=dtype, device="cuda")
        _, y = roundtrip(get_codec(name, group_size=16 if name != "none" else None), x)
        assert torch.isfinite(y).all()


def test_cuda_fallback_and_header_checks():
    x = 0.5 * torch.sign(torch.randn(64, 32, device="cuda"))
    x[:, 0] = 8.0
    buf, y = roundtrip(get_codec("int4", fallback=True), x)
    assert peek_header(buf).fallback and rel_err(x, y) <= ERROR_BUDGETS[peek_header(buf).codec]
    bad = buf.clone()
    bad[7] ^= 1
    with pytest.raises(CodecError, match="header"):
        decode(bad)
    with pytest.raises(CodecError, match="out: on cpu"):
        decode(buf, out=torch.empty(64, 32))


def test_cuda_scratch_is_reused():
    codec = get_codec("int4")
    x = normal((1024, 8, 128), torch.float16)
    out = torch.empty(codec.encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(x)
    codec.encode(x, out)
    decode(out, out=dst)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(5):
        codec.encode(x, out)
        decode(out, out=dst)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 4096   # small per-call tensors only (0-d results)


def test_cuda_verified_kv_chunks_get_the_cpu_verdicts_and_bytes():
    """The verifying KV codec on CUDA (its sampled check indexes the chunk's own device): the same stored codec
    as on CPU wherever the check's error is not within 1% of the budget (CUDA's matmuls round differently), and
    the same fp8 bytes (fp8 codes are integer passes)."""
    from kvtier_runtime.codecs import ATTENTION_BUDGETS, KVLayout, get_kv_codec
    from plugins.kv_accuracy import reference_check_error

    from tests.runtime.codecs.test_codecs_kv import GOAL
    from tests.runtime.codecs.test_codecs_kv import roundtrip as kv_roundtrip
    from tests.runtime.codecs.test_codecs_verdicts import chunks

    lay = KVLayout(**GOAL)
    on_cpu, on_gpu, plain = get_kv_codec("fp8", lay), get_kv_codec("fp8", lay), get_kv_codec("fp8", lay, verify=False)
    budget = ATTENTION_BUDGETS["fp8"]
    for phase, (label, x) in enumerate(chunks(lay)):
        out_cpu = torch.empty(on_cpu.max_encoded_nbytes(), dtype=torch.uint8)
        out_gpu = torch.empty(on_gpu.max_encoded_nbytes(), dtype=torch.uint8, device="cuda")
        n_cpu, n_gpu = on_cpu.encode(x, out_cpu), on_gpu.encode(x.cuda(), out_gpu)
        stored_cpu, stored_gpu = peek_header(out_cpu[:n_cpu]).codec, peek_header(out_gpu[:n_gpu].cpu()).codec
        err = reference_check_error(lay, x, kv_roundtrip(plain, x)[0], phase)
        if abs(err - budget) > 0.01 * budget:
            assert stored_gpu == stored_cpu, (label, err, stored_cpu, stored_gpu)
        if stored_gpu == stored_cpu == "fp8":
            assert torch.equal(out_gpu[:n_gpu].cpu(), out_cpu[:n_cpu]), label


def test_cuda_int4_scheme_3_on_real_kv_decodes_on_either_device():
    """int4 scheme 3 (Hadamard matmuls, sinks) on CUDA, on the real SmolLM2 chunk with a sink: stored as scheme 3
    with its sink, and the CUDA block decodes on CPU to what it decodes to on CUDA, close to the CPU encode's."""
    from kvtier_runtime.codecs import get_kv_codec
    from plugins.kv_accuracy import attention_cosine

    from tests.runtime.codecs.test_codecs_kv_int4 import LAY, real

    x = real("start")
    codec = get_kv_codec("int4", LAY)
    out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8, device="cuda")
    n = codec.encode(x.cuda(), out)
    header = peek_header(out[:n].cpu())
    assert header.codec == "int4" and header.scheme == 3 | 1 << 8 | 5 << 16
    on_gpu = torch.empty(LAY.numel, dtype=torch.bfloat16, device="cuda")
    codec.decode(out[:n], on_gpu)
    on_cpu = torch.empty(LAY.numel, dtype=torch.bfloat16)
    codec.decode(out[:n].cpu(), on_cpu)
    assert torch.allclose(on_gpu.cpu().float(), on_cpu.float(), rtol=1e-2, atol=1e-3)
    assert attention_cosine(LAY, x, on_cpu) >= 0.995
