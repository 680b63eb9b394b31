"""Checks the fused 8-bit update's prefix tables against torchao's quantization on all 2^32 fp32 patterns.

    .venv/bin/python scripts/check_qmap_table.py      # ~3 minutes on 2 cores

Note [fused 8-bit update]: the table gives torchao's `quantize_8bit_with_qmap` code for every fp32 value when the
code changes at most once within each 16-bit prefix. The tests check every pattern of the prefixes where it changes
and a random sample of the rest; this script checks every pattern, both maps, with both functions compiled (each
compiled one gives its eager ops' codes: comparisons and gathers round nothing). It prints the mismatches (0 when
the table holds) and exits non-zero if there are any.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.optimizers.lowbit_kernel import prefix_table, quantize_by_table  # noqa: E402

CHUNK = 1 << 24


def mismatches(qmap: tuple[float, ...]) -> int:
    from torchao.optim.quant_utils import quantize_8bit_with_qmap

    values, table = torch.tensor(qmap), prefix_table(qmap)
    if table is None:
        raise SystemExit("no table: a 16-bit prefix holds two changes of code")
    theirs = torch.compile(quantize_8bit_with_qmap, dynamic=False)
    ours = torch.compile(quantize_by_table, dynamic=False)
    count, offsets = 0, torch.arange(CHUNK, dtype=torch.int64)
    for start in range(-(1 << 31), 1 << 31, CHUNK):
        x = (offsets + start).to(torch.int32).view(torch.float32)
        count += int((theirs(x, values) != ours(x, table)).sum())
    return count


def main() -> int:
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    failed = 0
    for name, qmap in (("signed", get_qmap_signed()), ("unsigned", get_qmap_unsigned())):
        began = time.perf_counter()
        count = mismatches(qmap)
        print(f"{name} map: {count} of 2^32 patterns differ ({time.perf_counter() - began:.0f} s)")
        failed += count
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
