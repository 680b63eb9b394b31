"""ZeRO over chunks vs torch's own peers, 2 ranks, gloo on CPU.

    .venv/bin/python scripts/bench_zero.py                    # stage 1 vs ZeroRedundancyOptimizer + DDP
    .venv/bin/python scripts/bench_zero.py --stage 2          # stage 2 vs DDP
    .venv/bin/python scripts/bench_zero.py --stage 3          # stage 3 vs FSDP2 (fully_shard per block)
    .venv/bin/python scripts/bench_zero.py --rounds 2 --out /tmp/zero.md

Same harness as bench_dp.py (spawned ranks, one thread each, the same model, data and seed, AdamW
lr 1e-4 fp32 fused, alternating rounds, barrier-timed steps, loopback bytes per rank per step).
Peer for stage 1: torch.distributed.optim.ZeroRedundancyOptimizer (optimizer states sharded per
parameter, updated parameters broadcast from their owners) under DistributedDataParallel (which
all-reduces the gradients). Peer for stage 2: DistributedDataParallel (the issue's target: ≤ 1.05).
Peer for stage 3: FSDP2, `fully_shard` on every transformer block and then on the root model (its
documented use), AdamW over its sharded DTensor parameters.
Ours: reduce-scatter of gradient chunks during backward, AdamW over this rank's shards, all-gather
of the updated shards; stage 2 also releases each gradient chunk once reduced; stage 3 gathers each
parameter chunk around the modules that use it, ahead of demand in traced order, and releases it
after (default stage3_* settings).

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KEEP_FREED_MEMORY_ENV,
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
from bench_dp import (  # noqa: E402
    Loop,
    alternate_rounds,
    build_model,
    engine_config,
    make_batches,
    parse_args,
    summarize,
    tokens_per_step,
    torch_loop,
)

from engine.estimate.report import markdown_table  # noqa: E402

SYSTEMS = ("ours", "peer")
PEERS = {1: "torch ZeroRedundancyOptimizer + DDP", 2: "torch DDP", 3: "torch FSDP2 (fully_shard per block)"}


def labels(stage: int) -> dict[str, str]:
    return {"ours": f"tiers ZeRO stage {stage}", "peer": PEERS[stage]}


def parse(argv=None):
    """bench_dp.py's options plus --stage."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--stage", type=int, choices=sorted(PEERS), default=1, help="ZeRO stage to time (default 1)")
    known, rest = ap.parse_known_args(argv)
    args = parse_args(rest)
    args.stage = known.stage
    return args


def ours_loop(args) -> Loop:
    from engine import initialize

    cfg = engine_config(args)
    cfg.setdefault("zero_optimization", {})["stage"] = args.stage
    engine = initialize(build_model(args), cfg)
    return Loop(lambda x, y: engine(x, labels=y), engine.backward, engine.step,
                close=engine.close, comm_bytes=lambda: engine.comm.total_bytes)


def fsdp2_loop(args) -> Loop:
    from torch.distributed.fsdp import fully_shard

    model = build_model(args)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return torch_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0))


def peer_loop(args) -> Loop:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.stage == 3:
        return fsdp2_loop(args)
    model = DDP(build_model(args), gradient_as_bucket_view=True)
    if args.stage == 1:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                      weight_decay=0.0, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    return torch_loop(model, opt)


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    init_gloo(rank, world, port)
    runs = alternate_rounds(args, {"ours": ours_loop, "peer": peer_loop}, make_batches(args, rank), rank)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(runs)


def target(stage: int) -> float:
    return 1.05 if stage == 2 else 1.0


def records(args, runs: dict[str, list[dict]]) -> list[dict]:
    """The figures of the report as result_record dicts (--json)."""
    rows, names = {s: summarize(runs[s]) for s in SYSTEMS}, labels(args.stage)

    def record(key, **kw):
        s = rows[key]
        return result_record("zero", names[key], world=args.world, strategy=f"ZeRO-{args.stage}", step_s=s["step_s"],
                             throughput=tokens_per_step(args, args.world) / s["step_s"], unit="tokens/s",
                             peak_rss_per_rank_bytes=s["peak_rss"], loopback_bytes_per_rank_step=s["lo"],
                             model=args.model, stage=args.stage, **kw)

    return [record("ours", peer=names["peer"], ratio=rows["ours"]["step_s"] / rows["peer"]["step_s"],
                   target=target(args.stage)),
            record("peer", role="peer")]


def report(args, psi: int, runs: dict[str, list[dict]], elapsed_s: float) -> str:
    rows_in = {s: summarize(runs[s]) for s in SYSTEMS}
    peer = rows_in["peer"]["step_s"]
    unit = psi * 4
    names = labels(args.stage)
    rows = [[names[k], f"{s['step_s']:.3f}", f"{s['step_s'] / peer:.3f}", " / ".join(f"{t:.3f}" for t in s["phases"]),
             fmt_bytes(s["lo"]), f"{s['lo'] / unit:.2f}", fmt_bytes(s["peak_rss"]),
             ", ".join(f"{t:.3f}" for t in s["per_round"]), f"{s['foreign']:.2f}", f"{s['loss']:.4f}"]
            for k, s in rows_in.items()]
    chunk = f"{args.chunk_size} elements" if args.chunk_size else "engine default"
    return "\n".join([
        f"### ZeRO stage {args.stage}: tiers vs {PEERS[args.stage]} ({args.world} ranks, gloo, CPU, 1 thread/rank)",
        "",
        f"Model `{args.model}` (Ψ = {psi:,} parameters, Ψ·4B = {fmt_bytes(unit)}), micro batch {args.micro_batch} × "
        f"seq {args.seq} per rank, AdamW lr 1e-4 fp32 (fused), chunk size: {chunk}. Median over {args.rounds} "
        f"alternating rounds of {args.warmup} warm-up + {args.steps} timed steps; ratio target ≤ "
        f"{target(args.stage)}. Peak RSS/rank: the most over the ranks, median over rounds, each system's own "
        "(Note [peak memory of one system] in bench_common.py).",
        "",
        markdown_table(["system", "step time (s)", "ratio vs peer", "fwd / bwd / opt (s)", "loopback bytes/rank/step",
                        "× Ψ·4B", "peak RSS/rank", "per-round s/step", "other cores (max)", "last loss"], rows),
        "",
        "Processes started with " + " ".join(f"{k}={v}" for k, v in KEEP_FREED_MEMORY_ENV.items())
        + " (Note [malloc in benchmarks] in bench_common.py).",
        f"Machine: {machine_line()}",
        f"Command: `{command_line()}` (total {elapsed_s:.0f} s)",
    ])


def main(argv=None) -> None:
    args = parse(argv)
    started = time.perf_counter()
    psi = build_model(args).num_parameters()
    env = None if args.system_malloc else KEEP_FREED_MEMORY_ENV
    results = spawn_ranks(rank_main, args.world, args=(free_port(), args), env=env)
    if not results:
        raise RuntimeError("rank 0 returned no results")
    text = report(args, psi, results[0], time.perf_counter() - started)
    print("\n" + text, flush=True)
    if args.out:
        write_text(args.out, text)
    write_results(args.json, records(args, results[0]))


if __name__ == "__main__":
    main()
