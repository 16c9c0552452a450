#!/usr/bin/env bash
# Create .venv and install the package with the recipe and test extras (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import lightning_gradcomp, torchvision, segmentation_models_pytorch, pytest, hypothesis, sklearn, jsonargparse, docstring_parser" 2>/dev/null \
    || [ ! -x .venv/bin/ruff ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1" -e ".[recipes,test]"
fi
