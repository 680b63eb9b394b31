"""bf16 master weights (DeepSpeed's bf16.bf16_master_weights_and_grads / bf16_optimizer_states, Note [bf16 master
weights]) and Tiers' stochastic rounding of them (Note [keyed stochastic rounding]): the update is plain PyTorch's
single-tensor AdamW on the widened bf16 weights, bit for bit in one process; on 2 ranks (ZeRO 1-3, CPU and NVMe
tiers, a checkpoint resumed in one process under another stage) it equals one process at bf16's tolerance."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from engine import initialize
from engine.config import ConfigError, load_config
from engine.optimizers.stochastic_rounding import (
    BLOCK,
    KeyedBits,
    KeySpan,
    parameter_key,
    round_stochastically,
    round_stochastically_into,
)
from engine.optimizers.tiled_adam import Arithmetic, TiledAdam, TiledLayout
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import tiny_gpt, token_batches, train_engine, trained_params
from tests.test_data_parallel import ADAMW
from tests.test_mixed_precision import LOSS_RTOL, WEIGHT_RTOL

STEPS, GLOBAL_BATCH, SEED = 4, 8, 7
# (name, bf16_optimizer_states, stochastic_rounding): DeepSpeed's two layouts, and each rounded stochastically
LAYOUTS = {"bf16 states": (True, False), "bf16 states, rounded": (True, True),
           "fp32 states": (False, False), "fp32 states, rounded": (False, True)}


def torchao_rounding(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """torchao's _fp32_to_bf16_sr (torchao/optim/quant_utils.py), with its random draws given."""
    pattern = values.view(torch.int32)
    truncated = pattern & -65536
    pattern = torch.where(bits < (pattern & 0xFFFF), truncated + 0x10000, truncated)
    return pattern.view(torch.float32).bfloat16()


def test_rounding_is_torchaos_on_the_same_bits_and_keeps_nan():
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(10_000, generator=g) * 10.0 ** torch.randint(-20, 20, (10_000,), generator=g),
                        torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, float("inf"), 1e-45])])
    bits = torch.randint(0, 1 << 16, values.shape, generator=g, dtype=torch.int32)
    assert torch.equal(round_stochastically(values, bits).view(torch.int16),
                       torchao_rounding(values, bits).view(torch.int16))
    assert round_stochastically(torch.tensor([float("nan")]), torch.tensor([65535], dtype=torch.int32)).isnan().all()


@pytest.mark.parametrize("with_nan", [False, True])
def test_rounding_in_place_is_the_same_rounding(with_nan):
    """round_stochastically_into (the optimizer's, in its fp32 scratch tile) gives round_stochastically's bits: on
    values of every magnitude, the largest finite ones (which round up to infinity), and NaNs whose patterns the
    carry would wrap."""
    g = torch.Generator().manual_seed(1)
    values = torch.cat([torch.randn(10_000, generator=g) * 10.0 ** torch.randint(-30, 30, (10_000,), generator=g),
                        torch.tensor([0.0, -0.0, 3.4028235e38, -3.4028235e38, float("inf"), -float("inf"), 1e-40,
                                      -3e-42, 1.1754942e-38])])  # the last three subnormal
    if with_nan:
        nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32).view(torch.float32)
        values = torch.cat([values, nans])
    bits = torch.randint(0, 1 << 16, values.shape, generator=g, dtype=torch.int32)
    expected = round_stochastically(values, bits)
    out = torch.empty(values.shape, dtype=torch.bfloat16)
    round_stochastically_into(out, values.clone(), bits)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert out.isnan().sum() == (4 if with_nan else 0)


@pytest.mark.parametrize("length", [1, 7, 16, 33, 257])
def test_rounding_in_place_finds_a_lone_nan_anywhere(length):
    """The in-place rounding's NaN check sees one NaN at any position (vector lanes and tails alike), beside
    infinities of both signs, and keeps it NaN."""
    nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)  # the carry would wrap it into -0.0
    for at in range(length):
        values = torch.full((length,), 1.5)
        values[0], values[-1] = float("inf"), -float("inf")
        values[at] = nan
        out = torch.empty(length, dtype=torch.bfloat16)
        round_stochastically_into(out, values, torch.zeros(length, dtype=torch.int32))
        assert out[at].isnan() and out.isnan().sum() == 1


