"""An int8 frozen base (zero_optimization.quantize_frozen "int8", Note [int8 frozen chunks]): LoRA through PEFT on a
pretrained Llama trains as PEFT in memory on the base's int8 image (torchao's per-row recipe), on 2 ranks with the
base streamed from its files onto NVMe, in memory built normally, and from a full checkpoint, and in one process;
the gathered base is that image bit for bit, its NVMe copy holds 1 byte per element and is written once."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from peft import get_peft_model
from torch import nn
from torchao.quantization.granularity import PerRow
from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

from engine import initialize, zero_init
from engine.config import ConfigError
from engine.zero.int8_frozen import int8_image
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close
from tests.test_lora import DTYPES, GLOBAL_BATCH, adapters, batches, engine_config, lora_config, reference, train_steps
from tests.test_mixed_precision import LOSS_RTOL, WEIGHT_RTOL
from tests.test_streamed_weights import save_llama

# (dtype, offload, how the base arrives, its file): streamed from its files under zero_init, or a model built in
# memory whose values the start quantizes; "checkpoint": a full checkpoint saved before the last step resumes in a
# new engine; "bf16-tied": lm_head is the embedding's weight (quantized once, read by both)
CASES = [("fp32", "nvme", "zero_init", "fp32"), ("bf16", "cpu", "checkpoint", "bf16"), ("bf16", None, "memory", "bf16"),
         ("fp16", None, "zero_init", "bf16-tied")]


def quantize_base(model: nn.Module) -> None:
    """The reference's base: every frozen linear weight replaced by its int8 image."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                module.weight.data = int8_image(module.weight.data)


def base_weights(model: nn.Module, named: dict) -> dict[str, torch.Tensor]:
    """The frozen linear weights (PEFT's base layers, the other projections, lm_head) of `model`'s state dict."""
    names = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad}
    return {n: t for n, t in named.items() if n in names}


def int8_config(dtype: str, world: int, offload: str | None, swap: str) -> dict:
    cfg = engine_config(3, dtype, offload, swap)
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world
    cfg["zero_optimization"]["quantize_frozen"] = "int8"
    return cfg


def build(path: str, cfg: dict, arrival: str, seed: int):
    torch.manual_seed(seed)
    if arrival == "memory":
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    else:
        with zero_init():
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = get_peft_model(model, lora_config())
    model.train()
    return initialize(model, cfg)


def int8_case(rank: int, world: int, path: str, out: str, dtype: str, offload: str | None, arrival: str,
              other_path: str | None = None) -> dict:
    swap = os.path.join(out, f"swap-{dtype}-{arrival}-w{world}-r{rank}")
    os.makedirs(swap, exist_ok=True)
    engine = build(path, int8_config(dtype, world, offload, swap), arrival, rank)
    int8_states = [s for s in engine.chunked.frozen_states if s.int8 is not None]
    result = {"int8_chunks": len(int8_states), "shard_dtypes": {s.param_shard.dtype for s in int8_states}}
    manager = getattr(engine.optimizer, "manager", None)
    if manager is not None:
        written = manager.stats.nvme_written_bytes["frozen"]
        shard_bytes = sum(s.param_shard.numel() * s.param_shard.element_size()
                          for s in engine.chunked.frozen_states if s.param_handle is not None)
    losses = train_steps(engine, rank, world, batches()[:-1])
    checkpoint = os.path.join(out, f"full-{dtype}-w{world}")
    if arrival == "checkpoint":
        assert engine.save_checkpoint(checkpoint)
    losses += train_steps(engine, rank, world, batches()[-1:])
    result["losses"] = losses
    if manager is not None and offload == "nvme":
        result["frozen_written"] = (written, manager.stats.nvme_written_bytes["frozen"], shard_bytes)
    state = engine.full_state_dict()
    result["adapters"], result["base"] = adapters(state), base_weights(engine.module, state)
    engine.close()
    if arrival == "checkpoint":  # a new engine whose adapters start elsewhere, from the full checkpoint
        resumed = build(path, int8_config(dtype, world, offload, swap + "-resumed"), "zero_init", 100 + rank)
        result["load_warnings"] = loading_warnings(resumed, checkpoint)
        result["resumed_loss"] = train_steps(resumed, rank, world, batches()[-1:])[0]
        result["resumed_base"] = base_weights(resumed.module, resumed.full_state_dict())
        resumed.close()
        # built from other pretrained weights: the loaded base is no int8 image of its scales, and it says so
        other = build(other_path, int8_config(dtype, world, offload, swap + "-other"), "zero_init", rank)
        result["other_warnings"] = loading_warnings(other, checkpoint)
        other.close()
    return result


