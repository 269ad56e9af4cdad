#!/usr/bin/env bash
# The torchtitan lane: tests/test_titan_backend.py (the `torchtitan` trainer backend: FSDP2 ranks
# under torchrun on gloo), in a venv of its own with requirements/titan-cpu.txt. The default lane
# skips those tests because it does not install torchtitan.
#
#   bash ops/ci/titan_lane.sh            # venv in $TMPDIR/rlpipe-venv-titan, reused when present
#   bash ops/ci/titan_lane.sh install    # only the venv and its packages; `test`: only the tests (ops/ci/lane_common.sh)
#   TITAN_VENV=/some/dir bash ops/ci/titan_lane.sh
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu bash ops/ci/titan_lane.sh   # where no +cpu wheel is configured
#
# Measured on the 2-core dev machine: see docs/torchtitan.md ("The CI lane").
set -euo pipefail
cd "$(dirname "$0")/../.."
# Outside the work tree, so the venv can never be committed.
VENV="${TITAN_VENV:-${TMPDIR:-/tmp}/rlpipe-venv-titan}"
PY="${PY:-python3}"
LANE=titan
source ops/ci/lane_common.sh

if [ "$PHASE" != test ]; then
  make_venv
  torch_pip
  step "installing requirements/titan-cpu.txt (torchtitan 0.3.0, triton 3.7.1; ~250 MB with their dependencies)"
  "${PIP[@]}" -r requirements/titan-cpu.txt
  step "installing the project with the test, math and reasoning extras"
  # The reasoning extra (reasoning-gym): the SmolLM2 `pipeline up` test trains on its chain_sum task.
  deps_pip reasoning
  project_pip -r requirements/cpu.txt   # the project, its test and math extras, the CPU pins
  project_pip -e '.[reasoning]'
fi
"$VENV/bin/python" - <<'PY'
import torch, torchtitan, transformers
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, \
    f"torch {torch.__version__}: the lane needs 2.13.0+cpu (set TORCH_INDEX to a CPU wheel index)"
from importlib.metadata import version
print(f"titan lane: torchtitan {version('torchtitan')}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
if [ "$PHASE" = install ]; then exit 0; fi
step "running tests/test_titan_backend.py (most tests launch torchrun; ~8 min on 2 cores)"
"$VENV/bin/python" -m pytest -v tests/test_titan_backend.py
step "done"
