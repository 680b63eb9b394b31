"""The parameters of a `zero_init` block: inside it `Recorded` ones (meta storage that reports the CPU), after it
`Unbuilt` ones (the CPU, no storage); both have a shape and a dtype, and no values.

Inside the block parameters hold meta storage (Note [zero_init]): writes into them are recorded and cost nothing,
and views of them share that storage, so the recording finds a parameter from any view. Yet libraries ask a model's
device inside the block: `from_pretrained` ends by `kernelize(model)` (transformers 5.25 with `kernels`), which
refuses the meta device. So each one reports the CPU, where a plain `from_pretrained` leaves the model, and where its
`Unbuilt` successor says it is. What the block computes from them is `Computed`: shapes and dtypes only, and an
initialization that reads values (rejection sampling) raises instead of silently drawing nothing.
Code that runs between the block and initialize reads their metadata (weight-decay groups by `p.dim()`, parameter
counts) and places new tensors by their device: PEFT moves each adapter to its base layer's weight device, and an
adapter moved to the meta device loses its values. So when the block ends each meta parameter becomes an `Unbuilt`
tensor (in place: the same Python object, torch.utils.swap_tensors), which reports the CPU and computes nothing: any
operation on its values raises, naming the parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map


class Recorded(torch.Tensor):
    """A parameter inside a `zero_init` block, or a view of one: a shape, a dtype, the CPU as its device, and a meta
    tensor (`meta`) over the parameter's meta storage that every operation runs on (Note [zero_init]). Views of it
    are Recorded too (their `meta` a view of the same storage), in-place operations return it, and other results are
    Computed."""

    meta: torch.Tensor

    @staticmethod
    def __new__(cls, meta: torch.Tensor, requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype, device="cpu",
                                                requires_grad=requires_grad)
        t.meta = meta
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Recorded({tuple(self.shape)}, {self.dtype})"

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """`p.data = value` writes value into p, recorded like `p.copy_(value)` (a tensor's own `.data` assignment
        would swap in values the recording never sees)."""
        if value is self or (isinstance(value, Recorded) and _same_place(value.meta, self.meta)):
            return  # module.to() / .cpu() with nothing to move assigns a parameter its own tensor
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise ValueError(f"zero_init: assigning .data of {tuple(value.shape)} {value.dtype} to a parameter of "
                             f"{tuple(self.shape)} {self.dtype} cannot be recorded (a cast, such as module.to(dtype), "
                             "or another shape); build in the dtype you want (torch.set_default_dtype, "
                             "from_pretrained(dtype=...)), assign the parameter itself, or build without zero_init")
        with torch.no_grad():
            self.copy_(value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        recorded = {id(a.meta): a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Recorded)}
        storages = {m.meta.untyped_storage()._cdata for m in recorded.values()}
        out = func(*tree_map(_meta_of, args), **tree_map(_meta_of, kwargs or {}))

        def wrap(result):
            if not isinstance(result, torch.Tensor) or not result.is_meta:
                return result
            if id(result) in recorded:  # in place: the same tensor
                return recorded[id(result)]
            if result.untyped_storage()._cdata in storages:  # a view of a recorded parameter
                return Recorded(result)
            return Computed(result)

        return tree_map(wrap, out)


class Computed(torch.Tensor):
    """A value computed inside a `zero_init` block from parameters that have no values yet: a shape, a dtype, the CPU
    as its device, a meta tensor its operations run on (their results Computed too). Reading its values raises: an
    initialization that branches on values (nn.init.trunc_normal_'s and orthogonal_'s sampling) cannot be recorded."""

    meta: torch.Tensor

    @staticmethod
    def __new__(cls, meta: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype, device="cpu")
        t.meta = meta
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Computed({tuple(self.shape)}, {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _READS_VALUES:
            raise RuntimeError("zero_init: the model's construction reads the values of a tensor computed from its "
                               "parameters, which have none inside the block (an initialization that branches on "
                               "values, such as nn.init.trunc_normal_'s or orthogonal_'s sampling); build the model "
                               "without zero_init, or initialize that parameter with a function that does not")
        computed = {id(a.meta): a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Computed)}
        out = func(*tree_map(_meta_of, args), **tree_map(_meta_of, kwargs or {}))
        def wrap(result):
            if not isinstance(result, torch.Tensor) or not result.is_meta:
                return result
            same = computed.get(id(result))  # in place: the same tensor
            return same if same is not None else Computed(result)

        return tree_map(wrap, out)


_READS_VALUES = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


def _same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype)


def _meta_of(a):
    return a.meta if isinstance(a, (Recorded, Computed)) else a


def recorded_parameter(meta: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A parameter over `meta`'s storage that reports the CPU as its device."""
    return nn.Parameter(Recorded(meta), requires_grad=requires_grad)


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
