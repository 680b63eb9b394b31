"""One prepared check of Tiers on a GPU (or, with --simulate, on the CPU seam of Note [separate device memory]).

    python scripts/gpu_check.py [--simulate] [--json] [--only SECTION,...]

Runs each section in a child process with its own time limit, most important first, and writes everything it
measured to $OUT/gpu_check.json (or out/gpu_check.json). Needs only torch and the working tree (no .venv, no
installs: the GPU images carry torch 2.11 and allow nothing else). Sections:
  env           torch, CUDA, the device, which of the package's dependencies import
  device_tier   bf16 ZeRO-2 with offload_optimizer cpu: device bytes per kind between steps, the device peak,
                initialize's device peak, bus bytes per parameter per step, losses equal to the run without offload;
                then ZeRO-3 with parameters offloaded under a device budget and with placement "auto", and
                initialize's device peak against the 16-bit model (Note [a bounded start])
  manager       the chunk manager under a lagging compute stream, byte-exact against a CPU shadow
                (a short pass again under TORCH_CUDA_SANITIZER=1)
  ring          ring attention's explicit blocks under bf16 autocast against fp64
  gpt           a ~1.2 B GPT in bf16: plain PyTorch, Tiers stage 0, stage 3 offloaded under a device budget
  zero_init     zero_init of a ~0.3 B GPT straight to NVMe, one step
  offload       the ~1.28 B GPT per phase: plain PyTorch, Tiers ZeRO-3 fully offloaded and ZeRO-2 with
                offload_optimizer, FSDP2 with CPUOffloadPolicy, the host floor (fused AdamW on the CPU over as many
                elements) and the bus, with the ratios the offload targets are taken on
  lowbit        the fused 8-bit update on the device against torchao's compiled update on one tile: bit equality
                and ns per element (skipped where torchao is not installed)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# each section's time limit in seconds (on an H100; the whole check is meant to take under 8 minutes)
SECTIONS = {"env": 20, "device_tier": 90, "manager": 40, "ring": 20, "gpt": 100, "zero_init": 60, "offload": 150,
            "lowbit": 90}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true", help="the CPU seam instead of a GPU (small sizes)")
    parser.add_argument("--json", action="store_true", help="print the device-tier figures as one JSON object")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # a child process runs one section
    args = parser.parse_args()
    if args.section:
        from scripts.gpu_check_sections import run_section
        json.dump(run_section(args.section, args.simulate), sys.stdout)
        return 0
    results = {}
    for name in args.only.split(","):
        results[name] = _run_child(name, args.simulate, SECTIONS[name] * (1 if not args.simulate else 2))
        if not args.json:
            print(f"== {name}: {json.dumps(results[name], indent=1)}", flush=True)
    out = os.environ.get("OUT") or os.path.join(ROOT, "out")  # out/ is ignored by git
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    if args.json:
        print(json.dumps(results.get("device_tier", results), indent=1))
    return 0 if all("error" not in r for r in results.values()) else 1


def _run_child(name: str, simulate: bool, timeout: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--section", name] + (["--simulate"] if simulate else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr or "")
        return {"error": f"timed out after {timeout} s", "stderr_tail": stderr[-2000:]}
    seconds = round(time.perf_counter() - start, 1)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}", "seconds": seconds, "stderr_tail": done.stderr[-3000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = seconds
    return result


if __name__ == "__main__":
    sys.exit(main())
