"""Pipeline parallelism vs torch.distributed.pipelining, 2 stages (one process each), gloo on CPU.

    .venv/bin/python scripts/bench_pipeline.py                      # 2 stages, m = 4 and 8, every schedule
    .venv/bin/python scripts/bench_pipeline.py --schedules 1f1b --microbatches 8 --rounds 1

Same harness as bench_dp.py (spawned ranks, one thread each, fresh models under one seed, alternating
rounds, barrier-timed steps). The model is the example GPT (bench30m with 8 blocks, untied lm_head so
that the embedding and the head can live on different stages), cut into p·v stages of equal blocks:
stage 0 also holds the embeddings, the last stage ln_f and lm_head. Both systems run the very same
stage modules over the same micro-batches (m per step, b sequences each) and finish each step with
torch's fused AdamW over the parameters the rank holds:
  ours  tiers' pipeline (engine.pipeline: the schedule as data, PipelineRunner over the stage modules)
  peer  torch's PipelineStage over the same stage modules, built by hand, and torch's schedule of the
        same name: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (v stages per rank) and, for
        zero bubble (ZB-H1), ScheduleInterleavedZeroBubble with one stage per rank. The loss is divided
        by m inside the loss function on both sides (torch's scale_grads off), so both do the same work.
The report says whether both ran the same compute actions in the same order on every rank (logged as they ran).

Bubble: on every rank, the seconds spent in compute actions (forward, backward, input- and weight-gradient
passes and the loss; sends and receives taken out) are clocked. Idle = step time - compute - optimizer step;
bubble = idle / (step time - optimizer step), the idle fraction of the pipelined part of the step, printed per
rank next to the schedule's formula ((p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved; zero
bubble: engine.pipeline.simulate with F = I = W), with the compute per action that explains the difference.
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
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402
from engine.pipeline import SCHEDULES, ActionKind, PipelineRunner, build_schedule, simulate  # noqa: E402

LABELS = {"ours": "tiers pipeline", "peer": "torch.distributed.pipelining"}
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zero_bubble": "ScheduleInterleavedZeroBubble"}
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
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (tiers, torch) per configuration (default 2)")
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


# ---- the model, cut into stages -------------------------------------------------------------------------
def build_model(args):
    from engine.models import gpt_from_preset

    torch.manual_seed(args.seed)
    return gpt_from_preset(args.model, n_layer=args.layers, tie_weights=False, block_size=max(args.seq, 1))


class GPTStage(nn.Module):
    """Blocks [start, stop) of the example GPT, behind its embeddings on the first stage and before ln_f and
    lm_head on the last: the whole model's own modules, so the stages together compute GPT.forward's logits."""

    def __init__(self, model, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        self.embed = nn.ModuleDict({"wte": model.wte, "wpe": model.wpe}) if first else None
        self.blocks = nn.ModuleList(model.blocks[start:stop])
        self.head = nn.ModuleDict({"ln_f": model.ln_f, "lm_head": model.lm_head}) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed["wte"](x) + self.embed["wpe"](torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head["lm_head"](self.head["ln_f"](x))
        return x


def stage_modules(model, stages: int) -> list[GPTStage]:
    per = len(model.blocks) // stages
    return [GPTStage(model, s * per, (s + 1) * per, s == 0, s == stages - 1) for s in range(stages)]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


def make_batches(args, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, m·b sequences of token ids and labels (every rank draws the same; stage 0 uses the ids, the
    last stage the labels)."""
    from engine.models import preset_config

    vocab = preset_config(args.model).vocab_size
    g = torch.Generator().manual_seed(args.seed)
    shape = (m * args.micro_batch, args.seq)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(args.warmup + args.steps)]


