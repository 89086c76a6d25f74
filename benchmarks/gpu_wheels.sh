#!/usr/bin/env bash
# Run HERE (not on the device) before a GPU session: the device machine's image has PyTorch and Triton
# but not OR-Tools, and it reaches no package registry. This saves the wheels the planner needs there
# (CPython 3.12, x86-64 Linux, as the image's python3) into .whl/, which git ignores; the device call
# then carries it (`carry: [".whl"]`) and benchmarks/gpu_check.sh installs it before its first step.
#
#   bash benchmarks/gpu_wheels.sh        # ~30 MB: ortools, its immutabledict and the protobuf it pins
set -eu
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
ORTOOLS_VERSION="$(python3 -c 'import ortools; print(ortools.__version__)')"   # the version tested here
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    "ortools==$ORTOOLS_VERSION" "immutabledict>=3" "protobuf>=6.33.1,<6.34"
ls -l .whl
