"""Block-wise 8- and 4-bit Adam states (optimizer.type AdamW8bit / AdamW4bit, Note [block-wise optimizer states]):
one process is torchao's arithmetic on each whole parameter bit for bit (torchao's own compiled optimizer within
its last-bit rounding); 2 ranks under ZeRO 1-3 with the states in memory, on the CPU and on NVMe equal one process;
a checkpoint saved by 2 ranks at stage 3 on NVMe resumes in one process at stage 1."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from engine import initialize
from engine.config import ConfigError, load_config
from engine.optimizers.stochastic_rounding import KeyedBits, KeySpan, parameter_key, round_stochastically
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import FP32_RTOL, tiny_gpt, token_batches, trained_params
from tests.test_bf16_masters import assert_bf16_close, train

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.adam import single_param_adam  # noqa: E402
from torchao.optim.subclass_4bit import OptimState4bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

STEPS, GLOBAL_BATCH, SEED = 4, 8, 5
LR, WEIGHT_DECAY = 2e-3, 0.01
BLOCKS = {8: 256, 4: 128}


class TorchaoReference:
    """torchao's AdamW8bit / AdamW4bit as its step makes it, eagerly: each parameter's moments quantized block-wise
    when it has >= 4096 elements in whole blocks (else plain, in `plain_dtype`), `single_param_adam` on it; bf16
    weights rounded to nearest, or stochastically with the keyed bits."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], bits: int, plain_dtype: torch.dtype,
                 rounded: bool = False):
        self.named, self.keyed, self.steps = named, KeyedBits(SEED) if rounded else None, 0
        block, cls = BLOCKS[bits], OptimState8bit if bits == 8 else OptimState4bit
        self.moments = [tuple(cls.zeros(p.shape, signed, block, p.device) if p.numel() >= 4096 and
                              p.numel() % block == 0 else torch.zeros(p.shape, dtype=plain_dtype)
                              for signed in (True, False)) for _, p in named]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        self.steps += 1
        step, lr = torch.tensor(float(self.steps)), torch.tensor(LR)
        for (name, p), grad, (m, v) in zip(self.named, grads, self.moments):
            wide = p.float() if p.dtype != torch.float32 else p
            single_param_adam(wide, grad, step, m, v, None, lr, 0.9, 0.999, WEIGHT_DECAY, 1e-8, True, False)
            if wide is p:
                continue
            if self.keyed is None:
                p.copy_(wide)
            else:
                n = p.numel()
                bits = self.keyed.bits(self.steps, [KeySpan(0, n, parameter_key(name), 0)], 0, n, p.device)
                p.copy_(round_stochastically(wide.view(-1), bits).view(p.shape))


# name -> (bits, dtype, bf16 section additions): fp32 training; bf16 with fp32 masters; bf16 masters rounded
# stochastically
LAYOUTS = {"8-bit fp32": (8, torch.float32, None), "4-bit fp32": (4, torch.float32, None),
           "8-bit bf16": (8, torch.bfloat16, {}),
           "8-bit bf16 masters, rounded": (8, torch.bfloat16, {"bf16_master_weights_and_grads": True,
                                                              "bf16_optimizer_states": True,
                                                              "stochastic_rounding": True})}


def lowbit_config(layout: str, stage: int, world: int, offload: str | None = None, path: str = "") -> dict:
    bits, dtype, masters = LAYOUTS[layout]
    zero = {"stage": stage, "chunk_size": 60_000, "stage3_param_persistence_threshold": 0}
    if offload is not None:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": path}
        if stage == 3:
            zero["offload_param"] = {"device": offload, "nvme_path": path}
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1, "seed": SEED,
           "optimizer": {"type": f"AdamW{bits}bit", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
           "steps_per_print": 10**6, "zero_optimization": zero}
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True, **(masters or {})}
    return cfg


