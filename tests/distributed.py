"""The one spawn helper for multi-process tests: gloo on 127.0.0.1, bounded time, any rank's failure fails the test.

    results = run_distributed(worker, world_size=2, args=(...), timeout_s=120)

A user's script whose framework starts the processes itself (Lightning's launcher, Ray) runs through
`run_user_script`, under the same time bound.

`worker(rank, world_size, *args)` must be a module-level function (it is pickled by reference
into freshly spawned processes). It runs with torch.distributed already initialized (gloo) and
the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set, with one
thread per rank. Its return value (picklable; tensors are fine) is collected per rank.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.topology import free_port


def _entry(worker, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    })
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except dist.DistNetworkError as e:  # the free port was taken between free_port() and rank 0's listen
        results.put((rank, PORT_TAKEN if "EADDRINUSE" in str(e) else "error", traceback.format_exc()))
        return
    try:
        out = worker(rank, world_size, *args)
        results.put((rank, "ok", _serialize(out)))
    except BaseException:  # report every failure, including asserts, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serialize(value) -> bytes:
    """Plain bytes: tensors put on a queue would share memory with a process that is about to exit."""
    buffer = io.BytesIO()
    torch.save(_to_cpu(value), buffer)
    return buffer.getvalue()


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def run_distributed(worker, world_size: int, args: tuple = (), timeout_s: float = 180.0) -> list:
    """Runs `worker` on `world_size` fresh processes; returns their results in rank order. A group whose port
    another process took before rank 0 listened on it (nothing of the worker ran) starts again on another port."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _run_once(worker, world_size, args, timeout_s)
        except _PortTaken:
            continue
    return _run_once(worker, world_size, args, timeout_s)


PORT_TAKEN, PORT_ATTEMPTS = "port taken", 3


class _PortTaken(RuntimeError):
    pass


def _run_once(worker, world_size: int, args: tuple, timeout_s: float) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(worker, r, world_size, port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - collected.keys())
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s (hang or deadlock?)")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in collected and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} without reporting"
                    ) from None
                continue
            if status == PORT_TAKEN:
                raise _PortTaken(f"rank {rank} could not start the group on port {port}:\n{payload}")
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [collected[r] for r in range(world_size)]


def run_cases(rank: int, cases: list[tuple], run) -> dict:
    """The worker side of several cases sharing one spawned group: `run(*case)` for each case, in order, keyed by
    the case; a failure names the case and the rank."""
    results = {}
    for case in cases:
        try:
            results[case] = run(*case)
        except Exception as e:
            raise RuntimeError(f"case {case} failed on rank {rank}") from e
    return results


def results_by_case(per_rank: list[dict]) -> dict:
    """{case: [rank 0's result, rank 1's, ...]} from what each rank's run_cases returned."""
    return {case: [results[case] for results in per_rank] for case in per_rank[0]}


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "PL_GLOBAL_SEED")


def run_user_script(script, args: list[str], cwd, timeout_s: float = 240.0) -> str:
    """Runs `python script *args` in `cwd` as a user would (no launch variables inherited, one thread per process),
    in a session of its own, so that the processes its framework starts die with it on a timeout; returns its
    output, or raises with the output's tail when it fails or runs past timeout_s."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    job = subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise TimeoutError(f"{script} ran past {timeout_s:.0f} s (hang or deadlock?):\n{output[-4000:]}") from None
    if job.returncode != 0:
        raise RuntimeError(f"{script} exited with {job.returncode}:\n{output[-6000:]}")
    return output

