"""ColossalAI 0.5's Python API on Tiers: `from engine.compat import colossalai` in place of `import colossalai`.

    colossalai.launch_from_torch()
    plugin = GeminiPlugin(precision="bf16", offload_optim_frac=1.0)
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, criterion, dataloader,
                                                                          lr_scheduler)

Each plugin's arguments become one Tiers config (engine.compat.colossalai.booster.plugin); what ColossalAI has and
Tiers does not raises, naming the call and what to use (docs/migrating-from-colossalai.md).
"""

from __future__ import annotations

from engine.compat.colossalai import accelerator, booster, cluster, interface, lazy, nn, utils  # noqa: F401
from engine.compat.colossalai.launch import launch, launch_from_torch

__all__ = ["launch", "launch_from_torch", "accelerator", "booster", "cluster", "interface", "lazy", "nn", "utils"]

# ColossalAI's version whose API this layer answers
__version__ = "0.5.1"
