"""offload_optimizer.step_in_backward (Note [stepping in backward]): each gradient shard is stepped as
soon as it is reduced in the boundary backward, with the same result as stepping after it."""

from __future__ import annotations

import time

import pytest
import torch

from engine import initialize
from engine.config import ConfigError, load_config
from engine.config_checks import check_run
from engine.mesh import Mesh
from tests.distributed import run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import adamw
from tests.test_zero import GLOBAL_BATCH, STEPS, zero_config

ACCUMULATION = 2


def early_config(stage: int, world: int, nvme_dir: str, device: str = "cpu", param_device: str | None = None,
                 accumulation: int = ACCUMULATION, **top) -> dict:
    cfg = zero_config(stage, GLOBAL_BATCH // world // accumulation, accumulation)
    cfg["gradient_clipping"] = 0.0  # clipping needs every gradient first: refused with step_in_backward
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"] = {"device": device, "nvme_path": nvme_dir, "step_in_backward": True}
    if param_device:
        zero["offload_param"] = {"device": param_device, "nvme_path": nvme_dir}
    cfg["aio"] = {"block_size": 4096}  # small blocks: the CPU window is far below all states
    cfg.update(top)
    return cfg


@pytest.fixture(scope="module")
def unclipped_reference():
    model = tiny_gpt()
    losses, norms = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw)
    return losses, norms, param_snapshot(model)


def _training_worker(rank, world, stage, device, param_device, nvme_dir, tb_dir):
    tensorboard = {"enabled": True, "output_path": tb_dir, "job_name": f"early{rank}"}  # the norm is then summed
    engine = initialize(tiny_gpt(seed=rank), early_config(stage, world, nvme_dir, device, param_device,
                                                          tensorboard=tensorboard))
    stepped_tensors = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    losses, norms, stepped_after_backward = [], [], []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        step_losses = []
        for micro in micro_batches(x, rank, world, ACCUMULATION):
            loss = engine(micro, micro)
            engine.backward(loss)
            stepped_after_backward.append(engine.optimizer.stepped_early)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
        norms.append(engine.get_global_grad_norm())
    params = trained_params(engine)
    engine.close()
    return losses, norms, params, stepped_after_backward, stepped_tensors


@pytest.mark.parametrize("stage,device,param_device", [(2, "cpu", None), (3, "nvme", "nvme")])
def test_stepping_in_backward_matches_single_process(unclipped_reference, two_ranks, stage, device, param_device):
    ref_losses, ref_norms, ref_params = unclipped_reference
    results = two_ranks[("training", stage, device, param_device)]  # pytest's case id names the failing case
    assert_close_relative([(results[0][0][i] + results[1][0][i]) / 2 for i in range(STEPS)], ref_losses)
    for _, norms, params, stepped, stepped_tensors in results:
        assert_close_relative(norms, ref_norms)  # summed shard by shard as they were stepped
        assert_params_close(params, ref_params)
        # the boundary backward stepped every tensor before engine.step(); the other one stepped none
        assert stepped == [0, stepped_tensors] * STEPS, stepped


def _misuse_worker(rank, world, nvme_dir):
    refusals = {}
    for name, change in {"clipping": {"gradient_clipping": 1.0}, "fp16": {"fp16": {"enabled": True}}}.items():
        try:
            initialize(tiny_gpt(seed=rank), early_config(2, world, nvme_dir, **change))
        except ConfigError as e:
            refusals[name] = str(e)
    try:
        initialize(tiny_gpt(seed=rank), early_config(1, world, nvme_dir))
    except ConfigError as e:
        refusals["stage 1"] = str(e)

    engine = initialize(tiny_gpt(seed=rank), early_config(2, world, nvme_dir, accumulation=1))
    x = micro_batches(token_batches(1, GLOBAL_BATCH)[0], rank, world, 1)[0]
    engine.backward(engine(x, x))
    try:
        engine.backward(engine(x, x))  # a second boundary backward: the first one already updated the model
    except RuntimeError as e:
        refusals["second backward"] = str(e)
    engine.step()

    def slow_down(module, args, output):  # lets the later layers' reductions finish, so they are stepped
        output.register_hook(lambda grad: time.sleep(0.3))

    def fail_on_input_grad(module, args):  # fires once the first block's backward is done: near the end
        def hook(grad):
            raise RuntimeError("injected failure near the end of backward")
        args[0].register_hook(hook)

    engine.module.blocks[0].register_forward_hook(slow_down)
    engine.module.blocks[0].register_forward_pre_hook(fail_on_input_grad)
    try:
        engine.backward(engine(x, x))
    except RuntimeError as e:
        refusals["failed backward"] = (str(e), str(e.__cause__))
    engine.close()
    return refusals


def test_stepping_in_backward_refuses_what_it_cannot_do(two_ranks):
    for refusals in two_ranks[("misuse",)]:
        assert "set gradient_clipping to 0" in refusals["clipping"]
        assert "fp16 skips a step whose gradients overflow" in refusals["fp16"] and "use bf16" in refusals["fp16"]
        assert "ZeRO stage 2 or 3" in refusals["stage 1"]
        assert "already updated the model" in refusals["second backward"]
        message, cause = refusals["failed backward"]
        assert "partly updated" in message and "restore it from a checkpoint" in message, message
        assert "injected failure" in cause


