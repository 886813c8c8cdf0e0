#!/usr/bin/env bash
# Install (into .venv) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export GRADIO_ANALYTICS_ENABLED=False
.venv/bin/lint-imports  # the rooms' import contracts (pyproject.toml, docs/architecture.md)
exec .venv/bin/python -m pytest -q --durations=40 "$@"
