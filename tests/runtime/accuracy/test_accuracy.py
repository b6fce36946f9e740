"""``kvtier accuracy``: its measures against a hand computation, its figures against a plain forward pass of the
model, the chunking an engine does (whole chunks only), and its command line (bad input named, no torch import
for ``kvtier`` itself). The model is a small generated Llama (e2e/vllm_cpu/model.py: random weights, a WordLevel
tokenizer), loaded through transformers as a user's model is; the trained model's figures are in
docs/compression.md."""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch
from kvtier_runtime.accuracy import model as mdl
from kvtier_runtime.accuracy.chunks import Geometry
from kvtier_runtime.accuracy.cli import main
from kvtier_runtime.accuracy.harness import Run, Tolerance, execute
from kvtier_runtime.accuracy.scores import score
from vllm_cpu import model as tm

SPEC = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_words=300,
            max_position_embeddings=2048)


def test_scores_match_a_hand_computation():
    # position 0: p = (1/3, 2/3), q = (2/3, 1/3), target 1; position 1: p = q = (3/4, 1/4), target 0
    ref = torch.tensor([[0.0, math.log(2)], [math.log(3), 0.0]], dtype=torch.float64)
    test = torch.tensor([[math.log(2), 0.0], [math.log(3), 0.0]], dtype=torch.float64)
    s = score(ref, test, torch.tensor([1, 0]))
    assert s.positions == 2
    assert s.mean_kl == pytest.approx(math.log(2) / 6, rel=1e-12)        # (1/3 ln 1/2 + 2/3 ln 2) / 2
    assert s.nll_ref == pytest.approx(math.log(2) / 2, rel=1e-12)        # (ln 3/2 + ln 4/3) / 2
    assert s.nll_test == pytest.approx(math.log(2), rel=1e-12)           # (ln 3 + ln 4/3) / 2
    assert s.ppl_change_pct == pytest.approx(100 * (math.sqrt(2) - 1), rel=1e-12)
    assert s.top1 == 0.5
    with pytest.raises(ValueError, match="shapes"):
        score(ref, test[:1], torch.tensor([1]))
    with pytest.raises(ValueError, match="targets"):
        score(ref, test, torch.tensor([1, 0, 0]))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("accuracy")
    model_dir = tm.ensure_model(root / "models", **SPEC)
    spec = tm.ModelSpec(**SPEC)
    first = len(tm.SPECIAL_TOKENS)
    text = root / "text.txt"
    text.write_text(" ".join(tm.word(i - first) for i in tm.prompt_ids(700, 7, spec)))
    return model_dir, text


def _run(small, **kw) -> Run:
    model_dir, text = small
    geometry = kw.pop("geometry", Geometry(block_tokens=16, chunk_tokens=32, kv_dtype="float32"))
    return Run(model_dir=model_dir, text=text, geometry=geometry, **kw)


def test_the_reference_is_a_plain_forward_pass_and_an_exact_codec_changes_nothing(small):
    """With a float32 KV cache the reference continuation must score what one forward pass over prefix and
    continuation scores (the same positions and targets); ``none`` round-trips the cache exactly."""
    run = _run(small, codecs=("none", "int8"), contexts=(80,))
    lm = mdl.load(run.model_dir)
    result = execute(run, lm=lm)
    ctx = result.contexts[0]
    assert (ctx.context, ctx.continuation, ctx.chunked_tokens) == (80, 256, 64)  # a partial last chunk stays exact
    ids = mdl.tokenize(lm, run.text.read_text())
    with torch.no_grad():
        logits = lm.model(ids[:80 + 256].unsqueeze(0)).logits[0].double()
    nll = torch.nn.functional.cross_entropy(logits[80:80 + 256], ids[81:80 + 257], reduction="mean")
    assert ctx.reference_ppl == pytest.approx(math.exp(float(nll)), rel=1e-4)
    exact, int8 = ctx.rows
    assert exact.scores.mean_kl == 0 and exact.scores.top1 == 1 and exact.scores.ppl_change_pct == 0
    assert exact.trip.chunks == 2 and dict(exact.trip.stored) == {"none": 2}
    assert int8.trip.chunks == 2 and dict(int8.trip.stored) == {"int8": 2}
    assert 0 < int8.scores.mean_kl < 1e-3 and int8.trip.bytes_ratio == pytest.approx(0.26, abs=0.02)
    assert int8.trip.encode_gbps > 0 and int8.trip.decode_gbps > 0
    assert not exact.verdict and not int8.verdict


def test_a_lossy_roundtrip_is_scored_and_judged_against_the_tolerance(small):
    run = _run(small, codecs=("int4",), contexts=(64, 96), verify=False, tolerance=Tolerance(ppl_pct=0.0, kl=0.0),
               geometry=Geometry(block_tokens=16, chunk_tokens=32))
    result = execute(run)
    for ctx in result.contexts:
        (row,) = ctx.rows
        assert row.scores.mean_kl > 0 and "KL" in row.verdict
        assert sum(row.trip.stored.values()) == ctx.context // 32 == row.trip.chunks


def test_the_command_prints_a_table_or_json_and_names_bad_input(small, capsys):
    model_dir, text = small
    args = ["--model", str(model_dir), "--text", str(text), "--codecs", "int8", "--context", "64",
            "--chunk-tokens", "32", "--quiet", "--device", "cpu"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (ctx,) = out["contexts"]
    assert ctx["context"] == 64 and ctx["codecs"][0]["stored_as"] == {"int8": 2} and ctx["codecs"][0]["safe"]
    assert out["layout"].startswith("2 layers x 2 page(s) x CPU_VEC")
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "| 64 | 256 | int8 | int8 2 |" in table and "verdict: at 64 tokens" in table
    for bad, match in [(["--context", "8"], "--context"), (["--codecs", "zstd"], "--codecs"),
                       (["--chunk-tokens", "24"], "chunk_tokens"), (["--context", "1000"], "--text"),
                       (["--max-kl", "-1"], "--max-kl")]:
        assert main(args + bad) == 2
        assert match in capsys.readouterr().err
    assert main(["--model", str(text.parent), "--text", str(text), "--quiet"]) == 2
    assert "--model" in capsys.readouterr().err


def test_kvtier_lists_the_command_without_importing_torch():
    code = ("import sys; from kvtier_operator import cli; cli.build_parser(); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'")
    root = pathlib.Path(__file__).resolve().parents[3]
    env = {"PYTHONPATH": f"{root / 'operator'}:{root / 'runtime'}", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    out = subprocess.run([sys.executable, "-m", "kvtier_operator.cli", "--help"], check=True, env=env,
                         capture_output=True, text=True).stdout
    assert "accuracy" in out
