#!/usr/bin/env bash
# The prepared GPU check: run from a copy of the repository on a bare single-GPU machine.
#   bash scripts/gpu_check.sh [OUT_DIR]          (default: $OUT, else ./gpu-results)
# Nothing is installed: the project runs from PYTHONPATH with the machine's Python ($PYTHON, else
# /opt/torch/.venv/bin/python, else python3), which needs torch, numpy, numba, xxhash, safetensors
# and transformers; no vLLM, no zstandard, no internet. About 2-4 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-results}}"
mkdir -p "$out"
py="${PYTHON:-/opt/torch/.venv/bin/python}"
[ -x "$py" ] || py=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import torch, numba, xxhash, safetensors, transformers
assert torch.cuda.is_available(), 'no CUDA device visible to torch'
print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
status=0
timeout 300 "$py" -m bench.gpu --json "$out/gpu.json" >/dev/null 2> "$out/gpu.log" || status=$?
timeout 90 "$py" -m bench.gpu_digest --json "$out/gpu_digest.json" >/dev/null \
  2> "$out/gpu_digest.log" || status=$?
tail -n 20 "$out/gpu.log" "$out/gpu_digest.log"
exit "$status"
