"""Data parallelism (ZeRO stage 0): our engine vs torch DistributedDataParallel, 2 ranks, gloo on CPU.

    .venv/bin/python scripts/bench_dp.py                     # bench30m, 3 rounds of 2 + 10 steps
    .venv/bin/python scripts/bench_dp.py --chunk-size 8M --out docs/bench_dp.md

The script spawns the ranks itself (127.0.0.1, a free port, one thread per rank) and creates the
process group once. Each round builds a fresh model under the same seed, trains it with our
engine, then again with DDP (same data, AdamW lr 1e-4 fp32, fused); rounds alternate so drift of
the machine hits both alike. Reported per system: the median over rounds of the per-step wall
time (barrier before the clock starts and after the timed steps), bytes sent over the loopback
interface per rank per step (read on rank 0, divided by the world size), as a multiple of Ψ·4 B
(Ψ = parameter count), and the bytes our engine counts itself. The single-process compute floor
(no communication) is measured once first, in one process started like the ranks, for context.
Processes start with malloc thresholds that keep freed memory (Note [malloc in benchmarks] in
bench_common.py; --system-malloc turns that off); page faults per step are reported.
A second table splits a step into forward / backward / optimizer phases on rank 0 (medians): DDP
waits for its all-reduce at the end of backward, our engine at the start of step().

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KEEP_FREED_MEMORY_ENV,
    CpuMeter,
    LoopbackCounter,
    add_json_option,
    barrier_time,
    command_line,
    fmt_bytes,
    free_port,
    init_gloo,
    machine_line,
    max_over_ranks,
    median,
    release_free_heap_and_reset_peak,
    result_record,
    spawn_ranks,
    write_results,
    write_text,
)

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402

SYSTEMS = ("ours", "ddp")
LABELS = {"floor": "single process (no comm)", "ours": "tiers stage 0", "ddp": "torch DDP"}


def parse_elements(text: str) -> int:
    """'4M' → 4·2^20, '512K' → 512·2^10, '1000000' → 1000000."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if scale != 1 else t
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"chunk size {text!r}: give elements as an int or with K/M/G, e.g. 4M") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"chunk size {text!r} must be >= 1 element")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (default 2)")
    ap.add_argument("--model", default="bench30m", help="engine.models preset (default bench30m)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step (default 8)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (ours, DDP) (default 3)")
    ap.add_argument("--chunk-size", type=parse_elements, default=None,
                    help="zero_optimization.chunk_size in elements, e.g. 4M (default: the engine's)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-floor", action="store_true", help="skip the single-process compute floor")
    ap.add_argument("--system-malloc", action="store_true",
                    help="start the processes with glibc's default malloc thresholds (see Note [malloc in "
                         "benchmarks] in bench_common.py); default: freed memory stays in the process")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds, profile 3 steps of each system on rank 0 and print the top ops")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world {args.world}: data parallelism needs at least 2 ranks")
    return args


# ---- the three training loops --------------------------------------------------------------------
def make_batches(args, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token ids and labels for every step of a run; rank r always gets the same ones."""
    from engine.models import preset_config

    vocab = preset_config(args.model).vocab_size
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    shape = (args.micro_batch, args.seq)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(args.warmup + args.steps)]


def build_model(args):
    from engine.models import gpt_from_preset

    torch.manual_seed(args.seed)
    return gpt_from_preset(args.model)


def engine_config(args) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "steps_per_print": 10**9}
    if args.chunk_size is not None:
        cfg["zero_optimization"] = {"chunk_size": args.chunk_size}
    return cfg


class Loop:
    """One system's training step split into phases; `phases` collects (fwd, bwd, opt) seconds per step."""

    def __init__(self, forward, backward, optimize, close=lambda: None, comm_bytes=lambda: 0):
        self.forward, self.backward, self.optimize = forward, backward, optimize
        self.close, self.comm_bytes = close, comm_bytes
        self.phases: list[tuple[float, float, float]] = []

    def step(self, x, y, record: bool) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = self.forward(x, y)
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.optimize()
        t3 = time.perf_counter()
        if record:
            self.phases.append((t1 - t0, t2 - t1, t3 - t2))
        return loss


def ours_loop(args) -> Loop:
    from engine import initialize

    engine = initialize(build_model(args), engine_config(args))
    return Loop(lambda x, y: engine(x, labels=y), engine.backward, engine.step,
                close=engine.close, comm_bytes=lambda: engine.comm.total_bytes)


def ddp_loop(args) -> Loop:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_model(args), gradient_as_bucket_view=True)
    return torch_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True))


def floor_loop(args) -> Loop:
    model = build_model(args)
    return torch_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True))


def torch_loop(model, opt) -> Loop:
    """A peer's plain torch step: forward with labels, loss.backward(), opt.step(), zero_grad(set_to_none)."""
    def optimize():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Loop(lambda x, y: model(x, labels=y), lambda loss: loss.backward(), optimize)


