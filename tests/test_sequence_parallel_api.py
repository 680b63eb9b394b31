"""Sequence parallelism as users meet it (Note [sequence parallelism]): activation memory per rank falls as 1/S,
"auto" picks and says its mode, and inputs or models it cannot split are refused naming the fix."""

from __future__ import annotations

import contextlib
import io

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
def test_saved_activation_bytes_per_rank_fall_as_one_over_s(two_ranks, mode):
    whole = _saved_worker(0, 1, mode)  # one process, no sequence parallelism: config(1) whatever the mode
    for rank, peak in enumerate(two_ranks[("saved", mode)]):
        assert 0.45 * whole <= peak <= 0.55 * whole, (mode, rank, peak, whole)


def _auto_worker(rank, world, heads):
    """The chosen mode and what initialize printed (it says its choice on stdout)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine = initialize(tiny_gpt(0, n_head=heads, n_embd=48), config(2))
    return engine.sequence.mode, printed.getvalue()


def test_auto_picks_ulysses_when_heads_divide_and_ring_when_they_do_not(two_ranks):
    assert [mode for mode, _ in two_ranks[("auto", 2)]] == ["ulysses", "ulysses"]
    assert [mode for mode, _ in two_ranks[("auto", 3)]] == ["ring", "ring"]
    printed = "".join(out for _, out in two_ranks[("auto", 3)])
    assert "sequence_parallel.mode auto: ring over 2 ranks" in printed, printed


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


def test_inputs_it_cannot_split_are_refused_naming_the_fix(two_ranks):
    errors = two_ranks[("errors",)][0]
    assert "a sequence of 15 tokens does not divide by 2; pad it to a multiple" in errors[0]
    assert "an attention_mask cannot be split" in errors[1]


def _bytes_worker(rank, world, mode):
    engine = initialize(tiny_gpt(0, block_size=SEQ), config(world, mode))
    x = token_batches(1, 2, seq=SEQ)[0]
    before = (engine.comm.all_to_all_bytes, engine.comm.p2p_bytes)
    engine.backward(engine(x, x))
    return engine.comm.all_to_all_bytes - before[0], engine.comm.p2p_bytes - before[1]


@pytest.mark.parametrize("mode,world", [("ulysses", 2), ("ring", 2), ("ring", 4)])
def test_attention_bytes_per_step_equal_the_formulas(two_ranks, mode, world):
    """Per attention layer, this rank's q, k, v, out are [B, H, T/S, D] fp32 (n bytes each). Ulysses: four
    all-to-alls forward (q, k, v, out) and four backward: 8n. Ring: forward sends k, v and the positions S-1 times;
    backward sends k, v, positions, dK, dV S-1 times and dK, dV once more: (S-1)(2n + p) + (S-1)(4n + p) + 2n."""
    layers, b, t = 2, 2, SEQ // world  # the tiny GPT: 2 blocks, 64 wide, 2 heads
    n = b * 64 * t * 4
    positions = t * 8
    expected = {"ulysses": (layers * 8 * n, 0),
                "ring": (0, layers * ((world - 1) * (2 * n + positions) + (world - 1) * (4 * n + positions) + 2 * n))}
    per_rank = two_ranks[("bytes", mode)] if world == 2 else run_distributed(_bytes_worker, world, args=(mode,),
                                                                                 timeout_s=60)
    for rank, got in enumerate(per_rank):
        assert got == expected[mode], (mode, world, rank)


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


def test_a_model_without_position_ids_is_refused(two_ranks):
    message = two_ranks[("no_positions",)][0]
    assert "NoPositions.forward takes no position_ids; add a position_ids argument" in message


_TWO_RANK_CASES = {("saved", "ulysses"): (_saved_worker, "ulysses"), ("saved", "ring"): (_saved_worker, "ring"),
                   ("auto", 2): (_auto_worker, 2), ("auto", 3): (_auto_worker, 3), ("errors",): (_errors_worker,),
                   ("bytes", "ulysses"): (_bytes_worker, "ulysses"), ("bytes", "ring"): (_bytes_worker, "ring"),
                   ("no_positions",): (_no_positions_worker,)}


def _two_rank_cases_worker(rank, world, names):
    """Every two-rank case in one spawned group (a spawn costs seconds): one result per case, in order."""
    results = []
    for name in names:
        worker, *args = _TWO_RANK_CASES[name]
        try:
            results.append(worker(rank, world, *args))
        except Exception as e:
            raise RuntimeError(f"case {name} failed on rank {rank}") from e
    return results


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """{case name: [rank 0's result, rank 1's result]} for every case of _TWO_RANK_CASES."""
    names = list(_TWO_RANK_CASES)
    per_rank = run_distributed(_two_rank_cases_worker, 2, args=(names,), timeout_s=180)
    return {name: [results[i] for results in per_rank] for i, name in enumerate(names)}
