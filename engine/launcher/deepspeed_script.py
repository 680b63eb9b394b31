"""What each process of `tiers launch --as-deepspeed` runs first: `python deepspeed_script.py SCRIPT ARGS` runs
SCRIPT as DeepSpeed's launcher would, with `--local_rank=N` first among its arguments (unless
TIERS_NO_LOCAL_RANK is set: DeepSpeed's --no_local_rank), its own directory first on sys.path (as `python SCRIPT`
gives it), and `import deepspeed` answered by the compat layer (Note [the deepspeed shim]: the launcher put the
shim on PYTHONPATH), pinned to its cores first under --bind-cores."""

from __future__ import annotations

import os
import runpy
import sys

# the sibling file, by path: importing the `engine` package would import torch before the cores are bound
BOUND = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bound_script.py"))


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: deepspeed_script.py SCRIPT [ARGS...]")
    BOUND["bind_cores"]()  # Note [binding cores to ranks]: only when the launcher asked for it
    script, args = sys.argv[1], sys.argv[2:]
    if not os.environ.get("TIERS_NO_LOCAL_RANK"):
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    BOUND["run_script"](script, args)


if __name__ == "__main__":
    main()
