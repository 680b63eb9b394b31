"""Hugging Face's Trainer driving a Tiers engine: TiersTrainingArguments, TiersTrainerMixin, TiersTrainer.

Note [the Trainer's loop over an engine]
The Trainer keeps its loop (data, logging, callbacks, evaluation, checkpoint folders); the mixin swaps what
touches the model's training state:
- setup (`_prepare_for_training`, once the Trainer knows the run's optimizer steps): the config's "auto"
  values are filled (Note [auto values from the Trainer]), with clipping (max_grad_norm) and bf16/fp16 added
  where the config leaves them out and the arguments ask for them (as accelerate completes a DeepSpeed config),
  and the model is wrapped once with `initialize`.
  With no `optimizer` section, the Trainer's own optimizer (`create_optimizer`) is handed to initialize, and
  with no `scheduler` section its scheduler (`lr_scheduler_type`, warmup) is built by the engine over the
  engine's optimizer, as transformers does for DeepSpeed. An optimizer and scheduler passed to the Trainer
  (`optimizers=(optimizer, scheduler)`) go to initialize as they are: the engine points that optimizer at its
  shards, so the scheduler drives it, and the engine steps the scheduler after each update, where the Trainer
  would. The Trainer then holds stand-ins: its optimizer's and
  scheduler's `step` do nothing (the engine updates at its accumulation boundary), the scheduler reports the
  rate of the last update, and the model it passes around (`EngineModule`) runs the engine's forward.
- each micro-batch (`training_step`): the Trainer's loss, already its share of the accumulation (divided by the
  accumulation count, or normalized by the accumulation's token count), goes to engine.backward multiplied by
  the engine's accumulation steps, since engine.backward divides by them (and by the data-parallel size, which
  the Trainer's token-count normalization multiplies back, as it does for DDP); then engine.step(), which
  updates at the boundary. The Trainer's boundary (every gradient_accumulation_steps micro-batches, and an
  epoch's last) must be the engine's: an epoch whose micro-batch count the accumulation does not divide is
  refused before the first step, and every micro-batch checks that the two agree (an iterable dataset).
- the logged gradient norm is the engine's (None when the engine computed none: no clipping, no fp16).
- save: `save_model` writes the full weights through the model's save_pretrained (engine.full_state_dict, every
  process gathers); a checkpoint folder also gets the engine's checkpoint (every state, any layout), which a
  resume loads in place of the Trainer's optimizer and scheduler files.
- evaluation and prediction run the engine's forward under no_grad.
- a resume needs the engine's checkpoint in the folder (not a save_only_model one): refused otherwise.
Not built yet, refused: tensor, pipeline and sequence parallelism under the Trainer (its data loader gives every
process other samples), layer-major accumulation (the Trainer calls one micro-batch at a time), a second train()
on one trainer, a scheduler passed without its optimizer, auto_find_batch_size, load_best_model_at_end.
"""

from __future__ import annotations

import contextlib
import dataclasses

from transformers import Trainer, TrainingArguments, get_scheduler

from engine.config import load_layout_sections
from engine.config_checks import check_framework_run
from engine.initialization import initialize
from engine.integrations.config_dict import read_config, zero_stage
from engine.integrations.hf.auto_config import resolve_config
from engine.integrations.stand_ins import EngineModule, EngineOptimizer
from engine.zero.zero_init import zero_init


@dataclasses.dataclass
class TiersTrainingArguments(TrainingArguments):
    """TrainingArguments with `tiers_config`: a DeepSpeed-style config (a JSON file's path, or a dict) whose "auto"
    values the arguments fill."""

    tiers_config: str | dict | None = dataclasses.field(
        default=None, metadata={"help": "Tiers' config (DeepSpeed keys): a JSON file's path or a dict"})

    @property
    def place_model_on_device(self) -> bool:
        return False  # the engine places the model (its chunks, offloaded or sharded)

    def zero_init(self):
        """Where to build or load the model: `with args.zero_init(): model = AutoModelForCausalLM.from_pretrained(
        ...)`. Under a ZeRO stage-3 config each process keeps only its shards of the weights (Note [zero_init]), as
        transformers' from_pretrained does under a DeepSpeed stage-3 config; otherwise the model builds as usual."""
        config = read_config(self.tiers_config) if self.tiers_config is not None else {}
        return zero_init() if zero_stage(config) == 3 else contextlib.nullcontext()


class EngineScheduler:
    """The Trainer's scheduler once the engine exists: the engine steps its own; this reports the rates of the last
    update, which the Trainer logs."""

    def __init__(self, engine):
        self.engine = engine
        self.last_update_lr = engine.get_lr()

    def step(self, *args, **kwargs) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return list(self.last_update_lr)

    def state_dict(self) -> dict:
        return {}


