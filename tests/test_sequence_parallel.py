"""Sequence parallelism on unmodified models (Note [sequence parallelism]): each rank trains on a part of every
sequence, attention runs over the whole one by Ulysses or ring, and the losses and final parameters equal one process
training on the full sequences (fp32 1e-5), for the example GPT, HF GPT-2 and HF Llama (GQA), and dp 2 × sp 2 under
ZeRO-3."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from engine import initialize
from engine.config import ConfigError, load_config
from tests.distributed import run_distributed
from tests.reference import (
    FP32_RTOL,
    assert_close_relative,
    assert_params_close,
    micro_batches,
    param_snapshot,
    tiny_gpt,
    token_batches,
    train_reference,
    trained_params,
)
from tests.test_data_parallel import ADAMW, adamw
from tests.test_pipeline_engine import example_gpt, hf_gpt2, hf_llama

STEPS, GLOBAL_BATCH, SEQ = 3, 4, 32
def hf_llama_one_kv_head():
    """Llama with fewer key/value heads (1) than sequence-parallel ranks (2)."""
    model = hf_llama()
    transformers = pytest.importorskip("transformers")
    config = model.config
    config.num_key_value_heads = 1
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt": example_gpt, "gpt_4_heads": lambda: tiny_gpt(0, n_head=4), "hf_gpt2": hf_gpt2, "hf_llama": hf_llama,
          "hf_llama_1kv": hf_llama_one_kv_head}


def loss_of(out):
    return out if torch.is_tensor(out) else out.loss


def _worker(rank, world, name, sp, mode, stage, accumulation=1, tp=1):
    data_ranks = world // (sp * tp)
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // data_ranks // accumulation,
           "gradient_accumulation_steps": accumulation,
           "optimizer": {"type": "AdamW", "params": ADAMW}, "gradient_clipping": 1.0, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "sequence_parallel": {"size": sp, "mode": mode}, "tensor_parallel": {"size": tp}}
    engine = initialize(MODELS[name](), cfg)
    assert engine.sequence.mode == mode
    # the loop shards by the data-parallel coordinates (Note [data-parallel coordinates]), and the forward's loss
    # is the whole sequence's (Note [sequence parallelism])
    assert (engine.dp_world_size, engine.seq_parallel_world_size) == (data_ranks, sp)
    assert engine.seq_dp_world_size == data_ranks * sp
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH, seq=SEQ):
        mean = torch.zeros(1, dtype=torch.float64)
        for x in micro_batches(batch, engine.dp_rank, engine.dp_world_size, accumulation):
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            mean += loss.item() / accumulation
        dist.all_reduce(mean, group=engine.dp_group)  # the step's loss: the mean over the data-parallel ranks
        losses.append(mean.item() / engine.dp_world_size)
    return losses, trained_params(engine)


SP2_CASES = [(name, 2, mode, 0, 1, 1) for name, mode in [
    ("gpt", "ulysses"), ("gpt", "ring"), ("hf_gpt2", "ulysses"), ("hf_gpt2", "ring"), ("hf_llama", "ulysses"),
    ("hf_llama", "ring"), ("hf_llama_1kv", "ulysses"), ("hf_llama_1kv", "ring")]]
# the loss weights and the accumulation mean compose: neither is off by the size or by the steps
ACCUMULATION_CASES = [("gpt", 2, mode, 2, 2, 1) for mode in ("ulysses", "ring")]
DP2_BY_SP2_CASE = ("hf_llama", 2, "ring", 3, 1, 1)
# Ulysses or ring over the sequence inside each tensor-parallel rank's heads (world = sp 2 × tp 2: Ulysses splits
# the 2 heads of a tp rank)
SP2_BY_TP2_CASES = [("gpt_4_heads", 2, "ulysses", 2, 1, 2), ("hf_llama", 2, "ring", 2, 1, 2)]


def test_sp2_equals_one_process_on_the_full_sequence_for_every_model_and_mode():
    """Eight models x modes at size 2, and two accumulating under ZeRO-2, in one group of 2 processes."""
    check(2, SP2_CASES + ACCUMULATION_CASES)


def test_dp2_by_sp2_under_zero3_and_sp2_by_tp2_under_zero2():
    check(4, [DP2_BY_SP2_CASE] + SP2_BY_TP2_CASES)


def _cases_worker(rank, world, cases):
    return [_worker(rank, world, name, sp, mode, stage, accumulation, tp)
            for name, sp, mode, stage, accumulation, tp in cases]


def check(world: int, cases: list[tuple]) -> None:
    """Each case (model, sp, mode, stage, accumulation, tp) against one process on the full sequences."""
    results = run_distributed(_cases_worker, world, args=(cases,), timeout_s=600)
    for i, (name, _sp, mode, _stage, _accumulation, tp) in enumerate(cases):
        model = MODELS[name]()
        ref_losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH, seq=SEQ), adamw, clip=1.0,
                                        loss_fn=lambda m, x: loss_of(m(input_ids=x, labels=x)))
        # ring attention merges blockwise partial results, another summation order than one SDPA call; Adam's
        # normalization magnifies that in small parameters, so its parameters are held to tensor parallelism's
        # 1e-4, as is everything under tensor parallelism
        losses_rtol = 1e-4 if tp > 1 else FP32_RTOL
        params_rtol = 1e-4 if mode == "ring" or tp > 1 else FP32_RTOL
        for rank, rank_results in enumerate(results):
            losses, params = rank_results[i]
            try:
                assert_close_relative(losses, ref_losses, rtol=losses_rtol)
                assert_params_close(params, param_snapshot(model), rtol=params_rtol)
            except AssertionError as e:
                raise AssertionError(f"case {cases[i]}, rank {rank}: {e}") from e


def test_deepspeed_key_and_bad_values_name_the_fix():
    assert load_config({"sequence_parallel_size": 2}).sequence_parallel.size == 2
    with pytest.raises(ConfigError, match="are the same setting and differ"):
        load_config({"sequence_parallel_size": 2, "sequence_parallel": {"size": 4}})
    with pytest.raises(ConfigError, match="sequence_parallel.mode"):
        load_config({"sequence_parallel": {"size": 2, "mode": "striped"}})
    assert load_config({"sequence_parallel": {"size": 2}, "pipeline": {"stages": 2}}).pipeline.stages == 2
    with pytest.raises(ConfigError, match="with 2D tensor parallelism is not built yet"):
        load_config({"sequence_parallel": {"size": 2}, "tensor_parallel": {"size": 4, "mode": "2d"}})
    with pytest.raises(ConfigError, match="together with tensor_parallel.sequence_parallel"):
        load_config({"sequence_parallel": {"size": 2}, "tensor_parallel": {"size": 2, "sequence_parallel": True}})


def padded_labels(x: torch.Tensor) -> torch.Tensor:
    """Labels with positions 19 onward ignored (-100): the sequence's second half, rank 1's under Ulysses, counts 3
    tokens per row against the first half's 16."""
    labels = x.clone()
    labels[:, int(SEQ * 0.6):] = -100
    return labels


