"""Note [the Trainer's loop over an engine]: a Trainer script switched to TiersTrainer trains as plain Trainer does
(DDP over the processes), at ZeRO stages 0-3 and with CPU offload; it resumes exactly and saves loadable weights."""

from __future__ import annotations

import os

import pytest
import torch

from engine.zero.zero_init import zero_init_recording
from tests.distributed import run_distributed
from tests.reference import assert_close_relative, assert_params_close

transformers = pytest.importorskip("transformers")
from engine.integrations.hf import TiersTrainer, TiersTrainingArguments  # noqa: E402

STEPS = 4
ARGUMENTS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, learning_rate=1e-3, max_steps=STEPS,
                 logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, lr_scheduler_type="linear",
                 warmup_steps=1, max_grad_norm=1.0, disable_tqdm=True)
AUTO_BATCH = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto"}
AUTO_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
CONFIGS = {  # the Trainer's own optimizer and scheduler, or the config's optimizer with "auto" values
    "stage0": {**AUTO_BATCH, "zero_optimization": {"stage": 0}},
    "stage2": {**AUTO_BATCH, "zero_optimization": {"stage": 2}},
    "stage3-cpu-offload": {**AUTO_BATCH, "optimizer": AUTO_ADAMW,
                           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                 "offload_optimizer": {"device": "cpu"},
                                                 "stage3_param_persistence_threshold": 0}},
}


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


