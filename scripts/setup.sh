#!/usr/bin/env bash
# Installs hetplan into the active Python. A CPU build of torch is installed first when torch is
# missing, so the `torch>=2.5` requirement never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
# the packages' bytecode, as a regular (not editable) install writes it: an editable install leaves it to
# the first import, which PYTHONDONTWRITEBYTECODE turns off, and every `plan` then compiles them (0.2 s)
"$PY" -m compileall -q planner passes costmodel backends >/dev/null
