"""Each local rank pinned to its share of the node's physical cores (`tiers launch --bind-cores`).

Note [binding cores to ranks]
Ranks on one node that each run torch's CPU kernels (the offloaded optimizer's host step, a CPU run's matmuls)
otherwise all start a thread per core and contend for every core. With `--bind-cores` (DeepSpeed's
`--bind_cores_to_rank`) the launcher sets TIERS_BIND_CORES, and each process, before it imports torch or runs the
script, takes the cores it may use (its affinity, or `--bind_core_list`), groups the logical CPUs into physical
cores (the same package and core id: hyperthreads of one core go together), gives each of the LOCAL_WORLD_SIZE
ranks a contiguous, equal run of whole cores (the remainder unused, as DeepSpeed leaves it), pins itself to the
first logical CPU of each of its cores, and sets OMP_NUM_THREADS (and so torch's thread count) to their number.
Fewer physical cores than local ranks is refused, naming both.
"""

from __future__ import annotations

import os
from collections import OrderedDict

BIND_ENV = "TIERS_BIND_CORES"  # "1", or a --bind_core_list ("0-7,16-23")
SYSFS_CPU = "/sys/devices/system/cpu"


def parse_core_list(text: str) -> list[int]:
    """"1,3-5,7" -> [1, 3, 4, 5, 7] (DeepSpeed's --bind_core_list form)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"--bind_core_list {text!r}: {part!r} is not a CPU number or a range like 3-5")
        cpus.extend(range(int(first), int(last) + 1) if dash else [int(first)])
    if not cpus:
        raise ValueError(f"--bind_core_list {text!r}: names no CPU")
    return list(dict.fromkeys(cpus))


def physical_cores(cpus: list[int], sysfs: str = SYSFS_CPU) -> list[list[int]]:
    """`cpus` grouped by physical core (package id, core id), each group in CPU order, groups in order of their
    first CPU. A CPU whose topology is not readable counts as a core of its own."""
    cores: OrderedDict[tuple, list[int]] = OrderedDict()
    for cpu in sorted(cpus):
        key: tuple = ("cpu", cpu)
        try:
            with open(os.path.join(sysfs, f"cpu{cpu}", "topology", "physical_package_id")) as f:
                package = int(f.read())
            with open(os.path.join(sysfs, f"cpu{cpu}", "topology", "core_id")) as f:
                key = (package, int(f.read()))
        except (OSError, ValueError):
            pass
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


def share_of(cores: list[list[int]], local_rank: int, local_world: int) -> list[int]:
    """The logical CPUs local rank `local_rank` of `local_world` is pinned to: one per physical core of its run."""
    per_rank = len(cores) // local_world
    if per_rank == 0:
        raise ValueError(f"--bind-cores: {local_world} local ranks but {len(cores)} physical cores to bind them to; "
                         "run fewer processes per node, or launch without --bind-cores")
    return [core[0] for core in cores[local_rank * per_rank:(local_rank + 1) * per_rank]]


def bind_from_environment(environ: dict | None = None) -> list[int] | None:
    """Note [binding cores to ranks]: pins this process when the launcher asked for it; returns the CPUs (None:
    not asked). Call it before torch is imported."""
    environ = os.environ if environ is None else environ
    asked = environ.get(BIND_ENV)
    if not asked:
        return None
    available = sorted(os.sched_getaffinity(0)) if asked == "1" else parse_core_list(asked)
    cpus = share_of(physical_cores(available), int(environ.get("LOCAL_RANK", "0")),
                    int(environ.get("LOCAL_WORLD_SIZE", "1")))
    os.sched_setaffinity(0, cpus)
    environ["OMP_NUM_THREADS"] = str(len(cpus))
    return cpus
