"""Pipeline parallelism vs torch.distributed.pipelining, 2 stages (one process each), gloo on CPU.

    .venv/bin/python scripts/bench_pipeline.py                      # 2 stages, m = 4 and 8, every schedule
    .venv/bin/python scripts/bench_pipeline.py --schedules 1f1b --microbatches 8 --rounds 1

Same harness as bench_dp.py (spawned ranks, one thread each, fresh models under one seed, alternating
rounds, barrier-timed steps; the step time is the median of every timed step on rank 0 over the rounds,
the per-round figures the mean step between two barriers). The model is the example GPT (bench30m with 8
blocks, untied lm_head so that the embedding and the head can live on different stages), cut into p·v
stages of equal blocks: stage 0 also holds the embeddings, the last stage ln_f and lm_head. Every system
takes the same m micro-batches of b sequences per step through the same schedule and updates with AdamW
(lr 1e-4, fp32):
  tiers train_batch  what a user runs: initialize(model, {"pipeline": {"stages": p, "schedule": ..,
                     "virtual_stages": v, "partition": "uniform"}, "gradient_accumulation_steps": m, ..})
                     and engine.train_batch(iterator of {"input_ids", "labels"} micro-batches); the engine
                     splits the unmodified GPT itself (the script checks: at the same blocks) and steps
                     its own chunked AdamW. Ratio ÷ torch: the benchmark's figure (target ≤ 1.0).
  tiers runner       engine.pipeline.PipelineRunner over the script's own stage modules with torch's
                     fused AdamW: the schedule's execution alone, clocked action by action like torch's.
  torch              PipelineStage over the same stage modules, built by hand, under torch's schedule of
                     the same name: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (v stages per rank)
                     and, for zero bubble (ZB-H1), ScheduleInterleavedZeroBubble at one stage per rank;
                     fused AdamW. The loss is divided by m inside the loss function (scale_grads off), as
                     tiers does, so both do the same work.
The report says whether they ran the same compute actions in the same order on every rank (as logged while
they ran; train_batch: its schedule), and their mean losses (the same model, data and seed).

Bubble: for the runner and torch, the seconds each rank spends in compute actions (forward, backward, input-
and weight-gradient passes, the loss; sends and receives taken out) are clocked. Idle = step time - compute -
optimizer step; bubble = idle / (step time - optimizer step), the idle fraction of the pipelined part of the
step, per rank. train_batch's is the engine's own telemetry (engine.pipeline.last_bubble: 1 - compute ÷ wall
of the schedule's run, the mean over the pipeline ranks), averaged over the timed steps. Each is printed next
to the schedule's formula ((p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved; zero bubble:
engine.pipeline.simulate with F = I = W), with the compute per action that explains the difference.
Also printed: whether torch's own splitter (`pipeline()`, torch.export) splits the example GPT and a small
Hugging Face GPT-2 (built from a GPT2Config, no download), and if not the exception's first line.

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KEEP_FREED_MEMORY_ENV,
    CpuMeter,
    add_json_option,
    barrier_time,
    fmt_bytes,
    free_port,
    init_gloo,
    max_over_ranks,
    median,
    publish_report,
    release_free_heap_and_reset_peak,
    result_record,
    spawn_ranks,
    write_results,
)
from bench_pipeline_parts import (  # noqa: E402
    TORCH_SCHEDULES,
    ComputeClock,
    clocked_runner,
    lm_loss,
    split_attempts,
    stage_modules,
    torch_pipeline,
)

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402
from engine.pipeline import SCHEDULES, build_schedule, simulate  # noqa: E402

SYSTEMS = ("ours", "runner", "peer")
KINDS = ("F", "B", "I", "W")


def parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="pipeline ranks, one stage each (default 2)")
    ap.add_argument("--model", default="bench30m", help="engine.models preset (default bench30m)")
    ap.add_argument("--layers", type=int, default=8, help="blocks of the GPT: a multiple of world × virtual "
                    "stages (default 8)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--microbatches", type=lambda t: parse_list(t, int), default=[4, 8],
                    help="comma-separated micro-batches per step, m (default 4,8)")
    ap.add_argument("--schedules", type=parse_list, default=list(SCHEDULES),
                    help=f"comma-separated, of {', '.join(SCHEDULES)} (default all)")
    ap.add_argument("--virtual-stages", type=int, default=2, help="stages per rank of the interleaved schedule")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of (train_batch, runner, torch) per configuration (default 2)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-split-check", action="store_true", help="skip trying torch's pipeline() splitter")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    args = ap.parse_args(argv)
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        ap.error(f"--schedules: {unknown} not among {', '.join(SCHEDULES)}")
    if args.world < 2:
        ap.error(f"--world {args.world}: a pipeline needs at least 2 ranks")
    for v in {virtual_stages(args, s) for s in args.schedules}:
        if args.layers % (args.world * v):
            ap.error(f"--layers {args.layers} does not split into {args.world * v} stages of equal blocks")
    return args


def virtual_stages(args, schedule: str) -> int:
    return args.virtual_stages if schedule == "interleaved" else 1


def build_model(args):
    from engine.models import gpt_from_preset

    torch.manual_seed(args.seed)
    return gpt_from_preset(args.model, n_layer=args.layers, tie_weights=False, block_size=args.seq)


def make_batches(args, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, m·b sequences of token ids and labels (every rank draws the same; stage 0 uses the ids, the
    last stage the labels)."""
    from engine.models import preset_config

    vocab = preset_config(args.model).vocab_size
    g = torch.Generator().manual_seed(args.seed)
    shape = (m * args.micro_batch, args.seq)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(args.warmup + args.steps)]


