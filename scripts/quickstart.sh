#!/usr/bin/env bash
# Set up .venv (first run only), then train a small classifier on scikit-learn's 8x8 digits with
# two CPU processes and the lgc codec (recipes/configs/digits_quickstart.yaml). Extra arguments go
# to the recipe (LightningCLI: --help, --print_config, --trainer.strategy.codec NAME, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python recipes/digits_quickstart.py "$@"
