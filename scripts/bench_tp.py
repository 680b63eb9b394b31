"""1D tensor parallelism vs torch DTensor tensor parallel, gloo on CPU, same model, data and seed; at a
square world also 2D (SUMMA) tensor parallelism, for its per-rank memory and bytes against 1D.

    .venv/bin/python scripts/bench_tp.py                       # tp = 2 (both cores)
    .venv/bin/python scripts/bench_tp.py --world 4 --n-head 8 --rounds 1  # tp = 4 and 2×2 (4 processes on 2 cores)

Same harness as bench_dp.py (spawned ranks, one thread each, alternating rounds, barrier-timed
steps, loopback bytes per rank per step). Every rank of the tp group trains on the same batches.
The model is the example GPT with untied lm_head (DTensor's plans shard one module per weight).
A second run of ours takes `plan: "derived"`: the plan derived from the model's forward (Note [derived
tensor-parallel plans]; what "auto" gives a model with no built-in plan), which is the built-in one,
so it should time the same; the time deriving it takes is printed.
Ours: `tensor_parallel {size: world, plan: "auto"}`: vocab-parallel embedding, fused q/k/v split by
heads, column/row-parallel MLP and attention projections, lm_head column-parallel with gathered
logits, AdamW over the local shards. Peer: `parallelize_module` with ColwiseParallel /
RowwiseParallel on the same layers (the embedding RowwiseParallel, i.e. split over the vocabulary;
lm_head ColwiseParallel with replicated output), torch AdamW over its DTensor parameters. DTensor's
ColwiseParallel splits a weight's rows contiguously, so the peer's fused q/k/v rows are first
permuted to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (rank r's heads together): both then compute the same
function, and the last losses agree (printed). Also printed: parameter bytes per rank, and the bytes
of the tensors the first forward saves for backward (torch.autograd.graph.saved_tensors_hooks, each
storage counted once, the parameters' own storages left out).
At world q² (4, 9, ...) a third system runs: ours with `mode: "2d"` on the q×q mesh (every weight a
1/q² block, activations [batch/q, seq, hidden/q]; the micro batch must divide by q). At a world of
4·dp that is not a square, 2D runs on a 2×2 mesh times dp, each dp group on its part of the batch (the
same tokens per step). At world d·q² (d = 2) ours with `mode: "2.5d"` runs too, and at world q³ `mode:
"3d"` (Note [tensor-parallel grids]): at 8 ranks, 1D, 2D, 2.5D and 3D side by side. Their ratios are
against the same DTensor 1D peer (torch has no 2D, 2.5D or 3D tensor parallel to compare with).

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KEEP_FREED_MEMORY_ENV,
    SavedActivationBytes,
    command_line,
    fmt_bytes,
    free_port,
    init_gloo,
    machine_line,
    result_record,
    spawn_ranks,
    write_results,
    write_text,
)
from bench_dp import Loop, alternate_rounds, make_batches, parse_args, summarize, torch_loop  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402

LABELS = {"ours": "tiers 1D tensor parallel", "oursderived": "tiers 1D tensor parallel, derived plan",
          "ours2d": "tiers 2D tensor parallel (SUMMA)", "ours25d": "tiers 2.5D tensor parallel (2 grids)",
          "ours3d": "tiers 3D tensor parallel (cube)", "peer": "torch DTensor TP (parallelize_module)"}


def build_model(args):
    from engine.models import gpt_from_preset

    torch.manual_seed(args.seed)
    heads = {"n_head": args.n_head} if args.n_head else {}
    return gpt_from_preset(args.model, tie_weights=False, **heads)


def param_bytes(model) -> int:
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local)


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard on this rank


def counting_saved_bytes(loop: Loop, system: str, params: list, args) -> Loop:
    """Wraps loop.forward: its first call records the bytes autograd saves for backward in args.saved_bytes."""
    inner = loop.forward

    def forward(x, y):
        if system in args.saved_bytes:
            return inner(x, y)
        with SavedActivationBytes(params, unwrap=local) as saved:
            out = inner(x, y)
        args.saved_bytes[system] = saved.bytes
        return out

    loop.forward = forward
    return loop


def ours_loop(args, mode: str = "1d", plan: str = "auto", tp: int | None = None, depth: int = 1) -> Loop:
    """Ours over `tp` ranks (all of them by default); with fewer, each dp group trains on its part of the batch."""
    from engine import initialize

    tp = tp or args.world
    micro = args.micro_batch * tp // args.world
    cfg = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "tensor_parallel": {"size": tp, "mode": mode, "plan": plan, "depth": depth}, "steps_per_print": 10**9}
    engine = initialize(build_model(args), cfg)
    system = GRID_SYSTEMS.get(mode, "oursderived" if plan == "derived" else "ours")
    args.param_bytes[system] = param_bytes(engine.module)
    part = slice(engine.dp_rank * micro, (engine.dp_rank + 1) * micro)
    return counting_saved_bytes(Loop(lambda x, y: engine(x[part], labels=y[part]), engine.backward, engine.step,
                                     close=engine.close), system, list(engine.module.parameters()), args)


GRID_SYSTEMS = {"2d": "ours2d", "2.5d": "ours25d", "3d": "ours3d"}


def is_square(world: int) -> bool:
    return world >= 4 and math.isqrt(world) ** 2 == world


def grid_runs(world: int) -> dict[str, tuple[str, int, int]]:
    """The grids that run at `world`: system -> (mode, tp size, depth)."""
    runs = {}
    if is_square(world) or world % 4 == 0:
        runs["ours2d"] = ("2d", world if is_square(world) else 4, 1)
    if world % 2 == 0 and is_square(world // 2):
        runs["ours25d"] = ("2.5d", world, 2)
    side = round(world ** (1 / 3))
    if side >= 2 and side ** 3 == world:
        runs["ours3d"] = ("3d", world, 1)
    return runs


def _heads_together(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """Rows [q | k | v] reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: a contiguous split by tp gives
    each rank whole heads of q, k and v."""
    q, k, v = weight.chunk(3, dim=0)
    return torch.cat([torch.cat([t.chunk(tp, dim=0)[r] for t in (q, k, v)], dim=0) for r in range(tp)], dim=0)


def dtensor_loop(args) -> Loop:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = args.world
    model = build_model(args)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_attn.weight.copy_(_heads_together(block.attn.c_attn.weight, tp))
            block.attn.c_attn.bias.copy_(_heads_together(block.attn.c_attn.bias, tp))
    mesh = init_device_mesh("cpu", (tp,))
    parallelize_module(model, mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "blocks.*.attn.c_attn": ColwiseParallel(), "blocks.*.attn.c_proj": RowwiseParallel(),
        "blocks.*.mlp.c_fc": ColwiseParallel(), "blocks.*.mlp.c_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate())})
    for block in model.blocks:  # this rank's heads (the same adjustment our plan makes)
        block.attn.n_head //= tp
        block.attn.n_embd //= tp
    args.param_bytes["peer"] = param_bytes(model)
    return counting_saved_bytes(torch_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)),
                                "peer", list(model.parameters()), args)


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    init_gloo(rank, world, port)
    args.param_bytes, args.saved_bytes = {}, {}
    batches = make_batches(args, 0)  # one tp group: every rank trains on the same batches
    systems = {"ours": ours_loop, "oursderived": lambda a: ours_loop(a, plan="derived"), "peer": dtensor_loop}
    for system, (mode, tp, depth) in grid_runs(world).items():
        systems[system] = lambda a, mode=mode, tp=tp, depth=depth: ours_loop(a, mode, tp=tp, depth=depth)
    runs = alternate_rounds(args, systems, batches, rank)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put((runs, args.param_bytes, args.saved_bytes))


STRATEGIES = {"ours": "TP 1D", "oursderived": "TP 1D", "ours2d": "TP 2D", "ours25d": "TP 2.5D", "ours3d": "TP 3D",
              "peer": "TP 1D"}


def records(args, runs: dict, param_bytes: dict, saved_bytes: dict) -> list[dict]:
    """The figures of the report as result_record dicts (--json); tokens/s counts one batch per step (every rank
    of the tp group trains on the same one)."""
    rows = {s: summarize(runs[s]) for s in LABELS if s in runs}
    peer = rows["peer"]["step_s"]
    return [result_record("tp", LABELS[k], world=args.world, strategy=STRATEGIES[k],
                          role="peer" if k == "peer" else "ours", peer=None if k == "peer" else LABELS["peer"],
                          ratio=None if k == "peer" else s["step_s"] / peer, target=None if k == "peer" else 1.0,
                          step_s=s["step_s"], throughput=args.micro_batch * args.seq / s["step_s"], unit="tokens/s",
                          peak_rss_per_rank_bytes=s["peak_rss"], param_bytes_per_rank=param_bytes[k],
                          saved_activation_bytes_per_rank=saved_bytes[k], loopback_bytes_per_rank_step=s["lo"],
                          model=args.model)
            for k, s in rows.items()]


def derivation_seconds(args) -> float:
    """Wall time of deriving the plan (Note [derived tensor-parallel plans]) for the benchmark's model, one process."""
    from engine.tensor_parallel.derive import derive_plan

    model = build_model(args)
    started = time.perf_counter()
    derive_plan(model, args.world)
    return time.perf_counter() - started


