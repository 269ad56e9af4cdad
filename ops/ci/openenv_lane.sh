#!/usr/bin/env bash
# The openenv lane: tests/test_openenv.py (env.kind = "openenv:...": OpenEnv environments served
# by the generators or running elsewhere, docs/environments.md), tests/test_openenv_games.py (the
# code environment and a TextArena game served over OpenEnv), tests/test_chaos_env.py
# (`pipeline chaos` with the generators' environment servers SIGKILLed) and the two-server test of
# tests/test_env_scale.py (openenv:http://a:1,http://b:2, one stopped), in a venv of its own with the
# `openenv` extra (openenv-core 0.3.0 and its server stack: fastapi, uvicorn, gradio, fastmcp,
# openai, huggingface_hub) and the `textarena` extra (textarena 0.7.4). The default lane skips
# those tests because it installs neither.
#
#   bash ops/ci/openenv_lane.sh            # venv in $TMPDIR/rlpipe-venv-openenv, reused when present
#   bash ops/ci/openenv_lane.sh install    # only the venv and its packages; `test`: only the tests (ops/ci/lane_common.sh)
#   OPENENV_VENV=/some/dir bash ops/ci/openenv_lane.sh
#
# Measured on the 2-core dev machine: see docs/environments.md ("The CI lane").
set -euo pipefail
cd "$(dirname "$0")/../.."
# Outside the work tree, so the venv can never be committed.
VENV="${OPENENV_VENV:-${TMPDIR:-/tmp}/rlpipe-venv-openenv}"
PY="${PY:-python3}"
LANE=openenv
source ops/ci/lane_common.sh

if [ "$PHASE" != test ]; then
  make_venv
  # The CPU pins first (pyproject.toml holds ranges; an unpinned torch is a CUDA build), then the extra.
  step "installing requirements/cpu.txt (the CPU torch 2.13.0 and the project)"
  deps_pip openenv textarena
  project_pip -r requirements/cpu.txt
  step "installing the project with the test, openenv and textarena extras"
  project_pip -e '.[test,openenv,textarena]'
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, \
    f"torch {torch.__version__}: the lane needs the CPU build 2.13.0 (requirements/cpu.txt)"
print(f"openenv lane: openenv-core {md.version('openenv-core')}, textarena {md.version('textarena')}, "
      f"uvicorn {md.version('uvicorn')}, websockets {md.version('websockets')}, torch {torch.__version__}")
PY
if [ "$PHASE" = install ]; then exit 0; fi
step "running tests/test_openenv.py tests/test_openenv_games.py tests/test_chaos_env.py, tests/test_env_scale.py's servers test"
"$VENV/bin/python" -m pytest -q tests/test_openenv.py tests/test_openenv_games.py tests/test_chaos_env.py \
  "tests/test_env_scale.py::test_sessions_spread_over_two_servers_and_a_stopped_one_is_skipped_naming_its_url"
step "done"
