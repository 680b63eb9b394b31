"""Parallelisms composed on one group of ranks, each combination against one plain process on the same model, data
and seed: the step's losses, the global gradient norms and the final full_state_dict.

Every case runs inside one spawned group of WORLD ranks (one worker running the cases in turn), so a case added
here costs its training only, not another start of 8 processes. The layouts' checkpoints load under another layout
in the same group and in this one process (Note [reading a checkpoint anywhere]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

from engine import initialize
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, micro_batches, token_batches, train_reference
from tests.test_data_parallel import ADAMW, adamw

transformers = pytest.importorskip("transformers")

WORLD, STEPS, GLOBAL_BATCH, SEQ, VOCAB = 8, 3, 8, 16, 128
TP_RTOL = 1e-4  # a tensor-parallel matmul sums its products in another order than one process


def tiny_llama(seed: int = 0) -> nn.Module:
    """Two blocks (one per pipeline stage), GQA with 2 key/value heads (each tp rank takes one)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


@dataclass(frozen=True)
class Composition:
    parallel: dict  # the config keys that compose the parallelisms
    degrees: dict  # engine attribute -> the size this layout must give it (dp_world_size among them)
    accumulation: int  # micro-batches per step on each data-parallel rank
    model: Callable[[], nn.Module] = tiny_llama
    rtol: float = TP_RTOL

    def config(self) -> dict:
        return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // self.degrees["dp_world_size"] // self.accumulation,
                "gradient_accumulation_steps": self.accumulation, "optimizer": {"type": "AdamW", "params": ADAMW},
                "gradient_clipping": 1.0, "steps_per_print": 10**6, **self.parallel}


CASES = {
    # pp 2 x dp 2 x tp 2 under ZeRO-3: each stage's tp shards chunked and sharded over dp, gathered per action
    # (every parameter sharded, several chunks per stage: the tiny model is under the default threshold and chunk)
    "pp2_tp2_zero3": Composition(
        {"pipeline": {"stages": 2, "schedule": "1f1b"}, "tensor_parallel": {"size": 2},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "chunk_size": 4_000}},
        degrees={"num_stages": 2, "dp_world_size": 2, "tp_world_size": 2}, accumulation=4),
    # the same with Megatron's sequence parallelism inside tp: each stage sends its half of the sequence
    "pp2_tp2_megatron_sp_zero3": Composition(
        {"pipeline": {"stages": 2, "schedule": "1f1b"}, "tensor_parallel": {"size": 2, "sequence_parallel": True},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "chunk_size": 4_000}},
        degrees={"num_stages": 2, "dp_world_size": 2, "tp_world_size": 2}, accumulation=4),
    # pp 2 x sp 2 x tp 2: each stage's tp shards run their heads' attention over the sequence ranks
    "pp2_sp2_tp2_zero1": Composition(
        {"pipeline": {"stages": 2, "schedule": "1f1b"}, "tensor_parallel": {"size": 2},
         "sequence_parallel": {"size": 2}, "zero_optimization": {"stage": 1}},
        degrees={"num_stages": 2, "dp_world_size": 1, "tp_world_size": 2, "seq_parallel_world_size": 2},
        accumulation=4),
}


def batches() -> list[torch.Tensor]:
    return token_batches(STEPS, GLOBAL_BATCH, seq=SEQ, vocab=VOCAB)


# a checkpoint saved by the first layout's run is loaded under the second (and in one process by the test)
RELOADS = {"pp2_tp2_zero3": "pp2_sp2_tp2_zero1", "pp2_sp2_tp2_zero1": "pp2_tp2_zero3"}


