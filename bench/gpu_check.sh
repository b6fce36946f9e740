#!/usr/bin/env bash
# Device checks for a lent GPU machine (needs torch with CUDA, prometheus-client, pytest, hypothesis installed).
# Runs in well under 5 minutes: the cuda-marked codec tests, codec GB/s against the device's copy bandwidth
# (bench/gpu_codecs.py), and the engine path's device<->host copies: the vLLM spec worker's CUDA page copies
# against raw pinned copies (bench/engine_offload.py --copy-only).
# Prints the tables for docs/performance.md.
#
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

python - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not installed on this machine")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

echo "== cuda-marked codec tests"
timeout 120 python -m pytest -q -p no:cacheprovider -m cuda tests/runtime/codecs/test_codecs_cuda.py

echo "== codecs on the device"
timeout 60 python bench/gpu_codecs.py

# kvtier's vLLM offloading spec: the worker's CUDA path (side stream, pinned host rows, event polling), its batched
# path (vLLM's swap_blocks_batch: one call per job; needs a CUDA build of vllm in this python, else the table says
# it was not measured) and the per-block path, against one raw copy_ of the same pages, device -> pinned host.
echo "== vLLM offloading spec: worker page copies on CUDA"
timeout 60 python -m pytest -q -p no:cacheprovider -m cuda tests/runtime/engines/test_engine_offload_books.py
timeout 60 python -m pytest -q -p no:cacheprovider tests/runtime/engines/test_engine_offload_books.py -k "batched or scattered"
timeout 90 python bench/engine_offload.py --copy-only --device cuda
