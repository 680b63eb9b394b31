"""From `tiers launch` options to a LaunchPlan: the nodes (host, node rank, slots), the rendezvous, the environment."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from engine.launcher.core_binding import parse_core_list
from engine.launcher.environment import exported_environment
from engine.launcher.errors import LaunchError
from engine.launcher.hosts import expand_nodelist, read_hostfile, select_resources

DEFAULT_MASTER_PORT = 29500
# hosts a host list names for this machine: started here, not over ssh (ColossalAI runs these locally too)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", socket.gethostname())


class LauncherKind(str, Enum):
    LOCAL = "local"  # every node a torchrun on this machine (tests, single boxes)
    SSH = "ssh"      # one ssh per node
    PDSH = "pdsh"    # one pdsh for all nodes, the same command on each
    SLURM = "slurm"  # one srun task per node inside an allocation


@dataclass(frozen=True)
class LaunchOptions:
    script: str
    script_args: tuple[str, ...] = ()
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    launcher: LauncherKind | None = None  # None: ssh with a hostfile, else local
    max_restarts: int = 0
    as_deepspeed: bool = False  # Note [the deepspeed shim]: the script's `import deepspeed` is the compat layer
    local_rank_arg: bool = True  # with as_deepspeed: `--local_rank=N` first among the script's arguments
    bind_cores: bool = False  # Note [binding cores to ranks]
    bind_core_list: str | None = None  # the CPUs to share out (default: each node's affinity)
    as_colossalai: bool = False  # the script's `import colossalai` is engine.compat.colossalai
    hosts: tuple[str, ...] | None = None  # a host list (ColossalAI's --host, or its hostfile): nproc_per_node slots
    module: bool = False  # `script` names a module, run as `python -m` runs it
    extra_torchrun_args: tuple[str, ...] = ()  # ColossalAI's --extra_launch_args, as torchrun flags
    ssh_port: int | None = None  # the port ssh reaches every host on (default: ssh's)


@dataclass(frozen=True)
class Node:
    host: str
    rank: int  # torchrun's --node_rank: the hostfile's order
    slots: tuple[int, ...]  # GPU ordinals on that host, one process each


@dataclass(frozen=True)
class LaunchPlan:
    launcher: LauncherKind
    nodes: tuple[Node, ...]
    master_addr: str
    master_port: int
    max_restarts: int
    script: str
    script_args: tuple[str, ...]
    python: str  # the interpreter every node runs torchrun with: this one, as DeepSpeed does
    cwd: str  # every node starts here (remote nodes `cd` to it: shared file systems are the norm)
    exported: dict[str, str] = field(default_factory=dict)  # what a remote node's environment gets
    srun_cpus: str | None = None  # SLURM_CPUS_ON_NODE: each node's one srun task gets the node's CPUs
    from_env_files: dict[str, str] = field(default_factory=dict)  # what a node on this machine gets on top
    rdzv_id: str = ""
    as_deepspeed: bool = False
    local_rank_arg: bool = True
    bind_cores: str | None = None  # TIERS_BIND_CORES for every process: "1", or the core list (None: not bound)
    as_colossalai: bool = False
    module: bool = False
    extra_torchrun_args: tuple[str, ...] = ()
    ssh_port: int | None = None

    @property
    def shimmed(self) -> bool:
        """The script's framework imports are answered by a compat layer (Note [the deepspeed shim])."""
        return self.as_deepspeed or self.as_colossalai

    @property
    def uses_rendezvous(self) -> bool:
        """A c10d rendezvous instead of fixed node ranks: pdsh and srun run one identical command on every node,
        and restarts (--max_restarts) need every node's agent to rejoin, which only a rendezvous does."""
        return self.launcher in (LauncherKind.PDSH, LauncherKind.SLURM) or self.max_restarts > 0


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _host_pool(options: LaunchOptions, environ: dict[str, str]) -> OrderedDict[str, int]:
    if options.hosts is not None:
        return OrderedDict((host, options.nproc_per_node or 1) for host in options.hosts)
    if options.hostfile is not None:
        return read_hostfile(options.hostfile)
    if options.launcher is LauncherKind.SLURM:
        nodelist = environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LaunchError("--launcher slurm without --hostfile takes its hosts from SLURM_JOB_NODELIST, which is "
                              "not set; run inside an allocation (salloc/sbatch) or pass --hostfile")
        slots = options.nproc_per_node or int(environ.get("SLURM_GPUS_ON_NODE", "0") or 0) or 1
        return OrderedDict((host, slots) for host in expand_nodelist(nodelist))
    if options.launcher is not LauncherKind.LOCAL:
        raise LaunchError(f"--launcher {options.launcher.value} starts remote nodes and needs --hostfile "
                          "('hostname slots=N' lines); without one, use --launcher local")
    return OrderedDict(localhost=options.nproc_per_node or _local_gpu_count() or 1)


