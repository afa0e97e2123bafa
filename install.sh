#!/usr/bin/env bash
# Install torchacco into ./.venv. An importable torch is kept (the venv sees it);
# otherwise torch 2.13.0 is installed. `./install.sh test` adds the test extras, `./install.sh ft` torchft.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BASE="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "torchacco: creating $ROOT/.venv" >&2
  if "$BASE" -c "import torch" 2>/dev/null; then
    "$BASE" -m venv --system-site-packages "$ROOT/.venv"
  else
    "$BASE" -m venv "$ROOT/.venv"
  fi
fi
PIP=("$ROOT/.venv/bin/python" -m pip install -q)
"$ROOT/.venv/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
EXTRA=""
[ "${1:-}" = "test" ] && EXTRA="[test]"
[ "${1:-}" = "ft" ] && EXTRA="[ft]"  # torchft, for [diloco] fault_tolerant
"${PIP[@]}" -e "$ROOT$EXTRA"
