"""The offloaded optimizer step on the host against torch's fused AdamW over as many fp32 elements.

    TIERS_SEPARATE_DEVICE_MEMORY=1 is set by the script (the seam: Note [separate device memory]).
    .venv/bin/python scripts/bench_host_step.py                     # 6 cases, ~150 M parameters
    .venv/bin/python scripts/bench_host_step.py --layers 2 --width 512 --cases 3-bf16

One process, one GPT (vocab 256, `--layers` blocks of `--width`), AdamW fp32 states, gradient clipping 1.0
(fp16: dynamic loss scaling with its overflow check). For each case (ZeRO stage 2 or 3 × bf16 / fp16 with fp32
masters, or fp32) two engines train on the same batches: one with `offload_optimizer: cpu`, one without. Each step is timed in its phases (forward, backward, step), median of
`--steps` after `--warmup` steps. The floor is one step of torch's fused AdamW (`fused=True`) over a flat
fp32 tensor of as many elements as the model has parameters, in the same process and thread count.

    R     = (backward + step of the offloaded engine - backward of the engine without offload) / floor
    plain = step of the engine without offload / floor

Moving work between backward and step does not change R; doing less does. Also printed: minor page faults
per parameter per step (fresh host memory being touched), and bytes that crossed the seam's bus per parameter
per step. This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ["TIERS_SEPARATE_DEVICE_MEMORY"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import (  # noqa: E402
    add_json_option,
    command_line,
    machine_line,
    result_record,
    write_results,
    write_text,
)

from engine import initialize  # noqa: E402
from engine.estimate.report import markdown_table  # noqa: E402
from engine.models.gpt import GPT, GPTConfig  # noqa: E402

CASES = ("2-bf16", "2-fp16", "2-fp32", "3-bf16", "3-fp16", "3-fp32")
PRECISION = {"bf16": {"bf16": {"enabled": True}},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 12}},
             "fp32": {}}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=2,
                    help="tokens per sample: few, so that backward's compute (subtracted) stays small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    add_json_option(ap)
    return ap.parse_args(argv)


def model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                         n_embd=args.width))


def config(stage: int, precision: str, offload: bool, args) -> dict:
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10**9,
            **PRECISION[precision]}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_engine(stage: int, precision: str, offload: bool, args) -> dict:
    """Median phase times of one engine, its page faults and bus bytes per step."""
    engine = initialize(model(args), config(stage, precision, offload, args))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(args.warmup + args.steps)]
    manager = getattr(engine.optimizer, "manager", None)
    phases = {"forward": [], "backward": [], "step": []}
    faults, bus = [], []
    for i, x in enumerate(batches):
        f0 = _faults()
        b0 = manager.memory.bus.total + sum(manager.stats.moved_bytes.values()) if manager else 0
        t0 = time.perf_counter()
        loss = engine(x, x)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            for name, s in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(s)
            faults.append(_faults() - f0)
            if manager:
                bus.append(manager.memory.bus.total + sum(manager.stats.moved_bytes.values()) - b0)
    params = sum(p.numel() for p in engine.module.parameters())
    engine.close()
    return {**{k: statistics.median(v) for k, v in phases.items()}, "faults": statistics.median(faults),
            "bus": statistics.median(bus) if bus else 0, "params": params}


def fused_adamw_pass(numel: int, args) -> float:
    """Median seconds of one torch fused AdamW step over `numel` fp32 elements."""
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
    times = []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    rows, records = [], []
    floor = None
    for case in args.cases.split(","):
        stage, precision = int(case.split("-")[0]), case.split("-")[1]
        off = run_engine(stage, precision, True, args)
        plain = run_engine(stage, precision, False, args)
        if floor is None:
            floor = fused_adamw_pass(off["params"], args)
        r = (off["backward"] + off["step"] - plain["backward"]) / floor
        ratio = plain["step"] / floor
        per = off["params"]
        rows.append([f"ZeRO-{stage} {precision}", f"{off['backward']:.3f} / {off['step']:.3f}",
                     f"{plain['backward']:.3f} / {plain['step']:.3f}", f"{r:.2f}", f"{ratio:.2f}",
                     f"{off['faults'] * 4096 / per:.3f}", f"{off['bus'] / per:.1f}"])
        print(" | ".join(rows[-1]), flush=True)
        measured = (("offloaded", "R", r, 1.2), ("not offloaded", "step / floor", ratio, 1.3))
        for system, metric, value, target in measured:
            records.append(result_record("host_step", f"ZeRO-{stage} {precision} {system}", world=1,
                                         peer="torch fused AdamW", strategy=f"ZeRO-{stage} {precision}",
                                         metric=metric, ratio=round(value, 3), target=target,
                                         floor_s=floor, params=per))
    header = ["case", "offloaded: backward / step (s)", "not offloaded: backward / step (s)", "R",
              "plain step / floor", "faulted bytes per param", "bus bytes per param"]
    body = (f"# The offloaded host step\n\n{machine_line()}\n\n`{command_line()}`\n\n"
            f"{off['params'] / 1e6:.0f} M parameters; floor: torch fused AdamW over as many fp32 elements "
            f"{floor * 1e3:.0f} ms, {torch.get_num_threads()} threads.\n\n{markdown_table(header, rows)}\n"
            f"\n{time.time() - started:.0f} s\n")
    print(body)
    if args.out:
        write_text(args.out, body)
    write_results(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