# ---- the three systems: one step each = the schedule's forwards and backwards, then AdamW ---------------------
class ClockedSystem:
    """The runner or torch on this rank: `pipeline(x, y)` runs a step's micro-batches (clocked by `clock`) and
    gives the last stage's losses and the runner's own bubble telemetry (None: none); then torch's fused AdamW
    steps the parameters the rank holds."""

    def __init__(self, pipeline, params: list[torch.Tensor], clock: ComputeClock):
        self.pipeline, self.clock = pipeline, clock
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
        self.optimizer_s = 0.0
        self.losses: list[float] = []
        self.bubbles: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.clock.new_step()
        self.losses, bubble = self.pipeline(x, y)
        if bubble is not None:
            self.bubbles.append(bubble)
        start = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.optimizer_s += time.perf_counter() - start

    @property
    def order(self) -> list[str]:
        return self.clock.log

    def close(self) -> None:
        pass


class EngineSystem:
    """tiers' engine under a pipeline config: one train_batch per step; its bubble is the engine's telemetry."""

    def __init__(self, engine, m: int, rank: int):
        self.engine, self.m = engine, m
        self.clock, self.optimizer_s = None, float("nan")
        self.order = [str(a) for a in engine.pipeline.schedule.actions[rank]]
        self.losses: list[float] = []
        self.bubbles: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        microbatches = [{"input_ids": a, "labels": b} for a, b in zip(x.chunk(self.m), y.chunk(self.m))]
        self.losses = [self.engine.train_batch(iter(microbatches))]
        self.bubbles.append(self.engine.pipeline.last_bubble)

    def close(self) -> None:
        self.engine.close()


def my_stages(args, schedule_name: str, rank: int) -> tuple[dict, int]:
    """The script's stage modules this rank holds (stage s lives on rank s mod p) and the number of stages."""
    count = args.world * virtual_stages(args, schedule_name)
    parts = stage_modules(build_model(args), count)
    return {s: parts[s] for s in range(count) if s % args.world == rank}, count


def params_of(stages: dict) -> list[torch.Tensor]:
    return [p for module in stages.values() for p in module.parameters()]


def tiers_engine(args, schedule_name: str, m: int, rank: int) -> EngineSystem:
    from engine import initialize

    v = virtual_stages(args, schedule_name)
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": m,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9,
           "pipeline": {"stages": args.world, "schedule": schedule_name, "virtual_stages": v,
                        "partition": "uniform"}}
    engine = initialize(build_model(args), cfg)
    starts, per = engine.pipeline.split.plan.starts, args.layers // (args.world * v)
    if tuple(starts) != tuple(range(0, args.layers, per)):  # the comparison needs the same cut on every side
        raise RuntimeError(f"the engine cut the GPT's blocks at {starts}, the script at every {per}th block")
    return EngineSystem(engine, m, rank)