def report(args, psi: int, runs: dict, param_bytes: dict, saved_bytes: dict, elapsed_s: float,
           derive_s: float) -> str:
    rows_in = {s: summarize(runs[s]) for s in LABELS if s in runs}
    peer = rows_in["peer"]["step_s"]
    unit = psi * 4
    rows = [[LABELS[k], f"{s['step_s']:.3f}", f"{s['step_s'] / peer:.3f}", " / ".join(f"{t:.3f}" for t in s["phases"]),
             fmt_bytes(param_bytes[k]), f"{param_bytes[k] / unit:.3f}", fmt_bytes(saved_bytes[k]), fmt_bytes(s["lo"]),
             fmt_bytes(s["peak_rss"]), ", ".join(f"{t:.3f}" for t in s["per_round"]), f"{s['loss']:.5f}"]
            for k, s in rows_in.items()]
    return "\n".join([
        f"### tensor parallel: tiers vs torch DTensor TP (tp = {args.world}, gloo, CPU, 1 thread/rank)",
        "",
        f"Model `{args.model}` with untied lm_head (Ψ = {psi:,}, Ψ·4B = {fmt_bytes(unit)}), micro batch "
        f"{args.micro_batch} × seq {args.seq} (the same on every rank), AdamW lr 1e-4 fp32. Median over {args.rounds} "
        f"alternating rounds of {args.warmup} warm-up + {args.steps} timed steps; ratio target ≤ 1.0. "
        "Peak RSS/rank: the most over the ranks, median over rounds, each system's own (Note [peak memory of one "
        "system] in bench_common.py).",
        "",
        markdown_table(["system", "step time (s)", "ratio vs peer", "fwd / bwd / opt (s)", "param bytes/rank",
                        "÷ Ψ·4B", "saved activations/rank", "loopback bytes/rank/step", "peak RSS/rank",
                        "per-round s/step", "last loss"], rows),
        "",
        *([f"2D at {args.world} ranks runs on a 2×2 mesh × dp {args.world // 4}, each dp group on its half of the "
           "batch (the same tokens per step); 2.5D on 2 grids of q×q, 3D on a q×q×q cube.", ""]
          if not is_square(args.world) and "ours2d" in rows_in else []),
        f"The derived plan (`plan: \"derived\"`, the one `\"auto\"` gives a model with no built-in plan) took "
        f"{derive_s:.2f} s to derive (one forward on fake tensors and the per-rank shape check), once per rank at "
        "initialize.",
        "",
        f"Machine: {machine_line()}",
        f"Command: `{command_line()}` (total {elapsed_s:.0f} s)",
    ])


def parse(argv=None):
    """bench_dp.py's options plus --n-head (bench30m has 10 heads: --n-head 8 for tp = 4)."""
    import argparse
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--n-head", type=int, default=None, help="override the preset's attention heads")
    known, rest = ap.parse_known_args(argv)
    args = parse_args(rest)
    args.n_head = known.n_head
    return args


def main(argv=None) -> None:
    args = parse(argv)
    started = time.perf_counter()
    psi = build_model(args).num_parameters()
    derive_s = derivation_seconds(args)
    results = spawn_ranks(rank_main, args.world, args=(free_port(), args), env=KEEP_FREED_MEMORY_ENV)
    runs, param_bytes, saved_bytes = results[0]
    text = report(args, psi, runs, param_bytes, saved_bytes, time.perf_counter() - started, derive_s)
    print("\n" + text, flush=True)
    if args.out:
        write_text(args.out, text)
    write_results(args.json, records(args, runs, param_bytes, saved_bytes))


if __name__ == "__main__":
    main()
