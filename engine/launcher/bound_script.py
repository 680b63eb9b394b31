"""What each process of `tiers launch --bind-cores` runs first: `python bound_script.py SCRIPT ARGS` pins the
process to its share of the node's cores (Note [binding cores to ranks]), before anything imports torch, then runs
SCRIPT with ARGS as `python SCRIPT ARGS` would (its own directory first on sys.path)."""

from __future__ import annotations

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def bind_cores() -> None:
    """Note [binding cores to ranks], loaded by path: importing the `engine` package would import torch first."""
    runpy.run_path(os.path.join(HERE, "core_binding.py"))["bind_from_environment"]()


def run_script(script: str, args: list[str]) -> None:
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # was this file's directory
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: bound_script.py SCRIPT [ARGS...]")
    bind_cores()
    run_script(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