def timed_run(loop: Loop, batches, args, lo: LoopbackCounter) -> dict:
    """Warm-up steps, then the timed ones between two barriers; loopback and engine bytes around them."""
    for x, y in batches[:args.warmup]:
        loop.step(x, y, record=False)
    cpu = CpuMeter()
    lo0, comm0 = lo.read(), loop.comm_bytes()
    t0 = barrier_time()
    cpu.start()
    for x, y in batches[args.warmup:]:
        loss = loop.step(x, y, record=True)
    t1 = barrier_time()
    cpu.stop()
    lo1, comm1 = lo.read(), loop.comm_bytes()
    peak_rss = max_over_ranks(peak_rss_bytes())  # after the loopback reading: not counted
    world, own = 1, torch.tensor([cpu.own_s], dtype=torch.float64)
    if dist.is_initialized():
        world = dist.get_world_size()
        dist.all_reduce(own)  # after the loopback reading: not counted
    return {"step_s": (t1 - t0) / args.steps,
            "lo_per_rank_step": (lo1 - lo0) / world / args.steps,
            "counted_per_step": (comm1 - comm0) / args.steps,
            "cpu_util": float(own) / world / cpu.wall_s,
            "foreign_cores": cpu.foreign_cores(float(own)),
            "faults_per_step": cpu.minor_faults / args.steps,
            "peak_rss": peak_rss,
            "phases": loop.phases,
            "loss": float(loss.detach())}


# ---- ranks ---------------------------------------------------------------------------------------
def alternate_rounds(args, builders: dict, batches, rank: int) -> dict[str, list[dict]]:
    """args.rounds rounds; each builds and times every system in turn (a fresh model each time)."""
    lo = LoopbackCounter()
    runs: dict[str, list[dict]] = {s: [] for s in builders}
    for r in range(args.rounds):
        for system, build in builders.items():
            release_free_heap_and_reset_peak()  # Note [peak memory of one system]
            loop = build(args)
            runs[system].append(timed_run(loop, batches, args, lo))
            loop.close()
            del loop
            gc.collect()
            if rank == 0:
                run = runs[system][-1]
                print(f"round {r + 1}/{args.rounds} {system}: {run['step_s']:.3f} s/step, loopback "
                      f"{fmt_bytes(run['lo_per_rank_step'])}/rank/step, CPU busy/rank {run['cpu_util']:.0%}, "
                      f"{run['faults_per_step']:,.0f} page faults/step, other processes "
                      f"{run['foreign_cores']:.2f} cores", flush=True)
    return runs


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    init_gloo(rank, world, port)
    batches = make_batches(args, rank)
    builders = {"ours": ours_loop, "ddp": ddp_loop}
    runs = alternate_rounds(args, builders, batches, rank)
    profiles = profile_systems(args, batches, builders, rank) if args.profile else {}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"runs": runs, "profiles": profiles})


