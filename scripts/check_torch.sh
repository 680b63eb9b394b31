#!/usr/bin/env bash
# Runs a smoke subset of the tests on another torch version, in a throwaway venv (never .venv):
#   scripts/check_torch.sh 2.11.0          the oldest torch Tiers supports (pyproject's floor)
#   scripts/check_torch.sh 2.11.0 -x -v    extra arguments go to pytest
# The venv is /tmp/tiers-torch-VERSION (TIERS_CHECK_VENV overrides it) and is reused while its stamp
# matches; delete it to start over. The package is imported from this checkout through PYTHONPATH,
# nothing is installed into it. Where the registry holds only CUDA builds of VERSION, pip downloads
# that build and its nvidia-* packages (several GB) — the tests still run on the CPU. Not part of CI.
set -euo pipefail
version="${1:?usage: scripts/check_torch.sh TORCH_VERSION [pytest args...] (e.g. 2.11.0)}"
shift
cd "$(dirname "$0")/.."
venv="${TIERS_CHECK_VENV:-/tmp/tiers-torch-$version}"
python="${PYTHON:-python3}"
start=$SECONDS

# The package's dependencies from pyproject.toml (torch replaced by the version under test) and pytest.
deps=(numpy psutil aiofiles tensorboard safetensors xxhash pytest pytest-timeout)
stamp="$venv/.tiers-check"
want="torch==$version ${deps[*]}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "torch==$version" "${deps[@]}"
  echo "$want" > "$stamp"
fi
echo "venv ready after $((SECONDS - start)) s: $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"

# Fast tests over the paths a torch version can break: the collectives lookup and ZeRO 1-3 on 2 gloo
# ranks (stage 3 also through NVMe), chunks and the chunk manager, the offload policy, NVMe I/O, and the
# CUDA path of offload on the CPU seam (Note [separate device memory]).
tests=(
  tests/test_torch_versions.py
  tests/test_separate_device_memory.py
  tests/test_chunk.py
  tests/test_manager.py
  tests/test_offload_policy.py
  "tests/test_zero.py::test_stage_1_with_all_reduce_instead_of_reduce_scatter_trains_the_same"
  tests/test_zero_stage3.py
  tests/test_nvme.py
)
slow=(--deselect "tests/test_zero_stage3.py::test_stage_3_through_nvme_keeps_peak_rss_within_the_cpu_budget")
PYTHONPATH="$PWD" OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" "${slow[@]}" "$@"
echo "check_torch $version: passed in $((SECONDS - start)) s"
