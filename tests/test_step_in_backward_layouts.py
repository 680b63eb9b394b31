"""offload_optimizer.step_in_backward (Note [stepping in backward]) with every state layout: bf16 with fp32 masters,
bf16 masters with fp32 or bf16 states, stochastic rounding (Note [keyed stochastic rounding]), AdamW8bit and
AdamW4bit, on CPU and NVMe, in one process and on 2 ranks, per micro-batch and under layer-major accumulation
(Note [layer-major accumulation]). Stepping each shard as it is reduced runs the same arithmetic on the same final
gradients as stepping after backward, so the weights are equal bit for bit."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from engine import initialize
from engine.config import ConfigError
from offload.manager import BudgetError
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import micro_batches, tiny_gpt, token_batches, trained_params

STEPS, GLOBAL_BATCH, ACCUMULATION, SEED = 3, 8, 2, 7
MASTERS = {"bf16_master_weights_and_grads": True}
# name -> (optimizer type, bf16 section additions)
LAYOUTS = {
    "fp32 masters": ("AdamW", {}),
    "bf16 masters, fp32 states": ("AdamW", MASTERS),
    "bf16 masters, bf16 states": ("AdamW", {**MASTERS, "bf16_optimizer_states": True}),
    "bf16 masters, rounded": ("AdamW", {**MASTERS, "bf16_optimizer_states": True, "stochastic_rounding": True}),
    "bf16 masters, fp32 states, rounded": ("AdamW", {**MASTERS, "stochastic_rounding": True}),
    "8-bit": ("AdamW8bit", {}),
    "4-bit": ("AdamW4bit", {}),
    "8-bit, bf16 masters, rounded": ("AdamW8bit", {**MASTERS, "bf16_optimizer_states": True,
                                                   "stochastic_rounding": True}),
}
TIERS = {"cpu": 2, "nvme": 3}  # offload device -> the ZeRO stage it runs under (stage 3 offloads parameters too)


def layout_config(layout: str, device: str, path: str, early: bool, world: int = 1, layer_major: bool = False) -> dict:
    optimizer, bf16 = LAYOUTS[layout]
    stage = 3 if layer_major else TIERS[device]
    zero = {"stage": stage, "chunk_size": 60_000, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": device, "nvme_path": path, "step_in_backward": early}}
    if stage == 3:
        zero["offload_param"] = {"device": device, "nvme_path": path, "layer_major": layer_major}
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world // ACCUMULATION,
            "gradient_accumulation_steps": ACCUMULATION, "seed": SEED, "steps_per_print": 10**6,
            "optimizer": {"type": optimizer, "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "bf16": {"enabled": True, **bf16}, "zero_optimization": zero, "aio": {"block_size": 4096}}


class EarlySteps:
    """Counts the shards the optimizer steps inside backward (engine.optimizer.step_early calls)."""

    def __init__(self, engine):
        self.count, step_early = 0, engine.optimizer.step_early

        def counted(*args):
            self.count += 1
            step_early(*args)
        engine.optimizer.step_early = counted


def train(layout: str, device: str, path: str, early: bool, rank: int = 0, world: int = 1,
          layer_major: bool = False) -> dict:
    """STEPS steps of this rank's rows, per micro-batch (engine.backward / step) or layer-major (train_batch)."""
    os.makedirs(path, exist_ok=True)
    engine = initialize(tiny_gpt(seed=rank), layout_config(layout, device, path, early, world, layer_major))
    early_steps, losses = EarlySteps(engine), []
    reads_before = engine.chunked.sharded_params.gathered_bytes
    for batch in token_batches(STEPS, GLOBAL_BATCH):
        micro = micro_batches(batch, rank, world, ACCUMULATION)
        if layer_major:
            losses.append(engine.train_batch(iter([{"input_ids": x, "labels": x} for x in micro])))
            continue
        for x in micro:
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    result = {"losses": losses, "weights": trained_params(engine), "early": early_steps.count,
              "reads": engine.chunked.sharded_params.gathered_bytes - reads_before}
    engine.close()
    return result


def assert_same_training(early: dict, after: dict) -> None:
    assert early["losses"] == after["losses"]
    for name, value in after["weights"].items():
        assert torch.equal(early["weights"][name], value), name
    assert after["early"] == 0 and early["early"] > 0  # the early run stepped shards inside backward
    assert early["reads"] == after["reads"]  # the same parameter reads: no chunk is gathered again for the step


