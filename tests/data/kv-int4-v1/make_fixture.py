"""Writes the KV-layout blocks under tests/data/kv-int4-v1/ with the codec as it was before the sparse-K scheme
(scheme 2) existed (run at commit 27ca1af: ``.venv/bin/python tests/data/kv-int4-v1/make_fixture.py``).

Kept for provenance: the test checks that today's decoder gives these blocks' decoded bytes back exactly, and
that today's encoder still writes a chunk without outlier channels byte for byte as before.
Chunks: layout ``LAYOUT`` (1 layer, 2 heads, 32 tokens, head dim 16, bf16, HKTD), K and V normal from
``torch.Generator().manual_seed(seed)``; ``int4-normal`` (seed 1), and ``int4-outlier`` (seed 2, K channels 3 and
9 times 20: before scheme 2 that chunk fell back to int8, and its old block must still decode). For each:
``<name>.chunk`` (the chunk's bytes), ``<name>.block`` (the encoded block), ``<name>.decoded`` (what the codec of
that commit decoded it to).
"""
import pathlib

import torch
from kvtier_runtime.codecs import KVLayout, get_kv_codec

HERE = pathlib.Path(__file__).resolve().parent
LAYOUT = dict(num_layers=1, block_tokens=32, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_order="HKTD")


def chunk(seed: int, outlier: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((1, 2, 2, 32, 16), generator=gen)      # [L, K/V, H, T, D]: HKTD is [H][K/V][T][D] per layer
    if outlier:
        x[:, 0, :, :, [3, 9]] *= outlier
    return x.transpose(1, 2).contiguous().to(torch.bfloat16).reshape(-1)


def main() -> None:
    lay = KVLayout(**LAYOUT)
    codec = get_kv_codec("int4", lay)
    for name, seed, outlier in (("int4-normal", 1, 0.0), ("int4-outlier", 2, 20.0)):
        x = chunk(seed, outlier)
        out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8)
        n = codec.encode(x, out)
        y = torch.empty_like(x)
        codec.decode(out[:n], y)
        (HERE / f"{name}.chunk").write_bytes(x.view(torch.uint8).numpy().tobytes())
        (HERE / f"{name}.block").write_bytes(out[:n].numpy().tobytes())
        (HERE / f"{name}.decoded").write_bytes(y.view(torch.uint8).numpy().tobytes())


if __name__ == "__main__":
    main()
