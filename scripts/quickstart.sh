#!/usr/bin/env bash
# Set up .venv (first run only), then train a small classifier on scikit-learn's 8x8 digits with
# two CPU processes and a compressing codec. Extra arguments go to the recipe (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python recipes/digits_quickstart.py "$@"
