"""Mixture of experts with expert parallelism, gloo on CPU: a Hugging Face Mixtral (built from a config) at ep 2
against the same model replicated under DDP, and the share of the step the token all-to-alls take.

    .venv/bin/python scripts/bench_moe.py              # the documented run
    .venv/bin/python scripts/bench_moe.py --quick      # tiny sizes: a check that it runs

Two ranks (one thread each) train the same Mixtral on the same tokens per step (each rank its own micro-batch),
AdamW fp32:
- tiers ep 2: each rank holds half of every layer's experts, tokens go to them by the variable-split all-to-all
  (Note [expert parallelism]); dense parameters all-reduced over both ranks, expert gradients over their own
  (here one-rank) group; ZeRO stage 0;
- tiers ep 1: the same engine with every expert replicated (the model's own expert code, stage 0);
- torch DDP: the model replicated, gradients all-reduced (the peer; DeepSpeed-MoE does not run here).
Fresh models per round, alternating rounds, barrier-timed steps (bench_dp.py's harness). Then a few profiled steps
of ep 2 (torch.profiler): the wall time inside the token exchanges and count exchanges (record_function ranges
tiers.moe.all_to_all and tiers.moe.exchange_counts, forward and backward) as a share of the step, and the bytes
they moved per step as the engine counted them.

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
from bench_dp import Loop, alternate_rounds, summarize  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402

LABELS = {"ep2": "tiers ep 2 (experts split)", "ep1": "tiers ep 1 (experts replicated)", "ddp": "torch DDP"}
EXCHANGES = ("tiers.moe.all_to_all", "tiers.moe.exchange_counts")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every system")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled ep-2 steps for the all-to-all share")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.intermediate, args.experts, args.seq, args.micro_batch = 32, 64, 4, 32, 2
        args.steps, args.rounds, args.profile_steps = 2, 1, 1
    return args


def mixtral(args):
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=args.seq, num_local_experts=args.experts,
                                     num_experts_per_tok=args.top_k)
    torch.manual_seed(args.seed)
    return transformers.MixtralForCausalLM(cfg)


def engine_config(args, ep: int) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "moe": {"expert_parallel_size": ep}}


def ours(ep: int):
    def build(args) -> Loop:
        from engine import initialize

        engine = initialize(mixtral(args), engine_config(args, ep))
        loop = Loop(lambda x, y: engine(input_ids=x, labels=y, use_cache=False).loss, engine.backward, engine.step,
                    close=engine.close, comm_bytes=lambda: engine.comm.total_bytes)
        loop.engine = engine
        return loop
    return build


def ddp(args) -> Loop:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(mixtral(args), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

    def optimize():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Loop(lambda x, y: model(input_ids=x, labels=y, use_cache=False).loss, lambda loss: loss.backward(),
                optimize)


def exchange_share(args, batches) -> dict:
    """Profiled ep-2 steps: seconds per step inside the exchanges (this rank), the step's seconds, bytes moved."""
    from torch.profiler import ProfilerActivity, profile

    loop = ours(2)(args)
    for x, y in batches[:args.warmup]:
        loop.step(x, y, record=False)
    traffic = loop.engine.experts.traffic()
    before = sum(t.comm.all_to_all_bytes for t in traffic.values())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in batches[args.warmup:args.warmup + args.profile_steps]:
            loop.step(x, y, record=False)
        dist.barrier()
        wall = time.perf_counter() - t0
    inside = sum(e.cpu_time_total for e in prof.key_averages() if e.key in EXCHANGES) / 1e6
    moved = sum(t.comm.all_to_all_bytes for t in traffic.values()) - before
    loop.close()
    steps = args.profile_steps
    return {"exchange_s": inside / steps, "step_s": wall / steps, "bytes": moved / steps}


def step_rank(rank: int, world: int, port: int, args, results) -> None:
    init_gloo(rank, world, port)
    g = torch.Generator().manual_seed(args.seed + rank)
    shape = (args.micro_batch, args.seq)
    batches = [(x, x) for x in (torch.randint(0, 1024, shape, generator=g)
                                for _ in range(args.warmup + max(args.steps, args.profile_steps)))]
    runs = alternate_rounds(args, {"ep2": ours(2), "ep1": ours(1), "ddp": ddp}, batches, rank)
    share = exchange_share(args, batches)
    shares = [None] * world
    dist.all_gather_object(shares, share)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put({"runs": runs, "shares": shares})


