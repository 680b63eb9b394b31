"""Megatron sequence parallelism inside 1D tensor parallelism (Note [Megatron sequence parallelism]): tp 2 with it
equals tp 2 without it and single-process PyTorch, on the example GPT, GPT-2 and Llama, under ZeRO-3 and activation
checkpointing; saved activations and communication bytes per step equal their formulas; what it cannot split is
refused naming the fix."""

from __future__ import annotations

import re

import pytest
import torch

from engine import initialize
from engine.config import load_config
from engine.config_schema import ConfigError
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, tiny_gpt, token_batches
from tests.saved_bytes import SavedBytes
from tests.test_tensor_parallel import check_against_reference, tp_config, train_tp

FP32_RTOL = 1e-5


def sp_config(tp: int, dp: int, sequence_parallel: bool, accumulation: int = 1, stage: int = 0, **extra) -> dict:
    cfg = tp_config(tp, dp, accumulation, stage, **extra)
    cfg["tensor_parallel"]["sequence_parallel"] = sequence_parallel
    return cfg


def _with_and_without_worker(rank, world, models, stage, accumulation, checkpointing):
    extra = {"activation_checkpointing": {"enabled": True}} if checkpointing else {}
    dp = world // 2
    return {model: [train_tp(model, sp_config(2, dp, sp, accumulation, stage, **extra), rank, 2, dp, accumulation)
                    for sp in (False, True)] for model in models}


@pytest.mark.parametrize("world,stage,accumulation,checkpointing", [(2, 0, 2, False), (4, 3, 1, True)],
                         ids=["tp2-accumulation2", "dp2xtp2-zero3-checkpointing"])
def test_sequence_parallel_inside_tp_equals_tp_without_it_and_pytorch(two_ranks, world, stage, accumulation,
                                                                      checkpointing):
    models = MODELS
    if world == 2:  # tp 2 runs in the shared two-rank group
        results = two_ranks[("with_and_without", tuple(models), stage, accumulation, checkpointing)]
    else:
        results = run_distributed(_with_and_without_worker, world,
                                  args=(models, stage, accumulation, checkpointing), timeout_s=400)
    for model in models:
        for rank_result in results:
            without, with_sp = rank_result[model]
            assert_close_relative(with_sp[0], without[0], rtol=FP32_RTOL)  # losses
            assert_close_relative(with_sp[1], without[1], rtol=FP32_RTOL)  # gradient norms (layer norms' summed)
            assert_params_close(with_sp[2], without[2], rtol=FP32_RTOL)
        check_against_reference(model, [r[model][1] for r in results], world, 2, "1d")


SEQ, BATCH, HIDDEN, HEADS = 64, 2, 64, 4


def _saved_worker(rank, world, layers, sequence_parallel):
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "steps_per_print": 10**6}
    if world > 1:
        cfg["tensor_parallel"] = {"size": world, "sequence_parallel": sequence_parallel}
    engine = initialize(tiny_gpt(0, block_size=SEQ, n_layer=layers, n_head=HEADS, n_embd=HIDDEN), cfg)
    x = token_batches(1, BATCH, seq=SEQ)[0]
    saved = SavedBytes(engine.module.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, SavedBytes.unpack):
        loss = engine(x, x)
    engine.backward(loss)
    engine.close()
    return saved.peak


def _saved_one_rank_worker(rank, world, sequence_parallel):
    return [_saved_worker(rank, world, layers, sequence_parallel) for layers in (1, 2)]


def saved_bytes_per_layer(t: int, sequence_parallel: bool) -> float:
    """The example GPT's block in fp32 without dropout, with torch's flash attention (which saves q, k, v, its
    output and the logsumexp), s b h = sequence × batch × hidden, a heads:
    A = the replicated regions: 2 layer-norm inputs + 2 column-parallel inputs (4 sbh) + the norms' mean and
        rstd (4 sb);
    B = the tensor-parallel regions: q, k, v, attention output, c_proj input (5 sbh), logsumexp (as), GELU
        input and output (8 sbh);
    4 bytes × (A + B/t), and under sequence parallelism 4 bytes × (A + B)/t (Korthikanti et al.'s
    sbh(10 + 24/t + 5as/ht) -> sbh/t (34 + 5as/h), counted for this block)."""
    s, b, h, a = SEQ, BATCH, HIDDEN, HEADS
    replicated = 4 * s * b * h + 4 * s * b
    split = 13 * s * b * h + a * s * b
    return 4 * ((replicated + split) / t if sequence_parallel else replicated + split / t)


@pytest.mark.parametrize("t,sequence_parallel", [(1, False), (2, False), (2, True)], ids=["one", "tp2", "tp2-sp"])
def test_saved_activation_bytes_per_layer_equal_the_formula(two_ranks, t, sequence_parallel):
    if t == 2:  # in the shared two-rank group
        one_layer, two_layers = (two_ranks[("saved", layers, sequence_parallel)] for layers in (1, 2))
    else:  # one process: both layer counts in it
        (one, two), = run_distributed(_saved_one_rank_worker, t, args=(sequence_parallel,), timeout_s=60)
        one_layer, two_layers = [one], [two]
    for rank in range(t):
        assert two_layers[rank] - one_layer[rank] == saved_bytes_per_layer(t, sequence_parallel)


