#!/usr/bin/env bash
# One-GPU check: on a CUDA machine with nothing preinstalled but Python and pip, install the GPU
# requirement set and measure, on a randomly initialised ~0.6B Qwen3 (built here, no hub):
# vLLM generation throughput, the weight path (publish, fetch, load into vLLM), torchtitan
# trainer step time and a few end-to-end pipeline steps. Writes one JSON file.
#
#   bash ops/gpu_check.sh [OUT_JSON]        # default: gpu_check.json in the repository root
#
# Budget: 8 minutes in all (install included); each phase's result lands in the JSON as soon as
# it ends, so a check cut short still reports what it measured. Figures go to BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check.json}"
VENV="${GPU_VENV:-${TMPDIR:-/tmp}/rlpipe-venv-gpu}"
PY="${PY:-python3}"
start=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ ! -x "$VENV/bin/python" ]; then
  echo "gpu_check: creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
fi
echo "gpu_check: installing requirements/gpu.txt (torch 2.14.0, vllm 0.33.0, torchtitan 0.3.0)"
"$VENV/bin/pip" install --progress-bar off -r requirements/gpu.txt 2>&1 | grep -E '^(Successfully|ERROR)' || true
"$VENV/bin/python" -c "import torch, vllm, torchtitan; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu_check: torch', torch.__version__, 'vllm', vllm.__version__, 'cuda ok')"
echo "gpu_check: installed in $(( $(date +%s) - start )) s"
timeout "${GPU_CHECK_TIMEOUT:-420}" "$VENV/bin/python" bench/gpu_check.py --out "$OUT" "${@:2}"
echo "gpu_check: done in $(( $(date +%s) - start )) s; results in $OUT"
