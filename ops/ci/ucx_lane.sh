#!/usr/bin/env bash
# The ucx lane: the weight tests over the ucx transport, in a venv of their own with the
# `ucx` extra (ucxx-cu12, ~320 MB; imports and runs without a GPU). The default lane
# skips these tests because it does not install the extra.
#
#   bash ops/ci/ucx_lane.sh            # venv in $TMPDIR/rlpipe-venv-ucx, reused when present
#   bash ops/ci/ucx_lane.sh install    # only the venv and its packages; `test`: only the tests (ops/ci/lane_common.sh)
#   UCX_VENV=/some/dir bash ops/ci/ucx_lane.sh
#
# Measured on the 2-core dev machine: ~5.5 min with a fresh venv (mostly installing),
# ~1.5 min when the venv exists (the 18 ucx tests take ~70 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
# Outside the work tree, so the venv can never be committed.
VENV="${UCX_VENV:-${TMPDIR:-/tmp}/rlpipe-venv-ucx}"
PY="${PY:-python3}"
LANE=ucx
source ops/ci/lane_common.sh

if [ "$PHASE" != test ]; then
  make_venv
  step "installing the project with the test and ucx extras"
  # The CPU pins first (pyproject.toml holds ranges; an unpinned torch is a CUDA build), then the extra.
  deps_pip ucx
  project_pip -r requirements/cpu.txt
  project_pip -e '.[test,ucx]'
fi
"$VENV/bin/python" -c "import ucxx; print('ucx lane: ucxx', ucxx.__version__)"
if [ "$PHASE" = install ]; then exit 0; fi
# -k ucx: the ucx cases of both weight test files (the shm/tcp ones run in the main lane).
"$VENV/bin/python" -m pytest -q -k ucx tests/test_weights.py tests/test_weights_processes.py
