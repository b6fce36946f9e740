"""Codec round trips, headers, corruption and range handling (CPU; CUDA variants in test_codecs_cuda.py)."""
from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys
import zlib

import pytest
import torch
from kvtier_runtime.codecs import (
    ERROR_BUDGETS,
    HEADER_NBYTES,
    STATS,
    CodecError,
    CodecMetricsCollector,
    add_fallback_listener,
    decode,
    get_codec,
    peek_header,
    remove_fallback_listener,
)
from kvtier_runtime.config import CODECS

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ODD_SHAPES = [(16, 8, 128), (3, 7, 5), (1,), (0, 4), (), (1000, 33), (2, 3, 1, 97)]


def kv_normal(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def kv_outliers(shape, dtype, seed=0):
    """Normal data where a few channels of the last dim carry 10-100x magnitude, as real K caches do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    d = shape[-1]
    chans = torch.randperm(d, generator=g)[: max(1, d // 32)]
    mags = 10 + 90 * torch.rand(len(chans), generator=g)
    x[..., chans] *= mags
    return x.to(dtype)


def rel_err(x, y):
    x, y = x.double(), y.double()
    n = x.norm().item()
    return (x - y).norm().item() / n if n else (x - y).norm().item()


def roundtrip(codec, x):
    out = torch.empty(codec.max_encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    n = codec.encode(x, out)
    return out[:n], decode(out[:n])


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_round_trip_every_codec_dtype_and_odd_shape(name, dtype, shape):
    codec = get_codec(name)
    x = kv_normal(shape, dtype) if shape != () else torch.tensor(-1.25, dtype=dtype)
    n_expected = codec.encoded_nbytes(x.shape, x.dtype)
    buf, y = roundtrip(codec, x)
    assert buf.numel() == n_expected
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    if name == "none":
        assert torch.equal(y, x)
    elif x.numel():
        assert rel_err(x, y) <= ERROR_BUDGETS[name]
    header = peek_header(buf)
    assert (header.codec, header.dtype, header.shape) == (name, dtype, tuple(x.shape))


@pytest.mark.parametrize("name", [c for c in CODECS if c != "none"])
@pytest.mark.parametrize("kind", [kv_normal, kv_outliers])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_within_budget_on_normal_and_outlier_data(name, kind, dtype):
    x = kind((64, 8, 128), dtype, seed=3)
    _, y = roundtrip(get_codec(name), x)
    err = rel_err(x, y)
    assert 0 < err <= ERROR_BUDGETS[name], f"{name} {kind.__name__}: {err:.4f}"


def test_compression_ratios_match_the_layout():
    shape, dt = (16, 8, 128), torch.float16
    raw = 16 * 8 * 128 * 2
    sizes = {name: get_codec(name).encoded_nbytes(shape, dt) - HEADER_NBYTES for name in CODECS}
    assert sizes["none"] == raw
    assert sizes["fp8"] == raw // 2 + 4 * (16 * 8 * 128 // 128)
    assert sizes["int8"] == raw // 2 + 4 * (16 * 8 * 128 // 128)
    assert sizes["int4"] == raw // 4 + 4 * (16 * 8 * 128 // 32)
    assert get_codec("int8", scales="channel").encoded_nbytes(shape, dt) - HEADER_NBYTES == raw // 2 + 4 * 128


def test_blocks_written_under_one_codec_decode_after_a_switch():
    x = kv_normal((4, 8, 64), torch.bfloat16)
    blocks = {}
    for name in CODECS:  # the "policy" switches codec between writes
        out = torch.empty(get_codec(name).encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
        get_codec(name, group_size=None).encode(x, out)
        blocks[name] = bytes(out.numpy())
    for name, raw in blocks.items():  # the reader has no idea which codec is configured now
        assert peek_header(raw).codec == name
        y = decode(raw)
        assert rel_err(x, y) <= ERROR_BUDGETS[name]
        y2 = decode(memoryview(raw), out=torch.empty_like(x))
        assert torch.equal(y, y2)


def test_group_size_travels_in_the_header():
    x = kv_normal((8, 96), torch.float16)
    for g in (2, 6, 96, 1000):
        buf, y = roundtrip(get_codec("int4", group_size=g), x)
        assert peek_header(buf).group_size == g
        assert rel_err(x, y) <= ERROR_BUDGETS["int4"]


@pytest.mark.parametrize("name", ["int8", "int4"])   # fp8 is a float: a group's outlier costs it little
def test_per_channel_scales_beat_groups_on_outlier_channels(name):
    x = kv_outliers((256, 128), torch.float32, seed=5)
    buf, y_chan = roundtrip(get_codec(name, scales="channel"), x)
    assert peek_header(buf).per_channel and peek_header(buf).group_size == 0
    small = x.abs().amax(0) < 8  # the ordinary channels
    _, y_group = roundtrip(get_codec(name, group_size=128), x)
    assert rel_err(x[:, small], y_chan[:, small]) < rel_err(x[:, small], y_group[:, small]) / 2
    assert rel_err(x, y_chan) <= ERROR_BUDGETS[name]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 8, 128), (3, 10), (1, 2), (0, 4), (1000, 6)])
def test_per_channel_round_trips(dtype, shape):
    for name in ("fp8", "int8", "int4"):
        x = kv_normal(shape, dtype)
        codec = get_codec(name, scales="channel")
        buf, y = roundtrip(codec, x)
        assert buf.numel() == codec.encoded_nbytes(x.shape, x.dtype)
        assert y.shape == x.shape and torch.isfinite(y).all()
        if x.numel():
            assert rel_err(x, y) <= ERROR_BUDGETS[name]


def test_int4_per_channel_needs_an_even_last_dim():
    with pytest.raises(CodecError, match=r"src: shape \(4, 5\): int4 with scales='channel' needs an even"):
        get_codec("int4", scales="channel").encode(torch.zeros(4, 5), torch.empty(4096, dtype=torch.uint8))


# ---- headers: corrupt, foreign, truncated --------------------------------------------------------------------

def _encoded(name="int4"):
    x = kv_normal((4, 32), torch.float16)
    out = torch.empty(get_codec(name).encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    get_codec(name).encode(x, out)
    return bytearray(out.numpy().tobytes())


@pytest.mark.parametrize("offset", range(0, HEADER_NBYTES, 5))
def test_any_flipped_header_byte_is_rejected(offset):
    raw = _encoded()
    raw[offset] ^= 0x40
    with pytest.raises(CodecError, match=r"header"):
        decode(bytes(raw))


def test_foreign_and_truncated_buffers_are_rejected_with_the_field_named():
    before = STATS.snapshot()["kvtier_runtime_codec_decode_errors_total"]
    with pytest.raises(CodecError, match="magic"):
        decode(b"\x89PNG" + bytes(200))
    with pytest.raises(CodecError, match=r"header: 10 bytes"):
        decode(bytes(10))
    raw = _encoded()
    with pytest.raises(CodecError, match="truncated"):
        decode(bytes(raw[:-1]))
    assert STATS.snapshot()["kvtier_runtime_codec_decode_errors_total"] == before + 3


def _rewrite(raw: bytearray, offset: int, fmt: str, value) -> bytes:
    """Change a header field and re-seal its CRC: a header a future or buggy writer could produce."""
    struct.pack_into(fmt, raw, offset, value)
    struct.pack_into("<I", raw, 92, zlib.crc32(bytes(raw[:92])))
    return bytes(raw)


@pytest.mark.parametrize("offset,fmt,value,field", [
    (4, "<B", 2, "header.version"),
    (5, "<B", 99, "header.codec"),
    (6, "<B", 7, "header.codec_version"),
    (7, "<B", 9, "header.dtype"),
    (8, "<B", 9, "header.ndim"),
    (9, "<B", 0x80, "header.flags"),
    (12, "<I", 31, "header.payload_nbytes"),   # int4 group size changed: the payload length no longer fits
    (12, "<I", 0, "header.group_size"),
    (16, "<Q", 5, "header.payload_nbytes"),
    (24, "<Q", 5, "header.payload_nbytes"),    # shape changed
])
def test_consistent_but_invalid_headers_are_rejected(offset, fmt, value, field):
    with pytest.raises(CodecError, match=field.replace(".", r"\.")):
        decode(_rewrite(_encoded(), offset, fmt, value))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("offset,fmt,value", [
    (16, "<Q", 5),           # payload length
    (24, "<Q", 1 << 40),     # first dimension: would allocate terabytes
    (32, "<Q", 31),          # second dimension
])
def test_a_payload_length_that_does_not_fit_the_shape_is_rejected_by_every_codec(name, offset, fmt, value):
    raw = _rewrite(_encoded(name), offset, fmt, value)
    with pytest.raises(CodecError, match=r"header\.payload_nbytes"):
        decode(raw + bytes(64))


def test_decode_out_must_match_the_block():
    raw = bytes(_encoded())
    with pytest.raises(CodecError, match=r"out: \(4, 31\)"):
        decode(raw, out=torch.empty(4, 31, dtype=torch.float16))
    with pytest.raises(CodecError, match="out: .*float32"):
        decode(raw, out=torch.empty(4, 32, dtype=torch.float32))
    with pytest.raises(CodecError, match="contiguous"):
        decode(raw, out=torch.empty(32, 4, dtype=torch.float16).t())


# ---- argument validation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(name="zstd"), "codec: 'zstd' is not one of"),
    (dict(name="int4", group_size=31), "group_size: 31 must be even"),
    (dict(name="int8", group_size=0), "group_size: 0 must be a positive integer"),
    (dict(name="fp8", group_size="128"), "group_size: '128' must be"),
    (dict(name="none", group_size=64), "group_size: codec 'none' has no groups"),
    (dict(name="int8", scales="row"), "scales: 'row' is not one of"),
    (dict(name="int8", fallback="yes"), "fallback: 'yes' must be a bool"),
])
def test_bad_options_name_the_option(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(CodecError, match=match):
        get_codec(name, **kwargs)


def test_bad_encode_arguments_are_rejected():
    codec = get_codec("fp8")
    x = kv_normal((8, 128), torch.float16)
    with pytest.raises(CodecError, match="out: 10 bytes, codec 'fp8' needs"):
        codec.encode(x, torch.empty(10, dtype=torch.uint8))
    with pytest.raises(CodecError, match="out: must be a 1-D torch.uint8"):
        codec.encode(x, torch.empty(4096, dtype=torch.int8))
    with pytest.raises(CodecError, match="src: must be contiguous"):
        codec.encode(x.t(), torch.empty(4096, dtype=torch.uint8))
    with pytest.raises(CodecError, match="dtype: torch.int32"):
        codec.encode(x.int(), torch.empty(4096, dtype=torch.uint8))


# ---- range: no NaN/inf from finite input ---------------------------------------------------------------------

@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_finite_values_never_become_nan_or_inf(name, dtype):
    fi = torch.finfo(dtype)
    x = torch.tensor([[fi.max, -fi.max, fi.tiny, 0.0, 1e-3, -fi.max / 3] * 8,
                      [0.0] * 48, [fi.tiny] * 48, [fi.max] * 48], dtype=dtype)
    _, y = roundtrip(get_codec(name, group_size=16 if name != "none" else None), x)
    assert torch.isfinite(y).all(), y
    # values at the top of the range survive (within the codec's rounding)
    assert rel_err(x[3], y[3]) <= ERROR_BUDGETS[name]


@pytest.mark.parametrize("name,fmax", [("fp8", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_saturates_instead_of_producing_nan_or_inf(name, fmax):
    codec = get_codec(name, group_size=4)
    x = torch.tensor([1.0, 3.0, -7.0, 7.0000005], dtype=torch.float32)
    buf, y = roundtrip(codec, x)
    codes = buf[HEADER_NBYTES + 4:].view(codec.fp8_dtype).float()
    assert torch.isfinite(codes).all() and codes.abs().max() <= fmax
    assert torch.isfinite(y).all()
    # The kernel itself clamps: scaled values past the format's max (e5m2 would cast 1e6 to inf, e4m3 to NaN
    # or saturation depending on the backend) come out as +-fmax.
    big = torch.tensor([[1e6, -1e6, 1e9, 0.5]]) * codec.pre_scale
    out_codes = torch.empty(1, 4, dtype=torch.uint8)
    codec._quantize(big, out_codes)
    decoded = out_codes.view(codec.fp8_dtype).float()
    assert decoded.tolist() == [[fmax, -fmax, fmax, 0.5]]


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_fp8_bit_level_encode_and_decode_agree_with_torch_casts(name):
    """The codecs round and widen fp8 in int16 lanes (faster than torch's casts on CPU); the codes must be the
    ones torch's cast produces except near ties: rounding goes through fp16 first, so a value within an fp16
    rounding of an fp8 midpoint rounds away from zero, at most an fp16 ulp worse than torch's choice."""
    codec = get_codec(name)
    fmax = codec.qmax
    g = torch.Generator().manual_seed(7)
    a = torch.cat([torch.randn(1 << 16, generator=g) * fmax / 4, torch.rand(4096, generator=g) * 2 ** -8,
                   torch.tensor([fmax, -fmax, 0.0, -0.0])]).clamp(-fmax, fmax).view(1, -1)
    ours = torch.empty(a.shape, dtype=torch.uint8)
    codec._quantize((a * codec.pre_scale).clone(), ours)
    ref = a.to(codec.fp8_dtype)
    ours_v, ref_v = ours.view(codec.fp8_dtype).float(), ref.float()
    differ = ours_v != ref_v
    assert differ.float().mean() < 1e-2
    assert (ours_v[differ].abs() > ref_v[differ].abs()).all()   # away from zero
    av = a[differ]
    fp16_rounding = torch.maximum(av.abs() * 2.0 ** -10, torch.tensor(2.0 ** -24 / codec.pre_scale))
    assert ((ours_v[differ] - av).abs() <= (ref_v[differ] - av).abs() + fp16_rounding).all()
    # decode: bit tricks vs torch's fp8 -> float cast, with scale 1
    back = torch.empty(a.shape)
    codec._dequantize(ref.view(torch.uint8), torch.ones(1, 1), back)
    assert torch.equal(back, ref_v)


# ---- fallback and metrics ------------------------------------------------------------------------------------

def spiky_groups(rows=64, group=32):
    """Each group: one value 8, the rest +-0.5. Under int4 the step is 8/7, so every +-0.5 rounds to 0: a
    relative L2 error of about 0.33, well over int4's budget and trivial for int8."""
    x = 0.5 * torch.sign(torch.randn(rows, group, generator=torch.Generator().manual_seed(1)))
    x[:, 0] = 8.0
    return x


def test_over_budget_block_falls_back_to_a_wider_codec_and_is_counted():
    x = spiky_groups()
    seen = []
    listener = lambda req, used, err: seen.append((req, used, err))
    add_fallback_listener(listener)
    try:
        before = dict(STATS.snapshot()["kvtier_runtime_codec_fallbacks_total"])
        codec = get_codec("int4", fallback=True)
        buf, y = roundtrip(codec, x)
    finally:
        remove_fallback_listener(listener)
    header = peek_header(buf)
    assert header.fallback and header.requested_codec == "int4" and header.codec in ("int8", "none")
    assert rel_err(x, y) <= ERROR_BUDGETS[header.codec]
    after = STATS.snapshot()["kvtier_runtime_codec_fallbacks_total"]
    assert after.get(("int4", "int8"), 0) == before.get(("int4", "int8"), 0) + 1
    assert seen and seen[0][0] == "int4" and seen[0][2] > ERROR_BUDGETS["int4"]
    # without fallback the same block is stored as int4, over budget: the check is what made the difference
    _, y_plain = roundtrip(get_codec("int4"), x)
    assert rel_err(x, y_plain) > ERROR_BUDGETS["int4"]


def test_fallback_needs_room_for_the_wider_codec():
    x = spiky_groups()
    codec = get_codec("int4", fallback=True)
    out = torch.empty(codec.encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    assert codec.max_encoded_nbytes(x.shape, x.dtype) > out.numel()
    with pytest.raises(CodecError, match="out: .* codec 'int8' needs"):
        codec.encode(x, out)


def test_in_budget_blocks_do_not_fall_back():
    x = kv_normal((64, 8, 128), torch.float16)
    for name in ("fp8", "fp8_e5m2", "int8", "int4"):
        buf, _ = roundtrip(get_codec(name, fallback=True), x)
        assert not peek_header(buf).fallback and peek_header(buf).codec == name


def test_prometheus_collector_exports_kvtier_runtime_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(CodecMetricsCollector())
    roundtrip(get_codec("int8"), kv_normal((8, 128), torch.float16))
    text = generate_latest(registry).decode()
    assert 'kvtier_runtime_codec_blocks_total{codec="int8"}' in text
    assert "kvtier_runtime_codec_fallbacks_total" in text or "# TYPE kvtier_runtime_codec_fallbacks counter" in text
    assert "kvtier_runtime_codec_decode_errors_total" in text


# ---- allocation discipline and import hygiene ----------------------------------------------------------------

def test_scratch_is_reused_not_regrown_across_calls():
    codec = get_codec("int4")
    x = kv_normal((256, 8, 128), torch.float16)
    out = torch.empty(codec.encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    dst = torch.empty_like(x)
    codec.encode(x, out)
    decode(out, out=dst)
    from kvtier_runtime.codecs.registry import _decoder

    held = codec._scratch.nbytes() + _decoder("int4")._scratch.nbytes()
    for _ in range(3):
        codec.encode(x, out)
        decode(out, out=dst)
    assert codec._scratch.nbytes() + _decoder("int4")._scratch.nbytes() == held
    # chunked: scratch is bounded by the chunk size, not the block: a block 4x larger needs no more
    x4 = kv_normal((4 * 256, 8, 128), torch.float16)
    out4 = torch.empty(codec.encoded_nbytes(x4.shape, x4.dtype), dtype=torch.uint8)
    codec.encode(x4, out4)
    decode(out4, out=torch.empty_like(x4))
    assert codec._scratch.nbytes() + _decoder("int4")._scratch.nbytes() == held


RUNTIME_SRC = str(pathlib.Path(__file__).resolve().parents[3] / "runtime")


def test_runtime_package_import_stays_torch_free():
    code = "import sys, kvtier_runtime, kvtier_runtime.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": RUNTIME_SRC})


def test_codecs_package_does_not_import_kubernetes_or_kopf():
    code = ("import sys, kvtier_runtime.codecs; "
            "assert not {'kopf', 'kubernetes'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": RUNTIME_SRC})


# ---- torch.compile'd fp8 encoding ----------------------------------------------------------------------------

def test_compile_option_is_validated_and_only_used_where_it_pays():
    with pytest.raises(CodecError, match="compile: 'yes' must be a bool"):
        get_codec("fp8", compile="yes")
    assert get_codec("int4", compile=True).compiled_kernels is None
    assert get_codec("fp8", scales="channel", compile=True).compiled_kernels is None
    assert get_codec("fp8", compile=True).compiled_kernels is not None


@pytest.mark.slow
def test_compiled_fp8_encoding_compiles_off_the_hot_path_and_writes_the_same_format():
    import time

    x = kv_normal((8, 8, 128), torch.bfloat16)   # one chunk of 64 groups of 128
    codec, eager = get_codec("fp8", compile=True), get_codec("fp8")
    out = torch.empty(codec.encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
    ref = torch.empty_like(out)
    eager.encode(x, ref)
    t0 = time.perf_counter()
    codec.encode(x, out)          # queues the compile, encodes eagerly meanwhile
    assert time.perf_counter() - t0 < 2.0 and codec.compiled_kernels.calls == 0
    assert torch.equal(out, ref)
    deadline = time.monotonic() + 300
    while codec.compiled_kernels.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        codec.encode(x, out)
    assert codec.compiled_kernels.failed is None and codec.compiled_kernels.calls > 0
    y = decode(out)
    assert rel_err(x, y) <= ERROR_BUDGETS["fp8"]
    # torch's cast rounds ties to even, the eager bit path away from zero: nearly every byte agrees
    assert (out == ref).float().mean() > 0.99


def test_one_codec_shared_by_many_threads_gives_each_block_its_own_bytes():
    """The filesystem tier encodes from n_write_threads threads with one codec: scratch is per thread."""
    from concurrent.futures import ThreadPoolExecutor

    codec = get_codec("int4", fallback=True)
    blocks = [kv_normal((64, 8, 128), torch.float16, seed=s) for s in range(16)]
    expected = []
    for x in blocks:
        out = torch.empty(codec.max_encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
        expected.append(out[:codec.encode(x, out)].clone())

    def work(i: int) -> bool:
        x = blocks[i % len(blocks)]
        out = torch.empty(codec.max_encoded_nbytes(x.shape, x.dtype), dtype=torch.uint8)
        n = codec.encode(x, out)
        y = decode(out[:n])
        return torch.equal(out[:n], expected[i % len(blocks)]) and torch.equal(y, decode(expected[i % len(blocks)]))

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(work, range(64)))