def make_plan(options: LaunchOptions, environ: dict[str, str] | None = None, cwd: str | None = None) -> LaunchPlan:
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    if options.launcher is None:  # a hostfile names other machines: reach them (DeepSpeed's default is pdsh)
        remote = options.hostfile is not None or any(h not in LOCAL_HOSTS for h in options.hosts or ())
        options = dataclasses.replace(options, launcher=LauncherKind.SSH if remote else LauncherKind.LOCAL)
    _check_options(options)
    pool = _host_pool(options, environ)
    resources = select_resources(pool, options.include, options.exclude, options.num_nodes, options.nproc_per_node)
    nodes = tuple(Node(host, rank, tuple(slots)) for rank, (host, slots) in enumerate(resources.items()))
    if options.launcher in (LauncherKind.PDSH, LauncherKind.SLURM) and len({n.slots for n in nodes}) > 1:
        layout = ", ".join(f"{n.host}:{','.join(map(str, n.slots))}" for n in nodes)
        raise LaunchError(f"--launcher {options.launcher.value} runs one identical command on every node, but the "
                          f"nodes use different slots ({layout}); give every node the same slots, or use "
                          "--launcher ssh")
    master_addr = options.master_addr or ("127.0.0.1" if options.launcher is LauncherKind.LOCAL else nodes[0].host)
    exported, from_files = exported_environment(environ, cwd)
    return LaunchPlan(launcher=options.launcher, nodes=nodes, master_addr=master_addr,
                      master_port=options.master_port, max_restarts=options.max_restarts, script=options.script,
                      script_args=tuple(options.script_args), python=sys.executable, cwd=cwd, exported=exported,
                      from_env_files=from_files, srun_cpus=environ.get("SLURM_CPUS_ON_NODE"),
                      rdzv_id=f"tiers-{uuid.uuid4().hex[:12]}", as_deepspeed=options.as_deepspeed,
                      local_rank_arg=options.local_rank_arg,
                      bind_cores=(options.bind_core_list or "1") if options.bind_cores else None,
                      as_colossalai=options.as_colossalai, module=options.module,
                      extra_torchrun_args=options.extra_torchrun_args, ssh_port=options.ssh_port)


def _check_options(options: LaunchOptions) -> None:
    if not options.local_rank_arg and not options.as_deepspeed:
        raise LaunchError("--no_local_rank belongs to --as-deepspeed (without it, no --local_rank is passed)")
    if options.as_deepspeed and options.as_colossalai:
        raise LaunchError("--as-deepspeed and --as-colossalai: a script is run as one framework's; choose one")
    if options.max_restarts < 0:
        raise LaunchError(f"--max_restarts {options.max_restarts}: must be >= 0")
    if not 0 < options.master_port < 65536:
        raise LaunchError(f"--master_port {options.master_port}: not a TCP port (1..65535)")
    if options.ssh_port is not None and not 0 < options.ssh_port < 65536:
        raise LaunchError(f"--ssh-port {options.ssh_port}: not a TCP port (1..65535)")
    if options.module and (options.as_deepspeed or options.bind_cores):
        raise LaunchError("-m runs a module as torchrun runs it, without the bootstrap --as-deepspeed and "
                          "--bind-cores need; run a script file with them")
    if options.bind_core_list is not None and not options.bind_cores:
        raise LaunchError("--bind_core_list names the cores --bind-cores (--bind_cores_to_rank) shares out; add "
                          "--bind-cores")
    if options.bind_core_list is not None:
        try:
            parse_core_list(options.bind_core_list)
        except ValueError as e:
            raise LaunchError(str(e)) from e
