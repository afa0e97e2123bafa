#!/usr/bin/env bash
# Run the test suite (installs torchacco and the test extras into ./.venv first if needed).
#   ./run_tests.sh                 the default suite
#   ./run_tests.sh tests/test_x.py any pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
if ! .venv/bin/python -c "import torchacco.models, torchacco.data, pytest, transformers, hypothesis, torchft, matplotlib" 2>/dev/null; then
  ./install.sh test
fi
exec .venv/bin/python -m pytest "$@"