def tiers_runner(args, schedule_name: str, m: int, rank: int) -> ClockedSystem:
    schedule = build_schedule(schedule_name, args.world, m, virtual_stages(args, schedule_name))
    stages, _ = my_stages(args, schedule_name, rank)
    clock = ComputeClock()
    runner = clocked_runner(schedule, rank, stages, lm_loss, clock)

    def pipeline(x, y):
        result = runner.run(list(zip(x.chunk(m), y.chunk(m))))
        return result.losses, result.bubble  # the runner's own bubble: compute ÷ wall of its run, this rank

    return ClockedSystem(pipeline, params_of(stages), clock)


def torch_peer(args, schedule_name: str, m: int, rank: int) -> ClockedSystem:
    stages, count = my_stages(args, schedule_name, rank)
    clock = ComputeClock()
    step = torch_pipeline(stages, count, schedule_name, m, clock)
    return ClockedSystem(lambda x, y: (step(x, y), None), params_of(stages), clock)


BUILDERS = {"ours": tiers_engine, "runner": tiers_runner, "peer": torch_peer}


# ---- one run: warm-up, timed steps --------------------------------------------------------------------------
def timed_run(system, batches, args) -> dict:
    for x, y in batches[:args.warmup]:
        system.step(x, y)
    if system.clock is not None:
        system.clock.reset()
        system.optimizer_s = 0.0
    system.bubbles.clear()
    cpu = CpuMeter()
    t0 = barrier_time()
    cpu.start()
    ends = [t0]
    for x, y in batches[args.warmup:]:
        system.step(x, y)
        ends.append(time.perf_counter())
    t1 = barrier_time()
    cpu.stop()
    steps, clock = args.steps, system.clock
    return {"step_s": (t1 - t0) / steps, "step_times": [b - a for a, b in zip(ends, ends[1:])],
            "compute_s": clock.total / steps if clock else float("nan"),
            "optimizer_s": system.optimizer_s / steps,
            "per_kind_s": {k: clock.seconds[k] / max(clock.counts[k], 1) for k in clock.counts} if clock else {},
            "telemetry_bubble": median(system.bubbles) if system.bubbles else float("nan"),
            "own_cpu_s": cpu.own_s, "busy_s": cpu.busy_s, "wall_s": cpu.wall_s,
            "peak_rss": max_over_ranks(peak_rss_bytes()), "losses": system.losses, "order": system.order}


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    init_gloo(rank, world, port)
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for m in args.microbatches:
        batches = make_batches(args, m)
        for schedule_name in args.schedules:
            for r in range(args.rounds):
                for system in SYSTEMS:
                    release_free_heap_and_reset_peak()  # Note [peak memory of one system]
                    built = BUILDERS[system](args, schedule_name, m, rank)
                    runs[(system, schedule_name, m)].append(timed_run(built, batches, args))
                    built.close()
                    del built
                    gc.collect()
                    if rank == 0:
                        print(f"m={m} {schedule_name} round {r + 1}/{args.rounds} {system}: "
                              f"{runs[(system, schedule_name, m)][-1]['step_s']:.3f} s/step", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, dict(runs)))


# ---- summaries ----------------------------------------------------------------------------------------------
def bubble(run: dict) -> float:
    """The idle fraction of the pipelined part of a step on one rank (the optimizer step left out of both)."""
    pipelined = run["step_s"] - run["optimizer_s"]
    return (pipelined - run["compute_s"]) / pipelined if pipelined > 0 else float("nan")


