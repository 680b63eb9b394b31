"""Note [one mesh]: the config's degrees checked once, and every group of every layout read off one DeviceMesh,
against the layout written out by hand: rank = ((p·dp + d)·sp + s)·tp + t, ep over consecutive dp × sp positions."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from engine.mesh import Axis, Mesh, ParallelDims
from engine.topology import start_mesh
from tests.distributed import results_by_case, run_cases, run_distributed

WORLD = 8
LAYOUTS = [  # (pp, sp, tp, ep, 2d)
    (1, 1, 1, 1, False), (2, 1, 2, 1, False), (1, 2, 2, 1, False), (2, 2, 1, 1, False), (1, 2, 1, 2, False),
    (1, 2, 1, 4, False), (1, 4, 1, 2, False), (2, 1, 1, 2, False), (1, 1, 2, 2, False), (2, 1, 4, 1, True),
    # hybrid sharding (Note [hybrid sharding]): the last entry is zero_optimization.mics_shard_size
    (1, 1, 1, 1, False, 2), (1, 2, 1, 1, False, 4), (2, 1, 2, 1, False, 1), (1, 2, 2, 1, False, 2),
]


AXES = {"zero": "zero", "tp": "tp", "pp": "pp", "sp": "sp", "dp": "dp", "ep": "ep", "edp": "edp", "row": "tp_row",
        "col": "tp_col", "shard": "shard", "replicate": "replicate"}  # the expected groups' names -> the mesh's axes


def _build(pp: int, sp: int, tp: int, ep: int, two_d: bool, shard: int = 0) -> tuple[dict, dict]:
    """Each axis's group members, and its (rank, size)."""
    mesh = start_mesh(torch.device("cpu"), tp_size=tp, tp_mode="2d" if two_d else "1d", pp_size=pp, sp_size=sp,
                      ep_size=ep, shard_size=shard)
    axes = {name: getattr(mesh, axis) for name, axis in AXES.items()}
    groups = {name: None if a.group is None else dist.get_process_group_ranks(a.group) for name, a in axes.items()}
    return groups, {name: (a.rank, a.size) for name, a in axes.items()} | {"world": (mesh.world.rank, mesh.world.size)}


def _worker(rank: int, world: int, cases: list[tuple]) -> dict:
    return run_cases(rank, cases, _build)


