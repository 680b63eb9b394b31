"""The offloaded optimizer step on the host against torch's fused AdamW over as many fp32 elements.

    TIERS_SEPARATE_DEVICE_MEMORY=1 is set by the script (the seam: Note [separate device memory]).
    .venv/bin/python scripts/bench_host_step.py                     # 6 cases, ~150 M parameters
    .venv/bin/python scripts/bench_host_step.py --layers 2 --width 512 --cases 3-bf16

One process, one GPT (vocab 256, `--layers` blocks of `--width`), AdamW fp32 states, gradient clipping 1.0
(fp16: dynamic loss scaling with its overflow check). For each case (ZeRO stage 2 or 3 × bf16 / fp16 with fp32
masters, or fp32) two engines train on the same batches: one with `offload_optimizer: cpu`, one without. Each
step is timed in its phases (forward, backward, step), median of `--steps` after `--warmup` steps. The floor is
one step of torch's fused AdamW (`fused=True`) over a flat fp32 tensor of as many elements as the model has
parameters, in the same process and thread count. The two engines and the floor take their steps in turn, and
R and the plain ratio are medians of per-step ratios, so that the machine's drift hits all of them alike.

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


class Timed:
    """One engine on the case's batches, a step at a time: phase times, page faults and bus bytes per step."""

    def __init__(self, stage: int, precision: str, offload: bool, args):
        self.engine = initialize(model(args), config(stage, precision, offload, args))
        self.manager = getattr(self.engine.optimizer, "manager", None)
        self.phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
        self.faults: list[int] = []
        self.bus: list[int] = []
        self.params = sum(p.numel() for p in self.engine.module.parameters())

    def _bus(self) -> int:
        m = self.manager
        return m.memory.bus.total + sum(m.stats.moved_bytes.values()) if m is not None else 0

    def train_step(self, x: torch.Tensor, record: bool) -> None:
        f0, b0 = _faults(), self._bus()
        t0 = time.perf_counter()
        loss = self.engine(x, x)
        t1 = time.perf_counter()
        self.engine.backward(loss)
        t2 = time.perf_counter()
        self.engine.step()
        t3 = time.perf_counter()
        if record:
            for name, seconds in zip(self.phases, (t1 - t0, t2 - t1, t3 - t2)):
                self.phases[name].append(seconds)
            self.faults.append(_faults() - f0)
            self.bus.append(self._bus() - b0)


class FusedAdamW:
    """The floor: torch's fused AdamW over `numel` fp32 elements, one step at a time."""

    def __init__(self, numel: int):
        self.p = torch.nn.Parameter(torch.randn(numel))
        self.p.grad = torch.randn(numel)
        self.opt = torch.optim.AdamW([self.p], lr=1e-4, weight_decay=0.01, fused=True)

    def timed_step(self) -> float:
        t = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t


def run_case(stage: int, precision: str, args) -> dict:
    """The offloaded engine, the one without offload and the floor, interleaved step by step (drift of the
    machine hits all three alike); R and the plain ratio as medians of the per-step ratios."""
    off, plain = Timed(stage, precision, True, args), Timed(stage, precision, False, args)
    floor = FusedAdamW(off.params)
    g = torch.Generator().manual_seed(1)
    floors, r, ratio = [], [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        record = i >= args.warmup
        plain.train_step(x, record)
        off.train_step(x, record)
        seconds = floor.timed_step()
        if record:
            floors.append(seconds)
            r.append((off.phases["backward"][-1] + off.phases["step"][-1] - plain.phases["backward"][-1]) / seconds)
            ratio.append(plain.phases["step"][-1] / seconds)
    out = {"off": {k: statistics.median(v) for k, v in off.phases.items()},
           "plain": {k: statistics.median(v) for k, v in plain.phases.items()},
           "floor": statistics.median(floors), "R": statistics.median(r), "ratio": statistics.median(ratio),
           "faults": statistics.median(off.faults), "bus": statistics.median(off.bus), "params": off.params}
    off.engine.close()
    plain.engine.close()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    rows, records = [], []
    floors = []
    for case in args.cases.split(","):
        stage, precision = int(case.split("-")[0]), case.split("-")[1]
        m = run_case(stage, precision, args)
        off, plain, r, ratio, per = m["off"], m["plain"], m["R"], m["ratio"], m["params"]
        floors.append(m["floor"])
        rows.append([f"ZeRO-{stage} {precision}", f"{off['backward']:.3f} / {off['step']:.3f}",
                     f"{plain['backward']:.3f} / {plain['step']:.3f}", f"{m['floor'] * 1e3:.0f}", f"{r:.2f}",
                     f"{ratio:.2f}", f"{m['faults'] * 4096 / per:.3f}", f"{m['bus'] / per:.1f}"])
        print(" | ".join(rows[-1]), flush=True)
        measured = (("offloaded", "R", r, 1.2), ("not offloaded", "step / floor", ratio, 1.3))
        for system, metric, value, target in measured:
            records.append(result_record("host_step", f"ZeRO-{stage} {precision} {system}", world=1,
                                         peer="torch fused AdamW", strategy=f"ZeRO-{stage} {precision}",
                                         metric=metric, ratio=round(value, 3), target=target,
                                         floor_s=m["floor"], params=per))
    header = ["case", "offloaded: backward / step (s)", "not offloaded: backward / step (s)", "floor (ms)", "R",
              "plain step / floor", "faulted bytes per param", "bus bytes per param"]
    body = (f"# The offloaded host step\n\n{machine_line()}\n\n`{command_line()}`\n\n"
            f"{per / 1e6:.0f} M parameters, {torch.get_num_threads()} threads; floor: torch's fused AdamW over as "
            f"many fp32 elements (median {statistics.median(floors) * 1e3:.0f} ms). R and the plain ratio are "
            f"medians of per-step ratios, the three timed in turn.\n\n{markdown_table(header, rows)}\n"
            f"\n{time.time() - started:.0f} s\n")
    print(body)
    if args.out:
        write_text(args.out, body)
    write_results(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
