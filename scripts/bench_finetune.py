"""LoRA on a 7 B Llama-shaped model in one process on this machine: the base (bf16 safetensors shards the script
writes with random weights) loaded under zero_init, frozen in chunks on NVMe; PEFT's adapters (r = 16, every
linear layer of the blocks) trained 5 steps on a fixed batch; with --base int8, the base's linear weights kept as
int8 in their chunks (zero_optimization.quantize_frozen), half the bytes on NVMe and read per step.

    .venv/bin/python scripts/bench_finetune.py --dir /mnt/nvme/bench                 # 7 B, ~13.5 GB of weights
    .venv/bin/python scripts/bench_finetune.py --dir /tmp/b --preset tiny --compute-layers 1   # a check

Reported: the peak RSS from after the imports (target <= 4 GB), the loss per step, the step time against
max(compute, base read): compute is the same step's time with the base in memory (plain PEFT, bf16) on a model of
the same width with --compute-layers layers, scaled by the parameter ratio; base read is the frozen bytes the step
read from NVMe at dd's read bandwidth on --dir (measured before and after).

This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import (  # noqa: E402
    RETURN_FREED_MEMORY_ENV,
    DiskCounter,
    add_json_option,
    publish_report,
    result_record,
    spawn_ranks,
    write_results,
)
from disk_baseline import dd_bandwidth  # noqa: E402
from pretrained_files import PRESETS, llama_config, prepared_checkpoint  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402
from engine.estimate.runtime import peak_rss_bytes, reset_peak_rss  # noqa: E402

MB, GB = 1e6, 1e9
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora():
    from peft import LoraConfig
    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)


def fixed_batch(seq: int, vocab: int):
    import torch
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))


def engine_config(swap: str, cpu_budget_mb: int, lr: float, base: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
                                  "offload_optimizer": {"device": "cpu"},
                                  "quantize_frozen": "int8" if base == "int8" else "none"},
            "memory": {"cpu_budget": cpu_budget_mb * 2**20}, "steps_per_print": 10**6}


def finetune(rank: int, world: int, path: str, swap: str, args, results) -> None:
    import torch
    import transformers
    from peft import get_peft_model

    from engine import initialize, zero_init
    torch.set_num_threads(os.cpu_count() or 1)  # one process: every core
    reset_peak_rss()
    started = time.perf_counter()
    torch.manual_seed(0)
    with zero_init():
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = get_peft_model(model, lora())
    model.train()
    engine = initialize(model, engine_config(swap, args.cpu_budget_mb, args.lr, args.base))
    start_s = time.perf_counter() - started
    manager = engine.optimizer.manager
    written_at_start = manager.stats.nvme_written_bytes["frozen"]
    x = fixed_batch(args.seq, model.config.vocab_size)
    losses, times, reads = [], [], []
    for _ in range(args.steps):
        read_before, t0 = manager.stats.nvme_read_bytes["frozen"], time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        reads.append(manager.stats.nvme_read_bytes["frozen"] - read_before)
        losses.append(loss.item())
        print(f"step {len(losses)}: loss {losses[-1]:.4f}, {times[-1]:.1f} s, base read {reads[-1] / GB:.2f} GB",
              flush=True)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    frozen_written_in_training = manager.stats.nvme_written_bytes["frozen"] - written_at_start
    engine.close()
    results.put({"losses": losses, "times": times, "reads": reads, "peak_rss": peak_rss_bytes(),
                 "start_s": start_s, "trainable": trainable, "frozen_written": frozen_written_in_training,
                 "frozen_on_nvme": written_at_start})


def compute_only(rank: int, world: int, preset: str, layers: int, args, results) -> None:
    """Plain PEFT with the base in memory (bf16) on `layers` blocks of the preset's width: the step's compute."""
    import torch
    import transformers
    from peft import get_peft_model
    torch.set_num_threads(os.cpu_count() or 1)
    config = llama_config(preset)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = get_peft_model(transformers.LlamaForCausalLM(config).to(torch.bfloat16), lora())
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    x = fixed_batch(args.seq, config.vocab_size)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    results.put({"params": params, "step_s": statistics.median(times[1:] or times)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "tiers-bench"),
                    help="where the checkpoint and the NVMe swap files go (on the disk to measure)")
    ap.add_argument("--preset", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=8,
                    help="tokens per step (CPUs without native bf16 matrix products run bf16 GEMMs in torch's "
                         "reference kernel, under 1 GFLOP/s: a 7 B step of 32 tokens takes over 10 minutes there)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--base", default="bf16", choices=["bf16", "int8"],
                    help="the frozen base's chunks: bf16, or int8 linear weights (quantize_frozen)")
    ap.add_argument("--cpu-budget-mb", type=int, default=1024, help="the chunk manager's CPU tier")
    ap.add_argument("--compute-layers", type=int, default=2, help="blocks of the in-memory compute model")
    ap.add_argument("--raw-bytes", type=int, default=2 << 30, help="bytes per dd pass")
    ap.add_argument("--out", default=None, help="also write the report here")
    add_json_option(ap)
    args = ap.parse_args()
    started = time.perf_counter()
    path, base_bytes = prepared_checkpoint(args.dir, args.preset)
    swap = os.path.join(args.dir, f"finetune-swap-{args.base}")
    os.makedirs(swap, exist_ok=True)
    disk = DiskCounter(args.dir)
    _, read_before = dd_bandwidth(args.dir, args.raw_bytes, disk)
    (run,) = spawn_ranks(finetune, 1, args=(path, swap, args), env=RETURN_FREED_MEMORY_ENV)
    _, read_after = dd_bandwidth(args.dir, args.raw_bytes, disk)
    (small,) = spawn_ranks(compute_only, 1, args=(args.preset, args.compute_layers, args))
    read_bw = (read_before + read_after) / 2
    params = base_bytes / 2 + run["trainable"]
    compute_s = small["step_s"] * params / small["params"]
    steady = run["times"][1:] or run["times"]
    step_s, read_per_step = statistics.median(steady), statistics.median(run["reads"][1:] or run["reads"])
    read_s = read_per_step / read_bw
    ratio = step_s / max(compute_s, read_s)
    rows = [[i + 1, f"{loss:.4f}", f"{t:.1f}", f"{r / GB:.2f}"]
            for i, (loss, t, r) in enumerate(zip(run["losses"], run["times"], run["reads"]))]
    table = markdown_table(["step", "loss", "time (s)", "base read from NVMe (GB)"], rows)
    summary = markdown_table(["", "value"], [
        ["peak RSS (target ≤ 4 GB)", f"{run['peak_rss'] / GB:.2f} GB"],
        ["base checkpoint (bf16 files) / adapters (trainable)",
         f"{base_bytes / GB:.2f} GB / {run['trainable'] / 1e6:.1f} M"],
        ["frozen bytes on NVMe (written at the start)", f"{run['frozen_on_nvme'] / GB:.2f} GB"],
        ["load + initialize", f"{run['start_s']:.0f} s"],
        ["frozen bytes written to NVMe while training", f"{run['frozen_written']}"],
        ["step time (median of steps 2..)", f"{step_s:.1f} s"],
        [f"compute: plain PEFT in memory, {args.compute_layers} blocks × params ratio",
         f"{small['step_s']:.2f} s × {params / small['params']:.2f} = {compute_s:.1f} s"],
        ["base read per step at dd's read bandwidth", f"{read_per_step / GB:.2f} GB / {read_bw / MB:,.0f} MB/s = "
                                                      f"{read_s:.1f} s"],
        ["step ÷ max(compute, base read)", f"{ratio:.2f}"]])
    body = (f"LoRA r = 16 on every linear layer of the blocks of a Llama-shaped `{args.preset}` model, one process, "
            f"stage 3, bf16, the frozen base on NVMe as {'int8 linear weights' if args.base == 'int8' else 'bf16'} "
            f"(chunk manager CPU tier {args.cpu_budget_mb} MB), micro batch "
            f"1 × {args.seq} tokens (one fixed batch), AdamW lr {args.lr}.\n\n{summary}\n\n{table}")
    publish_report(body, started, args.out)
    write_results(args.json, [
        result_record("finetune", f"LoRA, {args.base} base on NVMe", world=1, metric="step ÷ max(compute, base read)",
                      ratio=ratio, target=1.0, step_s=step_s, peak_rss_per_rank_bytes=run["peak_rss"],
                      losses=run["losses"], compute_s=compute_s, read_s=read_s),
        result_record("finetune", f"peak RSS ÷ 4 GB, {args.base} base", world=1, metric="peak RSS / 4 GB",
                      ratio=run["peak_rss"] / 4e9, target=1.0, peak_rss_per_rank_bytes=run["peak_rss"])])


if __name__ == "__main__":
    main()
