"""The shapes of the tensor-parallel grids: q from a tp size and mode, and why a size makes no grid (Note
[tensor-parallel grids]). Plain arithmetic, so that config checks ask it without torch.distributed."""

from __future__ import annotations

import math


def grid_side(tp: int, mode: str, depth: int = 1) -> int:
    """q of a tensor-parallel group of `tp` ranks in `mode`: tp = q² (2d), depth·q² (2.5d), q³ (3d); 1 in 1d.
    Rounded down where tp is not of that shape (tp_grid_problem says so)."""
    if mode == "2d":
        return math.isqrt(tp)
    if mode == "2.5d":
        return math.isqrt(tp // max(depth, 1))
    if mode == "3d":
        q = round(tp ** (1 / 3))
        return q if q ** 3 <= tp else q - 1
    return 1


def tp_grid_problem(tp: int, mode: str, depth: int = 1) -> str | None:
    """Why `tp` ranks do not make the grid of `mode` (None: they do, or tp is 1)."""
    if tp == 1 or mode == "1d":
        return None if depth == 1 or mode == "2.5d" else "tensor_parallel.depth is for mode \"2.5d\""
    q = grid_side(tp, mode, depth)
    if mode == "2d" and (q < 2 or q * q != tp):
        return ("mode \"2d\" runs on a q×q mesh, so the size must be a square q² with q ≥ 2 (4, 9, 16, ...); use "
                "such a size, or mode \"1d\"")
    if mode == "2.5d" and (depth < 1 or q < 2 or depth * q * q != tp):
        return (f"mode \"2.5d\" runs tensor_parallel.depth {depth} grids of q×q ranks, so the size must be depth × q² "
                f"with q ≥ 2 ({4 * depth}, {9 * depth}, ...); use such a size, or another depth")
    if mode == "3d" and (q < 2 or q ** 3 != tp):
        return ("mode \"3d\" runs on a q×q×q cube, so the size must be a cube q³ with q ≥ 2 (8, 27, 64, ...); use "
                "such a size, or mode \"1d\"")
    if mode != "2.5d" and depth != 1:
        return f"tensor_parallel.depth {depth} is for mode \"2.5d\"; remove it"
    return None