def test_stepping_in_backward_needs_an_offloaded_optimizer_and_gradient_shards(tmp_path, unclipped_reference):
    with pytest.raises(ConfigError, match="needs gradient shards, i.e. ZeRO stage 2 or 3"):
        initialize(tiny_gpt(), early_config(1, 1, str(tmp_path)))
    # stage 2 in one process keeps gradient shards for the offloaded optimizer: each is stepped as it is reduced
    cfg = early_config(2, 1, str(tmp_path))
    losses, _, params, stepped, stepped_tensors = _training_worker(0, 1, 2, "cpu", None, str(tmp_path),
                                                                   str(tmp_path / "tb"))
    assert_close_relative(losses, unclipped_reference[0])
    assert_params_close(params, unclipped_reference[2])
    assert stepped == [0, stepped_tensors] * STEPS, stepped
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "none"
    with pytest.raises(ConfigError, match="set zero_optimization.offload_optimizer.device to cpu or nvme"):
        initialize(tiny_gpt(), cfg)


def _one_rank_fails_worker(rank, world, nvme_dir):
    engine = initialize(tiny_gpt(seed=rank), early_config(2, world, nvme_dir, accumulation=1))
    if rank == 1:  # an I/O or memory error while stepping a shard, on one rank only
        step_early, calls = engine.optimizer.step_early, [0]

        def failing_step_early(chunk, grad_scale):
            calls[0] += 1
            if calls[0] == 2:
                raise OSError("injected: the swap disk failed")
            step_early(chunk, grad_scale)
        engine.optimizer.step_early = failing_step_early
    x = micro_batches(token_batches(1, GLOBAL_BATCH)[0], rank, world, 1)[0]
    try:
        engine.backward(engine(x, x))
        outcome = "ok"
    except RuntimeError as e:
        outcome = (str(e), repr(e.__cause__))
    engine.close()
    return outcome


def test_a_shard_step_failing_on_one_rank_raises_there_without_hanging_the_others(two_ranks):
    ok, failed = two_ranks[("one_rank_fails",)]
    assert ok == "ok"  # rank 0 finished its backward: rank 1 still launched every reduction
    message, cause = failed
    assert "partly updated" in message and "injected: the swap disk failed" in cause


def _bf16_worker(rank, world, nvme_dir, early):
    """bf16, stage 3, everything offloaded to NVMe; step_in_backward on or off."""
    cfg = early_config(3, world, nvme_dir, "nvme", "nvme", bf16={"enabled": True})
    cfg["zero_optimization"]["offload_optimizer"]["step_in_backward"] = early
    engine = initialize(tiny_gpt(seed=rank), cfg)
    losses, stepped = [], []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        for micro in micro_batches(x, rank, world, ACCUMULATION):
            loss = engine(micro, micro)
            engine.backward(loss)
            stepped.append(engine.optimizer.stepped_early)
            engine.step()
            losses.append(loss.item())
    params = trained_params(engine)  # the fp32 masters
    engine.close()
    return losses, params, stepped


@pytest.mark.parametrize("world", [1, 2])
def test_stepping_in_backward_with_bf16_equals_stepping_after_it(tmp_path, two_ranks, world):
    """Note [offloaded master weights]: each 16-bit gradient shard is widened, stepped into its fp32 master and
    rounded into its bf16 shard during backward; the result is that of stepping after backward. One process
    pages its shards through NVMe (Note [paging in one process])."""
    runs = {}
    for early in (False, True):
        runs[early] = [_bf16_worker(0, 1, str(tmp_path), early)] if world == 1 else two_ranks[("bf16", early)]
    for (losses, params, stepped), (ref_losses, ref_params, ref_stepped) in zip(runs[True], runs[False]):
        assert losses == ref_losses  # the same bf16 forward every micro-step
        assert_params_close(params, ref_params)
        assert ref_stepped == [0] * len(ref_stepped) and stepped[1] > 0 and stepped[0] == 0


# the two-rank cases, in the order they run; the ones whose backward fails on purpose come last
TWO_RANK_CASES = [("training", 2, "cpu", None), ("training", 3, "nvme", "nvme"), ("bf16", False), ("bf16", True),
                  ("misuse",), ("one_rank_fails",)]


def _two_rank_case(rank, world, name, case_dir):
    kind, *args = name
    swap, tb = str(case_dir / "swap"), str(case_dir / "tb")
    workers = {"training": lambda *setting: _training_worker(rank, world, *setting, swap, tb),
               "bf16": lambda early: _bf16_worker(rank, world, swap, early),
               "misuse": lambda: _misuse_worker(rank, world, swap),
               "one_rank_fails": lambda: _one_rank_fails_worker(rank, world, swap)}
    return workers[kind](*args)


def _two_rank_cases_worker(rank, world, names, case_dirs):
    """Every two-rank case in one spawned group (a spawn costs seconds), each on its own engine and directory.
    The global RNG restarts from a fresh process's seed before each case."""
    fresh_seed = torch.initial_seed()
    results = []
    for name, case_dir in zip(names, case_dirs):
        torch.manual_seed(fresh_seed)
        try:
            results.append(_two_rank_case(rank, world, name, case_dir))
        except Exception as e:
            raise RuntimeError(f"case {name} failed on rank {rank}") from e
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """{case name: [rank 0's result, rank 1's result]} for every case of TWO_RANK_CASES."""
    case_dirs = [tmp_path_factory.mktemp("step_in_backward") for _ in TWO_RANK_CASES]
    for case_dir in case_dirs:
        (case_dir / "swap").mkdir()
    per_rank = run_distributed(_two_rank_cases_worker, 2, args=(TWO_RANK_CASES, case_dirs), timeout_s=600)
    return {name: [results[i] for results in per_rank] for i, name in enumerate(TWO_RANK_CASES)}


def test_refused_under_a_pipeline_whose_schedule_accumulates_before_the_step():
    cfg = zero_config(3, 2, 1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "step_in_backward": True}
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg["pipeline"] = {"stages": 2}
    with pytest.raises(ConfigError, match="step_in_backward: a pipeline schedule accumulates"):
        check_run(load_config(cfg), Mesh.layout("cpu", zero=2, pp=2))
