"""2.5D and 3D tensor parallelism composed with data parallelism and ZeRO on 16 ranks (two tp groups of 8), each
case against one process on the whole batch: losses, gradient norms and joined weights at 1e-4, each rank holding
its share of the weights (tests/test_tensor_parallel.py's check). Outside the suite: 16 processes on 2 cores.

    .venv/bin/python scripts/grid_tp_16.py            # every case; exits 1 when one differs
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.distributed import run_distributed  # noqa: E402 (after the path above)
from tests.test_tensor_parallel import check_against_reference, tp_config, train_tp  # noqa: E402

WORLD, TP, DP = 16, 8, 2
# (mode, depth, model, ZeRO stage): every stage once, each grid with a Hugging Face model
CASES = [("2.5d", 2, "gpt2", 1), ("2.5d", 2, "llama", 3), ("3d", 1, "llama8", 2), ("3d", 1, "gpt2", 3)]


def _worker(rank: int, world: int) -> dict:
    results = {}
    for mode, depth, model, stage in CASES:
        cfg = tp_config(TP, DP, stage=stage, mode=mode)
        cfg["tensor_parallel"]["depth"] = depth
        results[(mode, model, stage)] = train_tp(model, cfg, rank, TP, DP, 1)
    return results


def main() -> int:
    started = time.perf_counter()
    per_rank = run_distributed(_worker, WORLD, timeout_s=3000)
    failed = 0
    for mode, depth, model, stage in CASES:
        results = [r[(mode, model, stage)] for r in per_rank]
        try:
            check_against_reference(model, results, WORLD, TP, "2d", share=TP // depth)
            verdict = "equal to one process"
        except AssertionError as e:
            failed += 1
            verdict = f"DIFFERS: {e}"
        losses = [round(sum(r[0][i] for r in results) / WORLD, 6) for i in range(len(results[0][0]))]
        print(f"{mode} (depth {depth}) × dp {DP}, ZeRO-{stage}, {model}: losses {losses}: {verdict}", flush=True)
    print(f"{len(CASES) - failed} of {len(CASES)} cases equal to one process ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
