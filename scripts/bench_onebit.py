"""The compressed-communication optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) on 2 ranks, gloo on CPU: the bytes
each rank sends per step against the fp32 gradient all-reduce, and the loss they reach against the same algorithm
with exact averaging and against plain AdamW.

    .venv/bin/python scripts/bench_onebit.py            # the documented run
    .venv/bin/python scripts/bench_onebit.py --quick    # tiny sizes: a check that it runs

Every run trains the same GPT (fp32, ZeRO stage 0) from the same seed on the same random-token copy task, one
fresh batch per step split over the ranks:
- the compressed optimizer on 2 ranks: a warmup with full-precision communication (the engine all-reduces the
  gradients), then the optimizer's own 1-bit messages (Note [compressed allreduce]);
- the same optimizer on 1 rank over the whole batch: every average exact, nothing compressed (the uncompressed
  peer for convergence);
- AdamW on 2 ranks (the engine's fp32 gradient all-reduce every step: the peer for bytes).
Bytes are what each rank sends over a ring for the collectives the engine counted (CommCounter.ring_bytes: 2(w-1)/w
of an all-reduced tensor, (w-1)/w of an all-to-all's or all-gather's input/output). Bytes and losses are the
means over the second half of the run (past every warmup).

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
    add_json_option,
    free_port,
    init_gloo,
    one_thread,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)

from engine import initialize  # noqa: E402
from engine.estimate.report import markdown_table  # noqa: E402
from engine.models import gpt_from_preset  # noqa: E402

WORLD = 2
VOCAB = 256


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per rank per step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=10, help="freeze_step / var_freeze_step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a check that the script runs")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.embd, args.heads, args.seq, args.micro_batch, args.steps, args.warmup_steps = \
            2, 64, 2, 32, 4, 12, 4
    return args


def optimizers(args) -> dict[str, dict]:
    adam = {"lr": args.lr, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01}
    return {
        "OneBitAdam": {"type": "OneBitAdam", "params": {**adam, "freeze_step": args.warmup_steps}},
        "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {**adam, "var_freeze_step": args.warmup_steps,
                                                          "var_update_scaler": 16, "local_step_scaler": 8,
                                                          "local_step_clipper": 4}},
        "OneBitLamb": {"type": "OneBitLamb", "params": {**adam, "freeze_step": args.warmup_steps,
                                                        "max_coeff": 2.0, "min_coeff": 0.5, "coeff_beta": 0.5}},
        "AdamW": {"type": "AdamW", "params": adam},
    }


def batches(args) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (WORLD * args.micro_batch, args.seq), generator=g) for _ in range(args.steps)]


def train(args, optimizer: dict, rank: int, world: int) -> dict:
    """The whole batch's loss and this rank's ring bytes, per step."""
    torch.manual_seed(0)
    model = gpt_from_preset("tiny", n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq)
    engine = initialize(model, {"train_micro_batch_size_per_gpu": args.micro_batch * WORLD // world,
                                "gradient_accumulation_steps": 1, "optimizer": optimizer,
                                "zero_optimization": {"stage": 0}, "steps_per_print": 10**9})
    losses, sent = [], []
    for x in batches(args):
        mine = x.chunk(world)[rank]
        before = engine.comm.ring_bytes(world)
        loss = engine(mine, mine)
        engine.backward(loss)
        engine.step()
        sent.append(engine.comm.ring_bytes(world) - before)
        total = torch.tensor([loss.item()])
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "bytes": sent, "params": sum(p.numel() for p in model.parameters())}


def run_rank(rank: int, world: int, port: int, args, results) -> None:
    init_gloo(rank, world, port)
    try:
        got = {name: train(args, opt, rank, world) for name, opt in optimizers(args).items()}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.put(got)


def last_half(values: list[float]) -> float:
    """The mean over the second half of the run: every optimizer is past its warmup there (0/1 Adam's local
    steps start at var_freeze_step + 2)."""
    tail = values[len(values) // 2:]
    return sum(tail) / len(tail)


def rows_of(args, two: dict, exact: dict) -> list[dict]:
    full = last_half(two["AdamW"]["bytes"])
    out = []
    for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        sent = last_half(two[name]["bytes"])
        out.append({"name": name, "sent": sent, "full": full, "bytes_ratio": sent / full,
                    "warmup_sent": two[name]["bytes"][0], "loss": last_half(two[name]["losses"]),
                    "exact_loss": last_half(exact[name]["losses"]), "adamw_loss": last_half(two["AdamW"]["losses"]),
                    "first_loss": two[name]["losses"][0]})
    return out


def kilobytes(n: float) -> str:
    """The compressed messages are a few kB: MB with one decimal would show 0.0."""
    return f"{n / 1e3:,.1f} kB"


def report(args, rows: list[dict], params: int) -> str:
    byte_rows = [[r["name"], kilobytes(r["warmup_sent"]), kilobytes(r["sent"]), kilobytes(r["full"]),
                  f"{r['bytes_ratio']:.4f} (1/{1 / r['bytes_ratio']:.1f})"] for r in rows]
    loss_rows = [[r["name"], f"{r['first_loss']:.3f}", f"{r['loss']:.4f}", f"{r['exact_loss']:.4f}",
                  f"{r['loss'] / r['exact_loss']:.3f}", f"{r['adamw_loss']:.4f}"] for r in rows]
    return "\n".join([
        "### compressed-communication optimizers: bytes per step and convergence (2 ranks, gloo, CPU)",
        "",
        f"GPT {args.layers} layers, embd {args.embd}, {args.heads} heads ({params / 1e6:.2f}M parameters), "
        f"{WORLD} ranks × {args.micro_batch} × {args.seq} tokens per step, {args.steps} steps, warmup "
        f"(freeze_step / var_freeze_step) {args.warmup_steps}, lr {args.lr}, fp32, ZeRO stage 0.",
        "",
        "Bytes each rank sends per step (ring): a warmup step, and the mean over the second half of the run:",
        "",
        markdown_table(["optimizer", "warmup step", "compressed step", "AdamW step (fp32 all-reduce)",
                        "compressed ÷ fp32"], byte_rows),
        "",
        f"Loss (mean over the second half of the run; the first step's for scale) against the same optimizer on one "
        f"rank (exact averages) and AdamW on {WORLD} ranks:",
        "",
        markdown_table(["optimizer", "first step", f"{WORLD} ranks compressed", "exact", "compressed ÷ exact",
                        "AdamW"], loss_rows),
    ])


def records(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        out.append(result_record("onebit", f"tiers {r['name']} (1-bit messages)", world=WORLD,
                                 peer="the engine's fp32 gradient all-reduce", strategy=r["name"],
                                 metric="bytes sent per step", ratio=r["bytes_ratio"], target=0.05,
                                 bytes_per_step=r["sent"], fp32_bytes_per_step=r["full"]))
        out.append(result_record("onebit", f"tiers {r['name']} (1-bit messages)", world=WORLD,
                                 peer=f"{r['name']} with exact averages (1 rank)", strategy=r["name"],
                                 metric="loss, 2nd half", ratio=r["loss"] / r["exact_loss"], target=1.25,
                                 loss=r["loss"], exact_loss=r["exact_loss"]))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    two = spawn_ranks(run_rank, WORLD, args=(free_port(), args))[0]
    one_thread()
    exact = {name: train(args, opt, 0, 1) for name, opt in optimizers(args).items() if name != "AdamW"}
    rows = rows_of(args, two, exact)
    publish_report(report(args, rows, two["AdamW"]["params"]), started, args.out)
    write_results(args.json, records(rows))


if __name__ == "__main__":
    main()