class Tokens(torch.utils.data.Dataset):
    """Rows of token ids whose labels leave out a different number of positions each (-100), so that the loss's
    normalization by the accumulation's token count is not the mean per micro-batch."""

    def __init__(self, rows: int = 32):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 128, (rows, 16), generator=g)
        self.labels = self.ids.masked_fill(torch.rand(rows, 16, generator=g) < torch.rand(rows, 1, generator=g), -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def losses_of(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if "loss" in h]


def halving_adamw(model) -> tuple:
    """An optimizer and scheduler passed to the Trainer, built on the model's parameters before training."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def plain_run(output_dir: str, passed=None, **overrides) -> tuple[list[float], list[float], dict]:
    model = gpt2()
    trainer = transformers.Trainer(model=model, train_dataset=Tokens(), optimizers=passed(model) if passed else
                                   (None, None), args=transformers.TrainingArguments(output_dir,
                                                                                    **{**ARGUMENTS, **overrides}))
    trainer.train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses_of(trainer), logged(trainer, "grad_norm"), weights


def tiers_trainer(output_dir: str, config: dict, passed=None, **overrides) -> TiersTrainer:
    args = TiersTrainingArguments(output_dir, tiers_config=config, **{**ARGUMENTS, **overrides})
    model = gpt2()
    return TiersTrainer(model=model, train_dataset=Tokens(), args=args,
                        optimizers=passed(model) if passed else (None, None))


def tiers_run(output_dir: str, config: dict, passed=None, **overrides) -> tuple[list[float], list[float], dict]:
    trainer = tiers_trainer(output_dir, config, passed, **overrides)
    trainer.train()
    weights = trainer.engine.full_state_dict()
    trainer.engine.close()
    return losses_of(trainer), logged(trainer, "grad_norm"), {n: weights[n] for n, _ in gpt2().named_parameters()}


# the Trainer's loss: normalized by the accumulation's token count (the default for a model taking loss kwargs),
# each micro-batch's mean divided by the accumulation count, or label smoothing (the causal LM's labels shifted)
LOSS_PATHS = {"token-count": ({}, True), "per-micro-batch-mean": ({}, False),
              "label-smoothing": ({"label_smoothing_factor": 0.1}, True)}


@pytest.mark.parametrize("path", LOSS_PATHS)
def test_one_process_equals_plain_trainer_in_losses_norms_rates_and_weights(path, tmp_path):
    overrides, loss_kwargs = LOSS_PATHS[path]
    plain = transformers.Trainer(model=gpt2(), train_dataset=Tokens(), args=transformers.TrainingArguments(
        str(tmp_path / "plain"), **{**ARGUMENTS, **overrides}))
    trainer = tiers_trainer(str(tmp_path / "tiers"), CONFIGS["stage0"], **overrides)
    plain.model_accepts_loss_kwargs = trainer.model_accepts_loss_kwargs = loss_kwargs
    plain.train()
    trainer.train()
    assert len(losses_of(trainer)) == STEPS
    assert_close_relative(losses_of(trainer), losses_of(plain))
    assert_close_relative(logged(trainer, "grad_norm"), logged(plain, "grad_norm"))
    assert logged(trainer, "learning_rate") == logged(plain, "learning_rate")  # the rate each update used
    weights = trainer.engine.full_state_dict()
    assert_params_close({n: weights[n] for n, _ in plain.model.named_parameters()},
                        {n: p.detach() for n, p in plain.model.named_parameters()})
    trainer.engine.close()


def test_a_model_loaded_under_the_arguments_zero_init_trains_as_the_plain_one(tmp_path):
    """TiersTrainingArguments.zero_init() around from_pretrained under a stage-3 config: the model arrives as
    shards (their values read at initialize), and trains as plain Trainer on the same pretrained weights."""
    gpt2().save_pretrained(tmp_path / "pretrained")
    config = {**AUTO_BATCH, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    args = TiersTrainingArguments(str(tmp_path / "tiers"), tiers_config=config, **ARGUMENTS)
    with args.zero_init():
        model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    assert zero_init_recording(model) is not None  # built as shards: the values come in at initialize
    trainer = TiersTrainer(model=model, train_dataset=Tokens(), args=args)
    trainer.train()
    plain_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    plain = transformers.Trainer(model=plain_model, train_dataset=Tokens(),
                                 args=transformers.TrainingArguments(str(tmp_path / "plain"), **ARGUMENTS))
    plain.train()
    assert_close_relative(losses_of(trainer), losses_of(plain))
    weights = trainer.engine.full_state_dict()
    assert_params_close({n: weights[n] for n, _ in plain_model.named_parameters()},
                        {n: p.detach() for n, p in plain_model.named_parameters()})
    trainer.engine.close()
    with TiersTrainingArguments(str(tmp_path / "x"), tiers_config=CONFIGS["stage2"], **ARGUMENTS).zero_init():
        assert zero_init_recording(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")) is None


def two_process_worker(rank: int, world: int, root: str) -> dict:
    out = {"ddp": plain_run(os.path.join(root, "ddp"))}
    for name, config in CONFIGS.items():
        out[name] = tiers_run(os.path.join(root, name), config)
    out["ddp-passed"] = plain_run(os.path.join(root, "ddp-passed"), halving_adamw)
    out["stage2-passed"] = tiers_run(os.path.join(root, "stage2-passed"), CONFIGS["stage2"], halving_adamw)
    return out


def test_two_processes_equal_plain_trainer_over_ddp(tmp_path):
    """Every stage, the Trainer's optimizer or the config's, ZeRO-3 with CPU offload, and an optimizer and
    scheduler passed to the Trainer (the engine points that optimizer at its shards; the scheduler still drives
    it)."""
    for result in run_distributed(two_process_worker, 2, (str(tmp_path),), timeout_s=240):
        for name, reference in [*((name, "ddp") for name in CONFIGS), ("stage2-passed", "ddp-passed")]:
            expected_losses, expected_norms, expected = result[reference]
            losses, norms, weights = result[name]
            assert_close_relative(losses, expected_losses)
            assert_close_relative(norms, expected_norms)  # the gradients' scale, which clipping and Adam hide
            assert_params_close(weights, expected)


def test_a_resumed_run_goes_on_as_the_uninterrupted_one(tmp_path):
    config = CONFIGS["stage3-cpu-offload"]
    expected_losses, _, expected = tiers_run(str(tmp_path / "whole"), config)
    first = tiers_trainer(str(tmp_path / "parts"), config, save_strategy="steps", save_steps=2)
    first.train()
    first.engine.close()
    checkpoint = tmp_path / "parts" / "checkpoint-2"
    assert (checkpoint / "latest").exists() and (checkpoint / "model.safetensors").exists()
    resumed = tiers_trainer(str(tmp_path / "parts"), config, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    weights = resumed.engine.full_state_dict()
    assert_close_relative(losses_of(resumed)[-2:], expected_losses[-2:])
    assert_params_close({n: weights[n] for n in expected}, expected)
    # the checkpoint's weights load into the model class, as save_pretrained wrote them
    saved = transformers.GPT2LMHeadModel.from_pretrained(str(checkpoint))
    assert saved.transformer.wte.weight.shape == (128, 32)
    with pytest.raises(ValueError, match="train\\(\\) once per TiersTrainer"):
        resumed.train()
    resumed.engine.close()
    weights_only = tiers_trainer(str(tmp_path / "weights-only"), config, save_strategy="steps", save_steps=2,
                                 save_only_model=True)
    weights_only.train()
    weights_only.engine.close()
    with pytest.raises(ValueError, match="holds no engine checkpoint"):
        tiers_trainer(str(tmp_path / "weights-only"), config).train(
            resume_from_checkpoint=str(tmp_path / "weights-only" / "checkpoint-2"))


def test_runs_the_engine_cannot_follow_are_refused(tmp_path):
    with pytest.raises(ValueError, match="partial accumulation of 1"):
        tiers_trainer(str(tmp_path / "a"), CONFIGS["stage0"], gradient_accumulation_steps=3, max_steps=1).train()
    with pytest.raises(ValueError, match="tensor, pipeline or sequence parallelism is not built yet"):
        tiers_trainer(str(tmp_path / "b"), {**CONFIGS["stage0"], "tensor_parallel": {"size": 1},
                                            "sequence_parallel_size": 2}).train()
    layer_major = {**CONFIGS["stage3-cpu-offload"], "zero_optimization": {
        **CONFIGS["stage3-cpu-offload"]["zero_optimization"], "offload_param": {"device": "cpu", "layer_major": True}}}
    with pytest.raises(ValueError, match="the Trainer calls one micro-batch at a time"):
        tiers_trainer(str(tmp_path / "d"), layer_major).train()
    with pytest.raises(ValueError, match="an optimizer both passed to the Trainer"):
        tiers_trainer(str(tmp_path / "f"), CONFIGS["stage3-cpu-offload"], halving_adamw).train()
    with pytest.raises(ValueError, match="auto_find_batch_size under TiersTrainer is not built yet"):
        tiers_trainer(str(tmp_path / "e"), CONFIGS["stage0"], auto_find_batch_size=True).train()
    with pytest.raises(ValueError, match="TiersTrainerMixin needs the engine.s config"):
        TiersTrainer(model=gpt2(), train_dataset=Tokens(),
                     args=TiersTrainingArguments(str(tmp_path / "c"), **ARGUMENTS)).train()


def test_trls_sft_trainer_with_the_mixin_equals_plain_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    from engine.integrations.hf import TiersTrainerMixin

    class TiersSFTTrainer(TiersTrainerMixin, trl.SFTTrainer):
        pass

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 128)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>", eos_token="<pad>")
    rows = torch.randint(1, 128, (32, 16), generator=torch.Generator().manual_seed(1)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": rows})  # tokenized already: SFTTrainer keeps it as it is

    def run(trainer_class, name: str, **extra):
        # fp32 (SFTConfig defaults to bf16 autocast and checkpointing: both runs would share them, at bf16's precision)
        args = trl.SFTConfig(str(tmp_path / name), pad_token="<pad>", bf16=False, gradient_checkpointing=False,
                             **ARGUMENTS)
        trainer = trainer_class(model=gpt2(), args=args, train_dataset=data, processing_class=tokenizer, **extra)
        trainer.train()
        return trainer

    plain = run(trl.SFTTrainer, "plain")
    tiers = run(TiersSFTTrainer, "tiers", tiers_config=CONFIGS["stage0"])
    assert len(losses_of(tiers)) == STEPS
    assert_close_relative(losses_of(tiers), losses_of(plain))
    weights = tiers.engine.full_state_dict()
    assert_params_close({n: weights[n] for n, _ in plain.model.named_parameters()},
                        {n: p.detach() for n, p in plain.model.named_parameters()})
    tiers.engine.close()


def test_the_arguments_mixed_precision_and_clipping_reach_a_config_without_them(tmp_path):
    """As accelerate completes a DeepSpeed config: bf16 training and clipping by max_grad_norm."""
    trainer = tiers_trainer(str(tmp_path), {"zero_optimization": {"stage": 1}}, bf16=True)
    trainer.train()
    assert trainer.engine.config.bf16.enabled and trainer.engine.config.gradient_clipping == 1.0
    assert all(torch.isfinite(torch.tensor(losses_of(trainer))))
    trainer.engine.close()
