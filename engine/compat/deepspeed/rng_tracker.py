"""deepspeed.checkpointing.get_cuda_rng_tracker and model_parallel_cuda_manual_seed: named random streams, as
Megatron-style code uses them to draw tensor-parallel dropout apart from the data-parallel stream. The streams are
the compute device's generator (CUDA's when present, else the CPU's)."""

from __future__ import annotations

import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states: fork(name) draws from that stream and leaves the default one where it was."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states, self.seeds = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise Exception(f"seed {seed} already exists")  # DeepSpeed's error, type included
        if name in self.states:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds.add(seed)
        original = _get_state()
        _manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise Exception(f"cuda rng state {name} is not added")
        original = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(original)


class _Tracker:
    # one tracker per process, as DeepSpeed's module-level tracker (scripts fetch it with get_cuda_rng_tracker())
    tracker = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    return _Tracker.tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """The default stream seeded with `seed` (the data-parallel seed) and the model-parallel stream with
    seed + 2718 + the tensor-parallel rank (0: Tiers takes no mpu), as DeepSpeed seeds them."""
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718)
