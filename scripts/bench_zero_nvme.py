"""ZeRO stage 3 trained through NVMe: step time against the disk time its swap traffic needs, same run.

    .venv/bin/python scripts/bench_zero_nvme.py --dir /path/on/nvme
    .venv/bin/python scripts/bench_zero_nvme.py --dir /tmp --model bench30m --steps 6 --out /tmp/nvme.md

2 ranks (gloo, one thread each) train the GPT with `offload_optimizer` and `offload_param` both on
NVMe under a CPU budget (`memory.cpu_budget`, default 48 MB per rank) well below the model state
(16Ψ/2 bytes per rank, 239 MB for bench30m: the issue's case of states at least twice the budget),
so that every step streams parameter shards and optimizer states through the disk. It runs twice:
once stepping the optimizer after backward, once with `offload_optimizer.step_in_backward` (each
shard stepped as soon as it is reduced, Note [stepping in backward]). The manager counts the bytes
moved (both ranks share the disk, so their bytes are summed). The raw sequential bandwidth of the
same directory is measured with dd in the same run (O_DIRECT, before and after the training); the
disk-bound time of a step is write bytes ÷ raw write bandwidth + read bytes ÷ raw read bandwidth,
and the issue's target is a step time within 1.5× of it. The micro batch is small so that compute
stays below the disk time and the ratio shows how well the swaps overlap each other and the
compute (with a budget that holds most of the state, the step is compute-bound and the ratio
measures compute, not the disk).

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    DiskCounter,
    add_json_option,
    fmt_bytes,
    free_port,
    init_gloo,
    one_thread,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)
from disk_baseline import dd_bandwidth  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="swap directory, on the disk to measure")
    ap.add_argument("--model", default="bench30m", help="engine.models preset (default bench30m)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6, help="timed steps (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first: the manager traces them (default 2)")
    ap.add_argument("--aio-threads", type=int, default=2, help="aio.thread_count: I/O threads per rank (default 2)")
    ap.add_argument("--cpu-budget", default="48MB", help="memory.cpu_budget per rank (default 48MB)")
    ap.add_argument("--raw-bytes", type=int, default=1 << 30, help="bytes per raw dd pass (default 1 GiB)")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    return ap.parse_args(argv)


def engine_config(args, swap_dir: str, step_in_backward: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir,
                                                        "step_in_backward": step_in_backward},
                                  "offload_param": {"device": "nvme", "nvme_path": swap_dir}},
            "aio": {"thread_count": args.aio_threads}, "steps_per_print": 10**9,
            "memory": {"cpu_budget": args.cpu_budget}}


def rank_main(rank: int, world: int, port: int, args, step_in_backward: bool, results) -> None:
    from engine import initialize
    from engine.models import gpt_from_preset, preset_config

    one_thread()
    init_gloo(rank, world, port)
    torch.manual_seed(1234)
    engine = initialize(gpt_from_preset(args.model), engine_config(args, args.dir, step_in_backward))
    vocab = preset_config(args.model).vocab_size
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g)
               for _ in range(args.warmup + args.steps)]
    manager = engine.optimizer.manager
    times, moved = [], []
    for i, x in enumerate(batches):
        dist.barrier()
        before = dict(manager.stats.moved_bytes)  # stats: a snapshot
        t0 = time.perf_counter()
        engine.backward(engine(x, labels=x))
        engine.step()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            after = manager.stats.moved_bytes
            moved.append({k: after.get(k, 0) - before.get(k, 0) for k in ("cpu->nvme", "nvme->cpu")})
    stats = manager.stats
    held = {tier: stats.resident_bytes[tier] for tier in ("cpu", "nvme")}
    peak_cpu = stats.peak_bytes["cpu"]
    counters = {k: getattr(stats, k) for k in ("blocking_waits", "io_wait_seconds", "prefetches", "prefetch_hits",
                                                "prefetch_misses", "evictions", "clean_drops", "trace_divergences")}
    engine.close()
    results.put({"rank": rank, "times": times, "moved": moved, "held": held, "peak_cpu": peak_cpu,
                 "counters": counters, "steps": len(batches), "peak_rss": peak_rss_bytes()})


MODES = {False: "tiers ZeRO-3, offload_param + offload_optimizer nvme, step after backward",
         True: "tiers ZeRO-3, offload_param + offload_optimizer nvme, step_in_backward"}


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    disk = DiskCounter(args.dir)
    before = dd_bandwidth(args.dir, args.raw_bytes, disk)
    runs = {mode: sorted(spawn_ranks(rank_main, 2, args=(free_port(), args, mode)), key=lambda r: r["rank"])
            for mode in MODES}
    after = dd_bandwidth(args.dir, args.raw_bytes, disk)
    write_bw, read_bw = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    from engine.models import gpt_from_preset
    psi = gpt_from_preset(args.model).num_parameters()
    rows, details, records = [], [], []
    for mode, ranks in runs.items():
        step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
        written = statistics.median(sum(r["moved"][i]["cpu->nvme"] for r in ranks) for i in range(args.steps))
        read = statistics.median(sum(r["moved"][i]["nvme->cpu"] for r in ranks) for i in range(args.steps))
        disk_s = written / write_bw + read / read_bw
        ratio = step_s / disk_s if disk_s > 0 else float("nan")  # nan: the budget held every chunk, no disk traffic
        rows.append([MODES[mode], f"{step_s:.3f}", fmt_bytes(written), fmt_bytes(read), f"{disk_s:.3f}",
                     f"{ratio:.2f}"])
        records.append(result_record(
            "zero_nvme", MODES[mode], world=2, peer="raw disk (dd, O_DIRECT, same run)", strategy="ZeRO-3 NVMe",
            metric="step ÷ disk time", ratio=ratio, target=1.5, step_s=step_s,
            throughput=2 * args.micro_batch * args.seq / step_s, unit="tokens/s",
            peak_rss_per_rank_bytes=max(r["peak_rss"] for r in ranks), disk_s=disk_s, written_per_step=written,
            read_per_step=read, model=args.model))
        details.append(f"{MODES[mode]} — per rank after the run: " + "; ".join(
            f"rank {r['rank']}: NVMe holds {fmt_bytes(r['held']['nvme'])}, CPU tier holds "
            f"{fmt_bytes(r['held']['cpu'])} (peak {fmt_bytes(r['peak_cpu'])})" for r in ranks)
            + f"; manager counters, rank 0, whole run ({ranks[0]['steps']} steps): "
            + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in ranks[0]["counters"].items()))
    text = "\n".join([
        "### ZeRO stage 3 through NVMe (2 ranks, gloo, CPU, 1 thread/rank)",
        "",
        f"Model `{args.model}` (Ψ = {psi:,}; model state 16Ψ/2 = {fmt_bytes(8 * psi)} per rank), micro batch "
        f"{args.micro_batch} × seq {args.seq} per rank, AdamW fp32, memory.cpu_budget {args.cpu_budget} per rank. "
        f"Raw disk (dd, O_DIRECT, 8 MiB blocks, {fmt_bytes(args.raw_bytes)}; mean of before/after): write "
        f"{write_bw / 1e6:,.0f} MB/s ({before[0] / 1e6:,.0f} / {after[0] / 1e6:,.0f}), read {read_bw / 1e6:,.0f} MB/s "
        f"({before[1] / 1e6:,.0f} / {after[1] / 1e6:,.0f}). Median of {args.steps} steps after {args.warmup} "
        "warm-up; bytes summed over both ranks.",
        "",
        markdown_table(["system", "step time (s)", "written/step", "read/step", "disk time/step (s)",
                        "step ÷ disk time (target ≤ 1.5)"], rows),
        "",
        *[f"- {d}" for d in details],
    ])
    publish_report(text, started, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
