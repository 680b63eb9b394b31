"""LoRA through PEFT, written as users write it: a pretrained Llama (built from a config, saved with save_pretrained)
loaded under zero_init, wrapped by get_peft_model after the block, trained by the engine. On 2 ranks under ZeRO 1-3
in fp32, bf16 and fp16 (stage 3 with the frozen base on NVMe or CPU; with Hugging Face's activation checkpointing
and PEFT's enable_input_require_grads) it trains as PEFT in memory does on one process, the base's NVMe copy is
never written after initialize, and the adapters saved with PEFT's save_pretrained from the gathered weights
reload into PEFT."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open

from engine import initialize, zero_init
from engine.compat import deepspeed
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, micro_batches, step_masters, token_batches
from tests.test_data_parallel import adamw
from tests.test_mixed_precision import LOSS_RTOL, WEIGHT_RTOL
from tests.test_streamed_weights import save_llama
from tests.test_zero import zero_config

STEPS = 3
GLOBAL_BATCH = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FILE_OF = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16"}  # the pretrained file each precision trains from
LOSS_SCALE = 1024.0  # fp16: static, the same in the engine and the reference


def lora_config() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def batches() -> list[torch.Tensor]:
    return token_batches(STEPS, GLOBAL_BATCH, seq=16, vocab=96)


def enable_checkpointing(model) -> None:
    """transformers' own checkpointing, reentrant: without an input that requires grad, no gradient would reach the
    adapters (activation_checkpointing_enable since transformers 5.24, gradient_checkpointing_enable before)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()


def peft_model(path: str, checkpointing: bool) -> torch.nn.Module:
    model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), lora_config())
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    return model


def adapters(named: dict) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in named.items() if "lora_" in n}


def reference(path: str, dtype: str, checkpointing: bool, prepare=None) -> tuple[list[float], dict]:
    """PEFT in memory on one process, full batches: AdamW over the adapters, clipped at 1.0; under bf16 / fp16 the
    whole model in that dtype (as the engine computes) with fp32 masters of the adapters (fp16: a static loss
    scale). prepare(model): changes the model in that dtype before training."""
    torch.manual_seed(0)
    model = peft_model(path, checkpointing).to(DTYPES[dtype])
    if prepare is not None:
        prepare(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in trainable]
    optimizer = adamw(masters)
    losses = []
    for x in batches():
        loss = model(input_ids=x, labels=x).loss
        scale = LOSS_SCALE if dtype == "fp16" else 1.0
        (loss.float() * scale).backward()
        step_masters(masters, trainable, optimizer, clip=1.0, loss_scale=scale)
        losses.append(loss.item())
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return losses, dict(zip(names, (m.detach() for m in masters)))


def engine_config(stage: int, dtype: str, offload: str | None, swap: str) -> dict:
    cfg = zero_config(stage, GLOBAL_BATCH // 2, 1, chunk_size=4_000)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": LOSS_SCALE}
    if offload:
        for part in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][part] = {"device": offload, "nvme_path": swap}
    if offload == "nvme":
        cfg["aio"] = {"block_size": 4096}
        cfg["memory"] = {"cpu_budget": 64 * 1024}  # a few chunks: the base is paged in from NVMe at every pass
    return cfg


CASES = [(3, "fp32", "nvme", False), (3, "bf16", "cpu", True), (2, "fp32", None, False), (1, "bf16", None, True),
         (2, "fp16", None, False)]


def lora_engine(path: str, cfg: dict, seed: int, checkpointing: bool, deepspeed_api: bool):
    """Written as users write it: the base loaded under zero_init, PEFT's get_peft_model after the block."""
    torch.manual_seed(seed)
    with zero_init():
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = get_peft_model(model, lora_config())
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    return deepspeed.initialize(model=model, config=cfg)[0] if deepspeed_api else initialize(model, cfg)


