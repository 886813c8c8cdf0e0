#!/usr/bin/env bash
# Install everything into .venv at the repository root. `--test` adds the test tools (transformers,
# pytest, Playwright's Python driver, Debian's chromium for the browser tests).
# torch comes from the CPU wheel pinned below, installed before anything that depends on it, so no
# dependency range can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null \
  || $PIP install -q "torch==$TORCH_VERSION"
if [ "${1:-}" = "--test" ]; then
  $PIP install -q -e ".[test]"
  if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
        || echo "setup: could not install chromium; browser tests will be skipped" >&2
    else
      echo "setup: /usr/bin/chromium missing and not root; browser tests will be skipped" >&2
    fi
  fi
else
  $PIP install -q -e .
fi
.venv/bin/python -c "import workbench, model, probes, apps; print('setup: ok, torch', __import__('torch').__version__)"
