"""The optimizer update of each state layout, in memory, against torchao's and torch's own optimizers on as many
elements.

    .venv/bin/python scripts/bench_update.py                   # 16 M elements, ~3 minutes on 2 cores
    .venv/bin/python scripts/bench_update.py --elements 1048576 --steps 2

One process. Each layout is the optimizer initialize builds for it (engine.optim.build_optimizer and
tiled_layout, as scripts/scale_plan.py times it), stepping one tensor of `--elements` parameters laid out as one
chunk; its peer is the optimizer a user of that layout would otherwise run: torchao's AdamW8bit / AdamW4bit
(compiled per shape, as torchao compiles them; bf16 weights rounded stochastically by torchao's own draws where
ours are), or torch's fused AdamW (bf16 weights, states and arithmetic where ours keep bf16 masters). The floor is
torch's fused AdamW over fp32 weights and states. Each figure is the median of `--steps` steps after a warm-up
step (which compiles), the systems taking their steps in turn; ns per element and the ratio to the peer (lower
is better for ours). This is a benchmark script: it prints what it measured and never asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import add_json_option, machine_line, publish_report, result_record, write_results  # noqa: E402
from scale_plan import engine_update  # noqa: E402

from engine.estimate.report import markdown_table  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 0.01
MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
# name -> (optimizer type, bf16 section or None for fp32, the peer: (kind, bits, bf16 weights, rounded))
LAYOUTS = {
    "8bit-fp32": ("AdamW8bit", None, ("torchao", 8, False, False)),
    "8bit-bf16-masters": ("AdamW8bit", MASTERS, ("torchao", 8, True, False)),
    "8bit-bf16-masters-sr": ("AdamW8bit", {**MASTERS, "stochastic_rounding": True}, ("torchao", 8, True, True)),
    "4bit-fp32": ("AdamW4bit", None, ("torchao", 4, False, False)),
    "bf16-masters": ("AdamW", MASTERS, ("torch", 0, True, False)),
    "bf16-masters-sr": ("AdamW", {**MASTERS, "stochastic_rounding": True}, ("torch", 0, True, False)),
}
DESCRIPTIONS = {
    "8bit-fp32": "AdamW8bit, fp32 weights", "8bit-bf16-masters": "AdamW8bit, bf16 masters",
    "8bit-bf16-masters-sr": "AdamW8bit, bf16 masters rounded stochastically", "4bit-fp32": "AdamW4bit, fp32 weights",
    "bf16-masters": "AdamW, bf16 masters and states",
    "bf16-masters-sr": "AdamW, bf16 masters and states, rounded stochastically",
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 24)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per system, after one warm-up step")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layout names")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    add_json_option(ap)
    return ap.parse_args(argv)


def ours(name: str, elements: int):
    """The step of the optimizer initialize builds for layout `name`, over one tensor laid out as one chunk."""
    optimizer_type, bf16, _ = LAYOUTS[name]
    params = {"lr": LR, "weight_decay": WEIGHT_DECAY, **({"compile": True} if "bit" in optimizer_type else {})}
    return engine_update({"train_batch_size": 1, "optimizer": {"type": optimizer_type, "params": params},
                          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                          **({"bf16": bf16} if bf16 else {})}, elements)


def peer(name: str, elements: int) -> tuple[str, object]:
    """The peer's description and step."""
    kind, bits, bf16, rounded = LAYOUTS[name][2]
    weights = _tensor(elements, torch.bfloat16 if bf16 else torch.float32)
    if kind == "torch":
        optimizer = torch.optim.AdamW([weights], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        return "torch fused AdamW, bf16 weights and states", optimizer.step
    import torchao.optim

    cls = torchao.optim.AdamW8bit if bits == 8 else torchao.optim.AdamW4bit
    optimizer = cls([weights], lr=LR, weight_decay=WEIGHT_DECAY, bf16_stochastic_round=rounded)
    return (f"torchao {cls.__name__}" + (", bf16 weights" if bf16 else "")
            + (" rounded stochastically" if rounded else "")), optimizer.step


def floor(elements: int):
    weights = _tensor(elements, torch.float32)
    return torch.optim.AdamW([weights], lr=LR, weight_decay=WEIGHT_DECAY, fused=True).step


def _tensor(elements: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(elements, generator=g).to(dtype).requires_grad_()
    weights.grad = (torch.randn(elements, generator=g) * 1e-3).to(dtype)
    return weights


def timed_in_turn(steps: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each step, after a warm-up step each, the steps taken in turn."""
    times: dict[str, list[float]] = {key: [] for key in steps}
    for step in steps.values():
        step()
    for _ in range(repeats):
        for key, step in steps.items():
            began = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - began)
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    warnings.simplefilter("ignore")  # torchao's compile-cache notes
    n = args.elements
    rows, records = [], []
    for name in args.layouts.split(","):
        peer_name, peer_step = peer(name, n)
        seconds = timed_in_turn({"ours": ours(name, n), "peer": peer_step, "floor": floor(n)}, args.steps)
        ratio = seconds["ours"] / seconds["peer"]
        ns = {key: value / n * 1e9 for key, value in seconds.items()}
        rows.append([DESCRIPTIONS[name], f"{ns['ours']:.2f}", peer_name, f"{ns['peer']:.2f}", f"{ratio:.2f}",
                     f"{ns['floor']:.2f}", f"{seconds['ours'] / seconds['floor']:.1f}"])
        records.append(result_record(
            "update", f"tiers {DESCRIPTIONS[name]}", world=1, peer=peer_name, strategy=name, metric="update time",
            ratio=ratio, target=1.0, step_s=seconds["ours"], throughput=n / seconds["ours"], unit="elements/s",
            ns_per_element=ns["ours"], peer_ns_per_element=ns["peer"], floor_ns_per_element=ns["floor"]))
        records.append(result_record(
            "update", f"{peer_name} (beside {DESCRIPTIONS[name]})", world=1, role="peer", strategy=name,
            metric="update time", step_s=seconds["peer"], throughput=n / seconds["peer"], unit="elements/s"))
    text = "\n".join([
        "### The optimizer update of each state layout, in memory, one process",
        "",
        f"{n:,} elements in one tensor (one chunk), lr {LR}, weight decay {WEIGHT_DECAY}; ours: the optimizer "
        "initialize builds (low-bit updates compiled: `optimizer.params.compile`); peers: torchao's optimizers "
        "(compiled per shape, as torchao does) and torch's fused AdamW. Median of "
        f"{args.steps} steps after a warm-up, in turn. Floor: torch's fused AdamW, fp32 weights and states. "
        f"{machine_line()}, {torch.get_num_threads()} threads.",
        "",
        markdown_table(["layout", "ours (ns/element)", "peer", "peer (ns/element)", "ours ÷ peer (target ≤ 1)",
                        "fp32 fused AdamW (ns/element)", "ours ÷ fp32 fused AdamW"], rows),
    ])
    publish_report(text, started, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
