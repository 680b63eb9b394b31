"""Sequence parallelism (Ulysses and ring attention), gloo on CPU: how long a sequence fits, what a step costs, and
how evenly ring attention's causal work falls on the ranks.

    .venv/bin/python scripts/bench_sequence_parallel.py              # the documented run
    .venv/bin/python scripts/bench_sequence_parallel.py --quick      # tiny sizes: a check that it runs

1. Memory: the example GPT (2 layers, 64 wide, 4 heads) on one sequence of 1K–16K tokens, at S = 1 (one process),
   2 and 4 (Ulysses and ring): the bytes of the activations one forward saves for backward on each rank
   (torch.autograd.graph.saved_tensors_hooks, parameters left out; the most over the ranks), and the longest of
   those sequences whose saved bytes fit a fixed budget per rank (--budget-mb).
2. Step time at S = 2 (both cores) on the same tokens per step (--micro-batch sequences of --seq tokens): ours
   (Ulysses, ring; every rank of the group sees every sequence, each its part of it) against one process training
   the whole batch on the whole sequences (the other rank idles), and against DDP (each rank half of the
   sequences, whole). Fresh models per round, alternating rounds, barrier-timed steps (bench_dp.py's harness).
3. Causal balance: the attention compute each rank of a ring does for one layer, forward and backward (the same
   block functions the ring runs, timed in one process without communication), under the zigzag layout ring
   attention uses and under contiguous parts: max/min over the ranks, and the slowest rank's time.

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KEEP_FREED_MEMORY_ENV,
    SavedActivationBytes,
    add_json_option,
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
from bench_dp import Loop, alternate_rounds, summarize, torch_loop  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402

MODES = ("ulysses", "ring")
LABELS = {"ulysses": "tiers sequence parallel, Ulysses (S = 2)", "ring": "tiers sequence parallel, ring (S = 2)",
          "one": "one process, whole sequences", "ddp": "torch DDP, whole sequences (half the batch per rank)"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="sequence lengths of the memory sweep")
    ap.add_argument("--budget-mb", type=float, default=64.0, help="saved-activation budget per rank (MiB)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence of the timed steps")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per step (even: DDP halves them)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the timed model (width 128, 4 heads)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every system")
    ap.add_argument("--balance-seq", type=int, default=4096, help="sequence length of the balance measurement")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.seq, args.layers, args.steps, args.rounds, args.balance_seq = "256,512", 256, 2, 2, 1, 512
        args.budget_mb = 1.0
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.micro_batch % 2:
        ap.error(f"--micro-batch {args.micro_batch}: DDP gives each of 2 ranks half of the sequences; use an even "
                 "number")
    return args


def gpt(layers: int, width: int, block_size: int):
    from engine.models import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=width, block_size=block_size))


def sp_config(micro_batch: int, size: int, mode: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "steps_per_print": 10**9}
    return cfg if size == 1 else {**cfg, "sequence_parallel": {"size": size, "mode": mode}}


# ---- 1. memory ------------------------------------------------------------------------------------
def memory_rank(rank: int, world: int, port: int, args, results) -> None:
    """Saved bytes of one forward per (mode, length) on this rank; rank 0 reports the most over the ranks."""
    from engine import initialize

    init_gloo(rank, world, port)
    out = {}
    for mode in (MODES if world > 1 else ("none",)):
        torch.manual_seed(args.seed)
        engine = initialize(gpt(2, 64, max(args.lengths)), sp_config(1, world, mode))
        for length in args.lengths:
            x = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(args.seed))
            with SavedActivationBytes(list(engine.module.parameters())) as saved:
                loss = engine(x, labels=x)
            most = torch.tensor([saved.bytes], dtype=torch.float64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            out[(mode, length)] = float(most)
            del loss
        engine.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def measure_memory(args) -> dict[tuple[int, str], dict[int, float]]:
    """{(S, mode): {length: saved bytes per rank}}."""
    table = {}
    for size in (1, 2, 4):
        got = spawn_ranks(memory_rank, size, args=(free_port(), args), env=KEEP_FREED_MEMORY_ENV)[0]
        for (mode, length), saved in got.items():
            table.setdefault((size, mode), {})[length] = saved
        print(f"memory: S = {size} done", flush=True)
    return table


def longest_fitting(per_length: dict[int, float], budget: float) -> int | None:
    fits = [n for n, saved in per_length.items() if saved <= budget]
    return max(fits) if fits else None


# ---- 2. step time ---------------------------------------------------------------------------------
def step_rank(rank: int, world: int, port: int, args, results) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from engine import initialize

    init_gloo(rank, world, port)
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.micro_batch, args.seq)
    batches = [(torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g))
               for _ in range(args.warmup + args.steps)]  # the same on every rank
    half = slice(rank * args.micro_batch // 2, (rank + 1) * args.micro_batch // 2)

    def model():
        torch.manual_seed(args.seed)
        return gpt(args.layers, 128, args.seq)

    def ours(mode):
        def build(_args):
            engine = initialize(model(), sp_config(args.micro_batch, 2, mode))
            return Loop(lambda x, y: engine(x, labels=y), engine.backward, engine.step, close=engine.close)
        return build

    def ddp(_args):
        net = DDP(model(), gradient_as_bucket_view=True)
        loop = torch_loop(net, torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0, fused=True))
        return Loop(lambda x, y: loop.forward(x[half], y[half]), loop.backward, loop.optimize)

    def one(_args):
        if rank != 0:  # idles: its steps do nothing
            return Loop(lambda x, y: torch.zeros(()), lambda loss: None, lambda: None)
        net = model()
        return torch_loop(net, torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0, fused=True))

    runs = alternate_rounds(args, {"ulysses": ours("ulysses"), "ring": ours("ring"), "one": one, "ddp": ddp}, batches,
                            rank)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(runs)


# ---- 3. causal balance ----------------------------------------------------------------------------
def layouts(length: int, size: int) -> dict[str, list[torch.Tensor]]:
    from engine.sequence_parallel.ring_attention import zigzag_positions

    part = length // size
    return {"zigzag": [zigzag_positions(length, r, size) for r in range(size)],
            "contiguous": [torch.arange(r * part, (r + 1) * part) for r in range(size)]}


def rank_attention_s(q, k, v, positions: list[torch.Tensor], rank: int) -> float:
    """Seconds of rank `rank`'s attention compute for one layer, forward and backward, over every block (merged
    as the ring merges them)."""
    from engine.sequence_parallel import Attending
    from engine.sequence_parallel.ring_attention import KeyBlock, attend_block, block_gradients, merge

    how = Attending(q[rank].shape[-1] ** -0.5)
    blocks = [KeyBlock(k[s], v[s], positions[s]) for s in range(len(positions))]
    t0 = time.perf_counter()
    final = attend_block(q[rank], positions[rank], blocks[rank], how)
    for s in range(len(positions)):
        if s != rank:
            final = merge(*final, *attend_block(q[rank], positions[rank], blocks[s], how))
    grad = torch.ones_like(final.out)
    for block in blocks:
        block_gradients(q[rank], positions[rank], block, how, grad, final)
    return time.perf_counter() - t0


def measure_balance(args) -> dict[tuple[int, str], list[float]]:
    """{(S, layout): seconds per rank} (median of 3)."""
    torch.set_num_threads(1)
    out = {}
    for size in (2, 4):
        for name, positions in layouts(args.balance_seq, size).items():
            g = torch.Generator().manual_seed(args.seed)
            q, k, v = ([torch.randn(1, 4, args.balance_seq // size, 16, generator=g) for _ in range(size)]
                       for _ in range(3))
            out[(size, name)] = [statistics.median(rank_attention_s(q, k, v, positions, r) for _ in range(3))
                                 for r in range(size)]
    return out


# ---- report ---------------------------------------------------------------------------------------
def report(args, memory: dict, steps: dict, balance: dict, elapsed_s: float) -> str:
    budget = args.budget_mb * 2**20
    base = memory[(1, "none")]
    mem_rows = []
    for (size, mode), per in memory.items():
        mem_rows.append([f"S = {size}" + ("" if size == 1 else f", {mode}")]
                        + [f"{fmt_bytes(per[n])} ({per[n] / base[n]:.3f})" for n in args.lengths]
                        + [str(longest_fitting(per, budget) or f"< {args.lengths[0]}")])
    rows = {s: summarize(runs) for s, runs in steps.items()}
    step_rows = [[LABELS[s], f"{r['step_s']:.3f}", f"{r['step_s'] / rows['one']['step_s']:.3f}",
                  f"{r['step_s'] / rows['ddp']['step_s']:.3f}", fmt_bytes(r["lo"]), fmt_bytes(r["peak_rss"]),
                  ", ".join(f"{t:.3f}" for t in r["per_round"])] for s, r in rows.items()]
    bal_rows = [[f"S = {size}", name, ", ".join(f"{t * 1e3:.1f}" for t in per), f"{max(per) / min(per):.2f}",
                 f"{max(per) * 1e3:.1f}"] for (size, name), per in balance.items()]
    return "\n".join([
        "### sequence parallelism: memory, step time and causal balance (gloo, CPU, 1 thread/rank)",
        "",
        f"Saved activation bytes per rank of one forward, the example GPT (2 layers, width 64, 4 heads) on one "
        f"sequence; in brackets the ratio to one process. Budget {args.budget_mb:g} MiB per rank.",
        "",
        markdown_table(["layout"] + [f"{n:,} tokens" for n in args.lengths] + ["longest within budget"], mem_rows),
        "",
        f"Step time at S = 2 on {args.micro_batch} × {args.seq} tokens per step, the example GPT ({args.layers} "
        f"layers, width 128, 4 heads), AdamW fp32. Median over {args.rounds} alternating rounds of {args.warmup} "
        f"warm-up + {args.steps} timed steps; ratio target ≤ 1.0.",
        "",
        markdown_table(["system", "step time (s)", "÷ one process", "÷ DDP", "loopback bytes/rank/step",
                        "peak RSS/rank", "per-round s/step"], step_rows),
        "",
        f"Ring attention's compute per rank for one layer (forward + backward, {args.balance_seq:,} tokens, 4 heads "
        "of 16, the ring's own block functions, no communication), median of 3:",
        "",
        markdown_table(["S", "layout", "ms per rank", "max / min", "slowest rank (ms)"], bal_rows),
        "",
        f"Machine: {machine_line()}",
        f"Command: `{command_line()}` (total {elapsed_s:.0f} s)",
    ])


def records(args, memory: dict, steps: dict, balance: dict) -> list[dict]:
    rows = {s: summarize(runs) for s, runs in steps.items()}
    out = []
    for peer, against in (("ddp", ""), ("one", ", against one process")):
        out += [result_record("sequence_parallel", LABELS[m] + against, world=2, peer=LABELS[peer],
                              strategy=f"SP {m}", ratio=rows[m]["step_s"] / rows[peer]["step_s"], target=1.0,
                              step_s=rows[m]["step_s"], throughput=args.micro_batch * args.seq / rows[m]["step_s"],
                              unit="tokens/s", peak_rss_per_rank_bytes=rows[m]["peak_rss"]) for m in MODES]
    out += [result_record("sequence_parallel", LABELS[p], world=2 if p == "ddp" else 1, role="peer",
                          strategy="SP peer", step_s=rows[p]["step_s"],
                          throughput=args.micro_batch * args.seq / rows[p]["step_s"], unit="tokens/s",
                          peak_rss_per_rank_bytes=rows[p]["peak_rss"]) for p in ("ddp", "one")]
    budget = args.budget_mb * 2**20
    out += [result_record("sequence_parallel", f"longest sequence within budget, S = {size} {mode}", world=size,
                          role="reference", longest_tokens=longest_fitting(per, budget), budget_bytes=budget)
            for (size, mode), per in memory.items()]
    out += [result_record("sequence_parallel", f"ring causal balance, S = {size} {name}", world=size,
                          role="reference", max_over_min=max(per) / min(per), slowest_rank_s=max(per))
            for (size, name), per in balance.items()]
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    memory = measure_memory(args)
    steps = spawn_ranks(step_rank, 2, args=(free_port(), args), env=KEEP_FREED_MEMORY_ENV)[0]
    balance = measure_balance(args)
    text = report(args, memory, steps, balance, time.perf_counter() - started)
    print("\n" + text, flush=True)
    if args.out:
        write_text(args.out, text)
    write_results(args.json, records(args, memory, steps, balance))


if __name__ == "__main__":
    main()