def _comm_worker(rank, world, sequence_parallel):
    engine = initialize(tiny_gpt(0, block_size=SEQ, n_layer=2, n_head=HEADS, n_embd=HIDDEN),
                        sp_config(world, 1, sequence_parallel))
    counter = engine.tensor_parallel.tp.counter
    x = token_batches(1, BATCH, seq=SEQ)[0]
    before = (counter.all_gather_bytes, counter.reduce_scatter_bytes, counter.all_reduce_bytes)
    engine.backward(engine(x, x))
    replicated = sum(p.numel() * 4 for name, p in engine.module.named_parameters()
                     if name not in engine.tensor_parallel.specs)
    result = ((counter.all_gather_bytes - before[0], counter.reduce_scatter_bytes - before[1],
               counter.all_reduce_bytes - before[2]), replicated)
    engine.close()
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_communication_bytes_per_step_equal_the_formulas(two_ranks, sequence_parallel):
    """n = the hidden states' bytes (4 s b h), L = 2 layers, logits 4 s b V gathered over the vocabulary. Without
    sequence parallelism each layer all-reduces n twice forward and twice backward, the embedding once forward
    and the lm_head's input gradient once. With it, each layer all-gathers n twice forward (the regions' inputs)
    and four times backward (the row layers' gradients, the column layers' inputs again), and reduce-scatters n
    twice each way; the embedding reduce-scatters forward and all-gathers backward, the final norm all-gathers
    forward; the replicated parameters' gradients are all-reduced."""
    results = two_ranks[("comm", sequence_parallel)]
    n, layers, logits = 4 * SEQ * BATCH * HIDDEN, 2, 4 * SEQ * BATCH * 256
    for (all_gather, reduce_scatter, all_reduce), replicated in results:
        if sequence_parallel:
            assert all_gather == layers * 6 * n + 2 * n + logits
            assert reduce_scatter == layers * 4 * n + n
            assert all_reduce == n + replicated
        else:
            assert (all_gather, reduce_scatter) == (logits, 0)
            assert all_reduce == layers * 4 * n + 2 * n


def _errors_worker(rank, world):
    errors = []
    engine = initialize(tiny_gpt(0), sp_config(2, 1, True))
    x = token_batches(1, 2, seq=30)[0]
    for call in (lambda: engine(x[:, :15], x[:, :15]),
                 lambda: engine(input_ids=x[:, :16], labels=x[:, :16], attention_mask=torch.ones(2, 16))):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    engine.close()
    try:
        cfg = sp_config(2, 1, True)
        cfg["tensor_parallel"]["plan"] = {"wte": "vocab", "blocks.*.attn.c_attn": "colwise_qkv",
                                          "blocks.*.attn.c_proj": "rowwise"}
        initialize(tiny_gpt(0), cfg)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_what_it_cannot_split_is_refused_naming_the_fix(two_ranks):
    errors = two_ranks[("errors",)][0]
    assert "a sequence of 15 tokens does not divide by 2; pad it to a multiple" in errors[0]
    assert "an attention_mask is not supported" in errors[1]
    assert "the user plan does not; use a built-in plan, or turn sequence_parallel off" in errors[2]


@pytest.mark.parametrize("tensor_parallel,extra,message", [
    ({"size": 1, "sequence_parallel": True}, {}, "tensor_parallel.size is 1; set the size to 2 or more"),
    ({"size": 4, "mode": "2d", "sequence_parallel": True}, {}, "is for mode \"1d\""),
    ({"size": 2, "sequence_parallel": True}, {"activation_checkpointing": {"enabled": True,
                                                                          "partition_activations": True}},
     "each rank holds its own part of the sequence already; set it to false"),
])
def test_configs_it_cannot_run_are_refused(tensor_parallel, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": tensor_parallel, **extra})


def _bf16_worker(rank, world):
    return [train_tp("llama", sp_config(2, 1, sp, bf16={"enabled": True}), rank, 2, 1, 1)[0] for sp in (False, True)]


def test_under_bf16_autocast_it_trains_as_tp_without_it(two_ranks):
    """The column layers on the gathered input compute in bf16, as F.linear under autocast does."""
    for without, with_sp in two_ranks[("bf16",)]:
        assert_close_relative(with_sp, without, rtol=1e-2)


# --- every two-rank case above in one spawned group: start-up, not the cases, dominates their time ------------

MODELS = ["gpt", "gpt2", "llama"]
TWO_RANK_CASES = ([("with_and_without", tuple(MODELS), 0, 2, False)]
                  + [("saved", layers, sequence_parallel) for sequence_parallel in (False, True) for layers in (1, 2)]
                  + [("comm", False), ("comm", True), ("bf16",), ("errors",)])  # last: it ends with refusals


def _two_rank_cases_worker(rank, world):
    workers = {"with_and_without": _with_and_without_worker, "saved": _saved_worker, "comm": _comm_worker,
               "bf16": _bf16_worker, "errors": _errors_worker}
    return run_cases(rank, TWO_RANK_CASES, lambda kind, *args: workers[kind](rank, world, *args))


@pytest.fixture(scope="module")
def two_ranks() -> dict[tuple, list]:
    """Each two-rank case's results in rank order, keyed by the case."""
    per_rank = run_distributed(_two_rank_cases_worker, 2, timeout_s=600)
    return results_by_case(per_rank)
