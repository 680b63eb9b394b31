"""Random streams for dropout under tensor parallelism.

Note [tensor-parallel RNG]
Dropout on an activation every tp rank holds whole (replicated) must draw the same mask on every
rank, or the replicas drift apart; dropout on an activation split over the ranks (attention heads,
each rank's own) must draw different masks, or every rank's slice gets the same pattern. So:
- the default stream (torch's global generator) is made the same on the ranks of a tp group at
  initialize (tp rank 0's state is broadcast), and advances identically as they run the same
  replicated code;
- a second, per-rank stream, seeded with seed + 2718 + tp_rank (as Megatron seeds its
  model-parallel stream), is swapped in while a module the plan marks "sharded" runs, and a module
  inside it marked "replicated" swaps the default stream back for its own forward.
Swapping is a stack (nested modules), saving each stream's advanced state when it is left.
"""

from __future__ import annotations

import contextlib
import enum

import torch
import torch.distributed as dist
from torch import nn

from engine.tensor_parallel.mappings import TPGroup

SHARDED_STREAM_OFFSET = 2718  # Megatron's offset of the model-parallel seed


class Stream(enum.Enum):
    REPLICATED = "replicated"
    SHARDED = "sharded"


def _get_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_state(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


class RNGStreams:
    """The two streams of one rank, and the stack of which one is live."""

    def __init__(self, tp: TPGroup, device: torch.device):
        self.device = device
        source = dist.get_global_rank(tp.group, 0)

        def from_first_rank(t: torch.Tensor) -> torch.Tensor:  # via the device: nccl takes no CPU tensors
            moved = t.to(device)
            dist.broadcast(moved, src=source, group=tp.group)
            return moved.cpu()

        # the default stream: tp rank 0's on every rank of the group
        _set_state([from_first_rank(state) for state in _get_state(device)], device)
        # the per-rank seeds then differ by tp_rank alone
        seed = int(from_first_rank(torch.tensor([torch.initial_seed()], dtype=torch.int64)).item())
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed((seed + SHARDED_STREAM_OFFSET + tp.rank) % 2**63)
            self._saved = {Stream.SHARDED: _get_state(device)}
        self.live = Stream.REPLICATED
        self._stack: list[Stream] = []

    def enter(self, stream: Stream) -> None:
        self._stack.append(self.live)
        self._switch(stream)

    def exit(self) -> None:
        self._switch(self._stack.pop())

    @contextlib.contextmanager
    def using(self, stream: Stream):
        self.enter(stream)
        try:
            yield
        finally:
            self.exit()

    def _switch(self, stream: Stream) -> None:
        if stream is self.live:
            return
        self._saved[self.live] = _get_state(self.device)
        _set_state(self._saved.pop(stream), self.device)
        self.live = stream

    def attach(self, module: nn.Module, stream: Stream) -> list:
        """Runs `module`'s forward on `stream` (hooks; returns their handles)."""
        def pre_hook(_module, _args):
            self.enter(stream)

        def post_hook(_module, _args, _output):
            self.exit()

        # always_call: a forward that raises still gives the stream back
        return [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(post_hook, always_call=True)]

    # Note [activation checkpointing]: a recompute must draw the masks its forward drew
    def snapshot(self) -> tuple:
        """Which stream is live, the saved states of the others (the live one's is the default generator's,
        which torch's checkpoint saves and restores itself) and the stack."""
        return self.live, dict(self._saved), list(self._stack)

    def restore(self, snapshot: tuple) -> None:
        """Puts a snapshot back (states are never changed in place, so the snapshot's are still its own)."""
        live, saved, stack = snapshot
        self.live, self._saved, self._stack = live, dict(saved), list(stack)