def reference_run(layout: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: the model in the layout's dtype (bf16 with fp32 masters: the masters are stepped); returns the
    losses and the stepped weights."""
    bits, dtype, masters = LAYOUTS[layout]
    model = tiny_gpt().to(dtype)
    named = list(model.named_parameters())
    if dtype == torch.bfloat16 and not masters:  # fp32 masters, rounded to bf16 after each step
        stepped = [(n, p.detach().float().clone()) for n, p in named]
    else:
        stepped = [(n, p.data) for n, p in named]
    reference = TorchaoReference(stepped, bits, torch.bfloat16 if masters else torch.float32,
                                 rounded=bool(masters and masters.get("stochastic_rounding")))
    losses = []
    for x in token_batches(STEPS, GLOBAL_BATCH):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x, x)
        loss.backward()
        reference.step([p.grad.float() if s is not p.data else p.grad for (_, p), (_, s) in zip(named, stepped)])
        with torch.no_grad():
            for (_, p), (_, s) in zip(named, stepped):
                if s is not p.data:
                    p.copy_(s)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: s.detach().clone() for n, s in stepped}  # (fp32 masters: what full_state_dict gives)


@pytest.mark.parametrize("layout,stage", [("8-bit fp32", 0), ("4-bit fp32", 1), ("8-bit bf16", 2),
                                          ("8-bit bf16 masters, rounded", 1)])
def test_one_process_is_torchaos_arithmetic_bit_for_bit(layout, stage):
    engine = initialize(tiny_gpt(), lowbit_config(layout, stage, 1))
    assert any(g.blockwise for g in engine.chunked.groups) and not all(g.blockwise for g in engine.chunked.groups)
    losses = train(engine, 0, 1, token_batches(STEPS, GLOBAL_BATCH))
    expected_losses, expected = reference_run(layout)
    assert losses == expected_losses
    for name, value in trained_params(engine).items():
        assert torch.equal(value, expected[name]), name
    engine.close()


def test_torchaos_compiled_optimizer_agrees_within_its_last_bit():
    """torchao's AdamW8bit itself (its step compiled per shape) on a 64 x 64 linear layer: the same weights and
    moments to fp32's last bits (the compiled kernel rounds a few values differently from the eager ops)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    ours = initialize(nn.Linear(64, 64), {
        "train_batch_size": 4, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW8bit", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}})
    with torch.no_grad():
        for mine, theirs in zip(ours.module.parameters(), model.parameters()):
            mine.copy_(theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = torchao_optim.AdamW8bit(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        for step in range(3):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            loss = ours(x).square().mean()
            ours.backward(loss)
            ours.step()
    for mine, theirs in zip(ours.module.parameters(), model.parameters()):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=FP32_RTOL, atol=1e-6)
    ours.close()


# (layout, stage, offload) on 2 ranks; the stage-3 NVMe case saves a checkpoint after step 2
DISTRIBUTED = [("8-bit fp32", 1, None), ("4-bit fp32", 2, "cpu"), ("8-bit fp32", 3, "nvme"),
               ("8-bit bf16 masters, rounded", 3, "cpu")]


def lowbit_case(rank: int, world: int, root: str, layout: str, stage: int, offload: str | None) -> dict:
    path = os.path.join(root, f"swap-{stage}-{offload}-{rank}")
    os.makedirs(path, exist_ok=True)
    engine = initialize(tiny_gpt(seed=rank), lowbit_config(layout, stage, world, offload, path))
    batches = token_batches(STEPS, GLOBAL_BATCH)
    losses = train(engine, rank, world, batches[:2])
    if offload == "nvme":
        engine.save_checkpoint(os.path.join(root, "checkpoint"))
    losses += train(engine, rank, world, batches[2:])
    manager = getattr(engine.optimizer, "manager", None)
    result = {"losses": losses, "weights": trained_params(engine),
              "optim_bytes": sum(manager.chunk(c).nbytes for c in manager.chunks_of("optim")) if manager else None}
    engine.close()
    return result


def lowbit_worker(rank: int, world: int, root: str) -> dict:
    return run_cases(rank, DISTRIBUTED, lambda *case: lowbit_case(rank, world, root, *case))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lowbit"))
    return root, results_by_case(run_distributed(lowbit_worker, 2, (root,), timeout_s=240))


def assert_close_to(losses: list[float], trained: dict, expected_losses: list[float], expected: dict,
                    rtol: float) -> None:
    for a, e in zip(losses, expected_losses, strict=True):
        assert abs(a - e) <= rtol * abs(e), (losses, expected_losses)
    for name, value in trained.items():
        torch.testing.assert_close(value.float(), expected[name].float(), rtol=rtol, atol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", DISTRIBUTED, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}".replace(" ", ""))
def test_two_ranks_equal_one_process(two_ranks, case):
    """Every rank's shard is whole blocks of the same parameters, so the states are quantized as in one process;
    the 2-rank gradients differ in their last bits (reduced in another order), which the quantization can carry
    to a code's neighbour: fp32 layouts within 1e-4; bf16 masters as test_bf16_masters holds them, with up to
    0.3% of the weights (a code's neighbour moves a whole block's moments a little) a step or so apart."""
    _, results = two_ranks
    layout = case[0]
    expected_losses, expected = reference_run(layout)
    losses = [sum(r["losses"][i] for r in results[case]) / 2 for i in range(STEPS)]
    if LAYOUTS[layout][1] == torch.bfloat16:
        assert_bf16_close(losses, results[case][0]["weights"], expected_losses, expected, lr=LR, outliers=3e-3)
    else:
        assert_close_to(losses, results[case][0]["weights"], expected_losses, expected, 1e-4)
    assert all(torch.equal(results[case][0]["weights"][n], results[case][1]["weights"][n]) for n in expected)


def test_offloaded_states_hold_their_bytes(two_ranks):
    """On NVMe the 8-bit states of a rank's shards take 2 x (1 + 4 / 256) bytes per element of the quantized
    chunks plus 8 of the plain ones (fp32), as the estimate counts them."""
    _, results = two_ranks
    held = results[("8-bit fp32", 3, "nvme")][0]["optim_bytes"]
    engine = initialize(tiny_gpt(), lowbit_config("8-bit fp32", 3, 1))  # one rank: the same chunk members
    chunks = [(g.blockwise, s.param_chunk.numel) for g in engine.chunked.groups for s in g.states]
    engine.close()
    rounded = [(blockwise, -(-n // (2 * 256)) * 256 if blockwise else -(-n // 2)) for blockwise, n in chunks]
    assert held == sum(n * (2 * (1 + 4 / 256) if blockwise else 8) for blockwise, n in rounded)


def test_a_two_rank_checkpoint_resumes_in_one_process_at_stage_1(two_ranks):
    root, results = two_ranks
    engine = initialize(tiny_gpt(seed=9), lowbit_config("8-bit fp32", 1, 1))
    engine.load_checkpoint(os.path.join(root, "checkpoint"))
    losses = train(engine, 0, 1, token_batches(STEPS, GLOBAL_BATCH)[2:])
    saved = results[("8-bit fp32", 3, "nvme")]
    continued = [sum(r["losses"][i] for r in saved) / 2 for i in range(2, STEPS)]
    assert_close_to(losses, trained_params(engine), continued, saved[0]["weights"], 1e-4)
    engine.close()


@pytest.mark.parametrize("change,key", [
    ({"tensor_parallel": {"size": 2}}, "tensor-parallel"),
    ({"pipeline": {"stages": 2}}, "pipeline"),
    ({"optimizer": {"type": "AdamW8bit", "params": {"block_size": 100}}}, "block_size"),
    ({"optimizer": {"type": "AdamW4bit", "params": {"amsgrad": True}}}, "amsgrad"),
])
def test_what_is_not_built_is_named(change, key):
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW8bit"}, **change}
    with pytest.raises(ConfigError, match=key):
        load_config(cfg)


def test_quantized_parameters_pack_into_whole_blocks_of_every_shard():
    """A parameter of 17 blocks beside others: the quantized ones share chunks sized to whole blocks per shard (at
    4 shards), each starting on a block; the others (too small, or not whole blocks) are packed apart."""
    from engine.optimizers.blockwise_states import BlockwiseStates
    from engine.zero.chunk_layout import ChunkLayout
    from engine.zero.chunked_params import ChunkedParams

    sizes = [17 * 256, 100, 8192, 4096 + 8, 4096]
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    layout = ChunkLayout(40_000, shard_count=4, state_blocks=BlockwiseStates(8, 256))
    chunked = ChunkedParams([{"params": params}], layout, torch.device("cpu"))
    quantized = {id(p) for g in chunked.groups if g.blockwise for p in g.params}
    assert quantized == {id(params[0]), id(params[2]), id(params[4])}
    for group in chunked.groups:
        for state in group.states:
            assert state.param_chunk.numel % (4 * (256 if group.blockwise else 1)) == 0
            if group.blockwise:
                assert all(slot.offset % 256 == 0 for slot in state.slots)


def test_deepspeeds_state_getter_dequantizes_block_wise_moments():
    """deepspeed.utils.safe_get_full_optimizer_state gives a quantized moment as fp32: torchao's dequantization of
    the codes and scales the engine keeps."""
    from engine.compat import deepspeed

    engine, *_ = deepspeed.initialize(model=tiny_gpt(), config=lowbit_config("8-bit fp32", 1, 1))
    train(engine, 0, 1, token_batches(1, GLOBAL_BATCH))
    wte = engine.module.wte.weight
    state = engine.optimizer.state[engine.chunked.states[engine.chunked.chunk_index()[id(wte)]].stepped]
    slot = engine.chunked.chunk_members(engine.chunked.chunk_index()[id(wte)])
    offset = next(s.offset for p, s in slot if p is wte)
    moment, _ = engine.optimizer.layout.blockwise.moments(state, offset, wte.numel())
    exp_avg = deepspeed.utils.safe_get_full_optimizer_state(wte, "exp_avg")
    assert state["exp_avg.codes"].dtype == torch.uint8 and exp_avg.abs().sum() > 0
    assert torch.equal(exp_avg, moment.dequantize().view(wte.shape))
    engine.close()


def test_the_compiled_update_pads_its_last_tile_and_agrees_with_the_eager_one():
    """optimizer.params.compile: the update compiled for one tile shape (8-bit: the fused kernel, Note [fused 8-bit
    update]), the last tile padded with zero blocks; it agrees with the eager update to fp32's last bits (inductor
    rounds a few values differently)."""
    from engine.optimizers.blockwise_states import BlockwiseStates
    from engine.optimizers.tiled_adam import Arithmetic, TiledAdam, TiledLayout

    g = torch.Generator().manual_seed(0)
    start = torch.randn(10 * 256, generator=g)  # 10 blocks: tiles of 4, 4 and 2 (+ 2 of padding) blocks
    runs = {}
    for compiled in (False, True):
        weights = start.clone().requires_grad_()
        layout = TiledLayout(Arithmetic.TORCHAO, torch.float32, blockwise=BlockwiseStates(8, 256),
                             quantized=frozenset({id(weights)}))
        optimizer = TiledAdam([weights], layout, lr=LR, weight_decay=WEIGHT_DECAY, tile=1024, compiled=compiled)
        for step in range(3):
            weights.grad = torch.randn(start.shape, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        runs[compiled] = (weights.detach(), optimizer.state[weights]["exp_avg.scale"].view(torch.float32))
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=FP32_RTOL, atol=1e-7)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=FP32_RTOL, atol=0)
