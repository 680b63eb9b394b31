"""Lightning Fabric over a Tiers engine: TiersFabricStrategy.

Note [Fabric's loop over an engine]
The user's loop stays a Fabric loop: `model, optimizer = fabric.setup(model, optimizer)`, `fabric.backward(loss)`,
`optimizer.step()`, `optimizer.zero_grad()`, with accumulation written as Fabric's docs write it (the backward of
each micro-batch under `fabric.no_backward_sync(model, enabled=accumulating)`, a step after the last). The strategy
maps it onto the engine's per-micro-batch calls:
- setup: the config (Note [Lightning's arguments in the config]; accumulation and clipping are the config's, Fabric
  has no such arguments) and the optimizer given to fabric.setup go to `initialize`; the engine points the
  optimizer at its shards, so a scheduler built on it keeps working (the loop steps it, the engine does not).
- fabric.backward(loss): engine.backward(loss × the engine's accumulation steps), since engine.backward divides by
  them and by the data-parallel size, as DDP's gradient mean does, while Fabric's loop sums the micro-batches'
  gradients as they come. Before the accumulation's last micro-batch the engine's step() follows at once (it only
  counts); on the last one the update waits for optimizer.step().
- optimizer.step(): the engine's update. It must come right after the accumulation's last backward, and a backward
  must not follow that one without it: both are refused, as is a `no_backward_sync(enabled=...)` that disagrees
  with the config's gradient_accumulation_steps (the engine would update on other micro-batches than the loop).
- optimizer.zero_grad(): the engine clears at its update, so it must come between an update and the next
  accumulation (DDP's loop clears there); one inside an accumulation, and a backward after an update with none
  (DDP would add to the old gradients), are refused.
- clipping is the config's gradient_clipping: fabric.clip_gradients is refused (the engine clips at its update).
- fabric.save(path, state) writes the engine's checkpoint (every state, any layout) into the directory `path`, with
  the state's other entries (schedulers' and other stateful objects' state_dict(), plain values) beside it (Note
  [Lightning's state beside the engine's checkpoint]); fabric.load(path, state) restores what `state` holds: the
  model's weights, with the optimizer its states and the engine's counters, the other entries in place, and
  returns what is left. The model must be in `state` (the engine is restored in place).
- the weights: fabric.strategy.get_module_state_dict(model) gathers them from the engine (the model's own
  state_dict() holds the compute copies: bf16 under bf16, placeholders under ZeRO-3); weights loaded into the model
  after fabric.setup are not the engine's (load them before, or through fabric.load).
- fabric.init_module() builds under zero_init when the config is ZeRO stage 3.
Not built yet, refused: a config `optimizer` section (pass the optimizer to fabric.setup), more than one optimizer
or model, save filters, tensor/pipeline/sequence parallelism, half ("-true") and 64-bit precision.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _Stateful

from engine.initialization import initialize
from engine.integrations.config_dict import read_config, zero_stage
from engine.integrations.lightning.checkpoint_state import load_with_state, save_with_state
from engine.integrations.lightning.settings import lightning_config, precision_flag
from engine.integrations.stand_ins import EngineModule, EngineOptimizer
from engine.zero.zero_init import zero_init


class TiersFabricPrecision(Precision):
    """Fabric's precision plugin under TiersFabricStrategy: it keeps the precision flag, which the config's precision
    sections carry out (Note [Lightning's arguments in the config]); the engine casts, autocasts and scales, so the
    forward is not wrapped again."""

    def __init__(self, precision: str = "32-true"):
        self.precision = precision

    @classmethod
    def replacing(cls, plugin: Precision) -> TiersFabricPrecision:
        if isinstance(plugin, cls):
            return plugin
        return cls(precision_flag(plugin, (Precision, MixedPrecision), "TiersFabricStrategy"))


class _DeclaredAccumulation(_BackwardSyncControl):
    """fabric.no_backward_sync(model, enabled): the loop says whether this micro-batch accumulates, which the
    strategy checks against the engine's boundary (the engine itself reduces at its boundary only)."""

    def __init__(self, strategy: TiersFabricStrategy):
        self.strategy = strategy

    @contextmanager
    def no_backward_sync(self, module, enabled: bool):
        self.strategy.declared_accumulating = enabled
        try:
            yield
        finally:
            self.strategy.declared_accumulating = None


class TiersFabricStrategy(DDPStrategy):
    """Note [Fabric's loop over an engine]: `Fabric(strategy=TiersFabricStrategy("ds_config.json"), ...)`.

    config: a DeepSpeed-style config (a JSON file's path or a dict). The other arguments are Fabric's DDPStrategy's;
    Fabric's launcher starts the processes."""

    def __init__(self, config: str | os.PathLike | dict, **kwargs):
        super().__init__(**kwargs)
        ddp_only = sorted(name for name, value in self._ddp_kwargs.items() if value not in (None, False))
        if ddp_only:
            raise ValueError(f"TiersFabricStrategy: {', '.join(ddp_only)} configure DDP's wrapper, which the engine "
                             "replaces (it reduces the gradients itself); leave them out")
        self.config = config
        self.engine = None
        self.declared_accumulating: bool | None = None
        self._update_pending = False
        self._cleared = True  # no gradients held since the last update's zero_grad (or the start)
        self._backward_sync_control = _DeclaredAccumulation(self)

    @property
    def precision(self) -> TiersFabricPrecision:
        return self._precision if self._precision is not None else TiersFabricPrecision()

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = None if plugin is None else TiersFabricPrecision.replacing(plugin)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if self.engine is not None:
            raise ValueError("one model per TiersFabricStrategy: its engine wraps the first one set up")
        if len(optimizers) != 1:
            raise ValueError(f"TiersFabricStrategy trains one optimizer with the model, and fabric.setup got "
                             f"{len(optimizers)}")
        config = lightning_config(self.config, precision=self.precision.precision)
        if "optimizer" in config:
            raise ValueError("under Fabric the optimizer comes from fabric.setup(model, optimizer); remove the "
                             "config's optimizer section")
        self.engine = initialize(module, config, optimizer=optimizers[0])
        return EngineModule(self.engine), [FabricEngineOptimizer(self)], scheduler

    def setup_module(self, module):
        raise ValueError("TiersFabricStrategy sets up the model and its optimizer together: "
                         "fabric.setup(model, optimizer)")

    def setup_optimizer(self, optimizer):
        raise ValueError("TiersFabricStrategy sets up the model and its optimizer together: "
                         "fabric.setup(model, optimizer)")

    def module_to_device(self, module) -> None:
        pass  # the engine places the model's chunks (offloaded, sharded) itself

    def module_init_context(self, empty_init: bool | None = None):
        if zero_stage(read_config(self.config)) == 3:
            return zero_init()
        return super().module_init_context(empty_init)

    def backward(self, tensor, module, *args, **kwargs) -> None:
        engine = self._engine()
        accumulation = engine.gradient_accumulation_steps
        if self._update_pending:
            raise RuntimeError(f"fabric.backward after the accumulation's last micro-batch without optimizer.step(): "
                               f"the engine updates after every {accumulation} backward calls (the config's "
                               "gradient_accumulation_steps); step the optimizer there, or set it to your accumulation")
        if not self._cleared and engine.micro_step % accumulation == 0:
            raise RuntimeError("fabric.backward after an update without optimizer.zero_grad(): DDP would add these "
                               "gradients to the last update's, and the engine cleared them at its update; call "
                               "optimizer.zero_grad() after optimizer.step()")
        boundary = engine.is_gradient_accumulation_boundary()
        if self.declared_accumulating is not None and self.declared_accumulating == boundary:
            raise RuntimeError(f"no_backward_sync(enabled={self.declared_accumulating}) at micro-batch "
                               f"{engine.micro_step % accumulation + 1} of the engine's {accumulation} (the config's "
                               "gradient_accumulation_steps): the loop would update on other micro-batches than the "
                               "engine; accumulate the same count (e.g. enabled=(i + 1) % N != 0)")
        engine.backward(tensor * accumulation)  # engine.backward divides by the accumulation again
        if boundary:
            self._update_pending = True
        else:
            engine.step()  # counts the micro-step

    def optimizer_step(self, optimizer, **kwargs):
        engine = self._engine()
        if not self._update_pending:
            raise RuntimeError(f"optimizer.step() before the accumulation's last micro-batch: the engine updates after "
                               f"every {engine.gradient_accumulation_steps} fabric.backward calls (the config's "
                               "gradient_accumulation_steps); step there, or set it to your accumulation")
        self._update_pending = False
        self._cleared = False
        engine.step()

    def zero_grad(self) -> None:
        """optimizer.zero_grad(): the engine clears the gradients at its update, which is where DDP's loop clears
        them; anywhere inside an accumulation it would drop gradients that the engine keeps."""
        engine = self._engine()
        if self._update_pending or engine.micro_step % engine.gradient_accumulation_steps:
            raise RuntimeError("optimizer.zero_grad() inside an accumulation (before optimizer.step() ends it) would "
                               "drop its gradients under DDP, and the engine keeps them; call it after "
                               "optimizer.step()")
        self._cleared = True

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        raise ValueError("the engine clips by the config's gradient_clipping at its update; set it there and remove "
                         "fabric.clip_gradients")

    def clip_gradients_value(self, module, optimizer, clip_val):
        raise ValueError("the engine clips by the global norm only (the config's gradient_clipping); remove "
                         "fabric.clip_gradients(clip_val=...)")

    def get_module_state_dict(self, module) -> dict:
        if isinstance(module, EngineModule):
            return module.engine.full_state_dict()  # every process gathers its part
        return super().get_module_state_dict(module)

    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("fabric.save under TiersFabricStrategy writes the engine's whole checkpoint: leave out "
                            "storage_options and filter")
        client = {name: value.state_dict() if isinstance(value, _Stateful) else value
                  for name, value in state.items() if not isinstance(value, (EngineModule, EngineOptimizer))}
        save_with_state(self._engine(), self.broadcast(str(path)), client, self.is_global_zero)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict:
        """Restores what `state` holds: the model (its weights), the optimizer (its states, the engine's counters
        and RNG), and the other entries in place; returns what the checkpoint holds besides."""
        held = list((state or {}).values())
        if not any(isinstance(value, EngineModule) for value in held):
            raise ValueError("fabric.load under TiersFabricStrategy restores the engine in place: pass the model (and "
                             "the optimizer to restore its states), e.g. fabric.load(path, {\"model\": model, "
                             "\"optimizer\": optimizer})")
        with_optimizer = any(isinstance(value, EngineOptimizer) for value in held)
        client = load_with_state(self._engine(), path, weights_only, load_optimizer_states=with_optimizer,
                                 load_lr_scheduler_states=with_optimizer, load_module_only=not with_optimizer)
        for name, value in state.items():
            if isinstance(value, (EngineModule, EngineOptimizer)):
                continue
            if name not in client:
                if strict:
                    raise KeyError(f"fabric.load: {name!r} is not in the checkpoint {path} (it holds {sorted(client)})")
                continue
            if isinstance(value, _Stateful):
                value.load_state_dict(client.pop(name))
            else:
                state[name] = client.pop(name)
        return client

    def _engine(self):
        if self.engine is None:
            raise RuntimeError("the engine exists once fabric.setup(model, optimizer) has run under this strategy")
        return self.engine


class FabricEngineOptimizer(EngineOptimizer):
    """The optimizer a Fabric loop holds: the engine's param groups; its zero_grad is checked against the engine's
    accumulation (TiersFabricStrategy.zero_grad)."""

    def __init__(self, strategy: TiersFabricStrategy):
        super().__init__(strategy.engine)
        self.strategy = strategy

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad()