def _train_case(name: str, directory: str) -> tuple[tuple, list[float], list[float], dict | None]:
    case = CASES[name]
    engine = initialize(case.model(), case.config())
    assert {key: getattr(engine, key) for key in case.degrees} == case.degrees
    coordinates = (engine.stage_id, engine.dp_rank, engine.seq_parallel_rank, engine.tp_rank)
    losses, norms = [], []
    for batch in batches():
        micro = micro_batches(batch, engine.dp_rank, engine.dp_world_size, case.accumulation)
        losses.append(engine.train_batch(iter([{"input_ids": x, "labels": x} for x in micro])))
        norms.append(engine.get_global_grad_norm())
    full = engine.full_state_dict(rank0_only=True)
    if name in RELOADS:
        engine.save_checkpoint(directory, name)
    engine.close()
    return coordinates, losses, norms, full


def _reload_case(saved: str, directory: str) -> dict | None:
    """The checkpoint `saved`'s run wrote, loaded under RELOADS[saved]'s layout into another seed's model."""
    engine = initialize(tiny_llama(seed=1), CASES[RELOADS[saved]].config())
    engine.load_checkpoint(directory, saved)
    full = engine.full_state_dict(rank0_only=True)
    engine.close()
    return full


def _worker(rank: int, world: int, cases: list[tuple], directory: str) -> dict:
    def run(kind: str, name: str):
        return (_train_case if kind == "train" else _reload_case)(name, directory)
    return run_cases(rank, cases, run)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("composition_checkpoints"))


@pytest.fixture(scope="module")
def composed(checkpoints) -> dict:
    """{("train", case): [each rank's ((stage, dp rank, sequence rank, tp rank), losses, norms, full_state_dict or
    None)], ("reload", case): [each rank's full_state_dict or None]} from one group of WORLD ranks."""
    cases = [("train", name) for name in CASES] + [("reload", name) for name in RELOADS]
    return results_by_case(run_distributed(_worker, WORLD, args=(cases, checkpoints), timeout_s=420))


def _reference(case: Composition) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    model = case.model()
    losses, norms = train_reference(model, batches(), adamw, clip=1.0, loss_fn=lambda m, x: m(input_ids=x,
                                                                                                 labels=x).loss)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_relative(actual: list[float], expected: list[float]) -> float:
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected))


@pytest.mark.parametrize("name", list(CASES))
def test_a_composition_trains_as_one_process(composed, name):
    case = CASES[name]
    ref_losses, ref_norms, ref_state = _reference(case)
    per_rank = composed[("train", name)]
    assert len({coordinates for coordinates, *_ in per_rank}) == WORLD  # each rank one place in the grid
    for _, losses, norms, _ in per_rank:  # every rank reports the step's loss and the global norm
        assert_close_relative(losses, ref_losses, rtol=case.rtol)
        assert_close_relative(norms, ref_norms, rtol=case.rtol)
    full = per_rank[0][3]
    assert all(state is None for *_, state in per_rank[1:])
    assert full.keys() == ref_state.keys()
    assert_params_close(full, ref_state, rtol=case.rtol)
    worst_param = max(float((full[k] - ref_state[k]).abs().max()) for k in ref_state)
    print(f"{name}: max relative loss difference {_max_relative(per_rank[0][1], ref_losses):.2e}, grad norm "
          f"{_max_relative(per_rank[0][2], ref_norms):.2e}, max absolute parameter difference {worst_param:.2e}")


@pytest.mark.parametrize("name", list(RELOADS))
def test_a_compositions_checkpoint_loads_under_another_layout_and_in_one_process(composed, checkpoints, name):
    """What the run saved after its last step is, value for value, what RELOADS[name]'s layout and one plain process
    hold after loading it (parameters cut, sharded and staged another way, or not at all)."""
    saved = composed[("train", name)][0][3]
    elsewhere = composed[("reload", name)][0]
    engine = initialize(tiny_llama(seed=1), {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
                                             "optimizer": {"type": "AdamW", "params": ADAMW}})
    engine.load_checkpoint(checkpoints, name)
    here = engine.full_state_dict()
    engine.close()
    for loaded in (elsewhere, here):
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