def train_steps(engine, rank: int, world: int, steps: list[torch.Tensor]) -> list[float]:
    losses = []
    for x in steps:
        (micro,) = micro_batches(x, rank, world, 1)
        loss = engine(input_ids=micro, labels=micro).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def lora_case(rank: int, world: int, path: str, out: str, stage: int, dtype: str, offload: str | None,
              checkpointing: bool) -> dict:
    """Trains STEPS steps; with NVMe, through the DeepSpeed API with an adapter-only checkpoint before the last
    step, resumed in an engine whose adapters started elsewhere: its last step must be the first engine's."""
    swap = os.path.join(out, f"swap-{stage}-{dtype}-r{rank}")
    os.makedirs(swap, exist_ok=True)
    cfg = engine_config(stage, dtype, offload, swap)
    resumes = offload == "nvme"
    # rank 1's adapters start elsewhere: every rank trains rank 0's (the reference's seed)
    engine = lora_engine(path, cfg, rank, checkpointing, deepspeed_api=resumes)
    inner = getattr(engine, "engine", engine)  # the DeepSpeed API's engine wraps Tiers'
    manager = getattr(inner.optimizer, "manager", None)
    written = manager.stats.nvme_written_bytes["frozen"] if manager else None
    losses = train_steps(engine, rank, world, batches()[:-1])
    result = {}
    if resumes:
        assert engine.save_checkpoint(os.path.join(out, "adapter-checkpoint"), exclude_frozen_parameters=True)
        result["saved_keys"] = saved_keys(os.path.join(out, "adapter-checkpoint"))
        result["frozen_names"] = [n for n, p in inner.module.named_parameters() if not p.requires_grad]
    losses += train_steps(engine, rank, world, batches()[-1:])
    result["losses"] = losses
    if manager:
        result["frozen_written"] = (written, manager.stats.nvme_written_bytes["frozen"])
        result["frozen_read"] = manager.stats.nvme_read_bytes["frozen"]
    state = inner.full_state_dict(trainable_only=True)  # the adapters, gathered: no frozen chunk
    if rank == 0:
        saved = os.path.join(out, f"adapter-{stage}-{dtype}")
        inner.module.save_pretrained(saved, state_dict=state)
        result["saved"] = saved
        result["adapters"] = adapters(state)
        result["gathered"] = sorted(state)
    inner.close()
    if resumes:
        os.makedirs(swap + "-resumed", exist_ok=True)
        resumed = lora_engine(path, engine_config(stage, dtype, offload, swap + "-resumed"), 100 + rank,
                              checkpointing, deepspeed_api=True)
        resumed.load_checkpoint(os.path.join(out, "adapter-checkpoint"))
        result["resumed_loss"] = train_steps(resumed, rank, world, batches()[-1:])[0]
        result["resumed_adapters"] = adapters(resumed.engine.full_state_dict(trainable_only=True))
        resumed.engine.close()
    return result


def saved_keys(directory: str) -> set[str]:
    """Every tensor key in the rank files of the checkpoint `directory`/latest names."""
    with open(os.path.join(directory, "latest")) as f:
        tag = os.path.join(directory, f.read().strip())
    keys = set()
    for name in os.listdir(tag):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(tag, name), "pt") as f:
                keys.update(f.keys())
    return keys


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    return {"fp32": save_llama(str(root / "fp32"), torch.float32),
            "bf16": save_llama(str(root / "bf16"), torch.bfloat16)}


@pytest.fixture(scope="module")
def trained(pretrained, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("lora-runs"))
    per_rank = {}
    for file in pretrained:  # each pretrained file once: the cases training from it share one group
        cases = [c for c in CASES if FILE_OF[c[1]] == file]
        per_rank.update(results_by_case(run_distributed(lora_worker_for, 2, (pretrained[file], out, cases))))
    return per_rank


def lora_worker_for(rank: int, world: int, path: str, out: str, cases: list) -> dict:
    return run_cases(rank, cases, lambda *case: lora_case(rank, world, path, out, *case))


def case_id(case: tuple) -> str:
    stage, dtype, offload, checkpointing = case
    return f"stage{stage}-{dtype}-{offload or 'no-offload'}" + ("-ckpt" if checkpointing else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_lora_trains_as_peft_in_memory(pretrained, trained, case):
    stage, dtype, offload, checkpointing = case
    path = pretrained[FILE_OF[dtype]]
    expected_losses, expected_adapters = reference(path, dtype, checkpointing)
    zero, one = trained[case]
    losses = [(a + b) / 2 for a, b in zip(zero["losses"], one["losses"])]  # each rank's mean over half the batch
    rtol = 1e-5 if dtype == "fp32" else LOSS_RTOL[DTYPES[dtype]]
    assert_close_relative(losses, expected_losses, rtol)
    assert zero["gathered"] == sorted(expected_adapters)  # trainable_only: the adapters, nothing of the base
    assert_params_close(zero["adapters"], adapters(expected_adapters),
                        1e-5 if dtype == "fp32" else WEIGHT_RTOL[DTYPES[dtype]])
    if offload == "nvme":
        for rank_result in (zero, one):
            before, after = rank_result["frozen_written"]
            assert before > 0 and after == before  # written once at the start, then only read
            assert rank_result["frozen_read"] > 0
            # adapter-only: no frozen weight saved (a frozen parameter is saved as an extra entry); resumed
            # elsewhere, the last step is the same step
            assert len(rank_result["frozen_names"]) == 21
            assert not {f"extra.{n}" for n in rank_result["frozen_names"]} & rank_result["saved_keys"]
            assert any(k.startswith("chunk.") for k in rank_result["saved_keys"])
            assert rank_result["resumed_loss"] == rank_result["losses"][-1]
        assert_params_close(zero["resumed_adapters"], zero["adapters"], 0.0)
    # PEFT reloads the saved adapters onto the plain pretrained model
    reloaded = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(path),
                                         zero["saved"])
    named = {n.replace(".default", ""): p for n, p in reloaded.named_parameters() if "lora_" in n}
    saved = {n.replace(".default", ""): t for n, t in zero["adapters"].items()}
    assert named.keys() == saved.keys()
    for n in saved:
        assert torch.equal(named[n].float(), saved[n]), n
