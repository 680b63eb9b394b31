"""`tiers launch --bind-cores` (DeepSpeed's --bind_cores_to_rank): each local rank pinned to its share of the
physical cores, with its thread count to match (Note [binding cores to ranks])."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.launcher import LauncherKind, LaunchError, LaunchOptions, make_plan, node_commands
from engine.launcher.commands import BOUND_SCRIPT, DEEPSPEED_SCRIPT
from engine.launcher.core_binding import BIND_ENV, parse_core_list, physical_cores, share_of
from tests.distributed import free_port

REPO = Path(__file__).resolve().parent.parent


def _sysfs(tmp_path: Path, topology: dict[int, tuple[int, int]]) -> str:
    """A /sys/devices/system/cpu tree: cpu -> (package id, core id)."""
    for cpu, (package, core) in topology.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    return str(tmp_path)


def test_core_lists_in_deepspeeds_form():
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    for bad in ("", "a", "5-3", "1,-2"):
        with pytest.raises(ValueError, match="--bind_core_list"):
            parse_core_list(bad)


def test_hyperthreads_of_one_core_go_together_and_each_rank_gets_whole_cores(tmp_path):
    # 2 packages x 2 cores x 2 threads, siblings numbered as Linux numbers them (cpu n and n + 4)
    topology = {cpu: (cpu % 4 // 2, cpu % 2) for cpu in range(8)}
    cores = physical_cores(list(range(8)), _sysfs(tmp_path, topology))
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [share_of(cores, r, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert [share_of(cores, r, 3) for r in range(3)] == [[0], [1], [2]]  # the remainder stays unused
    with pytest.raises(ValueError, match="5 local ranks but 4 physical cores"):
        share_of(cores, 0, 5)


def test_the_plan_binds_every_process_and_checks_the_core_list(tmp_path):
    def commands(**options):
        plan = make_plan(LaunchOptions(script="train.py", launcher=LauncherKind.LOCAL, nproc_per_node=2, **options),
                         environ={}, cwd=str(tmp_path))
        return node_commands(plan)

    (plain,) = commands(bind_cores=True)
    assert plain.env[BIND_ENV] == "1" and BOUND_SCRIPT in plain.argv
    (listed,) = commands(bind_cores=True, bind_core_list="0-3")
    assert listed.env[BIND_ENV] == "0-3"
    (deepspeed,) = commands(bind_cores=True, as_deepspeed=True)
    assert deepspeed.env[BIND_ENV] == "1" and DEEPSPEED_SCRIPT in deepspeed.argv and BOUND_SCRIPT not in deepspeed.argv
    (unbound,) = commands()
    assert BIND_ENV not in unbound.env and BOUND_SCRIPT not in unbound.argv
    with pytest.raises(LaunchError, match="add --bind-cores"):
        commands(bind_core_list="0-3")
    with pytest.raises(LaunchError, match="is not a CPU number"):
        commands(bind_cores=True, bind_core_list="0-x")


PROBE = """
import json, os, sys
import torch
out = {"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "args": sys.argv[1:]}
with open(f"rank{os.environ['LOCAL_RANK']}.json", "w") as f:
    json.dump(out, f)
"""


@pytest.mark.parametrize("flags", [["--bind-cores"], ["--as-deepspeed", "--bind_cores_to_rank"]])
def test_launched_processes_are_pinned_before_torch_starts_its_threads(tmp_path, flags):
    available = sorted(os.sched_getaffinity(0))
    cores = physical_cores(available)
    ranks = min(2, len(cores))
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMP_NUM_THREADS")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--launcher", "local", "--nproc_per_node", str(ranks),
           "--master_port", str(free_port()), *flags, "probe.py", "--x"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    for rank, probe in enumerate(seen):
        assert probe["cpus"] == share_of(cores, rank, ranks)
        assert probe["threads"] == len(probe["cpus"])
        assert probe["args"][-1] == "--x"
    assert len({cpu for probe in seen for cpu in probe["cpus"]}) == sum(len(p["cpus"]) for p in seen)  # disjoint