def params_per_rank(args) -> dict[str, int]:
    """Parameters each rank holds: every expert replicated, or half of each layer's experts."""
    model = mixtral(args)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"ep2": total - experts // 2, "ep1": total, "ddp": total}


def report(args, runs: dict, shares: list[dict], params: dict, elapsed_s: float) -> str:
    rows = {s: summarize(r) for s, r in runs.items()}
    tokens = 2 * args.micro_batch * args.seq
    step_rows = [[LABELS[s], f"{r['step_s']:.3f}", f"{r['step_s'] / rows['ddp']['step_s']:.3f}",
                  f"{tokens / r['step_s']:,.0f}", f"{params[s] / 1e6:.2f}M", fmt_bytes(r["lo"]),
                  fmt_bytes(r["peak_rss"]), ", ".join(f"{t:.3f}" for t in r["per_round"])] for s, r in rows.items()]
    share_rows = [[str(rank), f"{s['step_s']:.3f}", f"{s['exchange_s']:.3f}", f"{s['exchange_s'] / s['step_s']:.1%}",
                   fmt_bytes(s["bytes"])] for rank, s in enumerate(shares)]
    return "\n".join([
        "### mixture of experts: expert parallelism vs DDP (gloo, CPU, 1 thread/rank)",
        "",
        f"HF Mixtral from a config: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of "
        f"intermediate {args.intermediate}, top-{args.top_k}, 4 heads; 2 ranks × {args.micro_batch} × {args.seq} "
        f"tokens per step, AdamW fp32. Median over {args.rounds} alternating rounds of {args.warmup} warm-up + "
        f"{args.steps} timed steps; ratio target ≤ 1.0.",
        "",
        markdown_table(["system", "step time (s)", "÷ DDP", "tokens/s", "params/rank", "loopback bytes/rank/step",
                        "peak RSS/rank", "per-round s/step"], step_rows),
        "",
        f"Token exchanges of ep 2 in {args.profile_steps} profiled steps (forward and backward, per step):",
        "",
        markdown_table(["rank", "step (s)", "in all-to-all (s)", "share of step", "all-to-all bytes/step"],
                       share_rows),
        "",
        f"Machine: {machine_line()}",
        f"Command: `{command_line()}` (total {elapsed_s:.0f} s)",
    ])


def records(args, runs: dict, shares: list[dict], params: dict) -> list[dict]:
    rows = {s: summarize(r) for s, r in runs.items()}
    tokens = 2 * args.micro_batch * args.seq
    out = [result_record("moe", LABELS[s], world=2, peer=LABELS["ddp"], strategy=f"MoE {s}",
                         ratio=rows[s]["step_s"] / rows["ddp"]["step_s"], target=1.0, step_s=rows[s]["step_s"],
                         throughput=tokens / rows[s]["step_s"], unit="tokens/s",
                         peak_rss_per_rank_bytes=rows[s]["peak_rss"], params_per_rank=params[s])
           for s in ("ep2", "ep1")]
    out.append(result_record("moe", LABELS["ddp"], world=2, role="peer", strategy="MoE peer",
                             step_s=rows["ddp"]["step_s"], throughput=tokens / rows["ddp"]["step_s"],
                             unit="tokens/s", peak_rss_per_rank_bytes=rows["ddp"]["peak_rss"],
                             params_per_rank=params["ddp"]))
    out.append(result_record("moe", "ep 2 all-to-all share of the step", world=2, role="reference",
                             share=max(s["exchange_s"] / s["step_s"] for s in shares),
                             bytes_per_step=shares[0]["bytes"]))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    got = spawn_ranks(step_rank, 2, args=(free_port(), args), env=KEEP_FREED_MEMORY_ENV)[0]
    params = params_per_rank(args)
    text = report(args, got["runs"], got["shares"], params, time.perf_counter() - started)
    print("\n" + text, flush=True)
    if args.out:
        write_text(args.out, text)
    write_results(args.json, records(args, got["runs"], got["shares"], params))


if __name__ == "__main__":
    main()