def _padding_worker(rank, world):
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "steps_per_print": 10**6, "sequence_parallel": {"size": 2, "mode": "ulysses"}}
    engine = initialize(example_gpt(), cfg)
    for x in token_batches(STEPS, GLOBAL_BATCH, seq=SEQ):
        engine.backward(engine(x, padded_labels(x)))
        engine.step()
    return trained_params(engine), engine.sequence.token_weight


def test_the_loss_is_weighted_by_tokens_so_padding_on_one_rank_changes_nothing():
    model = example_gpt()
    train_reference(model, token_batches(STEPS, GLOBAL_BATCH, seq=SEQ), adamw,
                    loss_fn=lambda m, x: m(x, padded_labels(x)))
    results = run_distributed(_padding_worker, 2, timeout_s=120)
    # 19 counted tokens per row: 16 in rank 0's half, 3 in rank 1's; each rank's mean weighs S × its share
    assert [w for _, w in results] == pytest.approx([2 * 16 / 19, 2 * 3 / 19])
    for params, _ in results:
        assert_params_close(params, param_snapshot(model))


def _checkpointed_worker(rank, world, save_dir):
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "gradient_clipping": 1.0, "steps_per_print": 10**6, "sequence_parallel": {"size": 2, "mode": "ring"},
           "activation_checkpointing": {"enabled": True}}
    engine = initialize(example_gpt(), cfg)
    losses = []
    for batch in token_batches(STEPS, GLOBAL_BATCH, seq=SEQ)[:2]:
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()
        share = torch.tensor([loss.item() * engine.sequence.token_weight / 2], dtype=torch.float64)
        dist.all_reduce(share)
        losses.append(share.item())
    engine.save_checkpoint(save_dir)
    return losses


