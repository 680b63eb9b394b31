"""Pieces every benchmark script shares: ranks on 127.0.0.1, loopback byte counts, the machine, tables.

Benchmarks are scripts, never timed assertions (DESIGN.md, Conventions). A script typically:

    port = free_port()
    results = spawn_ranks(worker, world, args=(port, options))  # worker(rank, world, port, options, results)
    print(markdown_table(headers, rows))  # engine.estimate.report.markdown_table
    print(machine_line(command_line()))
    write_results(args.json, [result_record("dp", "tiers stage 0", world=2, ...), ...])  # --json, for bench_all.py

`worker` runs in a fresh process per rank with one compute thread (as torchrun's OMP_NUM_THREADS=1);
`init_gloo(rank, world, port)` creates the default process group once, which `engine.initialize`
then reuses. Whatever a rank puts into `results` (a queue) comes back to the parent as a list.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, Sequence

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import topology
from engine.estimate.runtime import reset_peak_rss
from offload import units

try:
    import resource
except ImportError:  # Windows
    resource = None

LOOPBACK_NAMES = ("lo", "lo0")  # Linux, macOS


# ---- processes and process groups ----------------------------------------------------------------
free_port = topology.free_port  # the one the engine's trials and the tests' spawn helper use too


def one_thread() -> None:
    """One compute thread per process, as torchrun sets OMP_NUM_THREADS=1."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def init_gloo(rank: int, world: int, port: int, host: str = "127.0.0.1") -> None:
    """The default process group over TCP on `host:port`; the torchrun variables are set too."""
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world)


def _rank_entry(rank: int, fn: Callable, world: int, args: tuple, queue) -> None:
    one_thread()
    fn(rank, world, *args, queue)


# Note [malloc in benchmarks]
# glibc returns freed blocks above its (dynamic) mmap threshold, and heap tops above its trim
# threshold, to the kernel; the next step's activations then fault fresh zeroed pages in again.
# How much of that happens depends on allocation-order luck, not on the system being measured,
# and on these VMs a minor fault costs ~10 us (1e5 faults per step = +1 s on a 4.6 s step).
# Benchmarks therefore start their processes with fixed, high thresholds (freed memory stays in
# the process, as with jemalloc/tcmalloc) unless told otherwise, and report faults per step.
KEEP_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
# Benchmarks that report peak RSS do the opposite: the threshold fixed at 1 MiB, a freed tensor goes back to the
# kernel and RSS counts memory in use, not blocks glibc kept (e.g. of zero_init's throw-away tensors).
RETURN_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def spawn_ranks(fn: Callable, world: int, args: tuple = (), env: dict[str, str] | None = None) -> list:
    """Runs fn(rank, world, *args, results) in `world` fresh processes; returns what they put in `results`.

    fn must be a module-level function (it is pickled into spawned processes). `env` is added to the
    environment the processes start with (e.g. KEEP_FREED_MEMORY_ENV). The call returns after every
    rank has exited; a rank that raises makes it raise too.
    """
    queue = mp.get_context("spawn").SimpleQueue()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = mp.start_processes(_rank_entry, args=(fn, world, args, queue), nprocs=world, join=False,
                                   start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = []
    done = False
    while not done:  # drain while waiting: a rank blocks on a full pipe until someone reads it
        done = procs.join(timeout=0.2)
        while not queue.empty():
            out.append(queue.get())
    return out


def barrier_time() -> float:
    """perf_counter() right after a barrier of the default group (a plain clock without one)."""
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter()


# ---- measurements ---------------------------------------------------------------------------------
class LoopbackCounter:
    """Bytes sent over the loopback interface (every process on the machine, both directions counted once)."""

    def __init__(self):
        nics = psutil.net_io_counters(pernic=True)
        names = [n for n in LOOPBACK_NAMES if n in nics]
        self.name = names[0] if names else None

    @property
    def available(self) -> bool:
        return self.name is not None

    def read(self) -> int:
        if self.name is None:
            return 0
        return psutil.net_io_counters(pernic=True)[self.name].bytes_sent


class DiskCounter:
    """Bytes read + written by the block device holding `path` (every process on the machine), from
    /proc/diskstats; `device` is None (and read() 0) where there is none: tmpfs, overlay, not Linux."""

    def __init__(self, path: str):
        self.device = None
        try:
            dev = os.stat(path).st_dev
            with open("/proc/diskstats") as f:
                for line in f:
                    major, minor, name = line.split()[:3]
                    if (int(major), int(minor)) == (os.major(dev), os.minor(dev)):
                        self.device = name
        except (OSError, ValueError):
            pass

    @property
    def available(self) -> bool:
        return self.device is not None

    def read(self) -> int:
        if self.device is not None:
            with open("/proc/diskstats") as f:
                for line in f:
                    fields = line.split()
                    if fields[2] == self.device:
                        return (int(fields[5]) + int(fields[9])) * 512  # sectors read, written: 512 B each
        return 0


class CpuMeter:
    """CPU seconds this process and the whole machine spent, and this process's minor page faults,
    between start() and stop().

    `foreign_cores(own_total)` tells how many cores other processes kept busy meanwhile (given the
    CPU seconds of every process of the benchmark): a timing taken while it is well above zero was
    shared with someone else.
    """

    def __init__(self):
        self._proc = psutil.Process()
        self.minor_faults = 0

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)

    def start(self) -> None:
        c = self._proc.cpu_times()
        self._own0, self._busy0, self._wall0 = c.user + c.system, self._busy(), time.perf_counter()
        self._faults0 = _minor_faults()

    def stop(self) -> None:
        c = self._proc.cpu_times()
        self.own_s = c.user + c.system - self._own0
        self.busy_s = self._busy() - self._busy0
        self.wall_s = time.perf_counter() - self._wall0
        self.minor_faults = _minor_faults() - self._faults0

    def foreign_cores(self, own_total_s: float) -> float:
        return max(self.busy_s - own_total_s, 0.0) / self.wall_s if self.wall_s > 0 else 0.0


