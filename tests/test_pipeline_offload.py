"""A pipeline under ZeRO-3 with offloaded parameters and optimizer states (CPU, NVMe), under ZeRO-2 with offloaded
optimizer states, and under ZeRO-3 with a model built under zero_init (Note [a pipelined step], Note [offload
policy], Note [zero_init]): pp 2 × dp 2, schedule 1f1b, 2 micro-batches, 3 steps, each trains as one process trains
the whole model (fp32 1e-5); the offloaded chunks live on their tier, and a checkpoint saved through NVMe resumes
exactly; under zero_init each rank builds only its stage's parameters, and every stage gets rank 0's numbers though
each rank seeds differently. All cases run in one spawned group of 4 ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from engine import initialize, zero_init
from engine.config import ConfigError
from offload.chunk import Location
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import (
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    token_batches,
    train_reference,
)
from tests.test_data_parallel import adamw
from tests.test_pipeline_engine import (
    GLOBAL_BATCH,
    LAYERS,
    STEPS,
    example_gpt,
    pipeline_config,
    reference,
    stage_params,
)

PP, DP, M = 2, 2, 2
CASES = ("cpu", "nvme", "nvme_resumed", "zero_init", "stage2_cpu")
CPU_BUDGET = 200 * 1024  # bytes
WIDTH = 64  # the example GPT's hidden size


def _config(case: str, nvme_dir: str) -> dict:
    cfg = pipeline_config(PP, "1f1b", DP, M, stage=2 if case == "stage2_cpu" else 3)
    if case == "stage2_cpu":  # optimizer states and gradient shards only: parameters stay on the device
        cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"})
    if case in ("cpu", "nvme", "nvme_resumed"):
        offload = {"device": "nvme", "nvme_path": nvme_dir} if case != "cpu" else {"device": "cpu"}
        cfg["zero_optimization"].update(offload_optimizer=offload, offload_param=offload)
    if case in ("nvme", "nvme_resumed"):  # a CPU tier smaller than this rank's optimizer states: they stream
        cfg.update(aio={"block_size": 4096}, memory={"cpu_budget": CPU_BUDGET})
    return cfg


def _train(case: str, nvme_dir: str) -> dict:
    recording = None
    if case == "zero_init":  # each rank its own seed: every stage gets rank 0's numbers (seed 0, the reference's)
        with zero_init() as recording:
            model = gpt_with_drawn_biases(seed=dist.get_rank())
    else:  # resumed: other starting weights, replaced by the checkpoint the nvme case saved after its first step
        model = example_gpt(seed=5 if case == "nvme_resumed" else 0)
    engine = initialize(model, _config(case, nvme_dir))
    built = recording.built_elements if recording is not None else None
    names = engine.pipeline.split.names
    held = sorted(names[id(p)] for p in engine.module.parameters())
    losses, batches = [], token_batches(STEPS, GLOBAL_BATCH)
    if case == "nvme_resumed":
        engine.load_checkpoint(os.path.join(nvme_dir, "checkpoint"), tag="first")
        batches = batches[1:]
    for batch in batches:
        mbs = [{"input_ids": x, "labels": x} for x in micro_batches(batch, engine.dp_rank, DP, M)]
        losses.append(engine.train_batch(iter(mbs)))
        if case == "nvme" and len(losses) == 1:
            engine.save_checkpoint(os.path.join(nvme_dir, "checkpoint"), tag="first")
    manager = getattr(engine.optimizer, "manager", None)
    tiers = None if manager is None else {loc: manager.used_bytes_by_kind(loc) for loc in Location}
    stats = None if manager is None else (manager.stats.peak_bytes.get("cpu", 0),
                                          manager.stats.moved_bytes.get("nvme->cpu", 0))
    params = stage_params(engine)
    engine.close()
    return {"losses": losses, "params": params, "built": built, "held": held, "tiers": tiers, "stats": stats}


def gpt_with_drawn_biases(seed: int):
    """The example GPT with a bias in each stage made with its values (torch.randn under the build's seed), which
    no recorded RNG state decides: under zero_init rank 0 gives both, also stage 1's, which it does not hold."""
    model = example_gpt(seed)
    for block in (0, LAYERS - 1):
        torch.manual_seed(100 + seed)
        model.blocks[block].ln_1.bias = torch.nn.Parameter(torch.randn(model.blocks[block].ln_1.bias.shape))
    return model


def _refusals() -> dict[str, str]:
    errors = {}
    with zero_init():
        model = example_gpt()
    cfg = pipeline_config(PP, "1f1b", DP, M, stage=3)
    cfg["pipeline"]["partition"] = "time"
    try:
        initialize(model, cfg)
    except ConfigError as e:
        errors["time_partition"] = str(e)
    return errors


def _worker(rank, world, nvme_dir):
    results = run_cases(rank, [(case, nvme_dir) for case in CASES], _train)
    return {case: results[(case, nvme_dir)] for case in CASES}, _refusals()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    nvme_dir = str(tmp_path_factory.mktemp("nvme"))
    per_rank = run_distributed(_worker, PP * DP, args=(nvme_dir,), timeout_s=240)
    return results_by_case([r for r, _ in per_rank]), [e for _, e in per_rank]


@pytest.fixture(scope="module")
def one_process():
    losses, params, _ = reference("gpt")
    model = gpt_with_drawn_biases(seed=0)  # rank 0's seed builds the whole model, stage 1's bias included
    drawn_losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH), adamw, clip=1.0,
                                      loss_fn=lambda m, x: m(input_ids=x, labels=x))
    return {"plain": (losses, params), "zero_init": (drawn_losses, param_snapshot(model))}


