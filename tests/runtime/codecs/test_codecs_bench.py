"""The codec benchmark scripts still run (their figures are recorded in docs/, not asserted here)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


@pytest.mark.slow
def test_throughput_table_prints_every_requested_codec():
    out = subprocess.run(
        [sys.executable, str(BENCH / "codecs.py"), "--threads", "1", "--block-mib", "0.25", "--working-set-mib", "1",
         "--repeats", "1", "--codecs", "none,fp8,int4"], check=True, capture_output=True, text=True).stdout
    assert "raw copy_" in out
    for codec in ("none", "fp8", "int4"):
        assert f"| {codec} " in out


@pytest.mark.slow
def test_accuracy_table_prints_attention_error():
    out = subprocess.run(
        [sys.executable, str(BENCH / "codecs.py"), "--accuracy", "--threads", "1", "--contexts", "256",
         "--codecs", "int4,int8 K/chan"], check=True, capture_output=True, text=True).stdout
    assert "| normal | int4 | 256 |" in out and "| outlier K | int8 K/chan | 256 |" in out


def test_gpu_script_says_when_there_is_no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; bench/gpu_check.sh runs the real thing")
    res = subprocess.run([sys.executable, str(BENCH / "gpu_codecs.py")], capture_output=True, text=True)
    assert res.returncode == 3 and "no CUDA device" in res.stderr


@pytest.mark.slow
def test_engine_path_speed_table_prints_ratios_against_copy():
    out = subprocess.run(
        [sys.executable, str(BENCH / "codecs.py"), "--kv", "--threads", "1", "--working-set-mib", "2", "--repeats", "2",
         "--codecs", "fp8,flat fp8,int4 verify"], check=True, capture_output=True, text=True).stdout
    assert "copy_" in out
    for codec in ("fp8", "flat fp8", "int4 verify"):
        assert f"| {codec} | " in out


@pytest.mark.slow
def test_int4_outlier_table_prints_both_variants_and_the_why_table():
    out = subprocess.run([sys.executable, str(BENCH / "kv_int4.py"), "--chunks", "1", "--sets", "outlier x20"],
                         check=True, capture_output=True, text=True).stdout
    assert "| outlier x20 | scheme 1 | 0.00 |" in out and "| outlier x20 | scheme 2 | 1.00 |" in out
    assert "| outlier x20 | scheme 3 | 1.00 |" in out
    out = subprocess.run([sys.executable, str(BENCH / "kv_int4.py"), "--why", "--chunks", "1", "--sets", "normal"],
                         check=True, capture_output=True, text=True).stdout
    assert "| normal | 0." in out


@pytest.mark.slow
def test_bound_table_prints_every_row():
    out = subprocess.run(
        [sys.executable, str(BENCH / "codecs.py"), "--kv-bound", "--threads", "1", "--chunks", "1"],
        check=True, capture_output=True, text=True).stdout
    for row in ("normal", "outlier K x5", "outlier tokens x300", "whole chunk x0.05"):
        assert f"| {row} | " in out and "/16 |" in out   # 2 layers x 8 heads a chunk