def _minor_faults() -> int:
    if resource is None:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# Note [peak memory of one system]
# The data-parallel, ZeRO and tensor-parallel benchmarks time several systems one after another in the
# same rank processes, and glibc keeps freed memory (Note [malloc in benchmarks]): a system run second
# would find the first one's heap still resident, and a process-lifetime peak would charge it to both.
# So before each system is built, the free heap goes back to the kernel (malloc_trim) and the peak RSS
# is reset to the current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs); each system's peak then
# counts what it allocates on top of the same live baseline (interpreter, torch, batches), as a fresh
# process would. This happens outside the timed steps; the warm-up steps fault the heap back in.
def release_free_heap_and_reset_peak() -> bool:
    """Returns free malloc memory to the kernel and resets this process's peak RSS to its current RSS
    (Note [peak memory of one system]); False where the peak could not be reset (not Linux)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return reset_peak_rss()


def max_over_ranks(value: float) -> float:
    """The largest `value` over the ranks of the default group (the value itself without one)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class SavedActivationBytes:
    """Inside the block: the bytes of the distinct storages autograd saves for backward
    (torch.autograd.graph.saved_tensors_hooks), the parameters' own storages left out. `unwrap` maps a
    saved tensor to the one holding its memory (e.g. a DTensor's local shard)."""

    def __init__(self, params, unwrap: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self._unwrap = unwrap
        self._skip = {unwrap(p).untyped_storage().data_ptr() for p in params}
        self._sizes: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = self._unwrap(t).untyped_storage()
        if storage.data_ptr() not in self._skip:
            self._sizes[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def __enter__(self) -> "SavedActivationBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# ---- description and output -----------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """CPU model, core counts, memory, torch and Python versions, on one line."""
    physical = psutil.cpu_count(logical=False)
    logical = psutil.cpu_count(logical=True)
    mem_gib = psutil.virtual_memory().total / 2**30
    return (f"{cpu_model()}, {physical} cores / {logical} threads, {mem_gib:.0f} GiB RAM, "
            f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()}")


def command_line() -> str:
    """The command that started this process, with the interpreter path relative to the cwd when inside it."""
    exe = sys.executable
    try:
        rel = os.path.relpath(exe)
        if not rel.startswith(".."):
            exe = rel
    except ValueError:
        pass
    return shlex.join([exe, *sys.argv])


# bytes in benchmark tables: always MB (10^6) with one decimal, e.g. '119.6 MB' (nan: 'n/a'), so that a column
# compares at a glance and with the tables docs/benchmarks.md already records
fmt_bytes = functools.partial(units.fmt_bytes, unit="MB")


def write_text(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def publish_report(body: str, started: float, out: str | None) -> str:
    """The report every benchmark ends with: `body`, the machine, the command with the run's total time; printed,
    and written to `out` when given."""
    text = "\n\n".join([body, f"Machine: {machine_line()}",
                        f"Command: `{command_line()}` (total {time.perf_counter() - started:.0f} s)"])
    print("\n" + text, flush=True)
    if out:
        write_text(out, text)
    return text


# ---- structured results (--json) ---------------------------------------------------------------------
RESULTS_FORMAT = 1


def add_json_option(ap) -> None:
    """The --json FILE option every benchmark script takes (see result_record / write_results)."""
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="also write the measured figures as JSON records here (scripts/bench_all.py reads them)")


def result_record(benchmark: str, system: str, *, world: int, role: str = "ours", peer: str | None = None,
                  strategy: str | None = None, metric: str = "step time", ratio: float | None = None,
                  target: float | None = None, better: str = "lower", step_s: float | None = None,
                  throughput: float | None = None, unit: str | None = None,
                  peak_rss_per_rank_bytes: float | None = None, **extra) -> dict:
    """One measured system of one benchmark, as a plain dict (JSON-ready).

    role: "ours" (compared with `peer`: `ratio` = ours / peer on `metric`, met when ratio <= target, or >= with
    better="higher"), "peer" (torch's system, or a raw baseline) or "reference" (context, e.g. the compute floor).
    strategy: a short name shared by the system and its peer (plot labels, e.g. "ZeRO-1"). throughput: in `unit`
    ("tokens/s", "MB/s"). peak_rss_per_rank_bytes: the largest peak RSS over the ranks. `extra`: anything else
    worth keeping (numbers or strings).
    """
    if role not in ("ours", "peer", "reference"):
        raise ValueError(f"role {role!r}: use 'ours', 'peer' or 'reference'")
    if better not in ("lower", "higher"):
        raise ValueError(f"better {better!r}: use 'lower' (ratio <= target) or 'higher' (ratio >= target)")
    if throughput is not None and unit is None:
        raise ValueError(f"throughput {throughput} of {system!r} needs a unit, e.g. 'tokens/s' or 'MB/s'")
    record = {"benchmark": benchmark, "system": system, "role": role, "peer": peer, "strategy": strategy,
              "world": world, "metric": metric, "ratio": ratio, "target": target, "better": better,
              "step_s": step_s, "throughput": throughput, "unit": unit,
              "peak_rss_per_rank_bytes": peak_rss_per_rank_bytes}
    return {**record, **extra}


def write_results(path: str | None, records: Sequence[dict]) -> None:
    """Writes `records` (result_record dicts) with the machine and the command to `path` as JSON; nothing
    when path is None."""
    if not path:
        return
    doc = {"format": RESULTS_FORMAT, "machine": machine_line(), "command": command_line(), "records": list(records)}
    write_text(path, json.dumps(doc, indent=1, allow_nan=True))


def read_results(path: str) -> list[dict]:
    """The records a benchmark wrote with write_results."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != RESULTS_FORMAT:
        raise ValueError(f"{path}: results format {doc.get('format')!r}, expected {RESULTS_FORMAT} "
                         "(written by another version of the benchmark scripts: run them again)")
    return doc["records"]
