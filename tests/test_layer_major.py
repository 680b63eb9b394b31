"""Note [layer-major accumulation]: train_batch under offload_param.layer_major reads each parameter chunk once in
forward and once in backward per step, and trains as the per-micro-batch run does."""

from __future__ import annotations

import os

import pytest
import torch

from engine import initialize
from engine.config_schema import ConfigError
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, tiny_gpt, token_batches, trained_params

MICRO_BATCHES = 8
STEPS = 3
SGD = {"type": "SGD", "params": {"lr": 0.1}}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}
FIRST_STEP_READS = [4.0]  # the first step also checks the cut: one micro-batch whole and block by block, no grad


def layer_major_config(layer_major: bool, device: str, path: str, optimizer: dict = SGD, world: int = 1,
                       **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO_BATCHES,
            "optimizer": optimizer,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "chunk_size": 20_000,
                                  "offload_param": {"device": device, "nvme_path": path, "layer_major": layer_major},
                                  "offload_optimizer": {"device": device, "nvme_path": path}},
            **extra}


def hf_gpt2(seed: int = 0):
    """GPT-2 from a config: dict micro-batches, and output embeddings tied to the input ones."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def chunk_bytes(engine) -> int:
    """The bytes of the chunks that are gathered around their use (every chunk but the persistent ones)."""
    shards = engine.chunked.sharded_params
    return sum(shards.states[i].param_chunk.nbytes for i in shards.transient)


def train_steps(engine, layer_major: bool, rank: int = 0, world: int = 1) -> dict:
    """STEPS steps over the same data either way: train_batch (layer-major), or the per-micro-batch calls. Returns
    the step losses (this rank's), the parameter bytes read per step ÷ the chunks' bytes, and the trained weights."""
    losses, reads = [], []
    for batch in token_batches(STEPS, 2 * MICRO_BATCHES * world):
        mine = batch.chunk(world)[rank]
        micro = [{"input_ids": x, "labels": x} for x in mine.chunk(MICRO_BATCHES)]
        before = engine.chunked.sharded_params.gathered_bytes
        if layer_major:
            losses.append(engine.train_batch(iter(micro)))
        else:
            step = []
            for mb in micro:
                out = engine(**mb)
                loss = out if torch.is_tensor(out) else out.loss
                engine.backward(loss)
                engine.step()
                step.append(loss.item())
            losses.append(sum(step) / len(step))
        reads.append((engine.chunked.sharded_params.gathered_bytes - before) / chunk_bytes(engine))
    return {"losses": losses, "reads": reads, "weights": trained_params(engine)}


def run(model_fn, layer_major: bool, device: str, path: str, optimizer: dict = SGD, **extra) -> dict:
    os.makedirs(path, exist_ok=True)
    engine = initialize(model_fn(), layer_major_config(layer_major, device, path, optimizer, **extra))
    try:
        return train_steps(engine, layer_major)
    finally:
        engine.close()


def hf_llama(seed: int = 0):
    """Llama from a config: rotary positions and the causal mask computed in the model's forward, around its blocks."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


CASES = {  # name: (model, offload device, optimizer, extra config)
    "tiny-cpu-sgd": (tiny_gpt, "cpu", SGD, {}),
    "tiny-nvme-adamw-checkpointing": (tiny_gpt, "nvme", ADAMW, {"activation_checkpointing": {"enabled": True}}),
    "hf-gpt2-nvme-sgd": (hf_gpt2, "nvme", SGD, {}),
    "hf-llama-cpu-sgd": (hf_llama, "cpu", SGD, {}),
    "tiny-cpu-bf16": (tiny_gpt, "cpu", ADAMW, {"bf16": {"enabled": True}}),
}
BF16_LOSS_RTOL = 1e-3  # the bf16 gradients are summed in bf16 in another order


@pytest.mark.parametrize("name", CASES)
def test_one_process_equals_the_per_micro_batch_run_with_two_reads_per_step(name, tmp_path):
    """At 8 micro-batches the per-micro-batch run reads every chunk 16 times a step, layer-major twice; the losses
    are equal at fp32 1e-5, and so are the weights the gradients alone decide (SGD; Adam's normalized step turns
    the rounding of a gradient that is zero in exact arithmetic, a key bias's, into a step of up to lr)."""
    model_fn, device, optimizer, extra = CASES[name]
    reference = run(model_fn, False, device, str(tmp_path / "a"), optimizer, **extra)
    layered = run(model_fn, True, device, str(tmp_path / "b"), optimizer, **extra)
    assert reference["reads"] == [2.0 * MICRO_BATCHES] * STEPS
    assert layered["reads"] == FIRST_STEP_READS + [2.0] * (STEPS - 1)
    assert_close_relative(layered["losses"], reference["losses"], BF16_LOSS_RTOL if "bf16" in extra else 1e-5)
    if optimizer is SGD:
        assert_params_close(layered["weights"], reference["weights"])


def test_frozen_blocks_are_read_twice_per_step_too(tmp_path):
    """A frozen block's chunks (a fine-tune's base) are released after the last micro-batch's backward over them."""
    def half_frozen():
        model = tiny_gpt()
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(("blocks.0.", "wpe")))
        return model

    reference = run(half_frozen, False, "cpu", str(tmp_path / "a"))
    layered = run(half_frozen, True, "cpu", str(tmp_path / "b"))
    assert layered["reads"] == FIRST_STEP_READS + [2.0] * (STEPS - 1)
    assert_close_relative(layered["losses"], reference["losses"])
    assert_params_close(layered["weights"], reference["weights"])


