"""colossalai.accelerator.get_accelerator(): the device scripts move tensors to and synchronize, CUDA when present,
else the CPU (where synchronizing and emptying the cache have nothing to do)."""

from __future__ import annotations

import torch


class Accelerator:
    """The calls ColossalAI scripts make on their accelerator, for CUDA or the CPU."""

    def __init__(self, name: str):
        self.name = name
        self.communication_backend = "nccl" if name == "cuda" else "gloo"
        self.is_synchronous = name == "cpu"
        self.support_set_device = name == "cuda"

    def is_available(self) -> bool:
        return self.name == "cpu" or torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.name == "cuda" else 1

    def get_current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.name == "cuda" else torch.device("cpu")

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.name == "cuda" else 0

    def set_device(self, device=None) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(device if device is not None else 0)

    def synchronize(self, device=None) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        if self.name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_to_device(self, models):
        device = self.get_current_device()
        return [m.to(device) for m in models] if isinstance(models, (list, tuple)) else models.to(device)

    def _cuda_memory(self, call: str):
        if self.name != "cuda":
            raise RuntimeError(f"get_accelerator().{call}() measures CUDA memory, and this process runs on the CPU "
                               "(as ColossalAI's CPU accelerator, it is not supported there)")
        return getattr(torch.cuda, call)

    def memory_allocated(self, device=None) -> int:
        return self._cuda_memory("memory_allocated")(device)

    def max_memory_allocated(self, device=None) -> int:
        return self._cuda_memory("max_memory_allocated")(device)

    def memory_reserved(self, device=None) -> int:
        return self._cuda_memory("memory_reserved")(device)

    def max_memory_reserved(self, device=None) -> int:
        return self._cuda_memory("max_memory_reserved")(device)

    def reset_peak_memory_stats(self, device=None) -> None:
        self._cuda_memory("reset_peak_memory_stats")(device)


def get_accelerator() -> Accelerator:
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")
