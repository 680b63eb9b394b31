"""colossalai.nn.optimizer's HybridAdam, CPUAdam and FusedAdam: torch's Adam with ColossalAI's arguments.

adamw_mode (default True) is decoupled weight decay (AdamW), False is L2 weight decay added to the gradient (Adam),
as in ColossalAI. Where the states live is the plugin's choice in Tiers (LowLevelZeroPlugin(cpu_offload=True),
GeminiPlugin's fractions), so the class only carries the hyperparameters: Booster.boost gives them to the engine's
own optimizer. bias_correction=False and an NVMe share of the states set on the optimizer are refused.
"""

from __future__ import annotations

import torch

from engine.compat.colossalai.unsupported import refuse


def _check(name: str, bias_correction: bool, nvme_offload_fraction: float = 0.0) -> None:
    if not bias_correction:
        refuse(f"{name}(bias_correction=False) (Adam without bias correction)", "use bias_correction=True")
    if nvme_offload_fraction:
        refuse(f"{name}(nvme_offload_fraction={nvme_offload_fraction})",
               "offload the optimizer states with the plugin (GeminiPlugin(offload_optim_frac=...), "
               "LowLevelZeroPlugin(cpu_offload=True)) or a Tiers config with offload_optimizer.device \"nvme\"")


class CPUAdam(torch.optim.Adam):
    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, adamw_mode: bool = True,
                 nvme_offload_fraction: float = 0.0, nvme_offload_dir: str | None = None):
        _check(type(self).__name__, bias_correction, nvme_offload_fraction)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.defaults.update(adamw_mode=adamw_mode, bias_correction=bias_correction)


class HybridAdam(CPUAdam):
    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, adamw_mode: bool = True,
                 nvme_offload_fraction: float = 0.0, nvme_offload_dir: str | None = None, **defaults):
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode,
                         nvme_offload_fraction, nvme_offload_dir)


class FusedAdam(torch.optim.Adam):
    """ColossalAI's order: adamw_mode before weight_decay."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adamw_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        _check("FusedAdam", bias_correction)
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as in ColossalAI)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.defaults.update(adamw_mode=adamw_mode, bias_correction=bias_correction)