def two_rank_case(rank: int, world: int, root: str, layer_major: bool) -> dict:
    path = os.path.join(root, f"swap-{layer_major}-{rank}")
    os.makedirs(path, exist_ok=True)
    engine = initialize(tiny_gpt(seed=rank), layer_major_config(layer_major, "nvme", path, world=world))
    try:
        return train_steps(engine, layer_major, rank, world)
    finally:
        engine.close()


def two_rank_worker(rank: int, world: int, root: str) -> dict:
    return run_cases(rank, [(False,), (True,)], lambda layer_major: two_rank_case(rank, world, root, layer_major))


def test_two_ranks_reduce_each_chunk_once_and_equal_the_per_micro_batch_run(tmp_path):
    results = results_by_case(run_distributed(two_rank_worker, 2, (str(tmp_path),), timeout_s=180))
    reference, layered = results[(False,)], results[(True,)]
    # train_batch returns the step's loss averaged over the data-parallel ranks
    mean = [(a + b) / 2 for a, b in zip(reference[0]["losses"], reference[1]["losses"])]
    for rank in range(2):
        assert layered[rank]["reads"] == FIRST_STEP_READS + [2.0] * (STEPS - 1)
        assert_close_relative(layered[rank]["losses"], mean)
        assert_params_close(layered[rank]["weights"], reference[rank]["weights"])


def test_training_outside_train_batch_is_refused_and_forwards_without_gradients_run(tmp_path):
    """A backward over any other forward would reach the gradient chunks unscaled and join the next step's."""
    model = tiny_gpt()
    engine = initialize(model, layer_major_config(True, "cpu", str(tmp_path)))
    x = token_batches(1, 2)[0]
    try:
        for mode in (engine.train, engine.eval):
            mode()
            with pytest.raises(RuntimeError, match="trains only inside engine.train_batch"):
                engine(x, x)
            with pytest.raises(RuntimeError, match="trains only inside engine.train_batch"):
                engine.module(x, x)  # the model itself, past the engine
        with pytest.raises(RuntimeError, match="trains only inside engine.train_batch"):
            engine.step()
        with torch.no_grad():
            eval_loss = engine(x, x).item()
        micro = iter([{"input_ids": x, "labels": x}] * MICRO_BATCHES)
        assert engine.eval_batch(micro) == pytest.approx(eval_loss, rel=1e-6)
    finally:
        engine.close()
    assert not model._forward_pre_hooks  # closed: the guard is gone with the engine


class BetweenBlocks(torch.nn.Module):
    """Scales the hidden state after every block, in its own forward's loop: a block-by-block run skips that."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, labels):
        h = self.embed(x)
        for block in self.blocks:
            h = 2.0 * block(h)
        return torch.nn.functional.mse_loss(h.sum(-1), labels.float())


def test_a_model_whose_blocks_take_more_than_the_hidden_state_is_refused_before_it_trains(tmp_path):
    engine = initialize(BetweenBlocks(), layer_major_config(True, "cpu", str(tmp_path)))
    x = torch.randint(0, 16, (2, 4))
    try:
        with pytest.raises(RuntimeError, match="block by block is .* through the whole model"):
            engine.train_batch(iter([{"x": x, "labels": x}] * MICRO_BATCHES))
        assert engine.global_step == 0
    finally:
        engine.close()


@pytest.mark.parametrize("change, words", [
    ({"zero_optimization": {"stage": 2}}, "ZeRO stage 3"),
    ({"offload": "none"}, "offload_param.device"),
    ({"tensor_parallel": {"size": 2}}, "tensor parallelism"),
    ({"pipeline": {"stages": 2}}, "pipeline parallelism"),
])
def test_configs_it_cannot_run_are_refused_by_name(change, words, tmp_path):
    cfg = layer_major_config(True, "cpu", str(tmp_path))
    if change.get("offload") == "none":
        cfg["zero_optimization"]["offload_param"]["device"] = "none"
        cfg["zero_optimization"]["offload_optimizer"]["device"] = "none"
    elif "zero_optimization" in change:
        cfg["zero_optimization"].update(change["zero_optimization"])
        del cfg["zero_optimization"]["offload_param"]["device"]
    else:
        cfg.update(change)
    with pytest.raises(ConfigError, match="layer_major") as error:
        initialize(tiny_gpt(), cfg)
    assert words in str(error.value)


def test_a_model_without_a_block_list_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="layer_major: Sequential has no nn.ModuleList"):
        initialize(model, layer_major_config(True, "cpu", str(tmp_path)))


def test_a_step_whose_forward_fails_holds_nothing_and_the_next_one_trains(tmp_path):
    engine = initialize(tiny_gpt(), layer_major_config(True, "cpu", str(tmp_path)))
    x = token_batches(1, 2 * MICRO_BATCHES)[0]
    good = [{"input_ids": m, "labels": m} for m in x.chunk(MICRO_BATCHES)]
    too_long = torch.zeros(2, 40, dtype=torch.long)  # past the tiny GPT's 32 positions
    try:
        with pytest.raises(ValueError, match="exceeds block_size"):
            engine.train_batch(iter(good[:3] + [{"input_ids": too_long, "labels": too_long}] + good[4:]))
        shards = engine.chunked.sharded_params
        assert all(shards.states[c].held == 0 and shards.is_released(c) for c in shards.transient)
        before = shards.gathered_bytes
        engine.train_batch(iter(good))
        assert (shards.gathered_bytes - before) / chunk_bytes(engine) == 2.0
    finally:
        engine.close()
