"""Which hosts and slots a job runs on: DeepSpeed's hostfile and --include/--exclude formats, and SLURM node lists.

A hostfile has one `hostname slots=N` line per host; blank lines and `#` comments are allowed. A filter is
`host[:slot,slot][@host[:slot,...]...]`: `--include worker-1:0,1@worker-2` keeps slots 0 and 1 of worker-1 and every
slot of worker-2; `--exclude` removes what it names. Hosts keep the hostfile's order, which is the node-rank order.
"""

from __future__ import annotations

import re
from collections import OrderedDict

from engine.launcher.errors import LaunchError

# A host name as the remote shell and ssh see it: no spaces, no shell metacharacters, no leading '-' (which ssh
# would read as an option), no ':' or '@' (the filter syntax). IPv4 addresses fit; user@host belongs in ~/.ssh/config.
HOSTNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def parse_hostfile(text: str, source: str) -> OrderedDict[str, int]:
    """Host -> slot count, in file order. Errors name `source` and the line."""
    hosts: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {number}"
        fields = line.split()
        match = re.fullmatch(r"slots=(\d+)", fields[1]) if len(fields) == 2 else None
        if match is None:
            raise LaunchError(f"{where}: expected 'hostname slots=N', got {raw.strip()!r}")
        host, slots = fields[0], int(match.group(1))
        if not HOSTNAME.fullmatch(host):
            raise LaunchError(f"{where}: {host!r} is not a host name (letters, digits, '.', '-', '_'; "
                              "put user names and ports in ~/.ssh/config)")
        if slots < 1:
            raise LaunchError(f"{where}: host {host!r} has slots={slots}; a host needs at least one slot")
        if host in hosts:
            raise LaunchError(f"{where}: host {host!r} is listed twice; give it one line with its total slots")
        hosts[host] = slots
    if not hosts:
        raise LaunchError(f"{source}: no hosts in it; write one 'hostname slots=N' line per host")
    return hosts


def read_hostfile(path: str) -> OrderedDict[str, int]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"--hostfile {path}: cannot read it ({e.strerror})") from e
    return parse_hostfile(text, path)


def _parse_filter(spec: str, flag: str, pool: OrderedDict[str, int]) -> dict[str, list[int] | None]:
    """host -> the slots named (None: the whole host)."""
    named: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, colon, slot_text = part.partition(":")
        if not host:
            raise LaunchError(f"{flag} {spec!r}: an empty host between '@'s; the form is host[:slot,slot][@host...]")
        if host not in pool:
            raise LaunchError(f"{flag} {spec!r}: host {host!r} is not in the hostfile (it has {', '.join(pool)})")
        slots = None
        if colon:
            try:
                slots = [int(s) for s in slot_text.split(",")]
            except ValueError:
                raise LaunchError(f"{flag} {spec!r}: slots of {host!r} must be integers, e.g. {host}:0,1") from None
            for slot in slots:
                if not 0 <= slot < pool[host]:
                    raise LaunchError(f"{flag} {spec!r}: slot {slot} exceeds host {host!r}'s slots={pool[host]} "
                                      f"(slots 0..{pool[host] - 1})")
        if host in named:
            previous = named[host]
            slots = None if previous is None or slots is None else previous + slots
        named[host] = slots
    return named


def select_resources(pool: OrderedDict[str, int], include: str | None = None, exclude: str | None = None,
                     num_nodes: int | None = None, nproc_per_node: int | None = None) -> OrderedDict[str, list[int]]:
    """The slots the job uses on each host, hosts in hostfile order: the filters first, then the first
    `num_nodes` hosts, then the first `nproc_per_node` slots of each."""
    for flag, spec in (("--include", include), ("--exclude", exclude)):
        if spec is not None and not spec.strip():
            raise LaunchError(f"{flag} is empty; name hosts as host[:slot,slot][@host...], or leave {flag} out")
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together; name what to keep or what to drop")
    chosen: OrderedDict[str, list[int]] = OrderedDict((host, list(range(n))) for host, n in pool.items())
    if include:
        named = _parse_filter(include, "--include", pool)
        chosen = OrderedDict((host, sorted(set(named[host] or slots))) for host, slots in chosen.items()
                             if host in named)
    elif exclude:
        named = _parse_filter(exclude, "--exclude", pool)
        for host, slots in named.items():
            chosen[host] = [] if slots is None else [s for s in chosen[host] if s not in slots]
        chosen = OrderedDict((host, slots) for host, slots in chosen.items() if slots)
        if not chosen:
            raise LaunchError(f"--exclude {exclude!r} leaves no slots on any host")
    if num_nodes is not None:
        if num_nodes < 1 or num_nodes > len(chosen):
            raise LaunchError(f"--num_nodes {num_nodes}: there are {len(chosen)} host(s) to use "
                              f"({', '.join(chosen)}); ask for 1..{len(chosen)}")
        chosen = OrderedDict(list(chosen.items())[:num_nodes])
    if nproc_per_node is not None:
        if nproc_per_node < 1:
            raise LaunchError(f"--nproc_per_node {nproc_per_node}: needs at least 1 process per node")
        for host, slots in chosen.items():
            if nproc_per_node > len(slots):
                raise LaunchError(f"--nproc_per_node {nproc_per_node} exceeds the {len(slots)} slot(s) of host "
                                  f"{host!r}; raise its slots= in the hostfile or ask for fewer processes")
            chosen[host] = slots[:nproc_per_node]
    return chosen


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, in order."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text]
            if ranges:
                choices = []
                for piece in ranges.split(","):
                    first, dash, last = piece.partition("-")
                    if not first.isdigit() or (dash and not last.isdigit()):
                        raise LaunchError(f"SLURM node list {nodelist!r}: cannot read the range [{ranges}]")
                    for n in range(int(first), int(last if dash else first) + 1):
                        choices.append(f"{text}{n:0{len(first)}d}")
            expanded = [head + choice for head in expanded for choice in choices]
        hosts.extend(h for h in expanded if h)
    return hosts
