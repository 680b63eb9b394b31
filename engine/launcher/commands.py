"""The command each launcher runs: torchrun per node, wrapped in ssh, pdsh or srun, or started here.

Note [quoting for the remote shell]
Commands are argument vectors end to end. Where a remote shell must read one (ssh and pdsh hand sshd a string for
the user's shell), every word is quoted with shlex.quote, so host names, paths, variable values and script
arguments arrive as the same words, whatever spaces, quotes or `;` they hold. srun and local nodes exec the vector
directly, with no shell in between. Host names are checked against hosts.HOSTNAME too: ssh reads a leading '-' as
an option, which no quoting prevents.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

from engine.launcher.core_binding import BIND_ENV
from engine.launcher.plan import LauncherKind, LaunchPlan, Node

# Note [the deepspeed shim]: the directory holding the `deepspeed` package that is the compat layer, and the
# directory holding the `engine` package the shim imports
ENGINE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIM_DIR = os.path.join(ENGINE_ROOT, "engine", "compat", "shim")
DEEPSPEED_SCRIPT = os.path.join(ENGINE_ROOT, "engine", "launcher", "deepspeed_script.py")
BOUND_SCRIPT = os.path.join(ENGINE_ROOT, "engine", "launcher", "bound_script.py")  # Note [binding cores to ranks]

# Lines pdsh and srun print (on stderr) when one host's command fails: they name the host.
PDSH_FAILURE = re.compile(r"^pdsh@[^:\s]+: (?P<host>[^:\s]+): ssh exited with exit code (?P<code>\d+)")
SRUN_FAILURE = re.compile(r"^srun: error: (?P<host>[^:\s]+): tasks? [0-9,\-]+: "
                          r"(?:Exited with exit code (?P<code>\d+)|\w+)")


@dataclass(frozen=True)
class NodeCommand:
    name: str  # how errors name it: a node, or the one pdsh/srun process that runs them all
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # set on top of the launcher's environment, for this process
    failure_report: re.Pattern | None = None  # a stderr line naming a failed host (pdsh, srun)

    def display(self) -> str:
        """The exact command, as a POSIX shell line (what --dry-run prints)."""
        assignments = [f"{k}={v}" for k, v in self.env.items()]
        return shlex.join(["env", *assignments, *self.argv] if assignments else list(self.argv))


def node_name(node: Node) -> str:
    return f"node {node.host!r} (node_rank {node.rank})"


def node_environment(plan: LaunchPlan, node: Node) -> dict[str, str]:
    """What torchrun on `node` needs beyond the exported environment."""
    env = {}
    if plan.max_restarts > 0:  # restarts are refused without it (engine/topology.py); without restarts the
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # workers' own store costs start-up time for nothing
    if node.slots != tuple(range(len(node.slots))):  # a subset of the host's devices: --include/--exclude
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.slots))
    if plan.bind_cores is not None:  # Note [binding cores to ranks]
        env[BIND_ENV] = plan.bind_cores
    if plan.shimmed:  # the shim first, for this job's processes only (never site-packages)
        paths = [SHIM_DIR, ENGINE_ROOT, *plan.exported.get("PYTHONPATH", "").split(os.pathsep)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        if not plan.local_rank_arg:
            env["TIERS_NO_LOCAL_RANK"] = "1"
    return env


def torchrun_argv(plan: LaunchPlan, node: Node) -> list[str]:
    argv = [plan.python, "-u", "-m", "torch.distributed.run", f"--nnodes={len(plan.nodes)}",
            f"--nproc_per_node={len(node.slots)}", f"--max_restarts={plan.max_restarts}"]
    if plan.uses_rendezvous:
        argv += ["--rdzv_backend=c10d", f"--rdzv_endpoint={plan.master_addr}:{plan.master_port}",
                 f"--rdzv_id={plan.rdzv_id}"]
    else:
        argv += [f"--node_rank={node.rank}", f"--master_addr={plan.master_addr}", f"--master_port={plan.master_port}"]
    argv += list(plan.extra_torchrun_args)
    if plan.module:
        script = ["-m", plan.script]
    elif plan.as_deepspeed:  # (Note [the deepspeed shim]; it binds cores too)
        script = [DEEPSPEED_SCRIPT, plan.script]
    else:
        script = [BOUND_SCRIPT, plan.script] if plan.bind_cores is not None else [plan.script]
    return argv + [*script, *plan.script_args]


def remote_argv(plan: LaunchPlan, node: Node) -> list[str]:
    """torchrun under `env` with the exported environment: what runs on a node that does not inherit ours."""
    env = {**plan.exported, **node_environment(plan, node)}
    return ["env", *(f"{k}={v}" for k, v in env.items()), *torchrun_argv(plan, node)]


def remote_shell_line(plan: LaunchPlan, node: Node) -> str:
    """What a remote login shell runs: cd to the launch directory, then remote_argv."""
    return f"cd {shlex.quote(plan.cwd)} && exec {shlex.join(remote_argv(plan, node))}"


def node_commands(plan: LaunchPlan) -> list[NodeCommand]:
    if plan.launcher is LauncherKind.LOCAL:
        return [NodeCommand(node_name(n), tuple(torchrun_argv(plan, n)), {**plan.from_env_files,
                            **node_environment(plan, n)}) for n in plan.nodes]
    if plan.launcher is LauncherKind.SSH:
        # -tt: a remote terminal, so that when this ssh ends (the job is stopped) sshd hangs up on torchrun, which
        # stops its workers; the price is that the node's stderr arrives merged into stdout, with CRLF line ends.
        # BatchMode: fail at once rather than wait for a password nobody will type.
        port = ("-p", str(plan.ssh_port)) if plan.ssh_port is not None else ()
        return [NodeCommand(node_name(n), ("ssh", "-tt", "-o", "BatchMode=yes", *port, n.host,
                                           remote_shell_line(plan, n))) for n in plan.nodes]
    hosts = ",".join(n.host for n in plan.nodes)
    first = plan.nodes[0]  # every node has the same slots (make_plan checks), so one line serves them all
    if plan.launcher is LauncherKind.PDSH:
        # -S: exit with the largest remote exit code; -f: start all nodes at once, not 32 at a time.
        argv = ("pdsh", "-S", "-f", str(max(len(plan.nodes), 32)), "-w", hosts, remote_shell_line(plan, first))
        # pdsh's ssh gets -tt as well, for the same hang-up when pdsh is stopped.
        port = f"-p {plan.ssh_port}" if plan.ssh_port is not None else None
        ssh_args = " ".join(filter(None, [os.environ.get("PDSH_SSH_ARGS_APPEND"), "-tt", port]))
        return [NodeCommand(f"pdsh on {hosts}", argv, {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": ssh_args},
                            PDSH_FAILURE)]
    if plan.launcher is LauncherKind.SLURM:
        # one task per node, holding the node's CPUs (else a cgroup may give torchrun and its workers one)
        cpus = [f"--cpus-per-task={plan.srun_cpus}"] if plan.srun_cpus else []
        argv = ("srun", f"--nodes={len(plan.nodes)}", f"--ntasks={len(plan.nodes)}", "--ntasks-per-node=1", *cpus,
                f"--nodelist={hosts}", "--kill-on-bad-exit=1", f"--chdir={plan.cwd}",
                *remote_argv(plan, first))
        return [NodeCommand(f"srun on {hosts}", argv, {}, SRUN_FAILURE)]
    raise ValueError(f"no command for launcher {plan.launcher}")
