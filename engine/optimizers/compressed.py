"""What the compressed-communication optimizers share: the data-parallel group they average over, one
CompressedAverager per stepped tensor, and the say over the engine's gradient reduction.

Note [optimizers that communicate]
DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB average momentum (or gradients) themselves, compressed, and turn
the engine's gradient all-reduce off for the steps where they do (DeepSpeed's `enable_backward_allreduce`). The
ZeroRuntime asks `engine_reduces_gradients` before each backward and before the update: when it is false the
gradient chunks stay this rank's own. The engine divides every loss by the data-parallel size (the reduction
sums), so such a step multiplies the gradients back by it before unscaling and clipping: gradient_clipping clips
this rank's mean gradient by its own norm (the norm reported), and the optimizer steps from it, as DeepSpeed's
do. Each parameter has its own compression scale and errors, as in DeepSpeed (1-bit LAMB: one for
all, Note [1-bit lamb]), though the parameters of one chunk share the collectives. DeepSpeed's first step() only
sets up its communication buffers and leaves the parameters as they are (its counters count that step); here
every step updates, and the counters number the steps as DeepSpeed's do, so the same batch begins each phase
(freeze_step + 1 the compressed one). The errors are not saved in checkpoints; loading a state resets them, as
DeepSpeed does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.comm import CommCounter
from engine.optimizers.compressed_comm import CompressedAverager
from engine.optimizers.segments import Segments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataParallelGroup:
    """The ranks a compressed optimizer averages over, and the counter of the bytes it sends."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    counter: CommCounter


class CompressedOptimizer(torch.optim.Optimizer):
    """A torch optimizer that averages over the data-parallel group itself (Note [optimizers that communicate])."""

    def __init__(self, params, defaults: dict, data_parallel: DataParallelGroup, segments: Segments | None,
                 comm_backend_name: str, name: str):
        super().__init__(params, defaults)
        self.data_parallel = data_parallel
        self.segments = segments or Segments()
        self._averagers: dict[int, CompressedAverager] = {}
        self.engine_reduces_gradients = True
        if comm_backend_name != "torch" and data_parallel.rank == 0:
            logger.info("%s: comm_backend_name %r — the compressed messages travel on torch.distributed "
                        "collectives of the data-parallel group, whatever the backend name", name, comm_backend_name)

    def averager(self, tensor: torch.Tensor) -> CompressedAverager:
        if id(tensor) not in self._averagers:
            dp = self.data_parallel
            self._averagers[id(tensor)] = CompressedAverager(self.segments.of(tensor), tensor.device, dp.group,
                                                             dp.rank, dp.world, dp.counter)
        return self._averagers[id(tensor)]

    def compressed_average_(self, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`tensor` (laid out as the stepped tensor `like`) averaged over the ranks, compressed; as it is alone."""
        if self.data_parallel.world == 1:
            return tensor
        return self.averager(like).average_(tensor)

    def reset_errors(self) -> None:
        for averager in self._averagers.values():
            averager.reset_errors()

    def local_grad(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's mean gradient, on a step whose gradients the engine did not reduce (the runtime scaled
        them back, Note [optimizers that communicate])."""
        return p.grad

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._averagers.clear()
        self.restore_phase()

    def restore_phase(self) -> None:
        """Sets the phase (and engine_reduces_gradients) from the loaded step counts."""
        raise NotImplementedError