def test_rounding_is_unbiased():
    """An update a tenth of bf16's last place moves the weight by that much on average over many keyed draws."""
    keyed, n = KeyedBits(3), 200_000
    value = torch.full((n,), 1.0 + 2.0**-7 / 10)  # between bf16's 1.0 and 1.0078125
    rounded = round_stochastically(value, keyed.bits(1, [KeySpan(0, n, 5, 0)], 0, n, value.device)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(rounded.mean().item() - value[0].item()) < 2.0**-7 * 0.01


def test_bits_depend_on_the_element_only():
    """A parameter's bits are the same however its elements are cut into stepped tensors and tiles, and differ with
    the step, the seed and the parameter."""
    keyed, n, key = KeyedBits(11), 3 * BLOCK + 123, parameter_key("h.0.attn.weight")
    device = torch.device("cpu")
    whole = keyed.bits(4, [KeySpan(0, n, key, 0)], 0, n, device)
    for cut in (1, 777, BLOCK - 5, 2 * BLOCK + 17):  # two shards at `cut`, each 3 elements after other things
        shards = [keyed.bits(4, [KeySpan(3, cut, key, 0)], 0, cut + 3, device)[3:],
                  keyed.bits(4, [KeySpan(3, n - cut, key, cut)], 0, n - cut + 3, device)[3:]]
        assert torch.equal(torch.cat(shards), whole), cut
    tiles = [keyed.bits(4, [KeySpan(0, n, key, 0)], s, min(1000, n - s), device) for s in range(0, n, 1000)]
    assert torch.equal(torch.cat(tiles), whole)
    for other in (keyed.bits(5, [KeySpan(0, n, key, 0)], 0, n, device),
                  KeyedBits(12).bits(4, [KeySpan(0, n, key, 0)], 0, n, device),
                  keyed.bits(4, [KeySpan(0, n, key + 1, 0)], 0, n, device)):
        assert (other != whole).float().mean() > 0.99
    assert keyed.bits(4, [KeySpan(2, 5, key, 0)], 0, 9, device)[[0, 1, 7, 8]].eq(0).all()  # padding


class PlainBf16Masters:
    """The reference: a bf16 model whose weights are their own masters, stepped by plain torch.optim.AdamW (its
    single-tensor arithmetic) on fp32 copies widened from them every step, the moments kept in `state_dtype` (fp32,
    or rounded to bf16 after every step), the weights rounded back to nearest or with the keyed bits."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], state_dtype: torch.dtype, rounded: bool,
                 seed: int = SEED):
        self.named, self.state_dtype = named, state_dtype
        self.keyed = KeyedBits(seed) if rounded else None
        self.wide = [torch.zeros(p.shape, requires_grad=True) for _, p in named]
        self.opt = torch.optim.AdamW(self.wide, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                                     weight_decay=ADAMW["weight_decay"], foreach=False, fused=False)
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        self.steps += 1
        for wide, (_, p), grad in zip(self.wide, self.named, grads):
            wide.copy_(p)
            wide.grad = grad.float()
        self.opt.step()
        for wide, (name, p) in zip(self.wide, self.named):
            for moment in ("exp_avg", "exp_avg_sq"):
                state = self.opt.state[wide][moment]
                state.copy_(state.to(self.state_dtype))
            if self.keyed is None:
                p.copy_(wide)
            else:
                n = p.numel()
                bits = self.keyed.bits(self.steps, [KeySpan(0, n, parameter_key(name), 0)], 0, n, p.device)
                p.copy_(round_stochastically(wide.detach().view(-1), bits).view(p.shape))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_tiled_update_of_a_chunk_is_plain_adamw_bit_for_bit(layout):
    """TiledAdam stepping one flat bf16 tensor laid out like a chunk (padding between parameters, tiles cutting
    through them) equals the plain reference stepping each parameter on its own, bit for bit."""
    bf16_states, rounded = LAYOUTS[layout]
    state_dtype = torch.bfloat16 if bf16_states else torch.float32
    g = torch.Generator().manual_seed(0)
    shapes, names = [(33, 7), (1000,), (5, 5, 5)], ["a.weight", "b.bias", "c.weight"]
    offsets = [0, 240, 1245]  # 9 elements of padding after the first, 5 after the second
    flat = torch.zeros(1400, dtype=torch.bfloat16)
    named = [(n, torch.randn(s, generator=g).bfloat16()) for n, s in zip(names, shapes)]
    for (_, p), offset in zip(named, offsets):
        flat[offset:offset + p.numel()] = p.view(-1)
    spans = [KeySpan(o, p.numel(), parameter_key(n), 0) for (n, p), o in zip(named, offsets)]
    stepped = flat.clone().requires_grad_()
    ours = TiledAdam([stepped], TiledLayout(Arithmetic.TORCH, state_dtype, KeyedBits(SEED) if rounded else None,
                                            {id(stepped): spans}),
                          lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"],
                          tile=100)
    reference = PlainBf16Masters(named, state_dtype, rounded)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).bfloat16() for _, p in named]
        stepped.grad = torch.zeros_like(flat)
        for grad, offset in zip(grads, offsets):
            stepped.grad[offset:offset + grad.numel()] = grad.view(-1)
        ours.step()
        reference.step(grads)
        for (name, p), offset in zip(named, offsets):
            assert torch.equal(stepped.detach()[offset:offset + p.numel()].view(p.shape), p), name
    assert ours.state[stepped]["exp_avg"].dtype == state_dtype
    assert stepped.detach()[231:240].eq(0).all() and stepped.detach()[1240:1245].eq(0).all()


def masters_config(stage: int, layout: str, world: int, offload: str | None = None, path: str = "") -> dict:
    bf16_states, rounded = LAYOUTS[layout]
    zero = {"stage": stage, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0}
    if offload is not None:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": path}
        if stage == 3:
            zero["offload_param"] = {"device": offload, "nvme_path": path}
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": ADAMW}, "seed": SEED, "steps_per_print": 10**6,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": bf16_states,
                     "stochastic_rounding": rounded},
            "zero_optimization": zero}


def reference_run(layout: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    bf16_states, rounded = LAYOUTS[layout]
    model = tiny_gpt().to(torch.bfloat16)
    named = list(model.named_parameters())
    plain = PlainBf16Masters([(n, p.data) for n, p in named], torch.bfloat16 if bf16_states else torch.float32,
                             rounded)
    losses = []
    for x in token_batches(steps, GLOBAL_BATCH):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as the engine runs a bf16 forward
            loss = model(x, x)
        loss.backward()
        plain.step([p.grad for _, p in named])
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in named}


def train(engine, rank: int, world: int, batches: list[torch.Tensor]) -> list[float]:
    """This rank's losses over the global `batches`, one micro-batch per step."""
    return train_engine(engine, batches, rank, world, 1)[0]


@pytest.mark.parametrize("layout,offload", [("bf16 states", None), ("bf16 states, rounded", None),
                                            ("fp32 states", "cpu"), ("fp32 states, rounded", "nvme")])
def test_one_process_is_the_plain_reference_bit_for_bit(layout, offload, tmp_path):
    engine = initialize(tiny_gpt(), masters_config(1, layout, 1, offload, str(tmp_path)))
    assert not engine.chunked.has_masters  # no fp32 copy: the bf16 chunks are stepped
    losses = train(engine, 0, 1, token_batches(STEPS, GLOBAL_BATCH))
    expected_losses, expected = reference_run(layout)
    assert losses == expected_losses
    for name, value in trained_params(engine).items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, expected[name]), name
    engine.close()


