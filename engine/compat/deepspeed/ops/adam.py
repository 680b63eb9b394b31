"""deepspeed.ops.adam.FusedAdam and DeepSpeedCPUAdam: torch's Adam with DeepSpeed's arguments.

adam_w_mode / adamw_mode (default True) is decoupled weight decay (AdamW), False is L2 weight decay added to the
gradient (Adam), as in DeepSpeed. bias_correction=False (no 1 - beta^t division) has no torch counterpart and is
refused. The class stays what scripts test with isinstance, and survives the engine rebuilding it over shards
(its DeepSpeed arguments are in `defaults`).
"""

from __future__ import annotations

import torch


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False): Adam without bias correction is not in Tiers; use "
                         "bias_correction=True (the default)")
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant (as in DeepSpeed); use torch.optim.Adam")


class FusedAdam(torch.optim.Adam):
    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        _check("FusedAdam", bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.defaults.update(adam_w_mode=adam_w_mode, bias_correction=bias_correction)


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        _check("DeepSpeedCPUAdam", bias_correction, amsgrad)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.defaults.update(adamw_mode=adamw_mode, bias_correction=bias_correction)
