"""deepspeed.zero.Init and deepspeed.zero.GatheredParameters on Tiers."""

from __future__ import annotations

import contextlib

from torch import nn

from engine.compat.deepspeed.runtime.zero import partition_parameters
from engine.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: F401 (deepspeed.zero's)
from engine.compat.deepspeed.unsupported import refuse
from engine.zero.zero_init import zero_init


class Init(contextlib.AbstractContextManager):
    """Models built inside get placeholders whose initialization is recorded; initialize() materializes them
    shard by shard (Note [zero_init]). DeepSpeed's placement arguments are decided by the config given to
    initialize()."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device=None, pin_memory: bool = False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype=None, mpu=None, **unsupported):
        if module is not None:
            refuse("zero.Init(module=...) on a model already built", "building the model inside `with zero.Init():`")
        if mpu is not None or data_parallel_group is not None or unsupported:
            refuse(f"zero.Init({', '.join(['mpu'] * (mpu is not None) + list(unsupported))})",
                   "zero.Init(config_dict_or_path=...) with the config that initialize() gets")
        self.enabled = enabled
        self._context = zero_init(config_dict_or_path if config_dict_or_path is not None else config) if enabled \
            else contextlib.nullcontext()

    def __enter__(self):
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):  # noqa: N802
    """The parameters whole inside the block (Engine.gathered_parameters); with `modifier_rank`, that rank's
    changes reach every rank on exit. Parameters no engine holds yet are whole already."""
    params = [params] if isinstance(params, nn.Parameter) else list(params)
    if fwd_module is not None:
        refuse("GatheredParameters(fwd_module=...)", "GatheredParameters(params, modifier_rank=...)")
    if any(p.is_meta or hasattr(p, "tiers_zero_init") for p in params):
        refuse("GatheredParameters on parameters built under zero.Init before initialize()",
               "initialization inside the `with zero.Init():` block (it is recorded and replayed shard by shard), "
               "or GatheredParameters after initialize()")
    held = [getattr(p, "tiers_engine", lambda: None)() for p in params]  # weak references, set by initialize
    engines = {id(e): e for e in held if e is not None}
    if not enabled or not engines:
        yield params
        return
    if len(engines) > 1:
        raise ValueError("GatheredParameters: the parameters belong to different engines; gather each engine's apart")
    (engine,) = engines.values()
    with engine.gathered_parameters(params, modifier_rank=modifier_rank):
        before = partition_parameters.mark_available(params)  # Note [ds_status of a stage-3 parameter]
        try:
            yield params
        finally:
            partition_parameters.restore(params, before)