# ---- clocks around compute actions ------------------------------------------------------------------------
class ComputeClock:
    """Seconds spent per kind of compute action (F, B, I, W), the sends and receives inside them taken out, and the
    actions run since the last `new_step()` (F0.3: forward of stage 0, micro-batch 3)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.log: list[str] = []
        self._kind: str | None = None

    def new_step(self) -> None:
        self.log = []

    @contextmanager
    def action(self, kind: str, stage: int, microbatch: int):
        self.log.append(f"{kind}{stage}.{microbatch}")
        outer, self._kind = self._kind, kind
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - start
            self.counts[kind] += 1
            self._kind = outer

    @contextmanager
    def communicating(self):
        """A send or receive inside an action: its time is not compute."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._kind is not None:
                self.seconds[self._kind] -= time.perf_counter() - start

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class ClockedRunner(PipelineRunner):
    """tiers' runner with each compute action clocked (its sends and receives are not compute: torch runs them
    outside its stages' compute methods)."""

    def __init__(self, *args, clock: ComputeClock, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

    def _forward(self, a, *rest):
        with self.clock.action("F", a.stage, a.microbatch):
            super()._forward(a, *rest)

    def _backward(self, a, *rest):
        with self.clock.action("B" if a.kind is ActionKind.BACKWARD else "I", a.stage, a.microbatch):
            super()._backward(a, *rest)

    def _weight_grad(self, a, *rest):
        with self.clock.action("W", a.stage, a.microbatch):
            super()._weight_grad(a, *rest)

    def _send(self, *args):
        with self.clock.communicating():
            return super()._send(*args)

    def _recv(self, *args):
        with self.clock.communicating():
            return super()._recv(*args)


def clocked_stage_class():
    """torch's PipelineStage with its compute methods clocked (torch waits for receives outside them)."""
    from torch.distributed.pipelining import PipelineStage

    class ClockedStage(PipelineStage):
        def __init__(self, *args, clock: ComputeClock, **kwargs):
            super().__init__(*args, **kwargs)
            self.clock = clock

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self.clock.action("F", self.stage_index, fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, full_backward: bool = True, **kwargs):
            with self.clock.action("B" if full_backward else "I", self.stage_index, bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with self.clock.action("W", self.stage_index, bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    return ClockedStage


# ---- the two systems: one step each = the pipelined forward and backward, then AdamW ------------------------
class PipelineSystem:
    """One rank's side of one system: `pipeline(x, y)` runs a step's micro-batches, then the optimizer steps."""

    def __init__(self, pipeline, params: list[torch.Tensor], clock: ComputeClock):
        self.pipeline, self.clock = pipeline, clock
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
        self.optimizer_s = 0.0
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.clock.new_step()
        self.losses = self.pipeline(x, y)
        start = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.optimizer_s += time.perf_counter() - start


def my_stages(args, schedule_name: str, rank: int) -> tuple[dict[int, GPTStage], int]:
    """The stage modules this rank holds (stage s lives on rank s mod p) and the number of stages."""
    count = args.world * virtual_stages(args, schedule_name)
    parts = stage_modules(build_model(args), count)
    return {s: parts[s] for s in range(count) if s % args.world == rank}, count


def ours(args, schedule_name: str, m: int, rank: int) -> PipelineSystem:
    schedule = build_schedule(schedule_name, args.world, m, virtual_stages(args, schedule_name))
    stages, _ = my_stages(args, schedule_name, rank)
    clock = ComputeClock()
    runner = ClockedRunner(schedule, rank, stages, lm_loss, clock=clock)

    def pipeline(x, y):
        return runner.run(list(x.chunk(m)), list(y.chunk(m))).losses

    return PipelineSystem(pipeline, [p for s in stages.values() for p in s.parameters()], clock)


def peer(args, schedule_name: str, m: int, rank: int) -> PipelineSystem:
    import torch.distributed.pipelining as pp

    stages, count = my_stages(args, schedule_name, rank)
    clock = ComputeClock()
    stage_class = clocked_stage_class()
    torch_stages = [stage_class(module, s, count, torch.device("cpu"), clock=clock) for s, module in stages.items()]

    def loss_fn(logits, labels):  # divided by m here, as tiers does (scale_grads off)
        start = time.perf_counter()
        loss = lm_loss(logits, labels) / m
        clock.add("F", time.perf_counter() - start)
        return loss

    kind = getattr(pp, TORCH_SCHEDULES[schedule_name])
    if schedule_name in ("gpipe", "1f1b"):
        schedule = kind(torch_stages[0], m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = kind(torch_stages, m, loss_fn=loss_fn, scale_grads=False)
    first, last = 0 in stages, count - 1 in stages

    def pipeline(x, y):
        losses: list = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        return [loss.item() * m for loss in losses]

    return PipelineSystem(pipeline, [p for s in stages.values() for p in s.parameters()], clock)


# ---- one run: warm-up, timed steps --------------------------------------------------------------------------
def timed_run(system: PipelineSystem, batches, args) -> dict:
    for x, y in batches[:args.warmup]:
        system.step(x, y)
    system.clock.reset()
    system.optimizer_s = 0.0
    cpu = CpuMeter()
    t0 = barrier_time()
    cpu.start()
    for x, y in batches[args.warmup:]:
        system.step(x, y)
    t1 = barrier_time()
    cpu.stop()
    steps = args.steps
    return {"step_s": (t1 - t0) / steps, "compute_s": system.clock.total / steps,
            "optimizer_s": system.optimizer_s / steps,
            "per_kind_s": {k: system.clock.seconds[k] / max(system.clock.counts[k], 1)
                           for k in system.clock.counts},
            "own_cpu_s": cpu.own_s, "busy_s": cpu.busy_s, "wall_s": cpu.wall_s,
            "peak_rss": max_over_ranks(peak_rss_bytes()), "losses": system.losses, "order": system.clock.log}


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    init_gloo(rank, world, port)
    builders = {"ours": ours, "peer": peer}
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for m in args.microbatches:
        batches = make_batches(args, m)
        for schedule_name in args.schedules:
            for r in range(args.rounds):
                for system, build in builders.items():
                    release_free_heap_and_reset_peak()  # Note [peak memory of one system]
                    runs[(system, schedule_name, m)].append(timed_run(build(args, schedule_name, m, rank), batches,
                                                                      args))
                    gc.collect()
                    if rank == 0:
                        run = runs[(system, schedule_name, m)][-1]
                        print(f"m={m} {schedule_name} round {r + 1}/{args.rounds} {system}: {run['step_s']:.3f} "
                              f"s/step", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, dict(runs)))



# ---- torch's own splitter ------------------------------------------------------------------------------------
def split_attempts(args) -> list[tuple[str, str]]:
    """Tries torch.distributed.pipelining.pipeline() (torch.export underneath) on the example GPT and on a small
    Hugging Face GPT-2, into 2 stages at the middle block; (what was split, the outcome) for each try."""
    from torch.distributed.pipelining import SplitPoint

    from engine.models import gpt_from_preset

    x = torch.randint(0, 256, (2, 32))
    gpt = gpt_from_preset("tiny", n_layer=4, tie_weights=False)
    tries = [("example GPT, logits", gpt, "blocks.2", {}),
             ("example GPT, loss (labels= in forward)", gpt, "blocks.2", {"labels": x})]
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return [(what, split_outcome(model, x, at, SplitPoint, kwargs)) for what, model, at, kwargs in tries] + [
            ("Hugging Face GPT2LMHeadModel", "not tried: transformers is not installed")]
    for use_cache in (True, False):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                        use_cache=use_cache))
        tries.append((f"HF GPT2LMHeadModel, use_cache={use_cache}", hf, "transformer.h.2", {}))
    tries.append(("HF GPT2LMHeadModel, use_cache=False, loss (labels=)", hf, "transformer.h.2", {"labels": x}))
    return [(what, split_outcome(model, x, at, SplitPoint, kwargs)) for what, model, at, kwargs in tries]


def split_outcome(model, x, at: str, split_point, kwargs: dict) -> str:
    from torch.distributed.pipelining import pipeline

    try:
        pipe = pipeline(model, mb_args=(x,), mb_kwargs=kwargs or None, split_spec={at: split_point.BEGINNING})
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        return f"fails: `{first_line(e)}`" + (f"; cause: `{first_line(root_cause(e))}`" if root_cause(e) is not e
                                             else "")
    sizes = [sum(p.numel() for p in pipe.get_stage_module(i).parameters()) for i in range(pipe.num_stages)]
    return f"splits into {pipe.num_stages} stages of {' + '.join(f'{n:,}' for n in sizes)} parameters"


def root_cause(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


# ---- summaries ----------------------------------------------------------------------------------------------
def bubble(run: dict) -> float:
    """The idle fraction of the pipelined part of a step on one rank (the optimizer step left out of both)."""
    pipelined = run["step_s"] - run["optimizer_s"]
    return (pipelined - run["compute_s"]) / pipelined if pipelined > 0 else float("nan")


def summarize(by_rank: dict[int, dict], key: tuple) -> dict:
    ranks = sorted(by_rank)
    rounds = [[by_rank[r][key][i] for r in ranks] for i in range(len(by_rank[0][key]))]  # [round][rank]
    losses = next((run["losses"] for run in rounds[-1] if run["losses"]), [])
    return {"step_s": median([rs[0]["step_s"] for rs in rounds]),
            "per_round": [rs[0]["step_s"] for rs in rounds],
            "bubble": [median([bubble(rs[r]) for rs in rounds]) for r in ranks],
            "compute_s": [median([rs[r]["compute_s"] for rs in rounds]) for r in ranks],
            "optimizer_s": [median([rs[r]["optimizer_s"] for rs in rounds]) for r in ranks],
            "per_kind_s": [{k: median([rs[r]["per_kind_s"][k] for rs in rounds]) for k in rounds[0][r]["per_kind_s"]}
                           for r in ranks],
            "peak_rss": median([rs[0]["peak_rss"] for rs in rounds]),
            "foreign": max(max(rs[0]["busy_s"] - sum(x["own_cpu_s"] for x in rs), 0.0) / rs[0]["wall_s"]
                           for rs in rounds),
            "order": [rounds[0][r]["order"] for r in ranks],
            "loss": sum(losses) / len(losses) if losses else float("nan")}


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


def system_names(args, schedule_name: str, m: int) -> tuple[str, str]:
    v = virtual_stages(args, schedule_name)
    tag = f"m={m}" + (f", v={v}" if v > 1 else "")
    return f"tiers {schedule_name} ({tag})", f"torch {TORCH_SCHEDULES[schedule_name]} ({tag})"


def records(args, by_rank: dict) -> list[dict]:
    """Step time ratio per schedule and m (target <= 1.0), and zero bubble's bubble against 1F1B's (no target:
    the schedule's own figure is a third, with F = I = W). Plots: the largest m only, one pair per schedule."""
    out = []
    tokens = {m: m * args.micro_batch * args.seq for m in args.microbatches}
    for schedule_name, m in configurations(args):
        o, p = (summarize(by_rank, (s, schedule_name, m)) for s in ("ours", "peer"))
        ours_name, peer_name = system_names(args, schedule_name, m)
        plotted = m == max(args.microbatches)
        common = {"world": args.world, "strategy": f"PP {schedule_name}", "model": args.model, "microbatches": m,
                  "schedule": schedule_name, "formula_bubble": formula_bubble(args, schedule_name, m)}
        for name, s, extra in ((ours_name, o, {"peer": peer_name, "ratio": o["step_s"] / p["step_s"], "target": 1.0}),
                               (peer_name, p, {"role": "peer"})):
            out.append(result_record("pipeline", name, step_s=s["step_s"], peak_rss_per_rank_bytes=s["peak_rss"],
                                     throughput=tokens[m] / s["step_s"] if plotted else None,
                                     unit="tokens/s" if plotted else None, bubble_per_rank=s["bubble"],
                                     **common, **extra))
    if {"1f1b", "zero_bubble"} <= set(args.schedules):
        for m in args.microbatches:
            zb, base = (summarize(by_rank, ("ours", s, m))["bubble"] for s in ("zero_bubble", "1f1b"))
            out.append(result_record("pipeline", f"tiers zero_bubble bubble (m={m})", world=args.world,
                                     peer=f"tiers 1f1b bubble (m={m})", metric="bubble ÷ 1F1B's bubble",
                                     ratio=sum(zb) / sum(base), microbatches=m,
                                     formula=formula_bubble(args, "zero_bubble", m) / formula_bubble(args, "1f1b", m)))
    return out


# ---- report -------------------------------------------------------------------------------------------------
def fmt_ranks(values: list[float], fmt: str = "{:.3f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def report(args, psi: int, by_rank: dict, splits: list[tuple[str, str]]) -> str:
    step_rows, bubble_rows, cost_rows, foreign = [], [], [], []
    for schedule_name, m in configurations(args):
        o, p = (summarize(by_rank, (s, schedule_name, m)) for s in ("ours", "peer"))
        foreign += [o["foreign"], p["foreign"]]
        step_rows.append([schedule_name, str(m), TORCH_SCHEDULES[schedule_name], f"{o['step_s']:.3f}",
                          f"{p['step_s']:.3f}", f"{o['step_s'] / p['step_s']:.3f}",
                          ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(o["per_round"], p["per_round"])),
                          same_order(o["order"], p["order"]),
                          f"{fmt_bytes(o['peak_rss'])} / {fmt_bytes(p['peak_rss'])}",
                          f"{o['loss']:.4f} / {p['loss']:.4f}"])
        bubble_rows.append([schedule_name, str(m), f"{formula_bubble(args, schedule_name, m):.3f}",
                            fmt_ranks(o["bubble"]), fmt_ranks(p["bubble"]), fmt_ranks(o["compute_s"]),
                            fmt_ranks(p["compute_s"]), f"{o['optimizer_s'][0]:.3f} / {p['optimizer_s'][0]:.3f}"])
        if m == max(args.microbatches):
            for name, s in (("tiers", o), ("torch", p)):
                cost_rows.append([schedule_name, name] + [fmt_ranks([k.get(kind, float("nan")) * 1e3 for k in
                                                                     s["per_kind_s"]], "{:.1f}") for kind in KINDS])
    lines = [
        f"### Pipeline parallelism: tiers vs torch.distributed.pipelining ({args.world} stages, gloo, CPU, "
        "1 thread/rank)",
        "",
        f"Model `{args.model}` with {args.layers} blocks and untied lm_head (Ψ = {psi:,}), cut into {args.world} "
        f"stages of equal blocks ({args.world * args.virtual_stages} for interleaved, v = {args.virtual_stages}); "
        f"m micro-batches of {args.micro_batch} × seq {args.seq} per step, fused AdamW lr 1e-4 fp32 on each rank's "
        f"parameters. Median over {args.rounds} alternating rounds of {args.warmup} warm-up + {args.steps} timed "
        "steps; ratio tiers ÷ torch, target ≤ 1.0. Peak RSS/rank: the most over the ranks, each system's own.",
        "",
        markdown_table(["schedule", "m", "torch schedule", "tiers s/step", "torch s/step", "ratio",
                        "per round tiers/torch", "same action order", "peak RSS/rank tiers / torch",
                        "mean loss tiers / torch"], step_rows),
        "",
        "Bubble per rank (rank 0 / rank 1 ...): idle = step time - compute actions - optimizer step, as a fraction "
        "of step time - optimizer step. Formula: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, "
        "zero bubble simulated with F = I = W (engine.pipeline.simulate).",
        "",
        markdown_table(["schedule", "m", "formula", "tiers bubble", "torch bubble", "tiers compute s/step",
                        "torch compute s/step", "optimizer s (rank 0) tiers / torch"], bubble_rows),
        "",
    ]
    if {"1f1b", "zero_bubble"} <= set(args.schedules):
        for m in args.microbatches:
            ratios = []
            for name in ("ours", "peer"):
                zb, base = (summarize(by_rank, (name, s, m))["bubble"] for s in ("zero_bubble", "1f1b"))
                ratios.append(sum(zb) / sum(base))
            lines.append(f"Zero bubble's bubble ÷ 1F1B's (mean over ranks), m = {m}: tiers {ratios[0]:.2f}, torch "
                         f"{ratios[1]:.2f}; the schedule's, F = I = W: "
                         f"{formula_bubble(args, 'zero_bubble', m) / formula_bubble(args, '1f1b', m):.2f}.")
        lines.append("")
    lines += [
        f"Compute per action at m = {max(args.microbatches)}, ms (rank 0 / rank 1 ...; F includes the loss on the "
        "last stage; on stage 0 there is no input gradient, so zero bubble's I is empty and W the whole backward):",
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
    splits = [] if args.no_split_check else split_attempts(args)
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
