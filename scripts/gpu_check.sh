#!/usr/bin/env bash
# The device check (scripts/gpu_check.py) with whatever python the machine has: on the GPU images torch 2.11 is
# preinstalled and nothing can be installed, so no .venv is made. Results go to $OUT/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && ! "$python" -c "import torch" 2>/dev/null && python=.venv/bin/python
exec "$python" scripts/gpu_check.py "$@"
