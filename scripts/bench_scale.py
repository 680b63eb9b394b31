"""The largest GPT this machine trains: bf16, ZeRO stage 3, parameters, fp32 masters, optimizer states and
gradients all homed on NVMe, in one process and over 2 ranks.

    .venv/bin/python scripts/bench_scale.py --dir /path/on/nvme                  # ~4.2B parameters, ~68 GB
    .venv/bin/python scripts/bench_scale.py --dir /tmp --layers 2 --embd 256 --heads 4 --steps 3   # a smoke run

The model is built under `engine.zero_init()` (no full model in any process) and trained with AdamW on one
batch of byte-level text per process (the repository's corpus), the same every step, so that the loss must fall
if the updates are right. Per parameter the training states are 16 bytes
(Note [offloaded master weights]): 2 (bf16 parameter) + 2 (bf16 gradient) + 4 (fp32 master) + 8 (exp_avg,
exp_avg_sq); all of them live on NVMe and stream through a CPU window of `buffer_count` chunks per kind. The
chunk manager counts the bytes it moves; the raw sequential bandwidth of the same directory is measured with dd
(O_DIRECT) before and after the runs, and the disk-bound time of a step is written ÷ raw write bandwidth + read
÷ raw read bandwidth. The issue's targets: states ≥ 2.5× RAM (≥ 60 GB), peak RSS ≤ 25% of RAM, the loss falling
over ≥ 3 steps, step ÷ disk time ≤ 1.3.

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    DiskCounter,
    add_json_option,
    fmt_bytes,
    free_port,
    init_gloo,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)
from disk_baseline import dd_bandwidth  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402

MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
# --layout -> (bf16 section, optimizer type, training-state bytes per parameter after backward: Note [bf16 master
# weights], [block-wise optimizer states])
LAYOUTS = {
    "fp32-masters": ({"enabled": True}, "AdamW", 16),  # bf16 param + grad, fp32 master + two fp32 moments
    "bf16-masters": (MASTERS, "AdamW", 8),  # bf16 param (the master) + grad + two bf16 moments (DeepSpeed's)
    "rounded": ({**MASTERS, "stochastic_rounding": True}, "AdamW", 8),
    "lowbit": ({**MASTERS, "stochastic_rounding": True}, "AdamW8bit", 6.03),  # two 8-bit block-wise moments
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="swap directory, on the disk to measure")
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="training steps; the first one is not timed (default 4)")
    ap.add_argument("--worlds", default="1,2", help="process counts to run, in order (default 1,2)")
    ap.add_argument("--buffer-count", type=int, default=2, help="chunks of each kind in the CPU window (default 2)")
    ap.add_argument("--aio-threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-6)  # Adam moves every weight by ~lr at first: small at 4096 wide
    ap.add_argument("--raw-bytes", type=int, default=2 << 30, help="bytes per raw dd pass (default 2 GiB)")
    ap.add_argument("--layout", default="fp32-masters", choices=sorted(LAYOUTS),
                    help="training-state layout: fp32 masters (default); bf16 masters with bf16 moments; the same "
                         "rounded stochastically; lowbit: that with AdamW8bit's moments, its update compiled")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    return ap.parse_args(argv)


def engine_config(args, world: int) -> dict:
    offload = {"device": "nvme", "nvme_path": args.dir, "pin_memory": True, "buffer_count": args.buffer_count}
    largest = 4 * args.embd * args.embd  # an MLP weight: every large matrix is a chunk of its own or shares one
    bf16, optimizer, _ = LAYOUTS[args.layout]
    params = {"lr": args.lr, "weight_decay": 0.0, **({"compile": True} if optimizer == "AdamW8bit" else {})}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "seed": 1234,
            "optimizer": {"type": optimizer, "params": params},
            "bf16": bf16,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "chunk_size": largest - largest % world,
                                  "stage3_prefetch_bucket_size": largest,
                                  "offload_optimizer": offload, "offload_param": offload},
            "aio": {"thread_count": args.aio_threads}, "steps_per_print": 10**9}


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    from engine import initialize, zero_init
    from engine.models import load_corpus
    from engine.models.gpt import GPT, GPTConfig

    torch.set_num_threads(max(psutil.cpu_count() // world, 1))
    if world > 1:
        init_gloo(rank, world, port)  # one process: no process group at all
    torch.manual_seed(1234)
    config = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.embd)
    t0 = time.perf_counter()
    with zero_init():
        model = GPT(config)
    psi = model.num_parameters()
    engine = initialize(model, engine_config(args, world))
    init_s = time.perf_counter() - t0
    tokens = load_corpus()
    per_step = args.micro_batch * (args.seq + 1)
    manager = engine.optimizer.manager
    times, losses, moved, held = [], [], [], []
    start = rank * per_step  # the same batch every step: the loss must fall as the model fits it
    window = tokens[start:start + per_step].view(args.micro_batch, args.seq + 1)
    for _ in range(args.steps):
        before = dict(manager.stats.moved_bytes)
        t = time.perf_counter()
        loss = engine(window[:, :-1], labels=window[:, 1:])
        engine.backward(loss)
        held.append(manager.stats.resident_bytes["nvme"] + manager.stats.resident_bytes["cpu"])  # every state
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        after = manager.stats.moved_bytes
        moved.append({k: after.get(k, 0) - before.get(k, 0) for k in ("cpu->nvme", "nvme->cpu")})
    stats = manager.stats
    results.put({"rank": rank, "psi": psi, "init_s": init_s, "times": times, "losses": losses, "moved": moved,
                 "nvme_bytes": stats.resident_bytes["nvme"], "held_after_backward": max(held),
                 "peak_rss": peak_rss_bytes(), "skipped": engine.skipped_steps})
    engine.close()


def summarize(world: int, ranks: list[dict], write_bw: float, read_bw: float, ram: int, args) -> tuple[list, dict]:
    timed = range(1, args.steps)  # the first step traces the access order the later ones prefetch by
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in timed)
    written = statistics.median(sum(r["moved"][i]["cpu->nvme"] for r in ranks) for i in timed)
    read = statistics.median(sum(r["moved"][i]["nvme->cpu"] for r in ranks) for i in timed)
    disk_s = written / write_bw + read / read_bw
    ratio = step_s / disk_s if disk_s > 0 else float("nan")  # nan: the CPU window held every chunk
    states = sum(r["held_after_backward"] for r in ranks)  # the manager's CPU window and NVMe: every state
    on_disk = sum(r["nvme_bytes"] for r in ranks)  # at rest, after the last step (gradient shards freed)
    psi = ranks[0]["psi"]
    peak_rss = max(r["peak_rss"] for r in ranks)
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(args.steps)]
    falling = all(b < a for a, b in zip(losses, losses[1:]))
    row = [f"{world}", f"{psi / 1e9:.2f} B", fmt_bytes(states), f"{states / ram:.2f}×", fmt_bytes(on_disk),
           f"{fmt_bytes(peak_rss)} ({100 * peak_rss / ram:.1f}%)", f"{max(r['init_s'] for r in ranks):.0f}",
           f"{step_s:.1f}", fmt_bytes(written), fmt_bytes(read), f"{disk_s:.1f}", f"{ratio:.2f}",
           " → ".join(f"{x:.3f}" for x in losses) + (" (falling)" if falling else " (not falling)")]
    layout = "" if args.layout == "fp32-masters" else f" ({args.layout})"
    record = result_record(
        "scale", f"tiers ZeRO-3 bf16{layout}, everything on NVMe, {world} process(es)", world=world, layout=args.layout,
        peer="raw disk (dd, O_DIRECT, same run)", strategy="ZeRO-3 NVMe bf16", metric="step ÷ disk time",
        ratio=ratio, target=1.3, step_s=step_s, throughput=world * args.micro_batch * args.seq / step_s,
        unit="tokens/s", peak_rss_per_rank_bytes=peak_rss, parameters=psi, states_bytes=states,
        states_on_disk_at_rest_bytes=on_disk, states_over_ram=states / ram, peak_rss_over_ram=peak_rss / ram,
        losses=losses, loss_falling=falling,
        written_per_step=written, read_per_step=read, disk_s=disk_s)
    return row, record


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    ram = psutil.virtual_memory().total
    disk = DiskCounter(args.dir)
    before = dd_bandwidth(args.dir, args.raw_bytes, disk)
    runs = {}
    for world in (int(w) for w in args.worlds.split(",")):
        ranks = spawn_ranks(rank_main, world, args=(free_port(), args))
        runs[world] = sorted(ranks, key=lambda r: r["rank"])
    after = dd_bandwidth(args.dir, args.raw_bytes, disk)
    write_bw, read_bw = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    rows, records = [], []
    for world, ranks in runs.items():
        row, record = summarize(world, ranks, write_bw, read_bw, ram, args)
        rows.append(row)
        records.append(record)
    psi = next(iter(runs.values()))[0]["psi"]
    bf16, optimizer, per_param = LAYOUTS[args.layout]
    text = "\n".join([
        f"### Scale: the largest GPT through NVMe (bf16, ZeRO-3, everything offloaded; layout {args.layout})",
        "",
        f"GPT {args.layers} layers × {args.embd} wide ({args.heads} heads), byte vocabulary, Ψ = {psi:,}: training "
        f"states {per_param}Ψ = {fmt_bytes(per_param * psi)} against {fmt_bytes(ram)} of RAM (bf16 section "
        f"{bf16}). Micro batch {args.micro_batch} × seq {args.seq} per process, {optimizer} lr {args.lr}, "
        "clipping 1.0, "
        f"buffer_count {args.buffer_count}, built under zero_init. Raw disk (dd, O_DIRECT, 8 MiB blocks, "
        f"{fmt_bytes(args.raw_bytes)}; mean of before/after): write {write_bw / 1e6:,.0f} MB/s "
        f"({before[0] / 1e6:,.0f} / {after[0] / 1e6:,.0f}), read {read_bw / 1e6:,.0f} MB/s "
        f"({before[1] / 1e6:,.0f} / {after[1] / 1e6:,.0f}). Step figures: median of steps 2..{args.steps} (the "
        "first records the trace); bytes summed over the processes; the loss is the mean over the processes (each "
        "trains on one fixed batch).",
        "",
        markdown_table(["processes", "parameters", "training states (after backward)", "÷ RAM",
                        "on NVMe at rest", "peak RSS per process (of RAM)",
                        "build + initialize (s)", "step (s)", "written/step", "read/step", "disk time/step (s)",
                        "step ÷ disk time (target ≤ 1.3)", "loss by step"], rows),
    ])
    publish_report(text, started, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
