"""One cell of the zoo's grid (tests/test_hf_zoo.py): a Hugging Face architecture (tests/hf_zoo.py) trained by one
strategy, or refused: at initialize, or at the first forward, before any gradient (sequence parallelism learns what
a model's attention does when it runs). Each cell returns ("trained", losses, parameters) or ("refused", message)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine import initialize
from tests import hf_zoo
from tests.reference import micro_batches, trained_params
from tests.test_data_parallel import ADAMW

STEPS, GLOBAL_BATCH, ACCUMULATION = 2, 4, 2
ZERO3 = {"stage": 3, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0}
OFFLOADED = {**ZERO3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}

# strategy -> (processes, config additions, trained by train_batch, relative tolerance against one process)
STRATEGIES = {
    "zero3": (2, {"zero_optimization": ZERO3}, False, 1e-5),
    "offload": (2, {"zero_optimization": OFFLOADED}, False, 1e-5),
    "tp_auto": (2, {"tensor_parallel": {"size": 2, "plan": "auto"}}, False, 1e-4),
    "pipeline": (2, {"pipeline": {"stages": 2, "schedule": "1f1b"}, "gradient_accumulation_steps": ACCUMULATION},
                 True, 1e-5),
    "ulysses": (2, {"sequence_parallel": {"size": 2, "mode": "ulysses"}}, False, 1e-4),
    "ring": (2, {"sequence_parallel": {"size": 2, "mode": "ring"}}, False, 1e-4),
    "experts": (2, {"moe": {"expert_parallel_size": 2}}, False, 1e-5),
    "checkpointing": (1, {"activation_checkpointing": {"enabled": True}}, False, 1e-5),
    "layer_major": (1, {"zero_optimization": {**OFFLOADED, "offload_param": {"device": "cpu", "layer_major": True}},
                        "gradient_accumulation_steps": ACCUMULATION}, True, 1e-5),
}
REFUSALS = (ValueError, NotImplementedError)


def applies(name: str, strategy: str) -> bool:
    return strategy != "experts" or name in hf_zoo.MOE_MODELS


def cells(processes: int) -> list[tuple[str, str]]:
    """(architecture, strategy) of every cell whose strategy runs on `processes` ranks, strategy by strategy."""
    return [(name, strategy) for strategy, (procs, *_) in STRATEGIES.items() if procs == processes
            for name in hf_zoo.names() if applies(name, strategy)]


def config(strategy: str) -> dict:
    additions = STRATEGIES[strategy][1]
    return {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
            "gradient_clipping": 1.0, "steps_per_print": 10**6, **additions}


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, hf_zoo.VOCAB, (GLOBAL_BATCH, hf_zoo.SEQ), generator=g) for _ in range(STEPS)]


class _RefusedAtFirstForward(Exception):
    pass


def run_cell(name: str, strategy: str) -> tuple:
    """("trained", this rank's step losses (the data-parallel mean), its parameters by name: whole, or its pipeline
    stages') or ("refused", the error). An error after the first forward is the cell's failure, raised."""
    model = hf_zoo.build(name)
    try:
        engine = initialize(model, config(strategy))
    except REFUSALS as error:
        return ("refused", f"{type(error).__name__}: {error}")
    try:
        losses = _train(engine, STRATEGIES[strategy][2])
        return ("trained", losses, _params(engine))
    except _RefusedAtFirstForward as refused:
        return ("refused", str(refused))
    finally:
        engine.close()


def _train(engine, scheduled: bool) -> list[float]:
    losses = []
    for batch in batches():
        rows = micro_batches(batch, engine.dp_rank, engine.dp_world_size, 1)[0]
        if scheduled:  # train_batch: the step's micro-batches, its loss the data-parallel mean already
            micro = [{"input_ids": x, "labels": x} for x in rows.chunk(ACCUMULATION)]
            losses.append(float(engine.train_batch(iter(micro))))
            continue
        try:
            loss = hf_zoo.hf_loss(engine, rows)
        except REFUSALS as error:
            if losses:
                raise
            raise _RefusedAtFirstForward(f"{type(error).__name__}: {error}") from error
        engine.backward(loss)
        engine.step()
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        if engine.dp_world_size > 1:
            dist.all_reduce(mean, group=engine.dp_group)
        losses.append(mean.item() / engine.dp_world_size)
    return losses


def _params(engine) -> dict[str, torch.Tensor]:
    if engine.pipeline is None:
        return trained_params(engine)
    names = engine.pipeline.split.names  # this rank's stages: the others come from the other ranks
    with engine.gathered_parameters():
        return {names[id(p)]: p.detach().clone() for p in engine.module.parameters()}
