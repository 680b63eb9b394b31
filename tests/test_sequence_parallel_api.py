"""Sequence parallelism as users meet it (Note [sequence parallelism]): activation memory per rank falls as 1/S,
"auto" picks and says its mode, and inputs or models it cannot split are refused naming the fix."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from tests.distributed import run_distributed
from tests.reference import tiny_gpt, token_batches
from tests.saved_bytes import SavedBytes
from tests.test_data_parallel import ADAMW

SEQ = 128


def config(sp: int, mode: str = "auto") -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": ADAMW},
            "steps_per_print": 10**6, "sequence_parallel": {"size": sp, "mode": mode}}


def _saved_worker(rank, world, mode):
    engine = initialize(tiny_gpt(0, block_size=SEQ), config(world, mode) if world > 1 else config(1))
    x = token_batches(1, 2, seq=SEQ)[0]
    saved = SavedBytes(engine.module.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, SavedBytes.unpack):
        loss = engine(x, x)
    engine.backward(loss)
    return saved.peak


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_saved_activation_bytes_per_rank_fall_as_one_over_s(mode):
    whole = run_distributed(_saved_worker, 1, args=(mode,), timeout_s=60)[0]
    halves = run_distributed(_saved_worker, 2, args=(mode,), timeout_s=60)
    for peak in halves:
        assert 0.45 * whole <= peak <= 0.55 * whole, (peak, whole)


def _auto_worker(rank, world, heads):
    engine = initialize(tiny_gpt(0, n_head=heads, n_embd=48), config(2))
    return engine.sequence.mode


def test_auto_picks_ulysses_when_heads_divide_and_ring_when_they_do_not(capfd):
    assert run_distributed(_auto_worker, 2, args=(2,), timeout_s=60) == ["ulysses", "ulysses"]
    assert run_distributed(_auto_worker, 2, args=(3,), timeout_s=60) == ["ring", "ring"]
    assert "sequence_parallel.mode auto: ring over 2 ranks" in capfd.readouterr().out


def _errors_worker(rank, world):
    errors = []
    engine = initialize(tiny_gpt(0), config(2, "ulysses"))
    x = token_batches(1, 2, seq=30)[0]
    for call in (lambda: engine(x[:, :15], x[:, :15]),
                 lambda: engine(input_ids=x[:, :16], labels=x[:, :16], attention_mask=torch.ones(2, 16))):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_inputs_it_cannot_split_are_refused_naming_the_fix():
    errors = run_distributed(_errors_worker, 2, timeout_s=60)[0]
    assert "a sequence of 15 tokens does not divide by 2; pad it to a multiple" in errors[0]
    assert "an attention_mask cannot be split" in errors[1]


def _bytes_worker(rank, world, mode):
    engine = initialize(tiny_gpt(0, block_size=SEQ), config(world, mode))
    x = token_batches(1, 2, seq=SEQ)[0]
    before = (engine.comm.all_to_all_bytes, engine.comm.p2p_bytes)
    engine.backward(engine(x, x))
    return engine.comm.all_to_all_bytes - before[0], engine.comm.p2p_bytes - before[1]


@pytest.mark.parametrize("mode,world", [("ulysses", 2), ("ring", 2), ("ring", 4)])
def test_attention_bytes_per_step_equal_the_formulas(mode, world):
    """Per attention layer, this rank's q, k, v, out are [B, H, T/S, D] fp32 (n bytes each). Ulysses: four
    all-to-alls forward (q, k, v, out) and four backward: 8n. Ring: forward sends k, v and the positions S-1 times;
    backward sends k, v, positions, dK, dV S-1 times and dK, dV once more: (S-1)(2n + p) + (S-1)(4n + p) + 2n."""
    layers, b, t = 2, 2, SEQ // world  # the tiny GPT: 2 blocks, 64 wide, 2 heads
    n = b * 64 * t * 4
    positions = t * 8
    expected = {"ulysses": (layers * 8 * n, 0),
                "ring": (0, layers * ((world - 1) * (2 * n + positions) + (world - 1) * (4 * n + positions) + 2 * n))}
    for got in run_distributed(_bytes_worker, world, args=(mode,), timeout_s=60):
        assert got == expected[mode]


class NoPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    def forward(self, x):
        return self.layers[0](x).sum()


def _no_positions_worker(rank, world):
    try:
        initialize(NoPositions(), config(2, "ring"))
    except ValueError as e:
        return str(e)
    return ""


def test_a_model_without_position_ids_is_refused():
    message = run_distributed(_no_positions_worker, 2, timeout_s=60)[0]
    assert "NoPositions.forward takes no position_ids; add a position_ids argument" in message