def summarize(by_rank: dict[int, dict], key: tuple) -> dict:
    """One system at one schedule and m: medians over rounds, per rank where ranks differ."""
    ranks = sorted(by_rank)
    rounds = [[by_rank[r][key][i] for r in ranks] for i in range(len(by_rank[0][key]))]  # [round][rank]
    losses = next((run["losses"] for run in rounds[-1] if run["losses"]), [])

    def per_rank(field) -> list[float]:
        return [median([field(rs[r]) for rs in rounds]) for r in ranks]

    # every timed step of every round on rank 0 (the pipeline couples the ranks' steps): the median shrugs off
    # another process's burst on this shared machine better than the median of a few rounds' means does
    return {"step_s": median([t for rs in rounds for t in rs[0]["step_times"]]),
            "per_round": [rs[0]["step_s"] for rs in rounds],
            "bubble": per_rank(bubble), "telemetry": per_rank(lambda run: run["telemetry_bubble"]),
            "compute_s": per_rank(lambda run: run["compute_s"]),
            "optimizer_s": per_rank(lambda run: run["optimizer_s"]),
            "per_kind_s": [{k: median([rs[r]["per_kind_s"][k] for rs in rounds]) for k in rounds[0][r]["per_kind_s"]}
                           for r in ranks],
            "peak_rss": median([rs[0]["peak_rss"] for rs in rounds]),
            "foreign": max(max(rs[0]["busy_s"] - sum(x["own_cpu_s"] for x in rs), 0.0) / rs[0]["wall_s"]
                           for rs in rounds),
            "order": [rounds[0][r]["order"] for r in ranks],
            "loss": sum(losses) / len(losses) if losses else float("nan")}


def summaries(by_rank: dict, schedule_name: str, m: int) -> dict[str, dict]:
    return {system: summarize(by_rank, (system, schedule_name, m)) for system in SYSTEMS}


def same_order(ours: list[list[str]], peer: list[list[str]]) -> str:
    for rank, (a, b) in enumerate(zip(ours, peer)):
        if a != b:
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"no: rank {rank}, action {k}: tiers {a[k] if k < len(a) else 'end'}, "
                    f"torch {b[k] if k < len(b) else 'end'}")
    return "yes"


def formula_bubble(args, schedule_name: str, m: int) -> float:
    """The schedule's bubble with unit costs: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved
    (tests/test_pipeline_schedules.py checks simulate against both), ZB-H1's with F = I = W."""
    return simulate(build_schedule(schedule_name, args.world, m, virtual_stages(args, schedule_name))).bubble


def configurations(args) -> list[tuple[str, int]]:
    return [(s, m) for m in args.microbatches for s in args.schedules]


def system_names(args, schedule_name: str, m: int) -> dict[str, str]:
    v = virtual_stages(args, schedule_name)
    tag = f"m={m}" + (f", v={v}" if v > 1 else "")
    return {"ours": f"tiers train_batch {schedule_name} ({tag})", "runner": f"tiers runner {schedule_name} ({tag})",
            "peer": f"torch {TORCH_SCHEDULES[schedule_name]} ({tag})"}


def zero_bubble_vs_1f1b(args, by_rank: dict, m: int) -> dict[str, float]:
    """Zero bubble's bubble ÷ 1F1B's, mean over ranks: train_batch by the engine's telemetry, the runner and
    torch by the script's clock, and the schedules' own (F = I = W)."""
    out = {}
    for system, field in (("ours", "telemetry"), ("runner", "bubble"), ("peer", "bubble")):
        zb, base = (sum(summarize(by_rank, (system, s, m))[field]) for s in ("zero_bubble", "1f1b"))
        out[system] = zb / base
    out["formula"] = formula_bubble(args, "zero_bubble", m) / formula_bubble(args, "1f1b", m)
    return out


