"""`tiers launch`: one job over many nodes, each node a torchrun (torch's elastic agent) started by ssh, pdsh, srun or
on this machine. hosts.py reads hostfiles and filters, plan.py decides nodes and rendezvous, commands.py writes
each node's command, supervisor.py runs them."""

from __future__ import annotations

import sys

from engine.launcher.commands import NodeCommand, node_commands
from engine.launcher.errors import LaunchError
from engine.launcher.hosts import expand_nodelist, parse_hostfile, select_resources
from engine.launcher.plan import LauncherKind, LaunchOptions, LaunchPlan, make_plan
from engine.launcher.supervisor import supervise

__all__ = ["LaunchError", "LaunchOptions", "LaunchPlan", "LauncherKind", "NodeCommand", "expand_nodelist",
           "launch", "make_plan", "node_commands", "parse_hostfile", "select_resources"]


def describe(plan: LaunchPlan) -> str:
    processes = sum(len(n.slots) for n in plan.nodes)
    rendezvous = f"c10d rendezvous {plan.rdzv_id}" if plan.uses_rendezvous else "fixed node ranks"
    return (f"{plan.launcher.value}: {len(plan.nodes)} node(s), {processes} process(es), master "
            f"{plan.master_addr}:{plan.master_port}, {rendezvous}")


def launch(options: LaunchOptions, dry_run: bool = False, out=None, log=None) -> int:
    """Plans the job and runs it (or, with dry_run, prints every node's exact command). Returns the exit code."""
    out, log = out or sys.stdout, log or sys.stderr
    plan = make_plan(options)
    commands = node_commands(plan)
    if dry_run:
        print(f"# {describe(plan)}", file=out)
        for command in commands:
            print(f"# {command.name}", file=out)
            print(command.display(), file=out)
        return 0
    print(f"tiers launch: {describe(plan)}", file=log)
    for command in commands:
        print(f"tiers launch: {command.name}: {command.display()}", file=log, flush=True)
    return supervise(commands, log=log)