def expected_groups(rank: int, pp: int, sp: int, tp: int, ep: int, two_d: bool,
                    shard: int = 0) -> dict[str, list[int] | None]:
    """Each group of `rank` from the layout's formula, every rank enumerated."""
    dp = WORLD // (pp * sp * tp)
    at = lambda p, d, s, t: ((p * dp + d) * sp + s) * tp + t  # noqa: E731
    me = next(c for c in itertools.product(range(pp), range(dp), range(sp), range(tp)) if at(*c) == rank)
    p, d, s, t = me
    flat = d * sp + s  # place among the dp × sp ranks holding the same weights
    q = int(tp ** 0.5)
    members = {
        "zero": sorted(at(p, d2, s2, t) for d2 in range(dp) for s2 in range(sp)),
        "tp": [at(p, d, s, t2) for t2 in range(tp)] if tp > 1 else None,
        "pp": [at(p2, d, s, t) for p2 in range(pp)] if pp > 1 else None,
        "sp": [at(p, d, s2, t) for s2 in range(sp)] if sp > 1 else None,
        "dp": [at(p, d2, s, t) for d2 in range(dp)] if sp > 1 else None,
        "ep": None, "row": None, "col": None,
    }
    if sp == 1:
        members["dp"] = members["zero"]
    by_flat = lambda f: at(p, f // sp, f % sp, t)  # noqa: E731
    members["ep"] = [by_flat(flat // ep * ep + e) for e in range(ep)] if ep > 1 else None
    members["edp"] = [by_flat(f) for f in range(flat % ep, dp * sp, ep)] if ep > 1 else members["zero"]
    if two_d:
        row, col = divmod(t, q)
        members["row"] = [at(p, d, s, row * q + c) for c in range(q)]
        members["col"] = [at(p, d, s, r * q + col) for r in range(q)]
    shard = shard or dp * sp  # a shard group: consecutive dp × sp places; a replica group: one place in each
    members["shard"] = [by_flat(f) for f in range(flat // shard * shard, (flat // shard + 1) * shard)]
    members["replicate"] = [by_flat(f) for f in range(flat % shard, dp * sp, shard)] if shard < dp * sp else None
    return members


@pytest.fixture(scope="module")
def built() -> dict:
    return results_by_case(run_distributed(_worker, WORLD, args=(LAYOUTS,), timeout_s=300))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: "pp{}-sp{}-tp{}-ep{}{}{}".format(
    *c[:4], "-2d" * c[4], f"-shard{c[5]}" if len(c) > 5 else ""))
def test_every_group_of_a_layout_comes_from_the_mesh_as_the_layout_says(built, layout):
    for rank, (groups, _) in enumerate(built[layout]):
        assert groups == expected_groups(rank, *layout), rank


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: "pp{}-sp{}-tp{}-ep{}{}{}".format(
    *c[:4], "-2d" * c[4], f"-shard{c[5]}" if len(c) > 5 else ""))
def test_each_axis_knows_this_ranks_place_and_size(built, layout):
    """An axis's rank is this rank's place in its group's ranks and its size their count; an axis with no group (a
    parallelism that is off) has size 1 and rank 0."""
    for rank, (groups, facts) in enumerate(built[layout]):
        assert facts["world"] == (rank, WORLD)
        for name, members in groups.items():
            expected = (0, 1) if members is None else (members.index(rank), len(members))
            assert facts[name] == expected, (rank, name)


def test_one_process_and_a_layout_of_sizes_have_every_axis():
    one = Mesh.single("cpu")
    assert all(getattr(one, name) == Axis(None, 0, 1) for name in Mesh.AXES) and one.in_first_copy
    sizes = Mesh.layout("cpu", zero=4, tp=2, pp=2, sp=2, ep=2)
    assert (sizes.world.size, sizes.zero.size, sizes.dp.size, sizes.edp.size, sizes.tp.size) == (16, 4, 2, 2, 2)


@pytest.mark.parametrize("dims, message", [
    (dict(world=8, pp=3), "pipeline.stages 3 must divide the world size 8"),
    (dict(world=8, pp=2, tp=3), "pipeline.stages 2 × tensor_parallel.size 3 = 6 must divide the world size 8"),
    (dict(world=1, tp=2), "tensor_parallel.size 2 needs 2 processes"),
    (dict(world=8, sp=2, ep=3), "moe.expert_parallel_size 3 must divide the data-parallel size 8"),
    (dict(world=12, sp=2, ep=3), "moe.expert_parallel_size 3 and sequence_parallel.size 2: one must divide"),
    (dict(world=8, tp=2, tp_mode="2d"), "must be a square"),
    (dict(world=8, tp=4, tp_mode="3d"), "must be a cube"),
    (dict(world=8, tp=8, tp_mode="2.5d", tp_depth=4), "depth × q² with q ≥ 2"),
    (dict(world=8, ep=0), "moe.expert_parallel_size 0 must be 1 or more"),
    (dict(world=8, pp=2, shard=3), "zero_optimization.mics_shard_size 3 must divide the ZeRO group's 4 ranks"),
    (dict(world=8, sp=4, shard=2), "zero_optimization.mics_shard_size 2: a shard group holds whole sequence"),
    (dict(world=8, ep=2, shard=4), "zero_optimization.mics_shard_size 4 with moe.expert_parallel_size 2"),
])
def test_a_wrong_product_of_degrees_names_the_keys(dims, message):
    with pytest.raises(ValueError, match=message.replace("×", ".").replace("(", r"\(")):
        ParallelDims(**dims)
