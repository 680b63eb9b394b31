#!/usr/bin/env bash
# Runs the tests that touch the optional packages (transformers, accelerate, peft, torchao, trl, lightning, ray) in a
# throwaway venv (never .venv), torch 2.13.0 (the local CPU wheel) in both modes:
#   scripts/check_deps.sh floor          each extra's package at the lowest version pyproject.toml allows
#   scripts/check_deps.sh newest         the newest releases pip resolves under pyproject.toml's caps (what the
#                                        README's test command installs), and the releases above each cap, to try
#   scripts/check_deps.sh floor -x -v    extra arguments go to pytest
# The venv is /tmp/tiers-deps-MODE (TIERS_CHECK_VENV overrides it), made afresh each run. The dev extra's tools and
# the core dependencies resolve to their newest in both modes. Not part of CI: the README's test command is the
# newest check CI runs.
set -euo pipefail
mode="${1:?usage: scripts/check_deps.sh floor|newest [pytest args...]}"
shift
case "$mode" in floor|newest) ;; *) echo "mode is floor or newest, not $mode" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
venv="${TIERS_CHECK_VENV:-/tmp/tiers-deps-$mode}"
python="${PYTHON:-python3}"
extras="dev,hf,lightning,ray"
start=$SECONDS

# requirement -> "name==floor" for floor, nothing for newest; a requirement of an extra without a floor is an error
pins=$("$python" - "$mode" "$extras" <<'EOF'
import re, sys, tomllib
mode, extras = sys.argv[1], sys.argv[2].split(",")
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pins = []
for extra in extras:
    for requirement in project["optional-dependencies"][extra]:
        name = re.split(r"[<>=!\[; ]", requirement, maxsplit=1)[0]
        floor = re.search(r">=\s*([0-9][^,;\s]*)", requirement)
        if extra == "dev":
            continue  # test tools: newest in both modes
        if floor is None:
            sys.exit(f"pyproject.toml: {requirement!r} (extra {extra}) declares no floor (>=); declare one")
        if mode == "floor":
            extras_of = re.search(r"\[[^\]]*\]", requirement)
            pins.append(f"{name}{extras_of.group(0) if extras_of else ''}=={floor.group(1)}")
print(" ".join(pins))
EOF
)

rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install torch==2.13.0
# shellcheck disable=SC2086  # the pins are separate words
"${pip[@]}" install -e ".[$extras]" $pins
echo "venv ready after $((SECONDS - start)) s ($mode):"
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|peft|torchao|trl|lightning|ray|kernels) " \
    | awk '{printf "  %s %s\n", $1, $2}'

if [ "$mode" = newest ]; then  # releases above a cap: raise the cap once they pass
  "$venv/bin/python" - <<'EOF'
import re, subprocess, tomllib
from packaging.specifiers import SpecifierSet
from packaging.version import Version
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for extra, requirements in project["optional-dependencies"].items():
    for requirement in requirements:
        name = re.split(r"[<>=!\[; ]", requirement, maxsplit=1)[0]
        spec = SpecifierSet(",".join(re.findall(r"(?:<|<=)\s*[0-9][^,;\s]*", requirement)))
        if not str(spec):
            continue
        listed = subprocess.run(["pip", "index", "versions", name], capture_output=True, text=True).stdout
        versions = re.search(r"Available versions: (.*)", listed)
        above = [v for v in (versions.group(1).split(", ") if versions else []) if Version(v) not in spec
                 and not Version(v).is_prerelease]
        print(f"  {name}: {'above the cap ' + str(spec) + ': ' + ', '.join(above[:5]) if above else 'none above the cap ' + str(spec)}")
EOF
fi

# the tests that touch them: from_pretrained under zero_init and streamed weights, PEFT/LoRA, an int8 base, the HF
# Trainer and TRL, "auto" values, Lightning, Ray, derived plans and every strategy on Hugging Face models, MoE,
# torchao's block-wise states, checkpointing a Hugging Face model with its cache
tests=(
  tests/test_zero_init.py tests/test_streamed_weights.py tests/test_lora.py tests/test_int8_frozen.py
  tests/test_hf_trainer.py tests/test_hf_auto_config.py tests/test_lightning.py tests/test_ray_train.py
  tests/test_tensor_parallel_derived.py tests/test_hf_models.py tests/test_hf_zoo.py tests/test_moe.py
  tests/test_lowbit_states.py tests/test_activation_checkpointing.py
)
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" "$@"
echo "check_deps $mode: passed in $((SECONDS - start)) s"
