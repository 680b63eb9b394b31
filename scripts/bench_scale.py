"""The largest GPT this machine trains through NVMe in one process, and its step against the step's floor.

    .venv/bin/python scripts/bench_scale.py --dir /path/on/nvme          # 64 x 4096 (12.9 B) where it fits
    .venv/bin/python scripts/bench_scale.py --dir /tmp --layers 2 --embd 256 --heads 4 --steps 3   # a smoke run

By default (the issue's run): bf16 with `bf16_master_weights_and_grads`, `bf16_optimizer_states` and
`stochastic_rounding`, AdamW8bit (its update compiled), ZeRO-3 with parameters and optimizer on NVMe and
`offload_optimizer.step_in_backward`, micro batch 1 x 128 tokens, one process; `gradient_clipping` is off, as
step_in_backward refuses it (`--step-after-backward` steps after backward, clipping at 1.0). The model is built
under `engine.zero_init()` (no full model in any process) and trained on one batch of byte-level text, the same
every step, so that the loss must fall if the updates are right.

Before the run it measures the machine (scripts/scale_plan.py): a bf16 matmul of the model's MLP shape, one
pass of the layout's update in memory, the raw disk with dd (O_DIRECT, also after the run) and the free disk.
With `--layers auto` (default) it runs 64 blocks where a step is predicted to fit `--step-budget-s` (15 minutes)
and the estimate's disk peak fits the free disk, else the largest size that does, and projects the 64-block
figures from the run's own ratios (marked "projected"). Per run it reports: parameters; bytes on disk at rest
and at the peak per parameter (the chunk manager's swap-file figures, Note [bytes on disk]) beside the estimate's;
peak RSS beside the estimate's; the first and the steady step; each floor (disk traffic at dd's bandwidth,
matmul FLOPs at the measured rate, one update pass) and the steady step over the largest; the losses.

`--layout fp32-lowbit` trains in fp32 with AdamW8bit instead: on a CPU without fast bf16 matmuls, a run where the
disk, the matmuls and the update weigh alike.

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
from scale_plan import (  # noqa: E402
    choose_layers,
    estimated,
    gpt_params,
    measure_machine,
    predicted_step_s,
    predicted_traffic,
    step_flops,
)

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402

# the first step records the order the parameters are gathered in; the second gathers ahead by it, so the
# chunk manager's trace is recorded anew (Note [trace and divergence]); later steps follow both
WARM_UP_STEPS = 2


def steady_steps(args) -> range:
    """The steps the steady step is the median of: those after the warm-up, else the last."""
    return range(min(WARM_UP_STEPS, args.steps - 1), args.steps)


MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
# --layout -> (bf16 section, optimizer type, training-state bytes per parameter after backward: Note [bf16 master
# weights], [block-wise optimizer states])
LAYOUTS = {
    "fp32-masters": ({"enabled": True}, "AdamW", 16),  # bf16 param + grad, fp32 master + two fp32 moments
    "bf16-masters": (MASTERS, "AdamW", 8),  # bf16 param (the master) + grad + two bf16 moments (DeepSpeed's)
    "rounded": ({**MASTERS, "stochastic_rounding": True}, "AdamW", 8),
    "lowbit": ({**MASTERS, "stochastic_rounding": True}, "AdamW8bit", 6.03),  # two 8-bit block-wise moments
    "fp32-lowbit": ({"enabled": False}, "AdamW8bit", 10.03),  # fp32 param (the master) + grad, 8-bit moments
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="swap directory, on the disk to measure")
    ap.add_argument("--layers", default="auto", help="blocks, or auto: --max-layers where it fits (default auto)")
    ap.add_argument("--max-layers", type=int, default=64, help="the full size (default 64: 12.9 B at 4096 wide)")
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4,
                    help="training steps; the first is reported apart, the steady step is the median of those "
                         "after the first two (default 4)")
    ap.add_argument("--step-budget-s", type=float, default=900.0, help="the predicted step --layers auto allows")
    ap.add_argument("--worlds", default="1", help="process counts to run, in order (default 1)")
    ap.add_argument("--buffer-count", type=int, default=2, help="chunks of each kind in the CPU window (default 2)")
    ap.add_argument("--aio-threads", type=int, default=2)
    # Adam's first step moves every weight by about lr along the sign of its gradient; 64 blocks of 4096 add up
    # what that does to the last hidden state, and at 2e-6 the loss rises (docs/benchmark_notes/scale.md)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--raw-bytes", type=int, default=2 << 30, help="bytes per raw dd pass (default 2 GiB)")
    ap.add_argument("--layout", default="lowbit", choices=sorted(LAYOUTS),
                    help="training-state layout: fp32 masters; bf16 masters with bf16 moments; the same rounded "
                         "stochastically; lowbit (default): that with AdamW8bit's moments, its update compiled; "
                         "fp32-lowbit: fp32 training with AdamW8bit (a compute-light run where the disk and the "
                         "update set the step)")
    ap.add_argument("--step-after-backward", action="store_true",
                    help="step after backward (with gradient_clipping 1.0) instead of step_in_backward")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    return ap.parse_args(argv)


def precision(args) -> str:
    return "bf16" if LAYOUTS[args.layout][0].get("enabled") else "fp32"


def engine_config(args, world: int) -> dict:
    offload = {"device": "nvme", "nvme_path": args.dir, "pin_memory": True, "buffer_count": args.buffer_count}
    largest = 4 * args.embd * args.embd  # an MLP weight: every large matrix is a chunk of its own or shares one
    bf16, optimizer, _ = LAYOUTS[args.layout]
    params = {"lr": args.lr, "weight_decay": 0.0, **({"compile": True} if optimizer == "AdamW8bit" else {})}
    early = not args.step_after_backward
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "seed": 1234,
            "optimizer": {"type": optimizer, "params": params},
            "bf16": bf16,
            "gradient_clipping": 0.0 if early else 1.0,  # step_in_backward refuses clipping by the global norm
            "zero_optimization": {"stage": 3, "chunk_size": largest - largest % world,
                                  "stage3_prefetch_bucket_size": largest,
                                  "offload_optimizer": {**offload, "step_in_backward": early},
                                  "offload_param": offload},
            "aio": {"thread_count": args.aio_threads}, "steps_per_print": 10**9}


def rank_main(rank: int, world: int, port: int, args, layers: int, results) -> None:
    from engine import initialize, zero_init
    from engine.models import load_corpus
    from engine.models.gpt import GPT, GPTConfig

    torch.set_num_threads(max(psutil.cpu_count() // world, 1))
    if world > 1:
        init_gloo(rank, world, port)  # one process: no process group at all
    torch.manual_seed(1234)
    config = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=layers, n_head=args.heads, n_embd=args.embd)
    t0 = time.perf_counter()
    with zero_init():
        model = GPT(config)
    psi = model.num_parameters()
    engine = initialize(model, engine_config(args, world))
    init_s = time.perf_counter() - t0
    tokens = load_corpus()
    per_step = args.micro_batch * (args.seq + 1)
    manager = engine.optimizer.manager
    times, losses, moved = [], [], []
    start = rank * per_step  # the same batch every step: the loss must fall as the model fits it
    window = tokens[start:start + per_step].view(args.micro_batch, args.seq + 1)
    for _ in range(args.steps):
        before = dict(manager.stats.moved_bytes)
        t = time.perf_counter()
        loss = engine(window[:, :-1], labels=window[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        after = manager.stats.moved_bytes
        moved.append({k: after.get(k, 0) - before.get(k, 0) for k in ("cpu->nvme", "nvme->cpu")})
    stats = manager.stats
    results.put({"rank": rank, "psi": psi, "init_s": init_s, "times": times, "losses": losses, "moved": moved,
                 "disk_rest": stats.disk_bytes, "disk_peak": stats.peak_disk_bytes, "peak_rss": peak_rss_bytes(),
                 "skipped": engine.skipped_steps})
    engine.close()


def floors(args, layers: int, psi: int, written: float, read: float, rates, write_bw: float,
           read_bw: float) -> dict:
    """Each floor of one step (scripts/scale_plan.py) in seconds."""
    return {"disk": written / write_bw + read / read_bw,
            "compute": rates.compute_s(step_flops(psi, layers, args.embd, args.seq, args.micro_batch)),
            "update": rates.update_s(psi)}


def summarize(world: int, layers: int, ranks: list[dict], rates, write_bw: float, read_bw: float, ram: int,
              args) -> tuple[list, dict]:
    steady = steady_steps(args)
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in steady)
    first_s = max(r["times"][0] for r in ranks)
    written = statistics.median(sum(r["moved"][i]["cpu->nvme"] for r in ranks) for i in steady)
    read = statistics.median(sum(r["moved"][i]["nvme->cpu"] for r in ranks) for i in steady)
    psi = ranks[0]["psi"]
    floor = floors(args, layers, psi, written, read, rates, write_bw, read_bw)
    limit = max(floor.values())
    ratio = step_s / limit if limit > 0 else float("nan")
    est = estimated(layers, args.embd, args.heads, args.seq, engine_config(args, 1)) if world == 1 else None
    disk_rest = sum(r["disk_rest"] for r in ranks)
    disk_peak = sum(r["disk_peak"] for r in ranks)
    peak_rss = max(r["peak_rss"] for r in ranks)
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(args.steps)]
    falling = all(b < a for a, b in zip(losses, losses[1:]))
    row = [f"{world}", f"{layers} × {args.embd}", f"{psi / 1e9:.2f} B",
           f"{disk_rest / psi:.2f} / {disk_peak / psi:.2f}" + (f" (est. {est.disk_peak / psi:.2f})" if est else ""),
           f"{fmt_bytes(peak_rss)} ({100 * peak_rss / ram:.1f}%)" + (f" (est. {fmt_bytes(est.host_peak)})"
                                                                    if est else ""),
           f"{max(r['init_s'] for r in ranks):.0f}", f"{first_s:.1f}", f"{step_s:.1f}",
           f"{floor['disk']:.1f} / {floor['compute']:.1f} / {floor['update']:.1f}", f"{ratio:.2f}",
           " → ".join(f"{x:.3f}" for x in losses) + (" (falling)" if falling else " (not falling)")]
    layout = f" ({args.layout}{', step_in_backward' if not args.step_after_backward else ''})"
    record = result_record(
        "scale", f"tiers ZeRO-3 {precision(args)}{layout}, everything on NVMe, {world} process(es), {psi / 1e9:.2f} B",
        world=world, layout=args.layout, peer="this machine's floor (disk, compute, update; same run)",
        strategy=f"ZeRO-3 NVMe {precision(args)}", metric="step ÷ its floor", ratio=ratio, target=1.5, step_s=step_s,
        first_step_s=first_s, throughput=world * args.micro_batch * args.seq / step_s, unit="tokens/s",
        peak_rss_per_rank_bytes=peak_rss, parameters=psi, layers=layers, disk_rest_bytes=disk_rest,
        disk_peak_bytes=disk_peak, estimated_disk_peak_bytes=est.disk_peak if est else None,
        estimated_host_peak_bytes=est.host_peak if est else None, floors_s=floor, losses=losses,
        loss_falling=falling, written_per_step=written, read_per_step=read)
    return row, record


def projected_row(args, layers: int, record: dict, rates, write_bw: float, read_bw: float, ram: int) -> list:
    """The --max-layers figures of one process, projected from the run of `layers` blocks: its disk traffic and
    peak as the estimate predicts them where the CPU window is a small part of the states, the compute and update
    floors at the measured rates, the step at the run's step ÷ floor, the RSS at the run's RSS ÷ estimate."""
    full = args.max_layers
    psi = gpt_params(full, args.embd, args.seq)
    config = engine_config(args, 1)
    est, run_est = (estimated(n, args.embd, args.heads, args.seq, config) for n in (full, layers))
    read, written, disk = predicted_traffic(full, args.embd, args.heads, args.seq, config)
    floor = floors(args, full, psi, written, read, rates, write_bw, read_bw)
    step_s = record["ratio"] * max(floor.values())
    rss = est.host_peak * record["peak_rss_per_rank_bytes"] / run_est.host_peak  # the estimate, as far off as here
    predicted, _ = predicted_step_s(full, args.embd, args.heads, args.seq, args.micro_batch, config, rates, read_bw,
                                    write_bw)
    rest = est.disk_peak - (est.states.grad if args.step_after_backward else 0)  # gradient files wait for the step
    return ["1 (projected)", f"{full} × {args.embd}", f"{psi / 1e9:.2f} B",
            f"est. {rest / psi:.2f} / {disk / psi:.2f}",
            f"{fmt_bytes(rss)} ({100 * rss / ram:.1f}%) (est. {fmt_bytes(est.host_peak)})", "—", "—",
            f"{step_s:.0f} (predicted {predicted:.0f})",
            f"{floor['disk']:.0f} / {floor['compute']:.0f} / {floor['update']:.0f}", f"{record['ratio']:.2f}", "—"]


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    ram = psutil.virtual_memory().total
    os.makedirs(args.dir, exist_ok=True)
    disk = DiskCounter(args.dir)
    config = engine_config(args, 1)
    rates = measure_machine(args.dir, args.embd, args.micro_batch * args.seq, config)
    before = dd_bandwidth(args.dir, args.raw_bytes, disk)
    if args.layers == "auto":
        plan = choose_layers(args.max_layers, args.embd, args.heads, args.seq, args.micro_batch, config, rates,
                             before[1], before[0], args.step_budget_s)
        layers, why = plan.layers, f"{plan.why} (predicted step {plan.predicted_step_s:.0f} s)"
    else:
        layers, why = int(args.layers), "--layers given"
    runs = {}
    for world in (int(w) for w in args.worlds.split(",")):
        ranks = spawn_ranks(rank_main, world, args=(free_port(), args, layers))
        runs[world] = sorted(ranks, key=lambda r: r["rank"])
    after = dd_bandwidth(args.dir, args.raw_bytes, disk)
    write_bw, read_bw = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    rows, records = [], []
    for world, ranks in runs.items():
        row, record = summarize(world, layers, ranks, rates, write_bw, read_bw, ram, args)
        rows.append(row)
        records.append(record)
    one = next((r for r in records if r["world"] == 1), None)
    if layers < args.max_layers and one is not None:
        rows.append(projected_row(args, layers, one, rates, write_bw, read_bw, ram))
    bf16, optimizer, _ = LAYOUTS[args.layout]
    clipping = ("gradient_clipping off (step_in_backward refuses it)" if not args.step_after_backward
                else "stepped after backward, gradient_clipping 1.0")
    text = "\n".join([
        f"### Scale: the largest GPT through NVMe ({precision(args)}, ZeRO-3, everything offloaded; layout "
        f"{args.layout})",
        "",
        f"GPT {layers} layers × {args.embd} wide ({args.heads} heads), byte vocabulary; {why}. bf16 section {bf16}, "
        f"{optimizer} lr {args.lr}, {clipping}; micro batch {args.micro_batch} × seq {args.seq} per process, "
        f"buffer_count {args.buffer_count}, built under zero_init. This machine: {precision(args)} matmuls of a "
        f"{4 * args.embd} × {args.embd} weight over {args.micro_batch * args.seq} tokens at "
        f"{' / '.join(f'{r / 1e9:,.1f}' for r in rates.matmul_flops)} GFLOP/s (forward / input gradient / weight "
        f"gradient); the update {rates.update_s_per_element * 1e9:.2f} ns per element in memory; free disk "
        f"{rates.free_disk / 1e9:,.1f} GB; raw disk (dd, O_DIRECT, 8 MiB blocks, {fmt_bytes(args.raw_bytes)}; "
        f"mean of before/after): write {write_bw / 1e6:,.0f} MB/s ({before[0] / 1e6:,.0f} / {after[0] / 1e6:,.0f}), "
        f"read {read_bw / 1e6:,.0f} MB/s ({before[1] / 1e6:,.0f} / {after[1] / 1e6:,.0f}). The steady step is the "
        f"median of steps {steady_steps(args).start + 1}..{args.steps} (the first records the order the "
        "parameters are gathered in, the second the chunk trace under that order, which the later ones prefetch "
        "by); its floors: "
        "the disk traffic at dd's bandwidth, the matmul FLOPs at the measured rates, one update pass. A model the "
        "CPU window holds whole never touches the disk (0 B/param). A projected row takes the disk traffic and peak "
        "the estimate predicts at the full size, where the window is a small part of the states, and keeps the "
        "run's step ÷ floor and its RSS ÷ the estimate's.",
        "",
        markdown_table(["processes", "size", "parameters", "on disk at rest / at peak (B/param)",
                        "peak RSS per process (of RAM)", "build + initialize (s)", "first step (s)",
                        "steady step (s)", "floors: disk / compute / update (s)",
                        "steady step ÷ largest floor (target ≤ 1.5)", "loss by step"], rows),
    ])
    publish_report(text, started, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