class TiersTrainerMixin:
    """Note [the Trainer's loop over an engine]: mixed in before Trainer (or a Trainer subclass such as TRL's
    SFTTrainer): `class MyTrainer(TiersTrainerMixin, SFTTrainer)`."""

    engine = None

    def __init__(self, *args, tiers_config: str | dict | None = None, **kwargs):
        """tiers_config: the engine's config (a JSON file's path or a dict), for arguments of another class than
        TiersTrainingArguments (TRL's SFTConfig, say); default the arguments' tiers_config."""
        super().__init__(*args, **kwargs)
        self.tiers_config = tiers_config if tiers_config is not None else getattr(self.args, "tiers_config", None)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        args = self.args
        if self.tiers_config is None:
            raise ValueError("TiersTrainerMixin needs the engine's config, a JSON file's path or a dict: "
                             "TiersTrainingArguments(tiers_config=...), or the trainer's tiers_config=... keyword")
        config = read_config(self.tiers_config)
        self._check_trainer_run(config, train_dataloader)
        config = resolve_config(with_trainer_sections(config, args), args, self.model, num_training_steps=max_steps)
        optimizer = None if "optimizer" in config else self.create_optimizer()
        lr_scheduler = self.lr_scheduler  # passed as Trainer(optimizers=(optimizer, scheduler)): the engine steps it
        if lr_scheduler is None and "scheduler" not in config:
            lr_scheduler = lambda opt: get_scheduler(  # noqa: E731
                args.lr_scheduler_type, optimizer=opt, num_warmup_steps=args.get_warmup_steps(max_steps),
                num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
        self.engine = initialize(self.model, config, optimizer=optimizer, lr_scheduler=lr_scheduler)
        self.optimizer, self.lr_scheduler = EngineOptimizer(self.engine), EngineScheduler(self.engine)
        self.model_wrapped = EngineModule(self.engine)
        if resume_from_checkpoint is not None:
            path, _ = self.engine.load_checkpoint(resume_from_checkpoint)
            if path is None:
                raise ValueError(f"resume_from_checkpoint: {resume_from_checkpoint} holds no engine checkpoint (no "
                                 "`latest`): it was saved with save_only_model or by another trainer, and the run "
                                 "would go on from the starting weights; resume from a TiersTrainer checkpoint")
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model_wrapped, train_dataloader

    def _check_trainer_run(self, config: dict, train_dataloader) -> None:
        args, accumulation = self.args, self.args.gradient_accumulation_steps
        if self.engine is not None:
            raise ValueError("train() once per TiersTrainer: the engine it built holds the last run's schedule and "
                             "accumulation; make a new trainer (resume_from_checkpoint to go on)")
        if self.optimizer is not None and "optimizer" in config:
            raise ValueError("an optimizer both passed to the Trainer (optimizers=(optimizer, ...)) and in the "
                             "config's optimizer section; keep one")
        if self.lr_scheduler is not None and self.optimizer is None:
            raise ValueError("a scheduler passed to the Trainer without its optimizer (optimizers=(None, scheduler)) "
                             "drives an optimizer the engine does not step; pass both")
        for name in ("auto_find_batch_size", "load_best_model_at_end"):
            if getattr(args, name, False):
                raise ValueError(f"{name} under TiersTrainer is not built yet; set it to False")
        check_framework_run(load_layout_sections(config), "TiersTrainer", "the Trainer's data loader",
                            "the Trainer calls")
        length = len(train_dataloader) if hasattr(train_dataloader, "__len__") else None
        if length is not None and length % accumulation:
            raise ValueError(f"an epoch of {length} micro-batches ends with a partial accumulation of "
                             f"{length % accumulation} (gradient_accumulation_steps {accumulation}), where the Trainer "
                             "updates early and the engine would not; make the micro-batches per epoch a multiple of "
                             "gradient_accumulation_steps (the dataset's size, per_device_train_batch_size, "
                             "dataloader_drop_last)")

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled_for_accumulation = self.loss_is_scaled_for_ga
        if scaled_for_accumulation is None:
            scaled_for_accumulation = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled_for_accumulation:
            loss = loss / self.current_gradient_accumulation_steps
        engine = self.engine
        if engine.is_gradient_accumulation_boundary() != self.accelerator.sync_gradients:
            raise RuntimeError(f"the Trainer's accumulation boundary left the engine's (micro-step "
                               f"{engine.micro_step}, gradient_accumulation_steps {engine.gradient_accumulation_steps})"
                               ": an epoch ended inside an accumulation; make each epoch's micro-batches a multiple "
                               "of gradient_accumulation_steps")
        engine.backward(loss * engine.gradient_accumulation_steps)  # engine.backward divides by them again
        if engine.is_gradient_accumulation_boundary():
            self.lr_scheduler.last_update_lr = engine.get_lr()
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model):
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self.engine.get_global_grad_norm()  # the engine clipped by it at its update

    def _get_grad_norm(self, model, grad_norm=None):
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        return self.engine.get_global_grad_norm()

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.engine is not None:
            return self.model_wrapped
        return super()._wrap_model(model, training, dataloader)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        state = self.engine.full_state_dict(rank0_only=True)  # every process gathers its part
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        pass  # _prepare_for_training loaded the engine's checkpoint: every state

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        pass  # the engine's checkpoint in the same folder has the weights too



def with_trainer_sections(config: dict, args) -> dict:
    """`config` with what the Trainer's arguments ask for and the config leaves out, as accelerate adds it to a
    DeepSpeed config: clipping by max_grad_norm, and bf16 or fp16 training when the arguments' mixed precision is."""
    config = dict(config)
    config.setdefault("gradient_clipping", "auto")
    if args.bf16 and "bf16" not in config:
        config["bf16"] = {"enabled": True}
    if args.fp16 and "fp16" not in config:
        config["fp16"] = {"enabled": True}
    return config


class TiersTrainer(TiersTrainerMixin, Trainer):
    """Trainer over a Tiers engine (Note [the Trainer's loop over an engine])."""

