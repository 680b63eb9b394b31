"""colossalai.booster.plugin: each plugin's arguments mapped onto one Tiers config (docs/migrating-from-colossalai.md
lists every argument and what it maps to)."""

from engine.compat.colossalai.booster.plugin.dp_plugin_base import DPPluginBase
from engine.compat.colossalai.booster.plugin.gemini_plugin import GeminiPlugin
from engine.compat.colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin, MoeHybridParallelPlugin
from engine.compat.colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroPlugin
from engine.compat.colossalai.booster.plugin.torch_ddp_plugin import TorchDDPPlugin
from engine.compat.colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin

__all__ = ["DPPluginBase", "GeminiPlugin", "HybridParallelPlugin", "LowLevelZeroPlugin", "MoeHybridParallelPlugin",
           "TorchDDPPlugin", "TorchFSDPPlugin"]