def test_with_activation_checkpointing_and_a_checkpoint_resumed_without_sequence_parallelism(tmp_path):
    """Ring attention recomputed inside checkpointed blocks; the checkpoint saved at sp 2 loads in one process and
    the run ends as one uninterrupted process would."""
    model = example_gpt()
    ref_losses, _ = train_reference(model, token_batches(STEPS, GLOBAL_BATCH, seq=SEQ), adamw, clip=1.0,
                                    loss_fn=lambda m, x: m(x, x))
    losses = run_distributed(_checkpointed_worker, 2, args=(str(tmp_path),), timeout_s=120)[0]
    assert_close_relative(losses, ref_losses[:2])
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "gradient_clipping": 1.0, "steps_per_print": 10**6}
    engine = initialize(example_gpt(seed=1), cfg)
    engine.load_checkpoint(str(tmp_path))
    x = token_batches(STEPS, GLOBAL_BATCH, seq=SEQ)[2]
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    assert_close_relative([loss.item()], ref_losses[2:])
    assert_params_close(trained_params(engine), param_snapshot(model), rtol=1e-4)  # ring: see check()


def _outside_the_engine_worker(rank, world):
    """A Hugging Face model's attention runs split only inside the engine's forward: the model called directly
    computes as before; given positions that restart (packed documents) are refused before the forward."""
    model = hf_llama()
    plain = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "steps_per_print": 10**6, "sequence_parallel": {"size": 2, "mode": "ulysses"}}
    engine = initialize(model, cfg)
    x = token_batches(1, GLOBAL_BATCH, seq=SEQ)[0]
    with torch.no_grad():
        direct = engine.module(input_ids=x).logits
        expected = plain(input_ids=x).logits
    packed = torch.arange(SEQ // 2).repeat(2).unsqueeze(0)
    refusals = [_refusal(lambda: engine(input_ids=x, labels=x, position_ids=packed))]
    engine.module.gradient_checkpointing_enable()
    refusals.append(_refusal(lambda: engine(input_ids=x, labels=x)))
    return torch.equal(direct, expected), refusals


def _refusal(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return ""


def test_the_model_called_outside_the_engine_is_unchanged_and_what_it_cannot_split_is_refused():
    """Restarting positions (packed documents), and transformers' own checkpointing, whose recompute in backward
    would run attention outside the split."""
    for same, (packed, checkpointed) in run_distributed(_outside_the_engine_worker, 2, timeout_s=120):
        assert same
        assert "position_ids given restart or skip within a sequence (packed documents)" in packed
        assert "runs transformers' own gradient checkpointing" in checkpointed


def stray_window_llama():
    """A Llama config carrying a sliding_window key it never uses (as a config.json may)."""
    transformers = pytest.importorskip("transformers")
    config = hf_llama().config.to_dict()
    config["sliding_window"] = 8
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def lora_llama():
    """Llama wrapped by PEFT: its labels are shifted inside the wrapped model, as a plain Llama's."""
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(hf_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _first_loss_worker(rank, world, name):
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": ADAMW},
           "steps_per_print": 10**6, "sequence_parallel": {"size": 2, "mode": "ulysses"}}
    engine = initialize({"stray_window": stray_window_llama, "lora": lora_llama}[name](), cfg)
    x = token_batches(1, GLOBAL_BATCH, seq=SEQ)[0]
    return engine(input_ids=x, labels=x).loss.item()


@pytest.mark.parametrize("name", ["stray_window", "lora"])
def test_a_stray_window_key_and_a_peft_wrapped_model_give_the_one_process_loss(name):
    model = {"stray_window": stray_window_llama, "lora": lora_llama}[name]()
    x = token_batches(1, GLOBAL_BATCH, seq=SEQ)[0]
    with torch.no_grad():
        expected = model(input_ids=x, labels=x).loss.item()
    for loss in run_distributed(_first_loss_worker, 2, args=(name,), timeout_s=120):
        assert_close_relative([loss], [expected])
