"""The parameters a `zero_init` block leaves behind: their shape, dtype and a device (the CPU), no values.

Inside the block parameters live on the meta device (Note [zero_init]). Code that runs between the block and
initialize reads their metadata (weight-decay groups by `p.dim()`, parameter counts) and places new tensors by their
device: PEFT moves each adapter to its base layer's weight device, and an adapter moved to the meta device loses its
values. So when the block ends each meta parameter becomes an `Unbuilt` tensor (in place: the same Python object,
torch.utils.swap_tensors), which reports the CPU and computes nothing: any operation on its values raises, naming
the parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


class Unbuilt(torch.Tensor):
    """A tensor with a shape, a dtype and the CPU as its device, and no values (Note [zero_init])."""

    origin: str  # the parameter it stands for, for errors

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, name: str, requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu", requires_grad=requires_grad)
        t.origin = name
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # metadata reads stay plain; operations dispatch

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Unbuilt({tuple(self.shape)}, {self.dtype}, {self.origin})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        this = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Unbuilt))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # nn.Parameter(...) detaches
            return Unbuilt(this.shape, this.dtype, this.origin)
        if func is torch.ops.aten._to_copy.default:  # model.to(...), .half(), .cuda() between the block and initialize
            raise RuntimeError(f"parameter {this.origin} was built under engine.zero_init: initialize() places it and "
                               "casts it (the config's bf16 / fp16 sections), so leave out model.to() / .half() / "
                               ".cuda() before initialize")
        raise RuntimeError(f"parameter {this.origin} {tuple(this.shape)} was built under engine.zero_init and has no "
                           f"values until initialize() (it cannot run {func}): compute with it after initialize, on "
                           "the engine's model, or build the model without zero_init")


def unbuilt_parameter(shape: torch.Size, dtype: torch.dtype, name: str, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(Unbuilt(shape, dtype, name), requires_grad=requires_grad)
