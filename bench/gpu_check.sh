#!/usr/bin/env bash
# Device checks for a lent GPU machine (needs torch with CUDA, prometheus-client, pytest, hypothesis installed).
# Runs in well under 5 minutes: the cuda-marked store tests, then device<->host store/load throughput against
# raw pinned cudaMemcpyAsync (bench/gpu_store.py). Prints the table for docs/performance.md.
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

echo "== cuda-marked store tests"
timeout 120 python -m pytest -q -p no:cacheprovider -m cuda tests/test_store.py

echo "== device <-> host throughput"
timeout 150 python bench/gpu_store.py "$@"
