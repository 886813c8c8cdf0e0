#!/usr/bin/env bash
# Install (into .venv) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export GRADIO_ANALYTICS_ENABLED=False
# One torch thread unless the caller says otherwise (processes the tests start inherit it): the tests' forwards are
# tiny and the 2 CPUs are shared with the app, Chromium and the child processes, where torch's default of one
# thread per core only contends (test_rootcause + test_kvwhatif: 29-30 s with 1 thread, 135-144 s with 2, load 4-8)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/lint-imports  # the rooms' import contracts (pyproject.toml, docs/architecture.md)
# two workers, a test file each at a time (its module fixtures built once): half the wall time on 2 cores, since
# much of the suite waits on a browser, a server or a child process (serial: 14:51 on a loaded day, 8:55 quiet)
exec .venv/bin/python -m pytest -q --durations=40 -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
