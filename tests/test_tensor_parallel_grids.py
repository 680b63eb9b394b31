"""2.5D and 3D tensor parallelism (Note [tensor-parallel grids]) on 8 ranks: Hugging Face GPT-2 and Llama under
the built-in and derived plans equal one process on the whole batch (losses, gradient norms, weights: 1e-4), each
rank holding its share of the weights; a checkpoint moves between 1D, 3D, 2.5D and 2D with training continuing as
one process does; the configs that make no grid are refused by name."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine import initialize
from engine.config import load_config
from engine.estimate.estimator import trace_strategy
from engine.topology import start_mesh
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_engine,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import adamw
from tests.test_tensor_parallel import GLOBAL_BATCH, STEPS, TP_RTOL, check_against_reference, tp_config, train_tp

WORLD = 8
GRIDS = {"2.5d": 2, "3d": 1}  # mode -> depth: 2 grids of 2×2, a 2×2×2 cube
# (mode, model, plan): Llama under 3D with 8 query and 4 key/value heads, which split into q² = 4 hidden pieces
CASES = [("2.5d", "gpt2", "auto"), ("2.5d", "llama", "auto"), ("3d", "gpt2", "auto"), ("3d", "llama8", "auto"),
         ("2.5d", "gpt2", "derived"), ("3d", "gpt2", "derived")]
CHAIN_STEPS, CHAIN_BATCH = 8, 8


class InplaceLM(nn.Module):
    """A bias-free linear layer right after the embedding, then an in-place ReLU on its output: under 3D the linear
    layer's output is this rank's own tensor (not a view of a larger buffer), which an in-place op may change."""

    def __init__(self, seed: int = 0, vocab: int = 64, width: int = 32):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.act = nn.ReLU(inplace=True)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(self.norm(h + self.down(self.act(self.up(h)))))


def inplace_loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _inplace_worker(rank: int) -> tuple:
    engine = initialize(InplaceLM(seed=rank), grid_config("3d"))  # ranks seeded apart: the plan makes them agree
    losses, _ = train_engine(engine, token_batches(STEPS, GLOBAL_BATCH, vocab=64), 0, 1, 1, loss_fn=inplace_loss)
    return losses, engine.full_state_dict()


def grid_config(mode: str, plan: str = "auto", tp: int = WORLD, dp: int = 1) -> dict:
    cfg = tp_config(tp, dp, mode=mode)
    cfg["tensor_parallel"].update(plan=plan, depth=GRIDS.get(mode, 1))
    return cfg


def _chain_worker(rank: int, root: str) -> dict:
    """The example GPT trained two steps in each layout in turn, each loading the one before's checkpoint:
    1D (tp 4 × dp 2), 3D, 2.5D, 2D (tp 4 × dp 2)."""
    batches = token_batches(CHAIN_STEPS, CHAIN_BATCH)
    legs = [("1d", 4), ("3d", 8), ("2.5d", 8), ("2d", 4)]
    out, saved = {}, None
    for leg, (mode, tp) in enumerate(legs):
        engine = initialize(tiny_gpt(seed=rank, n_head=4), grid_config(mode, tp=tp, dp=WORLD // tp))
        if saved is not None:
            engine.load_checkpoint(os.path.join(root, legs[leg - 1][0]))
            loaded = engine.full_state_dict()
            out[f"{mode}_loaded_exactly"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
        losses, _ = train_engine(engine, batches[2 * leg:2 * leg + 2], engine.dp_rank, engine.dp_world_size, 1)
        out[mode] = losses
        engine.save_checkpoint(os.path.join(root, mode))
        saved = engine.full_state_dict()
        if leg == len(legs) - 1:
            out["params"] = trained_params(engine)
        if mode == "2.5d":  # the grids hold the same pieces (the joined weights read grid 0's only)
            depth = engine.mesh.tp_depth
            pieces = [p.detach().clone() for p in engine.module.parameters()]
            out["grids_agree"] = all(torch.equal(*gathered) for gathered in
                                     (_gathered(p, depth.group, depth.size) for p in pieces))
        engine.close()
    return out


def _axes_worker(rank: int) -> dict:
    """The members of each grid axis of this rank, 2.5D and 3D."""
    out = {}
    for mode, depth in GRIDS.items():
        mesh = start_mesh(torch.device("cpu"), tp_size=WORLD, tp_mode=mode, tp_depth=depth)
        out[mode] = {name: dist.get_process_group_ranks(axis.group) if axis.group is not None else None
                     for name in ("tp_row", "tp_col", "tp_depth", "tp_j", "tp_k") for axis in [getattr(mesh, name)]}
    return out


def _gathered(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _grids_worker(rank, world, root):
    """Every case of this file in one group of 8: start-up, not the cases, dominates their time."""
    results = {"axes": _axes_worker(rank)}
    for mode, model, plan in CASES:
        try:
            results[(mode, model, plan)] = train_tp(model, grid_config(mode, plan), rank, WORLD, 1, 1)
        except Exception as e:
            raise RuntimeError(f"case {mode} {model} {plan} failed on rank {rank}") from e
    results["chain"] = _chain_worker(rank, root)
    results["inplace"] = _inplace_worker(rank)
    return results


@pytest.fixture(scope="module")
def grid_results(tmp_path_factory) -> dict:
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp("grids"))
    per_rank = run_distributed(_grids_worker, WORLD, args=(root,), timeout_s=420)
    return {name: [rank_results[name] for rank_results in per_rank] for name in per_rank[0]}


def test_the_grid_axes_are_the_rows_columns_depths_and_cube_lines_the_layout_says(grid_results):
    """2.5D: rank g·4 + r·2 + c (grid g, row r, column c); 3D: rank i·4 + j·2 + k."""
    for t, axes in enumerate(grid_results["axes"]):
        g, r, c = t // 4, t // 2 % 2, t % 2
        assert axes["2.5d"] == {"tp_row": [g * 4 + r * 2 + x for x in range(2)],
                                "tp_col": [g * 4 + x * 2 + c for x in range(2)],
                                "tp_depth": [x * 4 + r * 2 + c for x in range(2)], "tp_j": None, "tp_k": None}, t
        i, j, k = g, r, c
        assert axes["3d"] == {"tp_row": [i * 4 + x for x in range(4)], "tp_col": [x * 4 + j * 2 + k for x in range(2)],
                              "tp_depth": None, "tp_j": [i * 4 + x * 2 + k for x in range(2)],
                              "tp_k": [i * 4 + j * 2 + x for x in range(2)]}, t


@pytest.mark.parametrize("mode,model,plan", CASES, ids=[f"{m}-{n}-{p}" for m, n, p in CASES])
def test_grid_trains_like_one_process(grid_results, mode, model, plan):
    """Losses, gradient norms (clipped at 1.0: the norm counts every grid's piece once) and the joined weights,
    and every rank holds 1/q² (2.5D, the same pieces in both grids) or 1/q³ (3D) of the weights."""
    results = grid_results[(mode, model, plan)]
    check_against_reference(model, results, WORLD, WORLD, "2d", share=4 if mode == "2.5d" else 8)


@pytest.fixture(scope="module")
def chain_reference():
    net = tiny_gpt(seed=0, n_head=4)
    losses, _ = train_reference(net, token_batches(CHAIN_STEPS, CHAIN_BATCH), adamw, clip=1.0)
    return losses, param_snapshot(net)


def test_a_checkpoint_moves_between_1d_3d_25d_and_2d_and_training_goes_on(grid_results, chain_reference):
    """Each leg loads the weights exactly and continues as one process (which needs the Adam states to have moved
    with their pieces)."""
    ref_losses, ref_params = chain_reference
    for rank, out in enumerate(grid_results["chain"]):
        for mode in ("3d", "2.5d", "2d"):
            assert out[f"{mode}_loaded_exactly"], f"rank {rank}: the weights loaded under {mode} differ"
        assert out["grids_agree"], f"rank {rank}: the 2.5D grids hold different pieces after training"
    for leg, mode in enumerate(("1d", "3d", "2.5d", "2d")):
        per_rank = [out[mode] for out in grid_results["chain"]]
        mean = [sum(losses[i] for losses in per_rank) / WORLD for i in range(2)]  # each dp group's, averaged
        assert_close_relative(mean, ref_losses[2 * leg:2 * leg + 2], rtol=TP_RTOL)
    assert_params_close(grid_results["chain"][0]["params"], ref_params, rtol=TP_RTOL)


@pytest.mark.parametrize("tp,share", [({"size": 4, "mode": "2d"}, 4), ({"size": 8, "mode": "2.5d", "depth": 2}, 4),
                                      ({"size": 8, "mode": "3d"}, 8)], ids=["2d", "2.5d", "3d"])
def test_the_estimate_traces_a_grid_rank_with_its_share_of_the_weights(tp, share):
    """The memory estimate applies the plan on the meta device (no autocast there) and traces the step."""
    whole = sum(p.numel() for p in tiny_gpt(n_head=4).parameters())
    traced = trace_strategy(lambda: tiny_gpt(n_head=4), load_config({"train_micro_batch_size_per_gpu": 8,
                                                                       "tensor_parallel": tp}), 32)
    assert sum(math.prod(p.shape) for p in traced.params) * share == whole
    assert traced.activations.small_peak > 0


@pytest.mark.parametrize("tp,extra,key", [
    ({"size": 8, "mode": "2d"}, {}, "tensor_parallel.size"),
    ({"size": 4, "mode": "3d"}, {}, "tensor_parallel.size"),
    ({"size": 8, "mode": "2.5d", "depth": 3}, {}, "tensor_parallel.size"),
    ({"size": 4, "mode": "1d", "depth": 2}, {}, "tensor_parallel.depth"),
    ({"size": 8, "mode": "3d", "sequence_parallel": True}, {}, "tensor_parallel.sequence_parallel"),
    ({"size": 8, "mode": "2.5d", "depth": 2}, {"sequence_parallel": {"size": 2}}, "sequence_parallel.size"),
    ({"size": 8, "mode": "3d"}, {"pipeline": {"stages": 2}}, "tensor_parallel.mode"),
], ids=["2d-not-square", "3d-not-cube", "25d-not-depth-q2", "depth-without-25d", "3d-megatron-sp", "25d-ulysses",
        "3d-pipeline"])
def test_configs_that_make_no_grid_or_compose_with_what_is_not_built_are_refused(tp, extra, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config({"train_micro_batch_size_per_gpu": 8, "tensor_parallel": tp, **extra})


def test_an_in_place_op_on_a_3d_linear_layers_output_trains_like_one_process(grid_results):
    """A derived 3D plan on a model whose first layer after the embedding is a bias-free linear layer followed by
    an in-place ReLU (ranks (i, j, j) keep their own piece of its output)."""
    net = InplaceLM()
    losses, _ = train_reference(net, token_batches(STEPS, GLOBAL_BATCH, vocab=64), adamw, clip=1.0,
                                loss_fn=inplace_loss)
    expected = param_snapshot(net)
    for rank_losses, full in grid_results["inplace"]:
        assert_close_relative(rank_losses, losses, rtol=TP_RTOL)
        assert_params_close({k: full[k] for k in expected}, expected, rtol=TP_RTOL)
