"""`tiers launch --as-colossalai`: `colossalai run`'s arguments in its own formats, as LaunchOptions.

A host list is `--host h1,h2` or a hostfile with one host name per line (blank lines skipped); `--include` and
`--exclude` are comma-separated host names; every host runs --nproc_per_node processes (required, as in
`colossalai run`); `--extra_launch_args a=1,b` are torchrun's `--a=1 --b` (master_addr and master_port there set
the rendezvous, as in ColossalAI); `-m` runs the script as a module (`-m package.module ARGS`).
A host list naming only this machine (127.0.0.1, localhost, 0.0.0.0, its host name) starts it here; other hosts are
reached by ssh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.launcher.errors import LaunchError
from engine.launcher.hosts import HOSTNAME
from engine.launcher.plan import DEFAULT_MASTER_PORT, LaunchOptions

FLAG = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")
# torchrun flags the launcher sets itself (per node, or for the rendezvous)
OWN_FLAGS = {"nnodes", "nproc_per_node", "nproc-per-node", "node_rank", "node-rank", "rdzv_endpoint",
             "rdzv-endpoint", "rdzv_backend", "rdzv-backend", "rdzv_id", "rdzv-id", "max_restarts", "max-restarts"}


@dataclass(frozen=True)
class ColossalAIRun:
    """`colossalai run`'s arguments as given."""

    script: str
    script_args: tuple[str, ...] = ()
    host: str | None = None
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    nproc_per_node: int | None = None
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    extra_launch_args: str | None = None
    ssh_port: int | None = None
    module: bool = False  # -m: `script` is a module name


def host_list(text: str, source: str, separator: str | None) -> tuple[str, ...]:
    """Host names split on `separator` (None: lines), each checked; a name twice is an error, as in ColossalAI."""
    names = [n.strip() for n in (text.split(separator) if separator else text.splitlines())]
    names = [n for n in names if n]
    for name in names:
        if not HOSTNAME.fullmatch(name):
            raise LaunchError(f"{source}: {name!r} is not a host name (one name per "
                              f"{'line' if separator is None else 'comma'}; `colossalai run`'s hostfile has no "
                              "slots: every host runs --nproc_per_node processes)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LaunchError(f"{source}: {', '.join(twice)} listed twice")
    if not names:
        raise LaunchError(f"{source}: no hosts in it")
    return tuple(names)


def _hosts(run: ColossalAIRun) -> tuple[str, ...] | None:
    if run.host is not None and run.hostfile is not None:
        raise LaunchError("--host and --hostfile both name the hosts; give one of them")
    if run.hostfile is not None:
        try:
            with open(run.hostfile) as f:
                return host_list(f.read(), f"--hostfile {run.hostfile}", None)
        except OSError as e:
            raise LaunchError(f"--hostfile {run.hostfile}: cannot read it ({e.strerror})") from e
    return host_list(run.host, "--host", ",") if run.host is not None else None


def _filter(spec: str | None, flag: str) -> str | None:
    """A comma list of hosts in the launcher's own filter syntax (host@host)."""
    return None if spec is None else "@".join(host_list(spec, flag, ","))


def torchrun_flags(extra: str | None) -> tuple[tuple[str, ...], dict[str, str]]:
    """(torchrun's flags, the rendezvous settings master_addr / master_port among them) of `a=1,b`."""
    flags, rendezvous = [], {}
    for item in filter(None, (extra or "").split(",")):
        name, eq, value = item.partition("=")
        if not FLAG.fullmatch(name) or name in OWN_FLAGS:
            raise LaunchError(f"--extra_launch_args: {item!r} is not a torchrun flag this launcher leaves to you "
                              f"(it sets {', '.join(sorted(n for n in OWN_FLAGS if '_' in n))} itself)")
        if name.replace("-", "_") in ("master_addr", "master_port"):
            rendezvous[name.replace("-", "_")] = value
        else:
            flags.append(f"--{name}={value}" if eq and value else f"--{name}")
    return tuple(flags), rendezvous


def colossalai_options(run: ColossalAIRun) -> LaunchOptions:
    if run.nproc_per_node is None:
        raise LaunchError("--as-colossalai: --nproc_per_node is required (as in `colossalai run`): the processes "
                          "each host runs")
    if run.module and run.script.endswith(".py"):
        raise LaunchError(f"-m {run.script}: -m takes a module name (package.module), not a file")
    if not run.module and not run.script.endswith(".py"):
        raise LaunchError(f"--as-colossalai runs a .py script (or -m module), got {run.script!r}")
    flags, rendezvous = torchrun_flags(run.extra_launch_args)
    try:
        port = int(rendezvous.get("master_port", run.master_port))
    except ValueError:
        raise LaunchError(f"--extra_launch_args master_port={rendezvous['master_port']}: not a port") from None
    return LaunchOptions(script=run.script, script_args=run.script_args, hosts=_hosts(run),
                         include=_filter(run.include, "--include"), exclude=_filter(run.exclude, "--exclude"),
                         num_nodes=None if run.num_nodes in (None, -1) else run.num_nodes,
                         nproc_per_node=run.nproc_per_node,
                         master_addr=rendezvous.get("master_addr", run.master_addr), master_port=port,
                         as_colossalai=True, module=run.module, extra_torchrun_args=flags,
                         ssh_port=run.ssh_port)
