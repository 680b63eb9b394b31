"""Layer-major accumulation (Note [layer-major accumulation]) against micro-batch by micro-batch, one process,
ZeRO-3 with parameters and optimizer states on NVMe behind a small CPU window.

    .venv/bin/python scripts/bench_layer_major.py --dir /path/on/nvme
    .venv/bin/python scripts/bench_layer_major.py --dir /tmp --layers 2 --embd 128 --steps 2   # a smoke run

Each mode trains the same fp32 GPT (byte vocabulary) on the same fixed batch of text for `--steps` steps of
`--accumulation` micro-batches in a fresh process: engine.train_batch under offload_param.layer_major, or the
engine's forward / backward / step per micro-batch. It prints the parameter bytes gathered (read) per step ÷ the
model's gathered chunks, NVMe traffic, the step time (median over the steps after the first, which records the
gather trace) and the losses, and the ratio of the step times (layer-major ÷ micro-batch-major, target ≤ 1.0).
This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (  # noqa: E402
    add_json_option,
    fmt_bytes,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes  # noqa: E402

MODES = {"micro-batch-major": False, "layer-major": True}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="swap directory, on the disk to measure")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--steps", type=int, default=4, help="training steps; the first one is not timed (default 4)")
    ap.add_argument("--buffer-count", type=int, default=2, help="chunks of each kind in the CPU window (default 2)")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    return ap.parse_args(argv)


def engine_config(args, layer_major: bool, swap: str) -> dict:
    largest = 4 * args.embd * args.embd  # an MLP weight: every large matrix is a chunk of its own or shares one
    offload = {"device": "nvme", "nvme_path": swap, "buffer_count": args.buffer_count}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.accumulation,
            "seed": 1234, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "chunk_size": largest, "stage3_prefetch_bucket_size": largest,
                                  "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": offload,
                                  "offload_param": {**offload, "layer_major": layer_major}},
            "steps_per_print": 10**9}


def rank_main(rank: int, world: int, args, mode: str, results) -> None:
    from engine import initialize
    from engine.models import load_corpus
    from engine.models.gpt import GPT, GPTConfig

    torch.manual_seed(1234)
    model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                          n_embd=args.embd))
    swap = tempfile.mkdtemp(dir=args.dir, prefix=f"layer-major-{mode}-")
    engine = initialize(model, engine_config(args, MODES[mode], swap))
    shards, manager = engine.chunked.sharded_params, engine.optimizer.manager
    chunk_bytes = sum(shards.states[i].param_chunk.nbytes for i in shards.transient)
    rows = args.micro_batch * args.accumulation
    window = load_corpus()[:rows * (args.seq + 1)].view(rows, args.seq + 1)  # the same batch every step
    micro = [{"input_ids": w[:, :-1], "labels": w[:, 1:]} for w in window.split(args.micro_batch)]
    times, losses, reads, moved = [], [], [], []
    for _ in range(args.steps):
        gathered, before = shards.gathered_bytes, dict(manager.stats.moved_bytes)
        t = time.perf_counter()
        if MODES[mode]:
            losses.append(engine.train_batch(iter(micro)))
        else:
            step = []
            for mb in micro:
                loss = engine(**mb)
                engine.backward(loss)
                engine.step()
                step.append(loss.item())
            losses.append(sum(step) / len(step))
        times.append(time.perf_counter() - t)
        reads.append((shards.gathered_bytes - gathered) / chunk_bytes)
        after = manager.stats.moved_bytes
        moved.append({k: after.get(k, 0) - before.get(k, 0) for k in ("cpu->nvme", "nvme->cpu")})
    results.put({"mode": mode, "psi": sum(p.numel() for p in model.parameters()), "times": times, "losses": losses,
                 "reads": reads, "moved": moved, "peak_rss": peak_rss_bytes()})
    engine.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    runs = {mode: spawn_ranks(rank_main, 1, args=(args, mode))[0] for mode in MODES}
    timed = range(1, args.steps)
    step_s = {mode: statistics.median(run["times"][i] for i in timed) for mode, run in runs.items()}
    ratio = step_s["layer-major"] / step_s["micro-batch-major"]
    rows, records = [], []
    for mode, run in runs.items():
        read = statistics.median(run["moved"][i]["nvme->cpu"] for i in timed)
        written = statistics.median(run["moved"][i]["cpu->nvme"] for i in timed)
        rows.append([mode, f"{statistics.median(run['reads'][i] for i in timed):.2f}", fmt_bytes(read),
                     fmt_bytes(written), f"{step_s[mode]:.2f}", fmt_bytes(run["peak_rss"]),
                     " → ".join(f"{x:.4f}" for x in run["losses"])])
        ours = mode == "layer-major"
        records.append(result_record(
            "layer_major", f"tiers ZeRO-3 NVMe, {mode}", world=1, role="ours" if ours else "peer",
            peer="tiers ZeRO-3 NVMe, micro-batch-major" if ours else None, strategy="ZeRO-3 NVMe accumulation",
            metric="step time", ratio=ratio if ours else None, target=1.0 if ours else None, step_s=step_s[mode],
            throughput=args.micro_batch * args.accumulation * args.seq / step_s[mode], unit="tokens/s",
            peak_rss_per_rank_bytes=run["peak_rss"], parameter_reads_per_step=run["reads"][-1],
            nvme_read_per_step=read, nvme_written_per_step=written, losses=run["losses"]))
    psi = runs["layer-major"]["psi"]
    text = "\n".join([
        "### Layer-major accumulation: parameter reads per step (ZeRO-3, everything on NVMe, one process)",
        "",
        f"GPT {args.layers} layers × {args.embd} wide, fp32, Ψ = {psi:,}; {args.accumulation} micro-batches of "
        f"{args.micro_batch} × {args.seq} tokens per step, AdamW, clipping 1.0, buffer_count {args.buffer_count}. "
        f"Step figures: median of steps 2..{args.steps}. Parameter reads: bytes gathered per step ÷ the gathered "
        f"chunks' bytes. Step time, layer-major ÷ micro-batch-major: **{ratio:.3f}** (target ≤ 1.0).",
        "",
        markdown_table(["mode", "parameter reads per step", "NVMe read/step", "NVMe written/step", "step (s)",
                        "peak RSS", "loss by step"], rows),
    ])
    publish_report(text, started, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
