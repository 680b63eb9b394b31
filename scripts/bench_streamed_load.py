"""Streamed pretrained weights (Note [streamed weights]): the peak RSS a rank grows by while a Llama-shaped model
saved in bf16 loads under zero_init and initialize places it with offload_param nvme, against the model's bf16
bytes (target <= 0.4 per rank on 2 ranks), next to a plain from_pretrained in one process (what every rank of a
loader without streaming holds: the whole model).

    .venv/bin/python scripts/bench_streamed_load.py --dir /mnt/nvme/bench        # ~1.1 B (TinyLlama's shape)
    .venv/bin/python scripts/bench_streamed_load.py --dir /tmp/b --preset tiny   # a check that it runs

The checkpoint (random bf16 weights, shards and an index as save_pretrained writes them) is written into --dir
once and reused. Each variant runs in fresh processes (freed memory goes back to the kernel); a rank's growth is
its peak RSS from after the imports (and a tiny warm-up build) to the end of initialize, minus its RSS then. The
whole model trains (bf16, AdamW with its states on NVMe too), so the start also writes fp32 masters to NVMe.

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import (  # noqa: E402
    RETURN_FREED_MEMORY_ENV,
    add_json_option,
    free_port,
    init_gloo,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)
from pretrained_files import PRESETS, llama_config, prepared_checkpoint  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes, reset_peak_rss  # noqa: E402

MB = 1e6


def engine_config(swap: str, cpu_budget_mb: int) -> dict:
    nvme = {"device": "nvme", "nvme_path": swap}
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
            "zero_optimization": {"stage": 3, "offload_param": dict(nvme), "offload_optimizer": dict(nvme)},
            "memory": {"cpu_budget": cpu_budget_mb * 2**20}, "steps_per_print": 10**6}


def current_rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def load(rank: int, world: int, variant: str, path: str, swap_root: str, cpu_budget_mb: int, port: int,
         results) -> None:
    import torch
    import transformers

    from engine import initialize, zero_init
    if world > 1:
        init_gloo(rank, world, port)
    with zero_init():  # torch's one-time costs of a first construction are not the model's
        transformers.LlamaForCausalLM(llama_config("tiny"))
    reset_peak_rss()
    before = current_rss()
    started = time.perf_counter()
    if variant == "plain from_pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        read = sum(p.numel() * p.element_size() for p in model.parameters())
        sum(float(p.sum()) for p in model.parameters())  # every weight really read (mapped pages touched)
    else:
        swap = os.path.join(swap_root, f"swap-r{rank}")
        os.makedirs(swap, exist_ok=True)
        with zero_init():
            if variant == "from_pretrained under zero_init":
                model = transformers.AutoModelForCausalLM.from_pretrained(path)
            else:
                model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(path))
        recording = next(model.parameters()).tiers_zero_init
        engine = initialize(model, engine_config(swap, cpu_budget_mb),
                            weights=path if variant == "weights=" else None)
        read = recording.read_bytes
        engine.close()
    seconds = time.perf_counter() - started
    results.put({"rank": rank, "growth": peak_rss_bytes() - before, "read": read, "seconds": seconds})
    del torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "tiers-bench"),
                    help="where the checkpoint and the NVMe swap files go (on the disk to measure)")
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cpu-budget-mb", type=int, default=256, help="the chunk manager's CPU tier")
    ap.add_argument("--out", default=None, help="also write the report here")
    add_json_option(ap)
    args = ap.parse_args()
    started = time.perf_counter()
    path, model_bytes = prepared_checkpoint(args.dir, args.preset)
    rows, records = [], []
    for variant, world in (("plain from_pretrained", 1), ("from_pretrained under zero_init", args.world),
                           ("weights=", args.world)):
        per_rank = spawn_ranks(load, world, args=(variant, path, args.dir, args.cpu_budget_mb, free_port()),
                               env=RETURN_FREED_MEMORY_ENV)
        growth = max(r["growth"] for r in per_rank)
        ratio = growth / model_bytes
        read = max(r["read"] for r in per_rank)
        seconds = max(r["seconds"] for r in per_rank)
        rows.append([variant, world, f"{growth / MB:,.0f}", f"{ratio:.3f}", f"{read / MB:,.0f}", f"{seconds:.1f}"])
        ours = variant != "plain from_pretrained"
        records.append(result_record("streamed_load", variant, world=world, role="ours" if ours else "reference",
                                     metric="peak RSS growth per rank / bf16 bytes", ratio=ratio if ours else None,
                                     target=0.4 if ours else None, step_s=seconds,
                                     peak_rss_per_rank_bytes=growth, read_bytes_per_rank=read,
                                     model_bytes=model_bytes))
        print(rows[-1], flush=True)
    table = markdown_table(["load", "ranks", "peak RSS growth per rank (MB)", "÷ bf16 bytes (target ≤ 0.4)",
                            "read per rank (MB)", "time (s)"], rows)
    body = (f"Llama-shaped `{args.preset}` model, {model_bytes / MB:,.0f} MB in bf16 (32 k vocabulary), "
            f"offload_param and offload_optimizer nvme, chunk manager CPU tier {args.cpu_budget_mb} MB.\n\n{table}")
    publish_report(body, started, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
