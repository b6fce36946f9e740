"""int4 scheme 3 (``codecs/kv_int4.py``) on a trained model's real KV: the chunks of ``tests/data/kv-smollm2``
(SmolLM2-135M-Instruct on "Pride and Prejudice", four layers, 32 tokens; ``make_fixture.py`` says how they were
made). The codec's verdicts on them, why scheme 3 replaced schemes 1 and 2 there, the format pinned byte for
byte, and bad scheme 3 headers and payloads refused with the field named."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
from kvtier_runtime.codecs import CodecError, KVLayout, decode, get_kv_codec, kv_int4, peek_header
from kvtier_runtime.codecs.header import HEADER_NBYTES, unpack_header
from kvtier_runtime.codecs.kv import canonical
from plugins.kv_accuracy import attention_cosine, chunk_error

from tests.runtime.codecs.test_codecs_kv import make_chunk, roundtrip

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "kv-smollm2"
META = json.loads((DATA / "layout.json").read_text())
LAY = KVLayout(**META["layout"])


def _bytes(name: str) -> torch.Tensor:
    return torch.frombuffer(bytearray((DATA / name).read_bytes()), dtype=torch.uint8)


def real(name: str) -> torch.Tensor:
    return _bytes(f"{name}.chunk").view(torch.bfloat16)


def test_the_fixture_is_real_kv_with_a_sink_in_its_first_chunk():
    start, late = real("start"), real("late")
    assert start.numel() == late.numel() == LAY.numel and bool(torch.isfinite(start.float()).all())
    # the first token's V is tiny in most (layer, head) pairs: the attention sink; no later token is
    assert kv_int4.find_sinks(LAY, start).tolist() == [0]
    assert kv_int4.find_sinks(LAY, late).tolist() == []
    # K has offset channels: a channel whose mean is many times its spread (why K gets a range per channel)
    k = canonical(LAY, start.float(), LAY.num_layers)[:, 0].flatten(2, 3)     # [L, H, N, D]
    assert float((k.mean(dim=2).abs() / k.std(dim=2)).max()) > 4


@pytest.mark.parametrize("name", ["start", "late"])
def test_verified_int4_keeps_real_chunks_as_int4_at_a_third_of_the_bytes(name):
    x = real(name)
    codec = get_kv_codec("int4", LAY)
    y, blob = roundtrip(codec, x)
    header = peek_header(blob)
    assert header.codec == "int4" and header.scheme & 0xFF == 3 and not header.fallback
    sinks = (header.scheme >> 8) & 0xFF
    assert sinks == (1 if name == "start" else 0)
    # 32-token chunks: 5-bit K with one range per channel, 4.5-bit V: 0.359 of raw, plus the exact sink token
    assert len(blob) / LAY.nbytes <= 0.36 + sinks / LAY.tokens * 0.51
    assert attention_cosine(LAY, x, y) >= 0.995
    # the sink comes back exactly, every layer, head, K and V
    if sinks:
        cx, cy = canonical(LAY, x, LAY.num_layers), canonical(LAY, y, LAY.num_layers)
        assert torch.equal(cx[:, :, :, 0, 0], cy[:, :, :, 0, 0])


def test_on_real_kv_scheme_3_errs_less_than_the_previous_int4():
    """Why scheme 3 is the default: on the first chunk (sink included) the previous int4's check error is several
    times scheme 3's; both unverified, so each is the codec alone."""
    x = real("start")
    new, _ = roundtrip(get_kv_codec("int4", LAY, verify=False), x)
    old, _ = roundtrip(get_kv_codec("int4", LAY, verify=False, int4_scheme=1), x)
    e_new, e_old = chunk_error(LAY, x, new), chunk_error(LAY, x, old)
    assert e_new < 0.6 * e_old, (e_new, e_old)


@pytest.mark.parametrize("codec_name", ["fp8", "int8"])
def test_eight_bit_verdicts_on_real_chunks(codec_name):
    """fp8 (e4m3) is over its budget on real K's offset channels and stored as int8 (the same bytes); int8 keeps
    them as int8."""
    for name in ("start", "late"):
        y, blob = roundtrip(get_kv_codec(codec_name, LAY), real(name))
        assert peek_header(blob).codec == "int8"
        assert attention_cosine(LAY, real(name), y) >= 0.999


def test_scheme_3_blocks_decode_byte_for_byte_as_when_they_were_written():
    block, expected = _bytes("int4-sink.block"), _bytes("int4-sink.decoded")
    header = peek_header(block)
    assert header.scheme == 3 | 1 << 8 | 5 << 16 and header.group_size == 32 | 32 << 16
    out = torch.empty(LAY.nbytes, dtype=torch.uint8)
    get_kv_codec("int4", LAY).decode(block, out)
    assert torch.equal(out, expected)
    assert torch.equal(decode(block).reshape(-1).view(torch.uint8), expected)
    # and today's encoder still writes those bytes
    _, blob = roundtrip(get_kv_codec("int4", LAY), real("start"))
    assert torch.equal(blob, block)


def _patched(block: torch.Tensor, **fields) -> torch.Tensor:
    import dataclasses

    header = dataclasses.replace(unpack_header(block[:HEADER_NBYTES].numpy().tobytes()), **fields)
    out = block.clone()
    out[:HEADER_NBYTES] = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    return out


@pytest.mark.parametrize("fields,match", [
    (dict(scheme=3 | 1 << 8 | 7 << 16), "k_bits 7"),
    (dict(scheme=3 | 9 << 8 | 5 << 16), "sinks"),
    (dict(group_size=24 | 32 << 16), "k_group 24"),
    (dict(group_size=32 | 3 << 16), "v_group 3"),
    (dict(codec="int8"), "int4's"),
    (dict(payload_nbytes=35428 - HEADER_NBYTES - 1), "payload_nbytes"),
])
def test_bad_scheme_3_headers_are_refused_before_anything_is_allocated(fields, match):
    with pytest.raises(CodecError, match=match):
        peek_header(_patched(_bytes("int4-sink.block"), **fields))


def test_a_sink_index_outside_the_chunk_is_refused():
    block = _bytes("int4-sink.block").clone()
    n = block.numel()
    sink_section = n - (4 + LAY.num_layers * 2 * LAY.num_kv_heads * LAY.head_dim * 2)
    block[sink_section:sink_section + 4] = torch.tensor([200, 0, 0, 0], dtype=torch.uint8)
    with pytest.raises(CodecError, match="sink token index"):
        get_kv_codec("int4", LAY).decode(block, torch.empty(LAY.nbytes, dtype=torch.uint8))


def test_synthetic_outlier_channels_fall_back_to_the_sparse_scheme_before_int8():
    """Channels scaled x20 (zero mean: unlike a real model's offset channels) are over scheme 3's budget; the
    verified encode then tries the previous int4 with those channels kept apart, and stays int4."""
    lay = KVLayout(num_layers=2, block_tokens=256, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_order="HKTD")
    x = make_chunk(lay, seed=5001, outlier=20.0)
    y, blob = roundtrip(get_kv_codec("int4", lay), x)
    header = peek_header(blob)
    assert header.codec == "int4" and header.scheme & 0xFF == 2
    assert attention_cosine(lay, x, y) >= 0.99


@pytest.mark.parametrize("kwargs,match", [(dict(int4_scheme=2), "int4_scheme"), (dict(k_group=48), "k_group"),
                                          (dict(v_group=6), "v_group")])
def test_bad_scheme_3_arguments_name_the_field(kwargs, match):
    with pytest.raises(CodecError, match=match):
        get_kv_codec("int4", LAY, **kwargs)
