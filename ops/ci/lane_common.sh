# Sourced by the lanes (ops/ci/*_lane.sh) after they set LANE, VENV and PY: the phase argument, the
# progress lines, and installs that can run side by side (.ci/run installs every lane's venv
# at once).
#
#   bash ops/ci/<lane>_lane.sh            # install, then run the lane's tests (the default)
#   bash ops/ci/<lane>_lane.sh install    # the venv and its packages only
#   bash ops/ci/<lane>_lane.sh test       # the tests only, on a venv `install` made

PHASE="${1:-all}"
case "$PHASE" in all|install|test) ;; *) echo "usage: $0 [all|install|test]" >&2; exit 2 ;; esac
if [ "$PHASE" = test ] && [ ! -x "$VENV/bin/python" ]; then
  echo "$0 test: no venv at $VENV; run \`$0 install\` first" >&2
  exit 2
fi

PIP=("$VENV/bin/pip" install --quiet --progress-bar off)
t0=$SECONDS
step() { echo "$LANE lane [$((SECONDS - t0))s]: $*"; }

# make_venv: the lane's venv, with a current pip, unless it is there.
make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    step "creating $VENV"
    "$PY" -m venv "$VENV"
    "${PIP[@]}" --upgrade pip
  fi
}

# torch_pip: torch 2.13.0, the CPU build (TORCH_INDEX: a CPU wheel index, where none is configured).
torch_pip() {
  step "installing torch 2.13.0 (CPU)"
  if [ -n "${TORCH_INDEX:-}" ]; then
    "${PIP[@]}" torch==2.13.0 --index-url "$TORCH_INDEX"
  else
    "${PIP[@]}" torch==2.13.0
  fi
}

# deps_pip EXTRA...: the project's dependencies and those of its extras (requirements/cpu.txt's and
# the named ones, from pyproject.toml), with requirements/cpu.txt's pins, installed without the
# project itself. They are the downloads; the project's own install (project_pip) then finds
# them in place.
deps_pip() {
  local reqs
  reqs="$(mktemp "${TMPDIR:-/tmp}/rlpipe-lane-deps.XXXXXX")"
  "$PY" - "$@" >"$reqs" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = list(sys.argv[1:])
lines = []
for line in open("requirements/cpu.txt"):
    line = line.split(" #")[0].strip()
    if line.startswith("-e") and "[" in line:  # the extras of the project line
        extras += line[line.index("[") + 1:line.index("]")].split(",")
    elif line and not line.startswith(("#", "-e")):
        lines.append(line)
lines += project["dependencies"]
for extra in dict.fromkeys(extras):
    lines += project["optional-dependencies"][extra]
print("\n".join(lines))
PY
  "${PIP[@]}" -r "$reqs"
  rm -f "$reqs"
}

# project_pip ARGS...: a pip install that builds the project (an editable install writes
# rlpipe.egg-info into the checkout), one lane at a time where flock(1) is there.
project_pip() {
  if command -v flock >/dev/null 2>&1; then
    flock "${TMPDIR:-/tmp}/rlpipe-lane-project.lock" "${PIP[@]}" "$@"
  else
    "${PIP[@]}" "$@"
  fi
}
