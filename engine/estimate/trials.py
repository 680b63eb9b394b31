"""A short training trial of one config: `world` fresh processes on this machine, step time and peak memory.

Each rank is a fresh interpreter (so its peak memory is its own), joins a process group over
127.0.0.1 through the torchrun variables (`initialize` creates it: gloo on CPU, nccl on CUDA), builds
the model with the same seed, and trains `warmup + steps` optimizer steps on random token batches.
The step time is the median over the timed steps of the slowest rank's time (a barrier ends each
step's clock); memory is each rank's peak RSS and, on CUDA, its peak allocated device bytes.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import queue
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from engine.estimate.activations import language_model_inputs, loss_of
from engine.estimate.runtime import peak_rss_bytes, reset_peak_rss
from engine.topology import free_port


@dataclass(frozen=True)
class TrialResult:
    step_s: float  # median optimizer-step time, slowest rank
    peak_rss: int  # max over ranks
    device_peak: int | None  # CUDA: max over ranks of max_memory_allocated; None on CPU
    managed_cpu_peak: int  # bytes the offload manager held in CPU memory at its peak (0 without offload)
    disk_peak: int = 0  # max over ranks of the swap files' peak bytes (Note [bytes on disk]; 0 without NVMe)


@dataclass(frozen=True)
class TrialRun:
    """What each rank of a trial trains: the model's factory, every rank's config, the sequence length, the timed
    steps after the warm-up ones, and the rendezvous port."""

    factory: Callable[[], nn.Module]
    configs: list[dict]
    seq_len: int
    steps: int
    warmup: int
    port: int


class TrialError(RuntimeError):
    """A trial that did not finish: a rank raised, died (e.g. killed for memory) or ran out of time."""


def run_trial(factory: Callable[[], nn.Module], config: dict, world: int, seq_len: int, steps: int = 3,
              warmup: int = 1, timeout_s: float = 600.0) -> TrialResult:
    """Trains `config` for warmup + steps steps on `world` local ranks; raises TrialError when it fails."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    with contextlib.ExitStack() as cleanup:
        config = _with_swap_directories(config, world, cleanup)
        run = TrialRun(factory, config, seq_len, steps, warmup, port)
        ranks = [context.Process(target=_rank_main, daemon=True, args=(rank, world, run, results))
                 for rank in range(world)]
        for p in ranks:
            p.start()
        reports, deadline = [], time.monotonic() + timeout_s
        try:
            while len(reports) < world:
                try:
                    reports.append(results.get(timeout=1.0))
                except queue.Empty:
                    dead = [p for p in ranks if p.exitcode not in (None, 0)]
                    if dead:
                        raise TrialError(
                            f"rank {ranks.index(dead[0])} died with exit code {dead[0].exitcode}") from None
                    if time.monotonic() > deadline:
                        raise TrialError(f"no result within {timeout_s:.0f} s") from None
                if reports and isinstance(reports[-1], str):
                    raise TrialError(reports[-1])
        except TrialError:
            for p in ranks:  # a failed trial's other ranks may wait in a collective forever
                p.kill()
            raise
        finally:
            for p in ranks:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    step_s = statistics.median(max(step) for step in zip(*(r["times"] for r in reports)))
    device = [r["device_peak"] for r in reports]
    return TrialResult(step_s, max(r["peak_rss"] for r in reports),
                       None if device[0] is None else max(device), max(r["managed_cpu"] for r in reports),
                       max(r["disk_peak"] for r in reports))


def _rank_main(rank: int, world: int, run: TrialRun, results) -> None:
    try:
        results.put(_train(rank, world, run))
    except BaseException:  # noqa: B902 - the parent reports it, with the traceback
        results.put(f"rank {rank}: {traceback.format_exc(limit=8)}")
    finally:
        import torch.distributed as dist
        if dist.is_initialized():  # gloo's threads are joined now, not during interpreter shutdown
            dist.destroy_process_group()


def _train(rank: int, world: int, run: TrialRun) -> dict:
    seq_len, steps, warmup = run.seq_len, run.steps, run.warmup
    reset_peak_rss()  # the peak this process reaches itself, not its parent's (runtime.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(run.port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    # CPU compute: one thread per rank, as torchrun sets OMP_NUM_THREADS=1; on CUDA the CPU threads serve the
    # offloaded optimizer, so the ranks share the cores
    torch.set_num_threads(max(os.cpu_count() // world, 1) if torch.cuda.is_available() else 1)
    import torch.distributed as dist

    from engine import initialize

    torch.manual_seed(0)
    engine = initialize(run.factory(), run.configs[rank])
    model = engine.module
    micro = engine.train_micro_batch_size_per_gpu
    generator = torch.Generator().manual_seed(1 + engine.dp_rank)
    vocab = model.config.vocab_size
    times = []
    for step in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        batches = [language_model_inputs(model, micro, seq_len, torch.randint(0, vocab, (micro, seq_len),
                                                                           generator=generator).to(engine.device))
                   for _ in range(engine.gradient_accumulation_steps)]
        if engine.pipeline is not None:  # the step's micro-batches through the schedule (Note [a pipelined step])
            engine.train_batch(iter([kwargs if kwargs else args for args, kwargs in batches]))
        for args, kwargs in batches if engine.pipeline is None else []:
            engine.backward(loss_of(engine(*args, **kwargs)))
            engine.step()
        if dist.is_initialized():
            dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    manager = getattr(engine.optimizer, "manager", None)
    stats = manager.stats if manager is not None else None
    managed_cpu = stats.peak_bytes.get("cpu", 0) if stats is not None else 0
    device_peak = torch.cuda.max_memory_allocated() if engine.device.type == "cuda" else None
    engine.close()
    return {"times": times, "peak_rss": peak_rss_bytes(), "device_peak": device_peak, "managed_cpu": managed_cpu,
            "disk_peak": stats.peak_disk_bytes if stats is not None else 0}


def _with_swap_directories(config: dict, world: int, cleanup: contextlib.ExitStack) -> list[dict]:
    """Each rank's config: NVMe swap files in a fresh directory per rank under the config's nvme_path (or the
    system's temporary directory), removed when the trial ends."""
    configs = []
    for rank in range(world):
        mine = copy.deepcopy(config)
        sections = [s for s in (mine.get("zero_optimization", {}).get(key, {})
                                for key in ("offload_optimizer", "offload_param")) if s.get("device") == "nvme"]
        if sections:  # one directory for both kinds (the engine keeps them together)
            base = sections[0].get("nvme_path")
            directory = cleanup.enter_context(tempfile.TemporaryDirectory(
                prefix=f"tiers-tune-rank{rank}-", dir=base if base and os.path.isdir(base) else None))
            for section in sections:
                section["nvme_path"] = directory
        configs.append(mine)
    return configs
