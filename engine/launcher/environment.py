"""The environment every node gets: `.tiers_env` files and the launcher's own variables with known prefixes.

As DeepSpeed does with `.deepspeed_env`, a `.tiers_env` in the home directory and one in the working directory
(read in that order, the later winning) hold KEY=VALUE lines, taken literally; blank lines and `#` comments are
allowed. Variables of the launcher's environment whose names start with EXPORTED_PREFIXES go along too, so
`NCCL_DEBUG=INFO tiers launch ...` reaches remote nodes as it would a local run. CUDA_VISIBLE_DEVICES is the
exception: it names devices of this machine, so a node gets its own (its slots) or none.
"""

from __future__ import annotations

import os
import re

from engine.launcher.errors import LaunchError

ENV_FILE_NAME = ".tiers_env"
EXPORTED_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "CUDA_", "TORCH_", "OMP_", "UCX_", "MLFLOW_", "TIERS_")
NOT_EXPORTED = ("CUDA_VISIBLE_DEVICES",)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env_file(text: str, source: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, equals, value = line.partition("=")
        key = key.strip()
        if not equals or not ENV_NAME.fullmatch(key):
            raise LaunchError(f"{source}, line {number}: expected KEY=VALUE with KEY a variable name, got {line!r}")
        values[key] = value
    return values


def env_file_paths(cwd: str, home: str) -> list[str]:
    """The .tiers_env files that exist, home first (a working-directory file overrides it; DeepSpeed lets the
    home file win, but the job's own directory is the more specific place)."""
    candidates = [os.path.join(home, ENV_FILE_NAME), os.path.join(cwd, ENV_FILE_NAME)]
    found: list[str] = []
    for path in candidates:
        if os.path.isfile(path) and os.path.realpath(path) not in map(os.path.realpath, found):
            found.append(path)
    return found


def exported_environment(environ: dict[str, str], cwd: str) -> tuple[dict[str, str], dict[str, str]]:
    """(exported, from_files): variables every remote node gets (prefixed ones and the .tiers_env files), and the
    .tiers_env values alone (what a node on this machine, which inherits `environ`, needs on top)."""
    from_files: dict[str, str] = {}
    for path in env_file_paths(cwd, environ.get("HOME") or os.path.expanduser("~")):
        try:
            with open(path) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise LaunchError(f"{path}: cannot read it ({e}); fix or remove the file") from e
        from_files.update(parse_env_file(text, path))
    exported = {k: v for k, v in sorted(environ.items()) if k.startswith(EXPORTED_PREFIXES) and k not in NOT_EXPORTED}
    exported.update(from_files)
    return exported, from_files
