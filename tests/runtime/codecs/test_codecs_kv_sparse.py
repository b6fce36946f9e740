"""int4 with K's outlier channels kept apart (scheme 2: dense-and-sparse): outlier-K chunks stay int4 at about
int4's size and keep attention; blocks written before the scheme decode as they did; bad headers and payloads
are refused with the field named. Scheme 3 is the default int4 now (test_codecs_kv_int4.py); these tests ask for
the previous int4 (``int4_scheme=1``), which a verified scheme 3 encode still falls back to before int8."""
from __future__ import annotations

import dataclasses
import math
import pathlib

import pytest
import torch
from kvtier_runtime.codecs import ATTENTION_BUDGETS, CodecError, KVLayout, decode, get_kv_codec, peek_header
from kvtier_runtime.codecs.header import HEADER_NBYTES, unpack_header
from kvtier_runtime.codecs.kv import SCHEME_SPARSE_K, canonical, sparse_nbytes, to_stage
from plugins.kv_accuracy import attention_cosine, chunk_error

from tests.runtime.codecs.test_codecs_kv import GOAL, make_chunk, roundtrip

V1 = pathlib.Path(__file__).resolve().parents[2] / "data" / "kv-int4-v1"
V1_LAYOUT = dict(num_layers=1, block_tokens=32, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_order="HKTD")


def s2_codec(lay: KVLayout, **kwargs):
    """The previous int4: scheme 1, with K's outlier channels kept apart (scheme 2) when verifying."""
    return get_kv_codec("int4", lay, int4_scheme=1, **kwargs)


