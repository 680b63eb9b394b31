"""Runs the node commands and watches them: the first one to fail stops the rest; Ctrl-C stops them all.

Note [stopping a job]
A node that fails leaves the others' workers waiting in a collective until its timeout (minutes, with NCCL), so
the launcher stops them itself. Each node command runs in its own session; stopping sends SIGTERM to that process
group (torchrun handles it by stopping its workers; a local ssh client ends, and sshd hangs up on the remote
torchrun through its terminal, see commands.py), then after a grace period SIGKILL to every process that was under
it, workers included: torchrun starts each worker in a session of its own, beyond the reach of a group signal.
A second Ctrl-C (or SIGTERM) during the grace period kills at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum

import psutil

from engine.launcher.commands import NodeCommand

POLL_S = 0.1


class NodeState(Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class Failure:
    name: str
    exit_code: int


class RunningNode:
    def __init__(self, command: NodeCommand, log):
        self.command = command
        self.state = NodeState.RUNNING
        self.reported: Failure | None = None  # a failed host named in pdsh's or srun's own report
        self.watcher: threading.Thread | None = None
        pipe = subprocess.PIPE if command.failure_report else None
        self.process = subprocess.Popen(command.argv, env={**os.environ, **command.env}, stdin=subprocess.DEVNULL,
                                        stderr=pipe, start_new_session=True, text=pipe is not None,
                                        errors="replace" if pipe else None)
        if pipe:
            self.watcher = threading.Thread(target=self._watch_stderr, args=(log,), daemon=True)
            self.watcher.start()

    def _watch_stderr(self, log) -> None:
        """Forwards stderr and notes the first line that reports a failed host."""
        for line in self.process.stderr:
            log.write(line)
            match = self.command.failure_report.match(line)
            if match and self.reported is None and match.group("code") != "0":
                self.reported = Failure(f"node {match.group('host')!r}", int(match.group("code") or 1))

    def finish_output(self, timeout_s: float = 2.0) -> None:
        """Waits for the last stderr lines (pdsh may exit before its report of the failed host is read)."""
        if self.watcher is not None:
            self.watcher.join(timeout_s)

    def poll(self) -> NodeState:
        if self.state is NodeState.RUNNING:
            code = self.process.poll()
            if code is not None:
                self.state = NodeState.SUCCEEDED if code == 0 else NodeState.FAILED
            elif self.reported is not None:
                self.state = NodeState.FAILED
        return self.state

    def failure(self) -> Failure:
        if self.process.poll() is not None:
            self.finish_output()
        if self.reported is not None:
            return Failure(f"{self.reported.name} under {self.command.name}", self.reported.exit_code)
        return Failure(self.command.name, _shell_code(self.process.returncode))

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)  # its own session: the group id is its pid
        except (ProcessLookupError, PermissionError):
            pass


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _shell_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode  # killed by signal s: 128 + s, as shells report it


def stop(nodes: list[RunningNode], grace_s: float, hurry=lambda: False) -> None:
    """SIGTERM to every running node's group; SIGKILL to whatever of theirs is left after `grace_s`, or as soon as
    `hurry()` says so."""
    running = [n for n in nodes if n.process.poll() is None]
    tree = {p.pid: p for n in running for p in n.processes()}
    for node in running:
        node.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not hurry():
        for node in running:  # processes started since (a torchrun restart) are killed too
            tree.update((p.pid, p) for p in node.processes())
        if not any(_alive(p) for p in tree.values()):
            break
        time.sleep(POLL_S)
    for process in tree.values():
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    for node in running:
        node.process.wait()
        node.finish_output()
        if node.state is NodeState.RUNNING:
            node.state = NodeState.STOPPED


def supervise(commands: list[NodeCommand], grace_s: float = 30.0, log=None) -> int:
    """Runs every command to the end; returns 0, or the exit code of the first failure (after stopping the rest),
    or 128 + the signal when interrupted."""
    log = log or sys.stderr
    interrupted: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, lambda s, _frame: interrupted.append(s))
    nodes: list[RunningNode] = []
    try:
        for command in commands:
            try:
                nodes.append(RunningNode(command, log))
            except OSError as e:
                print(f"tiers launch: cannot start {command.name}: {command.argv[0]}: {e.strerror}", file=log)
                stop(nodes, grace_s)
                return 127 if isinstance(e, FileNotFoundError) else 126
        while True:
            if interrupted:
                name = signal.Signals(interrupted[0]).name
                print(f"tiers launch: {name}: stopping {len(nodes)} node command(s) (again to kill at once)",
                      file=log, flush=True)
                stop(nodes, grace_s, hurry=lambda: len(interrupted) > 1)
                return 128 + interrupted[0]
            states = [n.poll() for n in nodes]
            failed = [n for n, s in zip(nodes, states) if s is NodeState.FAILED]
            if failed:
                failure = failed[0].failure()
                others = [n.command.name for n in nodes if n.state is NodeState.RUNNING]
                print(f"tiers launch: {failure.name} failed with exit code {failure.exit_code}"
                      + (f"; stopping {', '.join(others)}" if others else ""), file=log, flush=True)
                stop(nodes, grace_s)
                return failure.exit_code
            if all(s is NodeState.SUCCEEDED for s in states):
                for node in nodes:
                    node.finish_output()
                return 0
            time.sleep(POLL_S)
    finally:
        if any(n.process.poll() is None for n in nodes):  # an unexpected error here must not leave nodes running
            stop(nodes, grace_s)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
