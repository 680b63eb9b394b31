"""fp32 master weights for parameter chunks kept in a 16-bit compute dtype (bf16 / fp16).

Note [master weights]
With `bf16` or `fp16` enabled, parameter and gradient chunks hold the compute dtype (2 bytes per
element), so the model runs on 16-bit weights and autograd writes 16-bit gradients into the
chunks. The optimizer steps fp32 masters instead: one per stepped tensor (the whole chunk, or this
rank's shard of it once optimizer states are sharded — the masters are optimizer state, kind
OPTIM in Note [sharding policy]). That is the ZeRO paper's 2Ψ + 2Ψ + 12Ψ split (fp32 master,
exp_avg, exp_avg_sq). At each update:
- `stage_grads`: each master's .grad, an fp32 tensor whose storage is empty between updates, is
  filled from its 16-bit gradient (unscaling, the norm and clipping then work in fp32);
- the optimizer steps the masters;
- `update_params` rounds the masters into the 16-bit tensors the model uses, which are then
  all-gathered as usual (half the bytes of fp32);
- `drop_grads` empties the fp32 gradients again.
As in DeepSpeed, the masters start as the 16-bit weights widened (`sync_from_params`, once every
rank holds its starting values). fp32 runs have no masters: their chunks are stepped directly.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """fp32 masters of the 16-bit tensors an optimizer would otherwise step, with fp32 gradients."""

    def __init__(self, targets: list[torch.Tensor], grad_sources: list[torch.Tensor]):
        """targets[i]: the 16-bit tensor master i stands for; grad_sources[i]: its 16-bit gradient."""
        self.targets = targets
        self.grad_sources = grad_sources
        self.masters = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in targets]
        self.grads = [torch.empty(g.shape, dtype=torch.float32, device=g.device) for g in grad_sources]
        self._grad_nbytes = [g.untyped_storage().nbytes() for g in self.grads]
        self.drop_grads()

    def sync_from_params(self) -> None:
        """Masters := their 16-bit tensors, widened."""
        with torch.no_grad():
            for master, target in zip(self.masters, self.targets):
                master.copy_(target)

    def stage_grads(self) -> None:
        with torch.no_grad():
            for grad, source, nbytes in zip(self.grads, self.grad_sources, self._grad_nbytes):
                grad.untyped_storage().resize_(nbytes)
                grad.copy_(source)

    def update_params(self) -> None:
        with torch.no_grad():
            for target, master in zip(self.targets, self.masters):
                target.copy_(master)

    def drop_grads(self) -> None:
        for grad in self.grads:
            grad.untyped_storage().resize_(0)

    def nbytes(self) -> int:
        return sum(m.untyped_storage().nbytes() for m in self.masters)
