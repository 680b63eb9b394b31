#!/usr/bin/env bash
# Creates (or reuses) the repo's virtual environment .venv and installs what is missing.
#   scripts/setup_env.sh            the package and its dependencies
#   scripts/setup_env.sh dev,hf,lightning,ray   plus the extras (tests; Hugging Face, Lightning and Ray clients)
# torch is pinned first to the version these machines carry as a local CPU wheel, so pip never
# pulls a CUDA build from the registry; set TIERS_TORCH to install another (e.g. "torch" on a GPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
torch_spec="${TIERS_TORCH:-torch==2.13.0}"
python="${PYTHON:-python3}"

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

# Skip the installs when nothing they depend on changed since the last successful run.
stamp=".venv/.tiers-installed"
want="$(cat pyproject.toml | sha256sum | cut -c1-16) extras=[$extras] $torch_spec"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"${pip[@]}" install "$torch_spec"
"${pip[@]}" install -e ".${extras:+[$extras]}"
echo "$want" > "$stamp"
