"""Activation checkpointing: step time and memory with it off, on (ours, from the config), and with
torch.utils.checkpoint applied by hand to the same blocks, in one run.

    .venv/bin/python scripts/bench_checkpointing.py              # bench30m, 4 × 512 tokens, 3 rounds

All three systems are the same engine (stage 0, fp32, AdamW) on the same model, batches and seed,
single-process; they differ only in how the blocks run:
  off    no checkpointing;
  ours   `activation_checkpointing {enabled: true}` (every block of the example GPT);
  torch  no config checkpointing; each block's forward replaced by hand with
         torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False).
Each run is a fresh process (rounds alternate the systems; glibc keeps freed memory, Note [malloc in
benchmarks]), so its peak RSS is its own: reported as the growth from just before the first step to
the end of the run. Also reported: the bytes autograd saves for backward in one step
(saved_tensors_hooks, each storage once, parameters left out) and the recompute overhead,
(step time / off's step time - 1), ours against torch's. The target: ours ≤ torch's.

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    KEEP_FREED_MEMORY_ENV,
    SavedActivationBytes,
    add_json_option,
    fmt_bytes,
    median,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402

SYSTEMS = ("off", "ours", "torch")
LABELS = {"off": "no checkpointing", "ours": "tiers activation_checkpointing",
          "torch": "torch.utils.checkpoint by hand"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench30m", help="engine.models preset (default bench30m)")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (off, ours, torch) (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of the one process (default 2)")
    ap.add_argument("--dropout", type=float, default=0.1, help="model dropout (default 0.1: RNG is restored)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    add_json_option(ap)
    return ap.parse_args(argv)


def build_engine(system: str, args):
    from engine import initialize
    from engine.models import gpt_from_preset

    torch.manual_seed(args.seed)
    model = gpt_from_preset(args.model, block_size=max(args.seq, 1), dropout=args.dropout)
    config = {"train_batch_size": args.micro_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "steps_per_print": 10**9, "seed": args.seed,
              "activation_checkpointing": {"enabled": system == "ours"}}
    engine = initialize(model, config)
    if system == "torch":
        for block in model.blocks:  # by hand, as a user would without the config key
            block.forward = _torch_checkpointed(block.forward)
    return engine


def _torch_checkpointed(forward):
    def checkpointed(x):
        return torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)
    return checkpointed


def saved_bytes(engine, x: torch.Tensor) -> int:
    """Bytes of the distinct storages one forward saves for backward, the parameters' aside."""
    with SavedActivationBytes(engine.module.parameters()) as saved:
        loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    return saved.bytes


def run_main(rank: int, world: int, system: str, args, results) -> None:
    """One system's run in this fresh process."""
    torch.set_num_threads(args.threads)
    from engine.models import preset_config

    vocab = preset_config(args.model).vocab_size
    g = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g)
               for _ in range(args.warmup + args.steps)]
    engine = build_engine(system, args)
    rss0 = peak_rss_bytes()
    for x in batches[:args.warmup]:
        engine.backward(engine(x, x))
        engine.step()
    times = []
    for x in batches[args.warmup:]:
        t0 = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    peak = peak_rss_bytes() - rss0
    saved = saved_bytes(engine, batches[0])
    results.put({"step_s": median(times), "peak_rss_growth": peak, "peak_rss": peak_rss_bytes(), "saved": saved,
                 "loss": loss.item(),
                 "recompute_s": engine.activation_checkpointing.recompute_seconds})


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        for system in SYSTEMS:
            (run,) = spawn_ranks(run_main, 1, args=(system, args), env=KEEP_FREED_MEMORY_ENV)
            runs[system].append(run)
            print(f"round {r + 1}/{args.rounds} {system}: {run['step_s']:.3f} s/step, peak RSS growth "
                  f"{fmt_bytes(run['peak_rss_growth'])}, saved {fmt_bytes(run['saved'])}, loss {run['loss']:.5f}",
                  flush=True)
    step = {s: median([r["step_s"] for r in runs[s]]) for s in SYSTEMS}
    overhead = {s: step[s] / step["off"] - 1.0 for s in SYSTEMS}
    rows = []
    for s in SYSTEMS:
        rows.append([LABELS[s], f"{step[s]:.3f}", f"{step[s] / step['torch']:.3f}",
                     f"{overhead[s]:+.1%}" if s != "off" else "—",
                     fmt_bytes(median([r["peak_rss_growth"] for r in runs[s]])),
                     fmt_bytes(runs[s][-1]["saved"]),
                     ", ".join(f"{r['step_s']:.3f}" for r in runs[s]), f"{runs[s][-1]['loss']:.5f}"])
    from engine.models import gpt_from_preset
    model = gpt_from_preset(args.model, block_size=max(args.seq, 1))
    psi, cfg = sum(p.numel() for p in model.parameters()), model.config
    header = (f"Model `{args.model}` ({cfg.n_layer} blocks, hidden {cfg.n_embd}, Ψ = {psi:,}), "
              f"micro batch {args.micro_batch} × seq {args.seq}, dropout {args.dropout}, AdamW fp32, one process with "
              f"{args.threads} threads. Median over {args.rounds} alternating rounds (a fresh process each) of "
              f"{args.warmup} warm-up + {args.steps} timed steps.")
    table = markdown_table(["system", "step time (s)", "ratio vs torch", "recompute overhead", "peak RSS growth",
                            "saved activations", "per-round s/step", "last loss"], rows)
    ratio = overhead["ours"] / overhead["torch"] if overhead["torch"] > 0 else float("nan")
    summary = (f"Overhead ours {overhead['ours']:+.1%} against torch's {overhead['torch']:+.1%} "
               f"(ratio {ratio:.3f}; target ≤ 1.0).")
    publish_report("\n\n".join([header, table, summary]), start, args.out)
    write_results(args.json, records(args, runs, step, overhead))


def records(args, runs: dict[str, list[dict]], step: dict, overhead: dict) -> list[dict]:
    """The figures of the report as result_record dicts (--json): ours' ratio is of the recompute overheads (the
    target); one process, so world 1 and the process's own peak RSS."""
    roles = {"off": "reference", "ours": "ours", "torch": "peer"}
    ratio = overhead["ours"] / overhead["torch"] if overhead["torch"] > 0 else float("nan")
    return [result_record("checkpointing", LABELS[s], world=1, role=roles[s], strategy="activation checkpointing",
                          peer=LABELS["torch"] if s == "ours" else None, metric="recompute overhead",
                          ratio=ratio if s == "ours" else None, target=1.0 if s == "ours" else None,
                          step_s=step[s], throughput=args.micro_batch * args.seq / step[s], unit="tokens/s",
                          peak_rss_per_rank_bytes=median([r["peak_rss"] for r in runs[s]]),
                          peak_rss_growth_bytes=median([r["peak_rss_growth"] for r in runs[s]]),
                          saved_activation_bytes=runs[s][-1]["saved"], step_ratio=step[s] / step["torch"],
                          threads=args.threads, model=args.model)
            for s in SYSTEMS]


if __name__ == "__main__":
    main()