def records(args, by_rank: dict) -> list[dict]:
    """train_batch's step time ÷ torch's per schedule and m (target <= 1.0); the runner's as a reference; zero
    bubble's bubble ÷ 1F1B's (no target: the schedule's own, F = I = W, is printed beside it). Plots: the largest
    m only, one pair per schedule."""
    out = []
    for schedule_name, m in configurations(args):
        rows, names = summaries(by_rank, schedule_name, m), system_names(args, schedule_name, m)
        peer_s = rows["peer"]["step_s"]
        plotted = m == max(args.microbatches)
        common = {"world": args.world, "strategy": f"PP {schedule_name}", "model": args.model, "microbatches": m,
                  "schedule": schedule_name, "formula_bubble": formula_bubble(args, schedule_name, m)}
        roles = {"ours": {"peer": names["peer"], "ratio": rows["ours"]["step_s"] / peer_s, "target": 1.0,
                          "bubble_engine_telemetry": rows["ours"]["telemetry"][0]},
                 "runner": {"role": "reference", "ratio_vs_peer": rows["runner"]["step_s"] / peer_s,
                            "bubble_per_rank": rows["runner"]["bubble"]},
                 "peer": {"role": "peer", "bubble_per_rank": rows["peer"]["bubble"]}}
        for system, extra in roles.items():
            s = rows[system]
            tokens_per_s = m * args.micro_batch * args.seq / s["step_s"]
            out.append(result_record("pipeline", names[system], step_s=s["step_s"],
                                     peak_rss_per_rank_bytes=s["peak_rss"],
                                     throughput=tokens_per_s if plotted and system != "runner" else None,
                                     unit="tokens/s" if plotted and system != "runner" else None,
                                     **common, **extra))
    if {"1f1b", "zero_bubble"} <= set(args.schedules):
        for m in args.microbatches:
            r = zero_bubble_vs_1f1b(args, by_rank, m)
            out.append(result_record("pipeline", f"tiers train_batch zero_bubble bubble (m={m})", world=args.world,
                                     peer=f"tiers train_batch 1f1b bubble (m={m})", metric="bubble ÷ 1F1B's bubble",
                                     ratio=r["ours"], microbatches=m, runner_ratio=r["runner"], torch_ratio=r["peer"],
                                     formula=r["formula"]))
    return out