@pytest.mark.parametrize("device", TIERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_process_steps_in_backward_as_after_it(layout, device, tmp_path):
    runs = [train(layout, device, str(tmp_path / f"swap-{early}"), early) for early in (True, False)]
    assert_same_training(*runs)


@pytest.mark.parametrize("layout,device", [("fp32 masters", "cpu"), ("bf16 masters, rounded", "nvme"),
                                           ("8-bit, bf16 masters, rounded", "nvme")])
def test_layer_major_steps_in_backward_as_after_it(layout, device, tmp_path):
    """One autograd call over the step's micro-batches gives each parameter one final gradient: its shard is
    stepped as soon as it is reduced, and each chunk is still read once in forward and once in backward."""
    runs = [train(layout, device, str(tmp_path / f"swap-{early}"), early, layer_major=True) for early in (True, False)]
    assert_same_training(*runs)


# (layout, device, layer_major, early) on 2 ranks, each layout on the tier it is least covered on above
TWO_RANK_LAYOUTS = [("fp32 masters", "nvme", False), ("bf16 masters, fp32 states", "cpu", False),
                    ("bf16 masters, rounded", "nvme", False), ("4-bit", "cpu", False),
                    ("8-bit, bf16 masters, rounded", "nvme", False), ("8-bit, bf16 masters, rounded", "cpu", True)]
TWO_RANK_CASES = [(*case, early) for case in TWO_RANK_LAYOUTS for early in (True, False)]


def two_rank_worker(rank: int, world: int, root: str) -> dict:
    def case(layout, device, layer_major, early):
        path = os.path.join(root, f"{layout}-{device}-{layer_major}-{early}-{rank}".replace(" ", ""))
        return train(layout, device, path, early, rank, world, layer_major)
    return run_cases(rank, TWO_RANK_CASES, case)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("step_in_backward_layouts"))
    return results_by_case(run_distributed(two_rank_worker, 2, (root,), timeout_s=300))


@pytest.mark.parametrize("case", TWO_RANK_LAYOUTS, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_two_ranks_step_in_backward_as_after_it(two_ranks, case):
    for rank in range(2):
        assert_same_training(two_ranks[(*case, True)][rank], two_ranks[(*case, False)][rank])
    # every rank holds the same whole weights
    early = two_ranks[(*case, True)]
    assert all(torch.equal(early[0]["weights"][n], early[1]["weights"][n]) for n in early[0]["weights"])


class NotInstalled:
    """An import-system finder for which package `name` is not installed (ModuleNotFoundError, as pip leaves it)."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@pytest.mark.parametrize("layout,quantize_frozen,named", [
    ("8-bit", "none", "optimizer.type: \"AdamW8bit\""), ("4-bit", "none", "optimizer.type: \"AdamW4bit\""),
    ("fp32 masters", "int8", "quantize_frozen: \"int8\"")])
def test_a_missing_torchao_is_named_at_initialize(layout, quantize_frozen, named, monkeypatch, tmp_path):
    """Without torchao (not installed: its modules unloaded, and the import system finds none) initialize refuses
    a config that needs it, before it builds anything: no chunk is made, the model keeps its parameters."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled("torchao"), *sys.meta_path])
    cfg = layout_config(layout, "nvme", str(tmp_path), early=True)
    cfg["zero_optimization"]["quantize_frozen"] = quantize_frozen
    model = tiny_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=f"{re.escape(named)} needs a package this environment lacks") as e:
        initialize(model, cfg)
    assert "No module named 'torchao" in str(e.value) and "install" in str(e.value)
    assert all(torch.equal(p, before[n]) and p.numel() > 0 for n, p in model.named_parameters())
    assert not list(tmp_path.iterdir())  # no swap file was written


@pytest.mark.parametrize("layout", ["fp32 masters", "8-bit, bf16 masters, rounded"])
def test_a_cpu_budget_below_one_steps_chunks_is_refused_at_initialize(layout, tmp_path):
    """A CPU budget that cannot hold one stepped tensor's chunks at once (states, master, gradient and parameter
    shards) would stop backward after some shards were stepped (the model partly updated): initialize refuses it,
    naming the bytes that suffice; at exactly those bytes, with NVMe homes, it trains."""
    cfg = layout_config(layout, "nvme", str(tmp_path), early=True)
    cfg["memory"] = {"cpu_budget": 100_000}
    with pytest.raises(BudgetError, match="memory.cpu_budget: .* cannot hold the chunks one step") as refused:
        initialize(tiny_gpt(), cfg)
    need = int(re.search(r"set memory.cpu_budget to at least (\d+)", str(refused.value)).group(1))
    cfg["memory"] = {"cpu_budget": need}
    engine = initialize(tiny_gpt(), cfg)
    early = EarlySteps(engine)
    for batch in token_batches(2, GLOBAL_BATCH):
        for x in micro_batches(batch, 0, 1, ACCUMULATION):
            engine.backward(engine(x, x))
            engine.step()
    assert early.count > 0 and engine.optimizer.manager.stats.nvme_written_bytes["optim"] > 0  # it paged
    engine.close()
