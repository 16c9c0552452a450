#!/usr/bin/env bash
# Set up the virtual environment if needed, then lint and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint and formatting first: they take a second and name the file and line
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the slowest tests, so that a run that grows shows where
exec .venv/bin/python -m pytest -q --durations=10 tests "$@"