def profile_systems(args, batches, builders, rank: int) -> dict[str, str]:
    """Three profiled steps of each system (after warm-up); rank 0's top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for system in SYSTEMS:
        loop = builders[system](args)
        for x, y in batches[:args.warmup]:
            loop.step(x, y, record=False)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x, y in (batches * 3)[args.warmup:args.warmup + 3]:
                loop.step(x, y, record=False)
            dist.barrier()
        if rank == 0:
            tables[system] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        loop.close()
        del loop
        gc.collect()
    return tables


def floor_main(rank: int, world: int, args, results) -> None:
    """The single-process compute floor, in a process started like the ranks (same environment)."""
    results.put(timed_run(floor_loop(args), make_batches(args, 0), args, LoopbackCounter()))


# ---- report --------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    phases = [p for run in runs for p in run["phases"]]
    return {"step_s": median([r["step_s"] for r in runs]),
            "lo": median([r["lo_per_rank_step"] for r in runs]),
            "counted": median([r["counted_per_step"] for r in runs]),
            "per_round": [r["step_s"] for r in runs],
            "cpu_util": median([r["cpu_util"] for r in runs]),
            "foreign": max(r["foreign_cores"] for r in runs),
            "faults": median([r["faults_per_step"] for r in runs]),
            "peak_rss": median([r["peak_rss"] for r in runs]),
            "mean_phase_sum": sum(sum(p) for p in phases) / max(len(phases), 1),
            "phases": [median([p[i] for p in phases]) for i in range(3)],
            "loss": runs[-1]["loss"]}


def tokens_per_step(args, world: int) -> int:
    """Tokens one step trains on over all ranks (each rank its own micro batch)."""
    return world * args.micro_batch * args.seq


def records(args, floor: dict | None, runs: dict[str, list[dict]]) -> list[dict]:
    """The figures of the report as result_record dicts (--json)."""
    rows = {s: summarize(runs[s]) for s in SYSTEMS}
    ddp = rows["ddp"]["step_s"]

    def record(key, s, world, **kw):
        return result_record("dp", LABELS[key], world=world, strategy="DP (stage 0)", step_s=s["step_s"],
                             throughput=tokens_per_step(args, world) / s["step_s"], unit="tokens/s",
                             peak_rss_per_rank_bytes=s["peak_rss"], loopback_bytes_per_rank_step=s["lo"],
                             model=args.model, **kw)

    out = [record("ours", rows["ours"], args.world, peer=LABELS["ddp"], ratio=rows["ours"]["step_s"] / ddp, target=1.0),
           record("ddp", rows["ddp"], args.world, role="peer")]
    if floor is not None:
        out.append(record("floor", summarize([floor]), 1, role="reference"))
    return out


def report(args, psi: int, floor: dict | None, runs: dict[str, list[dict]], elapsed_s: float) -> str:
    rows_in = {s: summarize(runs[s]) for s in SYSTEMS}
    if floor is not None:
        rows_in = {"floor": summarize([floor]), **rows_in}
    ddp = rows_in["ddp"]["step_s"]
    unit = psi * 4
    headers = ["system", "step time (s)", "ratio vs DDP", "loopback bytes/rank/step", "× Ψ·4B",
               "engine-counted bytes/step", "CPU busy/rank", "page faults/step", "peak RSS/rank", "last loss"]
    rows = []
    for key, s in rows_in.items():
        no_comm = key == "floor"
        rows.append([LABELS[key], f"{s['step_s']:.3f}", f"{s['step_s'] / ddp:.3f}",
                     "—" if no_comm else fmt_bytes(s["lo"]), "—" if no_comm else f"{s['lo'] / unit:.2f}",
                     fmt_bytes(s["counted"]) if key == "ours" else "—", f"{s['cpu_util']:.0%}", f"{s['faults']:,.0f}",
                     fmt_bytes(s["peak_rss"]), f"{s['loss']:.4f}"])
    phase_rows = [[LABELS[k], *(f"{v:.3f}" for v in s["phases"]), f"{sum(s['phases']):.3f}",
                   f"{s['mean_phase_sum']:.3f}"] for k, s in rows_in.items()]
    chunk = f"{args.chunk_size} elements" if args.chunk_size else "engine default"
    lines = [
        f"### Data parallel, stage 0: tiers vs torch DDP ({args.world} ranks, gloo, CPU, 1 thread/rank)",
        "",
        f"Model `{args.model}` (Ψ = {psi:,} parameters, Ψ·4B = {fmt_bytes(unit)}), micro batch {args.micro_batch} × "
        f"seq {args.seq} per rank, AdamW lr 1e-4 fp32 (fused), chunk size: {chunk}. Median over {args.rounds} "
        f"alternating rounds of {args.warmup} warm-up + {args.steps} timed steps; ratio target ≤ 1.0.",
        "",
        markdown_table(headers, rows),
        "",
        "Other processes kept at most "
        + ", ".join(f"{s['foreign']:.2f}" for s in rows_in.values())
        + f" cores busy during the timed steps ({', '.join(LABELS[k] for k in rows_in)}; of {os.cpu_count()}).",
        "",
        "Per-round s/step: " + "; ".join(f"{LABELS[s]} " + ", ".join(f"{t:.3f}" for t in rows_in[s]["per_round"])
                                         for s in SYSTEMS),
        "",
        "Rank 0 step phases, median s (DDP waits for its all-reduce in backward, tiers in step):",
        "",
        markdown_table(["system", "forward", "backward", "optimizer step", "sum of medians", "mean step"],
                       phase_rows),
        "",
        "Processes started with " + ("glibc's default malloc thresholds" if args.system_malloc else
                                     " ".join(f"{k}={v}" for k, v in KEEP_FREED_MEMORY_ENV.items())
                                     + " (freed memory stays in the process; Note [malloc in benchmarks])")
        + "; page faults: minor faults per step on rank 0; peak RSS/rank: the most over the ranks (median over "
        "rounds), each system's own (Note [peak memory of one system]).",
        f"Machine: {machine_line()}",
        f"Command: `{command_line()}` (total {elapsed_s:.0f} s)",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    psi = build_model(args).num_parameters()
    env = None if args.system_malloc else KEEP_FREED_MEMORY_ENV
    floor = None
    if not args.no_floor:
        floor = spawn_ranks(floor_main, 1, args=(args,), env=env)[0]
        print(f"single process floor: {floor['step_s']:.3f} s/step, {floor['faults_per_step']:,.0f} page faults/step, "
              f"other processes {floor['foreign_cores']:.2f} cores", flush=True)
    results = spawn_ranks(rank_main, args.world, args=(free_port(), args), env=env)
    if not results:
        raise RuntimeError("rank 0 returned no results")
    out = results[0]
    for system, table in out["profiles"].items():
        print(f"\n--- profile, rank 0, {LABELS[system]} (3 steps) ---\n{table}")
    text = report(args, psi, floor, out["runs"], time.perf_counter() - started)
    print("\n" + text, flush=True)
    if args.out:
        write_text(args.out, text)
    write_results(args.json, records(args, floor, out["runs"]))


if __name__ == "__main__":
    main()
