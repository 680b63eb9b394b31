"""One forward of a copy of the model on fake tensors, recorded op by op (Note [derived tensor-parallel plans]).

Fake tensors (torch's FakeTensorMode: meta storage, a real device) cost no memory and no compute, and
libraries that branch on tensor values (Hugging Face's mask building) recognise them and take the
branch they take while tracing.

Linear layers (nn.Linear, Hugging Face's Conv1D) and embeddings are recorded as one op each, the
module call; every other torch function or tensor method called at the outermost level is one op.
Tensors are recorded as Refs (identity and shape); every tensor the forward touches is kept alive
until the trace is done, so that an id names one tensor.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from engine.zero.unbuilt import Unbuilt

SEQ_LEN, BATCH = 8, 2  # the example input's shape: small, and unlike any width


@dataclass(frozen=True)
class Ref:
    id: int
    shape: tuple[int, ...]


@dataclass
class Op:
    name: str  # normalized torch function name, or "linear_module" / "embedding_module"
    args: tuple  # tensors as Refs
    kwargs: dict
    outputs: list[Ref]
    module: str  # the innermost module running it (for a module op, that module)


@dataclass
class Trace:
    ops: list[Op] = field(default_factory=list)
    inputs: set[int] = field(default_factory=set)  # ids of the model's input tensors
    outputs: list[Ref] = field(default_factory=list)  # the tensors the forward returned
    alive: list = field(default_factory=list, repr=False)  # holds every traced tensor: ids stay unique


def module_kind(module: nn.Module) -> str | None:
    """"linear" or "embedding" for the layers a plan can replace: exactly nn.Linear, Hugging Face's Conv1D (a 2-D
    weight stored [in, out]) or nn.Embedding, holding nothing but their weight and bias. A subclass (a scaled
    embedding, a linear layer with a gate of its own) computes something else: its ops are traced instead."""
    own = {name for name, _ in module.named_parameters(recurse=False)} | \
        {name for name, _ in module.named_buffers(recurse=False)}
    if own - {"weight", "bias"} or "parametrizations" in module._modules:
        return None
    if type(module) is nn.Linear or (type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None
                                     and module.weight.dim() == 2):
        return "linear"
    if type(module) is nn.Embedding and module.max_norm is None and not module.sparse \
            and not module.scale_grad_by_freq:  # (what VocabParallelEmbedding does not do)
        return "embedding"
    return None


def linear_features(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer; Conv1D stores its weight as [in, out]."""
    rows, cols = module.weight.shape
    return (cols, rows) if isinstance(module, nn.Linear) else (rows, cols)


def fake_copy(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """The model deep-copied with every parameter and buffer a fake tensor (no data copied; tied parameters
    stay tied)."""
    memo = {id(t): _fake(t, mode) for t in itertools.chain(model.parameters(), model.buffers())}
    fake = copy.deepcopy(model, memo).train()  # traced as it trains: dropout in the forward, whatever mode it was in
    _trace_experts_batched(fake)
    return fake


def _fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake tensor like `t`; by its shape alone for a parameter without values (one zero_init has not built yet, or
    a ZeRO-3 parameter whose chunk is released)."""
    if isinstance(t, Unbuilt) or (t.numel() and not t.untyped_storage().nbytes()):
        with mode:
            return nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device=t.device), requires_grad=t.requires_grad)
    return mode.from_tensor(t)


def _trace_experts_batched(model: nn.Module) -> None:
    """Hugging Face's "eager" MoE experts loop over the experts a batch routes to (a count fake tensors do not
    have); "batched_mm" computes the same function on the same parameters without that loop. The experts' 3-D
    parameters are no linear layers, so a plan leaves them whole either way: only their output's shape matters."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) == "eager":
            config._experts_implementation = "batched_mm"


def example_input(model: nn.Module, mode: FakeTensorMode, batch: int = BATCH) -> tuple[tuple, dict, str]:
    """(args, kwargs, description): token ids [batch, SEQ_LEN] for a model with an embedding (also for the
    forward's other required arguments, such as targets), else [batch, in_features] of its first linear layer."""
    params = list(inspect.signature(model.forward).parameters.values())
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {"use_cache": False} if any(p.name == "use_cache" for p in params) else {}
    device = next(model.parameters()).device  # where the model is (a fake tensor reports it)
    if any(isinstance(m, nn.Embedding) for m in model.modules()):
        with mode:  # one tensor per argument: the first (the ids a 2D model cuts) is told apart from targets
            ids = tuple(torch.zeros(batch, SEQ_LEN, dtype=torch.long, device=device)
                        for _ in range(max(1, len(required))))
        return ids, kwargs, f"token ids of shape [{batch}, {SEQ_LEN}]"
    first = next((m for m in model.modules() if module_kind(m) == "linear"), None)
    if first is None or len(required) > 1:
        raise ValueError("no example input: Tiers tries token ids for a model with an nn.Embedding, or one tensor "
                         "[batch, in_features] for a model whose first layer is linear and whose forward takes "
                         "one argument")
    width = linear_features(first)[0]
    with mode:
        x = torch.zeros(batch, width, dtype=first.weight.dtype, device=device)
    return (x,), kwargs, f"a tensor of shape [{batch}, {width}]"


