"""Cutting a model's list of blocks into contiguous pipeline stages, balanced by a cost per block."""

from __future__ import annotations

import functools


def balanced_starts(costs: list[float], parts: int, head: float = 0.0, tail: float = 0.0) -> list[int]:
    """The index of the first block of each of `parts` contiguous runs of blocks (each at least one block) that
    minimizes the costliest run; `head` is added to the first run (what runs before the blocks, e.g. the
    embeddings) and `tail` to the last (the final norm and the output layer). Ties go to the earliest cut."""
    count = len(costs)
    if parts > count:
        raise ValueError(f"{parts} pipeline stages need at least {parts} blocks, and the model has {count}; use at "
                         f"most {count} stages (pipeline.stages × virtual_stages)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run_cost(lo: int, hi: int) -> float:
        return prefix[hi] - prefix[lo] + (head if lo == 0 else 0.0) + (tail if hi == count else 0.0)

    @functools.lru_cache(maxsize=None)
    def best(first: int, remaining: int) -> tuple[float, tuple[int, ...]]:
        """(the costliest run, the starts) for blocks first.. cut into `remaining` runs."""
        if remaining == 1:
            return run_cost(first, count), (first,)
        options = []
        for end in range(first + 1, count - remaining + 2):
            worst, starts = best(end, remaining - 1)
            options.append((max(run_cost(first, end), worst), (first,) + starts))
        return min(options, key=lambda option: option[0])

    return list(best(0, parts)[1])


def starts_from_names(block_names: list[str], first_names: list[str], parts: int) -> list[int]:
    """The starts given as the names of the blocks that begin each stage (the first block may be left out)."""
    names = list(first_names)
    if names and names[0] != block_names[0]:
        names.insert(0, block_names[0])
    unknown = [n for n in names if n not in block_names]
    if unknown:
        raise ValueError(f"pipeline.partition: {unknown[0]!r} is not one of the model's blocks "
                         f"({block_names[0]} .. {block_names[-1]}); name the blocks that start each stage")
    starts = [block_names.index(n) for n in names]
    if len(starts) != parts or starts != sorted(set(starts)):
        raise ValueError(f"pipeline.partition: {parts} distinct blocks in increasing order start the {parts} stages "
                         f"(the first block may be left out), got {first_names}")
    return starts
