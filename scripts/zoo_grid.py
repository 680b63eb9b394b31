"""The Hugging Face zoo's grid in docs/parallelism.md: architecture × strategy, rendered from the test's own data
(tests/hf_zoo.py, tests/zoo_cells.py, tests/zoo_grid.py), which tests/test_hf_zoo.py holds every cell to.

    python scripts/zoo_grid.py                                 # the grid, to stdout
    python scripts/zoo_grid.py --write docs/parallelism.md     # rewrites it between its markers
    python scripts/zoo_grid.py --check docs/parallelism.md     # exits 1 when it differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests import hf_zoo, zoo_cells  # noqa: E402 (after the path above)
from tests.zoo_grid import REASONS, REFUSED  # noqa: E402

BEGIN, END = "<!-- zoo grid -->", "<!-- end zoo grid -->"
HEADINGS = {"zero3": "ZeRO-3", "offload": "ZeRO-3 + CPU offload", "tp_auto": "TP 2, `plan: auto`",
            "pipeline": "pipeline 2, 1F1B", "ulysses": "Ulysses 2", "ring": "ring 2", "experts": "experts 2",
            "checkpointing": "act. ckpt", "layer_major": "layer-major"}


def render() -> str:
    strategies = list(zoo_cells.STRATEGIES)
    numbers = {reason: i + 1 for i, reason in enumerate(REASONS)}
    lines = ["| | " + " | ".join(HEADINGS[s] for s in strategies) + " |",
             "|---|" + "---|" * len(strategies)]
    trained = 0
    for name in hf_zoo.names():
        row = []
        for strategy in strategies:
            if not zoo_cells.applies(name, strategy):
                row.append("—")
            elif (name, strategy) in REFUSED:
                row.append(f"✗ Z{numbers[REFUSED[name, strategy]]}")
            else:
                row.append("✓")
                trained += 1
        lines.append(f"| **{name}** | " + " | ".join(row) + " |")
    refused = len(REFUSED)
    lines += ["", f"{trained + refused} cells: {trained} ✓ (equal to one process), {refused} ✗ (refused by name, "
                  "before any gradient). Refusals:", ""]
    lines += [f"- **Z{numbers[reason]}** {text}" for reason, (_, text) in REASONS.items()]
    return "\n".join(lines) + "\n"


def replaced(text: str, grid: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{grid}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path)
    parser.add_argument("--check", type=Path)
    args = parser.parse_args(argv)
    grid = render()
    if args.write:
        args.write.write_text(replaced(args.write.read_text(), grid))
    elif args.check:
        text = args.check.read_text()
        if replaced(text, grid) != text:
            print(f"{args.check}: the zoo grid is stale; run python scripts/zoo_grid.py --write {args.check}")
            return 1
    else:
        print(grid, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