def loading_warnings(engine, checkpoint: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(checkpoint)
    return [str(w.message) for w in caught if "int8" in str(w.message)]


def int8_worker(rank: int, world: int, paths: dict, out: str, cases: list) -> dict:
    return run_cases(rank, cases, lambda dtype, offload, arrival, file: int8_case(
        rank, world, paths[file], out, dtype, offload, arrival, other_path=paths["bf16-other"]))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("int8")
    return {"fp32": save_llama(str(root / "fp32"), torch.float32),
            "bf16": save_llama(str(root / "bf16"), torch.bfloat16),
            "bf16-other": save_llama(str(root / "other"), torch.bfloat16, seed=8),
            "bf16-tied": save_llama(str(root / "tied"), torch.bfloat16, tied=True)}


@pytest.fixture(scope="module")
def trained(pretrained, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("int8-runs"))
    return results_by_case(run_distributed(int8_worker, 2, (pretrained, out, CASES), timeout_s=300))


def expected(path: str, dtype: str) -> tuple[list[float], dict, dict]:
    """PEFT in memory on one process on the base's int8 image: losses, adapters, base weights."""
    images = {}

    def prepare(model: nn.Module) -> None:
        quantize_base(model)
        images.update(base_weights(model, model.state_dict()))  # a tied lm_head under its own key too

    losses, trained_adapters = reference(path, dtype, False, prepare)
    return losses, adapters(trained_adapters), {n: t.detach().clone() for n, t in images.items()}


def check_against_reference(results: list[dict], path: str, dtype: str) -> None:
    losses, reference_adapters, images = expected(path, dtype)
    mean = [sum(r["losses"][i] for r in results) / len(results) for i in range(len(losses))]
    rtol = 1e-5 if dtype == "fp32" else LOSS_RTOL[DTYPES[dtype]]
    assert_close_relative(mean, losses, rtol)
    assert_params_close(results[0]["adapters"], reference_adapters,
                        1e-5 if dtype == "fp32" else WEIGHT_RTOL[DTYPES[dtype]])
    base = results[0]["base"]
    assert base.keys() == images.keys() and len(base) == 15  # 2 layers x 7 linear weights, and lm_head
    for name in images:  # bit for bit: the chunk dequantizes exactly what the reference trains on
        assert torch.equal(base[name], images[name]), name
    for r in results:
        assert r["int8_chunks"] > 0 and r["shard_dtypes"] == {torch.int8}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1] or 'no-offload'}-{c[2]}-{c[3]}")
def test_int8_base_trains_as_peft_on_its_int8_image(pretrained, trained, case):
    dtype, offload, arrival, file = case
    results = trained[case]
    check_against_reference(results, pretrained[file], dtype)
    if offload == "nvme":
        for r in results:
            before, after, shard_bytes = r["frozen_written"]
            assert before == after == shard_bytes > 0  # written once, at int8's bytes, never again
    if arrival == "checkpoint":
        for r in results:  # the base reloaded from its dequantized values is the same int8 image
            assert r["resumed_loss"] == r["losses"][-1]
            assert r["load_warnings"] == []
            assert len(r["other_warnings"]) == 1 and "quantized again" in r["other_warnings"][0]
            for name, value in r["base"].items():
                assert torch.equal(r["resumed_base"][name], value), name


def test_int8_base_in_one_process_pages_without_offload(pretrained, tmp_path):
    """One rank, no offload_param: the int8 chunks are paged (gathered from in-memory int8 shards)."""
    results = [int8_case(0, 1, pretrained["fp32"], str(tmp_path), "fp32", None, "zero_init")]
    check_against_reference(results, pretrained["fp32"], "fp32")


def test_int8_image_is_torchaos_per_row_recipe():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(48, 40, dtype=dtype)
        image = int8_image(weight)
        assert torch.equal(image, Int8Tensor.from_hp(weight, PerRow()).dequantize(dtype))
        assert not torch.equal(image, weight)


@pytest.mark.parametrize("stage", [1, 2])
def test_int8_base_needs_stage_3(pretrained, stage):
    cfg = int8_config("fp32", 1, None, "")
    cfg["zero_optimization"]["stage"] = stage
    model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(pretrained["fp32"]), lora_config())
    with pytest.raises(ConfigError, match=f"quantize_frozen.*stage 3 \\(this run: stage {stage}\\)"):
        initialize(model, cfg)