def test_a_checkpoint_saved_through_nvme_resumes_exactly(four_ranks):
    """Saved after the first step, loaded into an engine started from other weights: the next steps' losses and
    the final parameters are exactly the uninterrupted run's."""
    for run, resumed in zip(four_ranks[0]["nvme"], four_ranks[0]["nvme_resumed"]):
        assert resumed["losses"] == run["losses"][1:]
        assert resumed["params"].keys() == run["params"].keys()
        for key, value in resumed["params"].items():
            torch.testing.assert_close(value, run["params"][key], rtol=0, atol=0)


@pytest.mark.parametrize("case", [c for c in CASES if c != "nvme_resumed"])
def test_trains_as_one_process(four_ranks, one_process, case):
    ref_losses, ref_params = one_process["zero_init" if case == "zero_init" else "plain"]
    held: dict[str, torch.Tensor] = {}
    for result in four_ranks[0][case]:
        assert_close_relative(result["losses"], ref_losses)
        for key, value in result["params"].items():
            if key in held:  # a parameter both stages hold (tied), or every data-parallel rank: the same values
                torch.testing.assert_close(value, held[key], rtol=0, atol=0)
            held[key] = value
    assert_params_close(held, ref_params)


def test_offloaded_chunks_live_on_the_cpu(four_ranks):
    """After the steps, this stage's parameter shards and optimizer states are on the CPU tier, none elsewhere."""
    for result in four_ranks[0]["cpu"]:
        tiers = result["tiers"]
        assert tiers[Location.CPU].get("param", 0) > 0 and tiers[Location.CPU].get("optim", 0) > 0, tiers
        assert not any(tiers[Location.DEVICE].values()) and not any(tiers[Location.NVME].values()), tiers


def test_optimizer_states_twice_the_cpu_budget_stream_through_nvme(four_ranks):
    """The CPU tier never held more than memory.cpu_budget while this stage's share of the Adam states is more
    than twice it: they were read back from the NVMe files every step."""
    for result in four_ranks[0]["nvme"]:
        tiers, (peak_cpu, read) = result["tiers"], result["stats"]
        states = sum(tiers[loc].get("optim", 0) for loc in Location)
        assert states >= 2 * CPU_BUDGET and peak_cpu <= CPU_BUDGET and read > STEPS * states, (states, peak_cpu, read)
        assert tiers[Location.NVME].get("optim", 0) > 0 and not any(tiers[Location.DEVICE].values()), tiers


def test_zero_init_builds_only_each_stages_parameters(four_ranks, one_process):
    """Each rank built exactly the parameters its stage holds (the tied embedding on both stages), never the other
    stage's: its elements are its stage's, well under the whole model's; rank 0 built both drawn biases once more,
    to send them to the ranks whose own differ (stage 1's included, which it does not hold)."""
    _, ref_params = one_process["zero_init"]
    results = four_ranks[0]["zero_init"]
    total = sum(v.numel() for v in ref_params.values())
    stages = [results[0]["held"], results[2]["held"]]  # rank = pp_rank * dp + dp_rank
    assert results[1]["held"] == stages[0] and results[3]["held"] == stages[1]
    assert set(stages[0]) | set(stages[1]) == set(ref_params)
    assert set(stages[0]) & set(stages[1]) == {"wte.weight"}  # the output layer's weight is wte's
    for rank, result in enumerate(results):
        stage_elements = sum(ref_params[n].numel() for n in result["held"])
        resent = 2 * WIDTH if rank == 0 else 0
        assert result["built"] == stage_elements + resent < 0.6 * total, (rank, result["built"], total)


def test_a_partition_measured_on_the_model_is_refused_under_zero_init(four_ranks):
    for errors in four_ranks[1]:
        assert "pipeline.partition: \"time\"" in errors["time_partition"]
        assert "zero_init()" in errors["time_partition"]