# (stage, layout, offload) on 2 ranks; the stage-3 NVMe case saves a checkpoint after step 2
DISTRIBUTED = [(1, "bf16 states, rounded", None), (2, "bf16 states", None), (2, "fp32 states", "cpu"),
               (3, "bf16 states, rounded", None), (3, "fp32 states, rounded", "nvme")]


def masters_case(rank: int, world: int, root: str, stage: int, layout: str, offload: str | None) -> dict:
    path = os.path.join(root, f"swap-{stage}-{offload}-{rank}")
    os.makedirs(path, exist_ok=True)
    engine = initialize(tiny_gpt(seed=rank), masters_config(stage, layout, world, offload, path))
    batches = token_batches(STEPS, GLOBAL_BATCH)
    losses = train(engine, rank, world, batches[:2])
    if offload == "nvme":
        engine.save_checkpoint(os.path.join(root, "checkpoint"))
    losses += train(engine, rank, world, batches[2:])
    result = {"losses": losses, "weights": trained_params(engine)}
    engine.close()
    return result


def masters_worker(rank: int, world: int, root: str) -> dict:
    return run_cases(rank, DISTRIBUTED, lambda *case: masters_case(rank, world, root, *case))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bf16_masters"))
    return root, results_by_case(run_distributed(masters_worker, 2, (root,), timeout_s=240))


def assert_bf16_close(losses: list[float], trained: dict, expected_losses: list[float], expected: dict,
                      lr: float = ADAMW["lr"], outliers: float = 1e-3) -> None:
    """Losses at bf16's tolerance; weights too, but for at most a share `outliers` of them, which may differ by up
    to one Adam step per step either way: without fp32 masters a gradient of a few bf16 ulps (reduced over 2 ranks
    in another order) can change sign, and Adam's normalized step is then about lr either way."""
    for a, e in zip(losses, expected_losses, strict=True):
        assert abs(a - e) <= LOSS_RTOL[torch.bfloat16] * abs(e), (losses, expected_losses)
    every, far = 0, 0
    for name, value in trained.items():
        assert value.dtype == torch.bfloat16, name
        a, e = value.float(), expected[name].float()
        close = torch.isclose(a, e, rtol=WEIGHT_RTOL[torch.bfloat16], atol=1e-3)
        every, far = every + a.numel(), far + int((~close).sum())
        assert (a - e).abs().max() <= 2 * lr * len(losses) + 1e-3, name
    assert far <= every * outliers, f"{far} of {every} weights differ beyond bf16's tolerance"


