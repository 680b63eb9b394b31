"""zero_init (Note [zero_init]): a model built on the meta device and materialized shard by shard has
exactly the weights a normal construction gives, trains like it, and never holds its full weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import initialize, zero_init
from engine.zero.unbuilt import Unbuilt
from tests.distributed import results_by_case, run_cases, run_distributed
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
from tests.rss import MALLOC_ENV, build_after_warm_up, peak_rss_bytes, stage3_config
from tests.test_data_parallel import adamw
from tests.test_zero import GLOBAL_BATCH, zero_config

transformers = pytest.importorskip("transformers")


def _builders():
    from tests.test_hf_models import hf_gpt2, hf_llama
    return {"gpt": tiny_gpt, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama}


# the two-rank cases, all run in one spawned group (the fixture two_ranks at the end)
TRAIN_CASES = [(1, "gpt"), (3, "gpt"), (3, "hf_llama")]
SEEDED_CASES = [(3, "gpt"), (2, "gpt"), (3, "hf_llama")]
RANDOM_START_STAGES = [3, 1]
GROUPS_CASES = [(3, False), (0, True)]
TWO_RANK_CASES = ([("stage", stage, name, False) for stage, name in TRAIN_CASES]
                  + [("stage", stage, name, True) for stage, name in SEEDED_CASES]
                  + [("random_start", stage) for stage in RANDOM_START_STAGES]
                  + [("groups", stage, client) for stage, client in GROUPS_CASES]
                  + [("different_models",)])  # last: its ranks end with a refused initialize


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "hf_llama"])
def test_materialized_weights_are_those_of_a_normal_construction(name):
    build = _builders()[name]
    with zero_init():
        model = build()
    rng_after_block = torch.get_rng_state()
    assert all(isinstance(p, Unbuilt) for p in model.parameters())  # no values (Note [zero_init])
    reference = build()
    assert [p.shape for p in model.parameters()] == [q.shape for q in reference.parameters()]
    assert torch.equal(rng_after_block, torch.get_rng_state())  # the RNG advanced as in a normal construction
    engine = initialize(model, zero_config(0, 2, 1))
    for (n, p), (m, q) in zip(engine.module.named_parameters(), reference.named_parameters()):
        assert n == m and torch.equal(p, q), n  # bit-identical


def _stage_worker(rank, world, stage, name, seed_per_rank=False):
    build = _builders()[name]
    with zero_init():
        model = build(seed=rank if seed_per_rank else 0)
    loss_fn = None if name == "gpt" else (lambda e, x: e(input_ids=x, labels=x).loss)
    engine = initialize(model, zero_config(stage, GLOBAL_BATCH // world, 1))
    start = trained_params(engine)
    losses, _ = train_engine(engine, token_batches(3, GLOBAL_BATCH), rank, world, 1, loss_fn=loss_fn)
    result = losses, trained_params(engine), engine.comm.broadcast_bytes, start
    engine.close()
    return result


def _trains_like_plain_pytorch(two_ranks, stage, name, seed_per_rank):
    """Each rank's (starting parameters, broadcast bytes), after checking that training matches plain PyTorch
    from the model built normally under seed 0 (rank 0's)."""
    reference = _builders()[name](seed=0)
    start = param_snapshot(reference)
    loss_fn = None if name == "gpt" else (lambda m, x: m(input_ids=x, labels=x).loss)
    ref_losses, _ = train_reference(reference, token_batches(3, GLOBAL_BATCH), adamw, clip=1.0, loss_fn=loss_fn)
    results = two_ranks[("stage", stage, name, seed_per_rank)]
    assert_close_relative([(a + b) / 2 for a, b in zip(results[0][0], results[1][0])], ref_losses)
    for _, params, _, initial in results:
        assert_params_close(params, param_snapshot(reference))
        assert initial.keys() == start.keys()
        for n in start:
            assert torch.equal(initial[n], start[n]), n  # bit-identical to rank 0's normal construction
    return 4 * sum(t.numel() for t in start.values()), [broadcast for _, _, broadcast, _ in results]


@pytest.mark.parametrize("stage,name", TRAIN_CASES)
def test_a_zero_init_model_trains_like_plain_pytorch(two_ranks, stage, name):
    psi_bytes, broadcasts = _trains_like_plain_pytorch(two_ranks, stage, name, seed_per_rank=False)
    for broadcast in broadcasts:
        assert broadcast < psi_bytes / 10  # every rank built the same weights: only buffers and checksums move


@pytest.mark.parametrize("stage,name", SEEDED_CASES)
def test_ranks_seeded_differently_get_rank_0s_model(two_ranks, stage, name):
    """Rank 1 seeds with 1, rank 0 with 0: both end with the weights of a normal construction under seed 0."""
    psi_bytes, broadcasts = _trains_like_plain_pytorch(two_ranks, stage, name, seed_per_rank=True)
    for broadcast in broadcasts:
        assert broadcast < psi_bytes / 2  # rank 0's RNG states moved (5 KB per parameter), not its weights


class RandomStart(nn.Module):
    """Parameters whose values the recorded calls do not decide: one made with random values, one given a
    random tensor by copy_; next to them, a layer initialized by calls."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.offset = nn.Parameter(torch.randn(8))
        self.scale = nn.Parameter(torch.empty(8))
        with torch.no_grad():
            self.scale.copy_(torch.randn(8))


def _random_start_worker(rank, world, stage):
    torch.manual_seed(rank)
    with zero_init():
        model = RandomStart()
    engine = initialize(model, zero_config(stage, 2, 1, chunk_size=16))  # stage 3: every chunk split in two
    result = trained_params(engine), engine.comm.broadcast_bytes
    engine.close()
    return result


@pytest.mark.parametrize("stage", RANDOM_START_STAGES)
def test_parameters_made_with_random_values_are_rank_0s_on_every_rank(two_ranks, stage):
    torch.manual_seed(0)
    reference = param_snapshot(RandomStart())
    for params, broadcast in two_ranks[("random_start", stage)]:
        assert params.keys() == reference.keys()
        for n in reference:
            assert torch.equal(params[n], reference[n]), n
        assert broadcast >= 2 * 8 * 4  # offset and scale came from rank 0 whole


class CopiesMetaValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        with torch.no_grad():
            self.weight.copy_(self.weight * 2)  # computed from a parameter that has no values yet


class PlacesByDevice(nn.Module):
    """Makes a value on its parameter's device, as libraries do (kernelize asks model.device inside
    from_pretrained; PEFT places adapters by their base layer's device)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        assert self.weight.device.type == "cpu" and self.weight.storage_offset() == 0
        with torch.no_grad():
            self.weight.copy_(torch.eye(4, device=self.weight.device) * 2)
            self.weight[1:3].t().add_(torch.ones(2, device=self.weight.device))  # through a view


class AssignsData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.weight.data = torch.full((4, 4), 7.0)  # as older init code and some libraries write it


def _built_with_and_without_zero_init(cls) -> tuple[nn.Module, object]:
    """(cls() built plainly, an engine over cls() built under zero_init), from the same seed."""
    torch.manual_seed(0)
    reference = cls()
    torch.manual_seed(0)
    with zero_init():
        model = cls()
    return reference, initialize(model, zero_config(0, 2, 1))


def test_assigning_data_in_the_block_is_recorded_like_a_copy():
    reference, engine = _built_with_and_without_zero_init(AssignsData)
    assert torch.equal(engine.module.lin.weight, reference.lin.weight)
    assert torch.equal(engine.module.lin.bias, reference.lin.bias)


def test_parameters_in_the_block_report_the_cpu_and_writes_made_there_replay():
    torch.manual_seed(0)
    reference = PlacesByDevice()
    with zero_init():
        model = PlacesByDevice()
        assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    engine = initialize(model, zero_config(0, 2, 1))
    assert torch.equal(engine.module.weight, reference.weight)


def test_a_write_it_cannot_replay_names_the_parameter():
    with pytest.raises(RuntimeError, match="zero_init cannot rebuild parameter CopiesMetaValues.weight"):
        with zero_init():
            CopiesMetaValues()


class TruncatedNormal(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        nn.init.trunc_normal_(self.weight, std=0.02)  # samples by rejection: reads the values it drew


class MovesAndComputes(nn.Module):
    """In-block calls that must keep working: a move with nothing to move, a value computed from a parameter and
    changed in place (never written back)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.to("cpu")
        scaled = self.lin.weight * 2
        scaled.add_(1)
        assert scaled.shape == (4, 4) and scaled.device.type == "cpu"


def test_moves_and_values_computed_in_the_block_keep_working_and_a_cast_is_refused():
    reference, engine = _built_with_and_without_zero_init(MovesAndComputes)
    assert torch.equal(engine.module.lin.weight, reference.lin.weight)
    with pytest.raises(ValueError, match=r"assigning .data of \(4, 4\) torch.float16 to a parameter of \(4, 4\) "
                                         r"torch.float32 cannot be recorded \(a cast"):
        with zero_init():
            nn.Linear(4, 4).half()


def test_an_initialization_that_reads_values_is_refused_not_skipped():
    """trunc_normal_ has no torch-function hook, so the block sees its inner operations, which branch on values;
    on a meta tensor it returns without drawing, which left the weight uninitialized."""
    with pytest.raises(RuntimeError, match="reads the values of a tensor computed from its parameters.*trunc_normal_"):
        with zero_init():
            TruncatedNormal()


def test_meta_parameters_not_built_by_zero_init_are_refused():
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="was not built inside engine.zero_init"):
        initialize(model, zero_config(0, 2, 1))


# ~100M parameters (14 blocks of 768), small vocabulary: the largest single tensor is 2.4M elements
BIG = dict(n_layer=14, n_head=12, n_embd=768, block_size=64)
WORKING_SET = 160 * 2**20  # allowed on top of 16Ψ/N (see the test's docstring)


def _peak_rss_worker(rank, world):
    model, before = build_after_warm_up(**BIG)
    psi = sum(p.numel() for p in model.parameters())
    cfg = stage3_config(2**22)
    engine = initialize(model, cfg)
    x = torch.randint(0, 256, (1, 16))
    engine.backward(engine(x, x))
    engine.step()  # Adam's states now exist
    return psi, peak_rss_bytes() - before


def test_a_100m_parameter_model_never_holds_its_full_weights_on_any_rank(monkeypatch):
    """Peak RSS growth per rank, from before construction through one training step, stays within 16Ψ/N
    (fp32 shards of parameters, gradients and Adam's two states) plus a working set of 160 MiB: two
    4M-element chunks gathered (16 MiB each) plus up to 8M elements prefetched (32 MiB), a gradient chunk
    and its reduce-scatter buffer (32 MiB), the largest single parameter while it is built (9.4 MiB) and
    the allocator's slack. Building the model normally would need its full 4Ψ (~400 MB) on every rank.
    The ranks run with glibc's mmap threshold fixed at 1 MiB, so that a freed chunk goes back to the OS
    and RSS counts memory in use, not blocks glibc keeps for reuse (its default threshold adapts upward)."""
    monkeypatch.setenv(*MALLOC_ENV)
    results = run_distributed(_peak_rss_worker, 4, timeout_s=300)
    for psi, growth in results:
        assert 95e6 < psi < 105e6
        assert growth <= 16 * psi / 4 + WORKING_SET, (growth / 2**20, (16 * psi / 4 + WORKING_SET) / 2**20)


def _groups_worker(rank, world, stage, client):
    torch.manual_seed(0)
    with zero_init():
        model = tiny_gpt(seed=0)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    cfg = zero_config(stage, GLOBAL_BATCH // world, 1)
    if client:  # an optimizer built after the block, over the meta parameters
        del cfg["optimizer"]
        engine = initialize(model, cfg, optimizer=torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-6),
                            lr_scheduler=None)
    else:
        engine = initialize(model, cfg, model_parameters=groups)
    losses, _ = train_engine(engine, token_batches(2, GLOBAL_BATCH), rank, world, 1)
    decays = [g["weight_decay"] for g in engine.optimizer.param_groups]
    engine.close()
    return losses, decays


@pytest.mark.parametrize("stage,client", GROUPS_CASES)
def test_param_groups_built_after_zero_init_name_the_materialized_parameters(two_ranks, stage, client):
    for losses, decays in two_ranks[("groups", stage, client)]:
        assert all(torch.isfinite(torch.tensor(losses))) and sorted(set(decays)) == [0.0, 0.1]


def _different_models_worker(rank, world):
    with zero_init():
        model = nn.Sequential(nn.Linear(4, 4 + rank), nn.Linear(4 + rank, 1))
    try:
        initialize(model, zero_config(3, 2, 1))
    except RuntimeError as e:
        return str(e)
    return None


def test_ranks_that_build_different_models_are_told_which_parameter_differs(two_ranks):
    zero, one = two_ranks[("different_models",)]
    assert zero is not None and "rank 1 built a different model from rank 0's" in zero
    assert one is not None and "this rank (1) built a different model from rank 0's: parameter '0.weight' (5, 4)" in one
    assert "build the same model on every rank" in zero and "build the same model on every rank" in one


# --- every two-rank case above in one spawned group: start-up, not the cases, dominates their time ------------

def _two_rank_cases_worker(rank, world):
    workers = {"stage": _stage_worker, "random_start": _random_start_worker, "groups": _groups_worker,
               "different_models": _different_models_worker}
    return run_cases(rank, TWO_RANK_CASES, lambda kind, *args: workers[kind](rank, world, *args))


@pytest.fixture(scope="module")
def two_ranks() -> dict[tuple, list]:
    """Each two-rank case's results in rank order, keyed by the case."""
    per_rank = run_distributed(_two_rank_cases_worker, 2, timeout_s=600)
    return results_by_case(per_rank)


def test_after_the_block_parameters_have_shapes_and_a_device_but_computing_with_them_raises():
    """Code between the block and initialize reads shapes and devices (weight-decay groups, PEFT placing adapters on
    their base layer's device); computing with a parameter's values raises, naming it."""
    with zero_init():
        model = nn.Linear(4, 3)
    assert model.weight.shape == (3, 4) and model.weight.device.type == "cpu" and model.weight.dim() == 2
    with pytest.raises(RuntimeError, match="Linear.weight .* was built under engine.zero_init"):
        model(torch.ones(2, 4))