def op_name(func) -> str:
    """A torch function's name with in-place and reflected forms folded in: "__iadd__", "add_" -> "add"."""
    name = getattr(func, "__name__", str(func))
    if name == "__get__":  # a tensor property (.T, .mT): the descriptor's own name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("i", "r") and name[1:] in ("add", "sub", "mul", "truediv", "floordiv", "pow", "matmul",
                                                    "and", "or", "xor", "mod"):
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return name


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _refs(value):
    if isinstance(value, torch.Tensor):
        return Ref(id(value), tuple(value.shape))
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_refs(v) for v in value) if type(value) in (list, tuple) else tuple(_refs(v) for v in value)
    if isinstance(value, dict):
        return {k: _refs(v) for k, v in value.items()}
    return value


# ops whose fake-tensor (meta) kernel takes bf16 only, where the CPU and CUDA kernels the model runs take fp32 too
# (Hugging Face's default MoE experts call grouped_mm): traced in bf16, their result cast back
_META_BF16_ONLY = {"grouped_mm", "_grouped_mm"}


def _run_fake(func, args: tuple, kwargs: dict):
    """func(*args, **kwargs) on fake tensors, as the model's own kernels would shape it."""
    if getattr(func, "__name__", "") not in _META_BF16_ONLY or not args or args[0].dtype == torch.bfloat16:
        return func(*args, **kwargs)

    def narrow(a):
        return a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    out = func(*tree_map(narrow, args), **tree_map(narrow, kwargs))
    return out.to(args[0].dtype)


class _Recorder(TorchFunctionMode):
    """Records the ops of one forward; modules report their calls through hooks (see `trace`)."""

    def __init__(self, trace: Trace, kind: Callable[[nn.Module], str | None]):
        super().__init__()
        self.trace, self.kind = trace, kind
        self.stack: list[str] = [""]  # module names, innermost last (left as it was when a forward raises)
        self.atomic: list[tuple[str, str, torch.Tensor]] = []  # (name, kind, input) of the module op running
        self.alive: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recording = not self.atomic
        arg_refs, kwarg_refs = (_refs(args), _refs(kwargs)) if recording else (None, None)  # before an in-place op
        out = _run_fake(func, args, kwargs)
        name = op_name(func)
        outs = _tensors(args[0]) if name == "setitem" else _tensors(out)  # x[i] = y writes x
        if outs and recording:
            self.alive.extend(itertools.chain(outs, _tensors(list(args)), _tensors(kwargs)))
            self.trace.ops.append(Op(name, arg_refs, kwarg_refs, [_refs(t) for t in outs], self.stack[-1]))
        return out

    def enter(self, name: str, module: nn.Module, args: tuple) -> None:
        self.stack.append(name)
        kind = self.kind(module)
        if kind is not None and not self.atomic and args and isinstance(args[0], torch.Tensor):
            self.atomic.append((name, kind, args[0]))

    def leave(self, name: str, output) -> None:
        self.stack.pop()
        if self.atomic and self.atomic[-1][0] == name:
            _, kind, inp = self.atomic.pop()
            outs = _tensors(output)
            self.alive.extend(outs + [inp])
            self.trace.ops.append(Op(f"{kind}_module", (_refs(inp),), {}, [_refs(t) for t in outs], name))


class TraceFailed(Exception):
    def __init__(self, module: str, error: Exception, partial: Trace):
        super().__init__(f"{type(error).__name__}: {error}")
        self.module, self.error, self.partial = module, error, partial  # partial: the ops before the failure


def trace(model: nn.Module, args: tuple, kwargs: dict, mode: FakeTensorMode,
          kind: Callable[[nn.Module], str | None] = module_kind) -> Trace:
    """Runs model(*args, **kwargs) (fake tensors) recording its ops; a forward that raises is a TraceFailed naming
    the innermost module that was running. `kind` says which modules are one op ("<kind>_module")."""
    result = Trace(inputs={id(t) for t in _tensors(list(args))})
    recorder = _Recorder(result, kind)
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, name=name: recorder.enter(name, m, a)))
        handles.append(module.register_forward_hook(lambda m, a, out, name=name: recorder.leave(name, out)))
    try:
        with torch.no_grad(), mode, recorder:
            out = model(*args, **kwargs)
    except Exception as error:  # any failure of the user's forward on meta tensors is reported, by module
        raise TraceFailed(recorder.stack[-1], error, result) from error
    finally:
        for handle in handles:
            handle.remove()
    result.outputs = [_refs(t) for t in _tensors(out)]
    result.alive = recorder.alive + [out]
    return result