# ---- report -------------------------------------------------------------------------------------------------
def fmt_ranks(values: list[float], fmt: str = "{:.3f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def slash(rows: dict, fmt) -> str:
    return " / ".join(fmt(rows[s]) for s in SYSTEMS)


def step_row(args, schedule_name: str, m: int, rows: dict) -> list[str]:
    peer_s = rows["peer"]["step_s"]
    orders = {same_order(rows[s]["order"], rows["peer"]["order"]) for s in ("ours", "runner")}
    return [schedule_name, str(m), TORCH_SCHEDULES[schedule_name], slash(rows, lambda r: f"{r['step_s']:.3f}"),
            f"**{rows['ours']['step_s'] / peer_s:.3f}**", f"{rows['runner']['step_s'] / peer_s:.3f}",
            ", ".join("/".join(f"{t:.2f}" for t in ts) for ts in zip(*(rows[s]["per_round"] for s in SYSTEMS))),
            "yes" if orders == {"yes"} else "; ".join(sorted(orders - {"yes"})),
            slash(rows, lambda r: fmt_bytes(r["peak_rss"])), slash(rows, lambda r: f"{r['loss']:.4f}")]


def bubble_row(args, schedule_name: str, m: int, rows: dict) -> list[str]:
    runner, peer = rows["runner"], rows["peer"]
    return [schedule_name, str(m), f"{formula_bubble(args, schedule_name, m):.3f}",
            f"{rows['ours']['telemetry'][0]:.3f}", fmt_ranks(runner["bubble"]), fmt_ranks(runner["telemetry"]),
            fmt_ranks(peer["bubble"]), fmt_ranks(runner["compute_s"]), fmt_ranks(peer["compute_s"]),
            f"{runner['optimizer_s'][0]:.3f} / {peer['optimizer_s'][0]:.3f}"]


def report(args, psi: int, by_rank: dict, splits: list[tuple[str, str]]) -> str:
    step_rows, bubble_rows, cost_rows, foreign = [], [], [], []
    for schedule_name, m in configurations(args):
        rows = summaries(by_rank, schedule_name, m)
        foreign += [r["foreign"] for r in rows.values()]
        step_rows.append(step_row(args, schedule_name, m, rows))
        bubble_rows.append(bubble_row(args, schedule_name, m, rows))
        if m == max(args.microbatches):
            for name, s in (("tiers runner", rows["runner"]), ("torch", rows["peer"])):
                cost_rows.append([schedule_name, name] + [fmt_ranks([k.get(kind, float("nan")) * 1e3 for k in
                                                                     s["per_kind_s"]], "{:.1f}") for kind in KINDS])
    lines = [
        f"### Pipeline parallelism: tiers vs torch.distributed.pipelining ({args.world} stages, gloo, CPU, "
        "1 thread/rank)",
        "",
        f"Model `{args.model}` with {args.layers} blocks and untied lm_head (Ψ = {psi:,}), cut into {args.world} "
        f"stages of equal blocks ({args.world * args.virtual_stages} for interleaved, v = {args.virtual_stages}); "
        f"m micro-batches of {args.micro_batch} × seq {args.seq} per step, AdamW lr 1e-4 fp32. Three systems: "
        "tiers `train_batch` (the engine splits the model and steps its own AdamW), tiers' PipelineRunner over the "
        "script's stage modules with torch's fused AdamW, and torch's PipelineStage over the same modules under its "
        f"schedule, with fused AdamW. Median over {args.rounds} alternating rounds of {args.warmup} warm-up + "
        f"{args.steps} timed steps (step time: the median of all timed steps on rank 0; per round: the mean between "
        "two barriers); the benchmark's ratio is train_batch ÷ torch (bold), target ≤ 1.0. Peak "
        "RSS/rank: the most over the ranks, each system's own.",
        "",
        markdown_table(["schedule", "m", "torch schedule", "s/step train_batch / runner / torch", "train_batch ÷ torch",
                        "runner ÷ torch", "per round", "same action order", "peak RSS/rank", "mean loss"], step_rows),
        "",
        "Bubble per rank (rank 0 / rank 1 ...). train_batch: the engine's telemetry (engine.pipeline.last_bubble, "
        "1 - compute ÷ wall of the schedule's run, mean over the ranks). Runner and torch, the script's clock: idle = "
        "step time - compute actions - optimizer step, as a fraction of step time - optimizer step; the runner's own "
        "telemetry per rank beside it. Formula: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, zero "
        "bubble simulated with F = I = W (engine.pipeline.simulate).",
        "",
        markdown_table(["schedule", "m", "formula", "train_batch (telemetry)", "runner", "runner (telemetry)",
                        "torch", "runner compute s/step", "torch compute s/step",
                        "optimizer s, rank 0, runner / torch"], bubble_rows),
        "",
    ]
    if {"1f1b", "zero_bubble"} <= set(args.schedules):
        for m in args.microbatches:
            r = zero_bubble_vs_1f1b(args, by_rank, m)
            lines.append(f"Zero bubble's bubble ÷ 1F1B's (mean over ranks), m = {m}: tiers train_batch "
                         f"{r['ours']:.2f}, runner {r['runner']:.2f}, torch {r['peer']:.2f}; the schedule's, "
                         f"F = I = W: {r['formula']:.2f}.")
        lines.append("")
    lines += [
        f"Compute per action at m = {max(args.microbatches)}, ms (rank 0 / rank 1 ...; F includes the loss on the "
        "last stage; stage 0 has no input gradient, so zero bubble's I is empty there and W the whole backward):",
        "",
        markdown_table(["schedule", "system", *KINDS], cost_rows),
        "",
        f"Other processes kept at most {max(foreign):.2f} cores busy during the timed steps (of {os.cpu_count()}).",
        "",
        "torch's own splitter, `pipeline(model, mb_args, split_spec={middle block: SplitPoint.BEGINNING})` "
        "(torch.export), on a 4-block model:",
        "",
        *([f"- {what}: {outcome}" for what, outcome in splits] or ["- not tried (--no-split-check)"]),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    psi = build_model(args).num_parameters()
    splits = [] if args.no_split_check else split_attempts()
    for what, outcome in splits:
        print(f"torch pipeline() split, {what}: {outcome}", flush=True)
    results = spawn_ranks(rank_main, args.world, args=(free_port(), args), env=KEEP_FREED_MEMORY_ENV)
    if len(results) != args.world:
        raise RuntimeError(f"{len(results)} of {args.world} ranks returned results")
    by_rank = dict(results)
    publish_report(report(args, psi, by_rank, splits), started, args.out)
    write_results(args.json, records(args, by_rank))


if __name__ == "__main__":
    main()
