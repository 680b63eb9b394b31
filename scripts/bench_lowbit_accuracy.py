"""Accuracy of the low-precision layouts: the example job (scripts/train.py, real text) trained in each, its final
eval loss against the fp32-master run's (target: within 1%, ratio <= 1.01).

    .venv/bin/python scripts/bench_lowbit_accuracy.py                  # 1,000 steps per layout, tiny GPT
    .venv/bin/python scripts/bench_lowbit_accuracy.py --steps 20       # a check that every layout runs

Every layout runs the same job: configs/bf16.json's optimizer, schedule (its cosine decay spanning --steps),
batch and seed at ZeRO stage 1 in one process, differing in the bf16 section only (and offload_optimizer where
fp32 moments beside bf16 masters need it, as in DeepSpeed) and, for the 8- and 4-bit rows, optimizer.type. Bytes
per parameter are the model states at rest: weights + masters + moments (Note [bf16 master weights], [block-wise
optimizer states]).

This is a benchmark script: it prints what it measured and never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import add_json_option, publish_report, result_record, write_results  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASTERS = {"bf16_master_weights_and_grads": True}
ROUNDED = {**MASTERS, "bf16_optimizer_states": True, "stochastic_rounding": True}
# name -> (bf16 section additions, offload the optimizer states, bytes per parameter at rest, optimizer type (None:
# the config's AdamW)); 8/4-bit: parameters under 4096 elements keep bf16 moments (Note [block-wise optimizer states])
LAYOUTS = {
    "fp32 masters (bf16 default)": ({}, False, "14", None),
    "bf16 masters, fp32 moments (DeepSpeed)": (MASTERS, True, "10", None),
    "bf16 masters, bf16 moments (DeepSpeed)": ({**MASTERS, "bf16_optimizer_states": True}, False, "6", None),
    "bf16 masters, bf16 moments, stochastic rounding": (ROUNDED, False, "6", None),
    "bf16 masters, AdamW8bit, stochastic rounding": (ROUNDED, False, "~4.03", "AdamW8bit"),
    "bf16 masters, AdamW4bit, stochastic rounding": (ROUNDED, False, "~3.06", "AdamW4bit"),
}
BASELINE = "fp32 masters (bf16 default)"


def layout_config(name: str, steps: int) -> dict:
    with open(os.path.join(REPO, "configs", "bf16.json")) as f:
        cfg = json.load(f)
    extra, offload, _, optimizer = LAYOUTS[name]
    cfg["bf16"].update(extra)
    if optimizer is not None:
        cfg["optimizer"]["type"] = optimizer
    cfg["zero_optimization"] = {"stage": 1, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    cfg["scheduler"]["params"]["total_num_steps"] = steps
    cfg["tensorboard"] = {"enabled": False}
    return cfg


def run_layout(name: str, steps: int, model: str, work: str) -> dict:
    path = os.path.join(work, re.sub(r"\W+", "_", name) + ".json")
    with open(path, "w") as f:
        json.dump(layout_config(name, steps), f)
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "1",
               os.path.join(REPO, "scripts", "train.py"), "--config", path, "--steps", str(steps),
               "--eval-every", str(max(steps // 10, 1)), "--model", model]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=work)
    seconds = time.perf_counter() - started
    found = re.search(r"final train loss ([\d.]+) \| final eval loss ([\d.]+)", done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{name}: train.py failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    return {"train": float(found.group(1)), "eval": float(found.group(2)), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--model", default="tiny", choices=["tiny", "small", "bench30m"])
    ap.add_argument("--out", default=None, help="also write the report here")
    add_json_option(ap)
    args = ap.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        results = {name: run_layout(name, args.steps, args.model, work) for name in LAYOUTS}
    base = results[BASELINE]["eval"]
    rows = ["| layout | bytes / param at rest | final train loss | final eval loss | ÷ fp32 masters' (target ≤ 1.01) "
            "| run time (s) |", "|---|---|---|---|---|---|"]
    records = []
    for name, r in results.items():
        ratio = r["eval"] / base
        rows.append(f"| {name} | {LAYOUTS[name][2]} | {r['train']:.4f} | {r['eval']:.4f} | {ratio:.4f} | "
                    f"{r['seconds']:.0f} |")
        records.append(result_record("lowbit_accuracy", name, world=1, role="peer" if name == BASELINE else "ours",
                                     peer=None if name == BASELINE else BASELINE, metric="final eval loss ratio",
                                     ratio=None if name == BASELINE else ratio, target=None if name == BASELINE
                                     else 1.01, eval_loss=r["eval"], train_loss=r["train"], seconds=r["seconds"]))
    body = (f"### Low-precision layouts: the example job, {args.steps} steps, `{args.model}` GPT, one process, "
            "ZeRO stage 1\n\n" + "\n".join(rows))
    publish_report(body, started, args.out)
    write_results(args.json, records)


if __name__ == "__main__":
    main()
