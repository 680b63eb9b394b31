"""deepspeed.accelerator.get_accelerator(): the calls training scripts make, answered for this machine (CUDA when
present, else CPU)."""

from __future__ import annotations

import os

import psutil
import torch

from engine.compat.deepspeed.unsupported import refuse


class Accelerator:
    """DeepSpeed's accelerator object, reduced to what scripts ask of it."""

    def _cuda(self) -> bool:
        return torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        name = "cuda" if self._cuda() else "cpu"
        return name if device_index is None or name == "cpu" else f"{name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda() else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda() else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda():
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return True  # the CPU always is: Tiers runs there when no GPU is present

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda() else 1

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda():
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda() else "gloo"

    def is_bf16_supported(self) -> bool:
        return not self._cuda() or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._cuda():
            torch.cuda.manual_seed_all(seed)

    def empty_cache(self) -> None:
        if self._cuda():
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda() else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda() else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda() else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda() else 0

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory; on the CPU, the host's (as DeepSpeed's CPU accelerator answers)."""
        if self._cuda():
            return torch.cuda.get_device_properties(device_index or torch.cuda.current_device()).total_memory
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda():
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        return psutil.virtual_memory().available

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda() else tensor

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def __getattr__(self, name: str):
        refuse(f"get_accelerator().{name}", "torch.cuda / torch.device calls directly")


def get_accelerator() -> Accelerator:
    return Accelerator()