def _bytes(path: pathlib.Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def test_blocks_written_before_the_sparse_scheme_decode_exactly_as_they_did():
    lay = KVLayout(**V1_LAYOUT)
    codec = s2_codec(lay)
    for name in ("int4-normal", "int4-outlier"):
        block, expected = _bytes(V1 / f"{name}.block"), _bytes(V1 / f"{name}.decoded")
        out = torch.empty(lay.nbytes, dtype=torch.uint8)
        codec.decode(block, out)
        assert torch.equal(out, expected), name
        assert torch.equal(decode(block).reshape(-1).view(torch.uint8), expected), name
    # a chunk without outlier channels is still written byte for byte as before (scheme 1)
    chunk = _bytes(V1 / "int4-normal.chunk")
    _, blob = roundtrip(codec, chunk)
    assert torch.equal(blob, _bytes(V1 / "int4-normal.block"))
    # the outlier chunk the old codec stored as int8 is now int4 with its 2 outlier channels apart, and smaller
    old = peek_header(_bytes(V1 / "int4-outlier.block"))
    y, blob = roundtrip(codec, _bytes(V1 / "int4-outlier.chunk"))
    header = peek_header(blob)
    assert old.codec == "int8" and old.scheme == 1
    assert header.codec == "int4" and header.scheme == SCHEME_SPARSE_K | 2 << 8 and not header.fallback
    assert blob.numel() < old.total_nbytes
    assert attention_cosine(lay, _bytes(V1 / "int4-outlier.chunk"), y) >= 0.99


OUTLIER_CASES = [  # (outlier scale, outlier channels, offset instead of scale)
    (5.0, 4, False), (20.0, 4, False), (50.0, 4, False), (20.0, 16, False), (20.0, 4, True)]


def _outlier_chunk(lay: KVLayout, seed: int, scale: float, n_out: int, offset: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, lay.num_kv_heads, lay.tokens, lay.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ch = torch.randperm(lay.head_dim, generator=gen)[:n_out]
    if offset:
        k[..., ch] += scale
    else:
        k[..., ch] *= scale
    return make_chunk(lay, k=k, v=v)


@pytest.mark.parametrize("scale,n_out,offset", OUTLIER_CASES)
def test_outlier_k_chunks_stay_int4_at_about_int4_size_and_keep_attention(scale, n_out, offset):
    lay = KVLayout(**GOAL)
    codec = s2_codec(lay)
    plain = s2_codec(lay, sparse_k=False)
    for seed in range(2):
        x = _outlier_chunk(lay, 40 + seed, scale, n_out, offset)
        y, blob = roundtrip(codec, x)
        header = peek_header(blob)
        sparse = header.scheme >> 8
        assert header.codec == "int4" and not header.fallback and sparse == (4 if n_out <= 4 else 16)
        assert blob.numel() / lay.nbytes <= (0.33 if n_out <= 4 else 0.38)
        assert chunk_error(lay, x, y) <= ATTENTION_BUDGETS["int4"]
        assert attention_cosine(lay, x, y, seed=seed) >= 0.99
        assert torch.equal(decode(blob).reshape(-1).view(torch.int16), y.view(torch.int16))
        # without the sparse channels the same chunk falls back to int8 (the check refuses int4)
        assert peek_header(roundtrip(plain, x)[1]).codec == "int8"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("order,outer,pages", [("HKTD", "LP", 1), ("THKD", "PL", 2), ("CPU_VEC", "LP", 2)])
def test_the_channels_kept_apart_decode_exactly_in_every_dtype_and_order(dtype, order, outer, pages):
    lay = KVLayout(num_layers=2, block_tokens=64, num_kv_heads=2, head_dim=64, dtype=dtype, page_order=order,
                   pages=pages, outer=outer)
    codec = s2_codec(lay)
    x = make_chunk(lay, seed=7, outlier=20.0, n_outliers=4)
    y, blob = roundtrip(codec, x)
    header = peek_header(blob)
    assert header.codec == "int4" and header.scheme >> 8 == 4
    assert attention_cosine(lay, x, y) >= 0.99
    # the 4 largest K channels of every (layer, head, page) come back bit for bit; the rest as int4
    stage = lay.stage_layout
    kx = canonical(stage, to_stage(lay, x), lay.num_layers)[:, 0]
    ky = canonical(stage, to_stage(lay, y), lay.num_layers)[:, 0]
    top = kx.float().abs().amax(dim=3).topk(4, dim=3).indices
    idx = top.unsqueeze(3).expand(*top.shape[:3], lay.block_tokens, 4)
    assert torch.equal(kx.gather(4, idx), ky.gather(4, idx))
    assert not torch.equal(kx, ky)


def test_the_sampled_check_gives_the_full_checks_verdict_on_sparse_chunks():
    lay = KVLayout(**{**GOAL, "num_kv_heads": 4})
    sampled, full = s2_codec(lay), s2_codec(lay, verify_sample=1)
    for i, (scale, n_out) in enumerate([(5.0, 4), (20.0, 4), (20.0, 16), (20.0, 24), (3.5, 4)]):
        x = make_chunk(lay, seed=60 + i, outlier=scale, n_outliers=n_out)
        y, blob = roundtrip(sampled, x)
        _, blob_full = roundtrip(full, x)
        assert peek_header(blob).codec == peek_header(blob_full).codec, (scale, n_out)
        assert attention_cosine(lay, x, y, seed=i) >= 0.99, (scale, n_out)
        # 24 outlier channels are more than int4 keeps apart (head_dim / 8): that chunk falls back
        assert (peek_header(blob).codec == "int8") == (n_out == 24), (scale, n_out)


def test_normal_chunks_and_unverified_encodes_are_written_as_before():
    lay = KVLayout(**GOAL)
    x = make_chunk(lay, seed=3)
    _, blob = roundtrip(s2_codec(lay), x)
    _, plain = roundtrip(s2_codec(lay, sparse_k=False), x)
    assert torch.equal(blob, plain) and peek_header(blob).scheme == 1
    # without the check nothing decides whether channels should go apart: the chunk is stored as asked
    _, blob = roundtrip(s2_codec(lay, verify=False), make_chunk(lay, seed=3, outlier=20.0))
    assert peek_header(blob).scheme == 1


def test_non_finite_values_in_a_sparse_chunk_keep_its_bytes():
    lay = KVLayout(num_layers=1, block_tokens=64, num_kv_heads=2, head_dim=32, dtype="bfloat16")
    x = make_chunk(lay, seed=8, outlier=20.0)
    x[-3] = math.nan                                       # a V value
    y, blob = roundtrip(s2_codec(lay), x)
    assert peek_header(blob).codec == "none" and torch.equal(y.view(torch.int16), x.view(torch.int16))


def _sparse_block() -> tuple[KVLayout, torch.Tensor]:
    lay = KVLayout(num_layers=1, block_tokens=32, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    _, blob = roundtrip(s2_codec(lay), make_chunk(lay, seed=9, outlier=20.0, n_outliers=2))
    assert peek_header(blob).scheme == SCHEME_SPARSE_K | 2 << 8
    return lay, blob.clone()


def _with_header(blob: torch.Tensor, **fields) -> torch.Tensor:
    header = dataclasses.replace(unpack_header(blob[:HEADER_NBYTES].numpy().tobytes()), **fields)
    out = blob.clone()
    out[:HEADER_NBYTES] = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    return out


@pytest.mark.parametrize("fields,message", [
    ({"scheme": SCHEME_SPARSE_K}, "1 to head_dim / 2"),                       # no channels
    ({"scheme": SCHEME_SPARSE_K | 9 << 8}, "1 to head_dim / 2"),              # head_dim 16: at most 8
    ({"scheme": SCHEME_SPARSE_K | 255 << 8}, "1 to head_dim / 2"),
    ({"scheme": 1 | 2 << 8}, "header.scheme"),                                # scheme 1 has no channels
    ({"scheme": 4}, "header.scheme"),                                         # (3 is int4's scheme 3)
    ({"scheme": SCHEME_SPARSE_K | 4 << 8}, "header.payload_nbytes"),          # a size that does not match
    ({"codec": "int8"}, "int4's"),
])
def test_bad_sparse_headers_are_refused_before_anything_is_allocated(fields, message):
    lay, blob = _sparse_block()
    bad = _with_header(blob, **fields)
    with pytest.raises(CodecError, match=message):
        s2_codec(lay).decode(bad, torch.empty(lay.nbytes, dtype=torch.uint8))
    with pytest.raises(CodecError, match=message):
        decode(bad)


def test_a_sparse_channel_index_outside_the_head_is_refused():
    lay, blob = _sparse_block()
    header = peek_header(blob)
    dense = header.payload_nbytes - sparse_nbytes(lay, 2)
    at = HEADER_NBYTES + dense                               # the first int32 index
    for bad in (16, -1, 1 << 30):
        corrupt = blob.clone()
        corrupt[at:at + 4] = torch.tensor([bad], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(CodecError, match="sparse K channel index is outside head_dim 16"):
            s2_codec(lay).decode(corrupt, torch.empty(lay.nbytes, dtype=torch.uint8))


def test_sparse_k_must_be_a_bool():
    with pytest.raises(CodecError, match="sparse_k"):
        s2_codec(KVLayout(**GOAL), sparse_k=1)  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sparse_k_chunks_encode_on_cuda_and_decode_alike_on_either_device():
    lay = KVLayout(**GOAL)
    x = make_chunk(lay, seed=12, outlier=20.0)
    codec = s2_codec(lay)
    out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8, device="cuda")
    n = codec.encode(x.cuda(), out)
    assert peek_header(out[:n]).scheme == SCHEME_SPARSE_K | 4 << 8
    y_gpu = torch.empty(lay.numel, dtype=x.dtype, device="cuda")
    codec.decode(out[:n], y_gpu)
    y_cpu = torch.empty_like(x)
    codec.decode(out[:n].cpu(), y_cpu)
    assert torch.equal(y_gpu.cpu().view(torch.int16), y_cpu.view(torch.int16))
    assert attention_cosine(lay, x, y_cpu) >= 0.99