@pytest.mark.parametrize("case", DISTRIBUTED, ids=lambda c: f"stage{c[0]}-{c[1]}-{c[2]}".replace(" ", ""))
def test_two_ranks_equal_one_process(two_ranks, case):
    """Each rank's losses (its half of the batch) average to the full batch's; the weights are one process's at
    bf16's tolerance (the gradients are reduced in bf16 over 2 ranks, summed in another order)."""
    _, results = two_ranks
    expected_losses, expected = reference_run(case[1])
    losses = [sum(r["losses"][i] for r in results[case]) / 2 for i in range(STEPS)]
    assert_bf16_close(losses, results[case][0]["weights"], expected_losses, expected)
    assert torch.equal(torch.cat([v.view(-1) for v in results[case][0]["weights"].values()]),
                       torch.cat([v.view(-1) for v in results[case][1]["weights"].values()]))


def test_a_two_rank_checkpoint_resumes_in_one_process_under_stage_2(two_ranks, tmp_path):
    """Saved at step 2 by 2 ranks at stage 3 with everything on NVMe, loaded by one process at stage 2 with the
    states on the CPU: the resumed run goes on as the reference does (the keyed bits depend on the element only)."""
    root, _ = two_ranks
    layout = "fp32 states, rounded"
    engine = initialize(tiny_gpt(seed=5), masters_config(2, layout, 1, "cpu"))
    engine.load_checkpoint(os.path.join(root, "checkpoint"))
    losses = train(engine, 0, 1, token_batches(STEPS, GLOBAL_BATCH)[2:])
    expected_losses, expected = reference_run(layout)
    assert_bf16_close(losses, trained_params(engine), expected_losses[2:], expected)
    engine.close()


BASE = {"train_batch_size": 8, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize("bf16,zero,optimizer,key", [
    ({"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, {}, None,
     "bf16.enabled to true"),
    ({"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, {"stage": 0}, None,
     "stage to 1, 2 or 3"),
    ({"enabled": True, "bf16_optimizer_states": True}, {}, None, "bf16_master_weights_and_grads to true"),
    ({"enabled": True, "stochastic_rounding": True}, {}, None, "bf16_master_weights_and_grads to true"),
    ({"enabled": True, "bf16_master_weights_and_grads": True}, {}, None, "offload_optimizer.device to cpu or nvme"),
    ({"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
      "stochastic_rounding": True}, {}, {"type": "SGD", "params": {"lr": 0.1}}, "use Adam, AdamW"),
    ({"enabled": True, "bf16_master_weights_and_grads": True}, {"offload_optimizer": {"device": "cpu"}},
     {"type": "Adam", "params": {"bias_correction": False}}, "bias_correction"),
    ({"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, {},
     {"type": "AdamW", "params": {"bias_correction": False}}, "bias_correction"),
])
def test_deepspeeds_rules_and_tiers_are_named(bf16, zero, optimizer, key):
    cfg = {**BASE, "bf16": bf16, "zero_optimization": {**BASE["zero_optimization"], **zero}}
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    with pytest.raises(ConfigError, match=key):
        load_config(cfg)


def test_other_optimizers_step_bf16_masters_with_bf16_states():
    """SGD with momentum over bf16 masters: torch's own, on the bf16 chunks (DeepSpeed's semantics)."""
    cfg = {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "steps_per_print": 10**6,
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    engine = initialize(model, cfg)
    loss = engine(torch.ones(8, 4)).float().sum()
    engine.backward(loss)
    engine.step()
    states = [t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert states and all(t.dtype == torch.bfloat16 for t in states)
    engine.close()


def test_the_gradient_norm_of_bf16_masters_is_summed_in_fp32():
    """Clipping bf16 masters' gradients: the global norm is fp32's norm of the bf16 gradients (bf16 norms would be
    off by up to 0.4%), clipped into the bf16 gradients before the step."""
    cfg = {**masters_config(2, "bf16 states", 1), "gradient_clipping": 0.5}
    engine = initialize(tiny_gpt(), cfg)
    model = tiny_gpt().to(torch.bfloat16)
    x = token_batches(1, GLOBAL_BATCH)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x).backward()
    expected = torch.stack([p.grad.float().norm() for p in model.parameters()]).norm().item()
    train(engine, 0, 1, [x])
    assert abs(engine.get_global_grad_norm() - expected) <= 1e-5 * expected
    engine.close()
