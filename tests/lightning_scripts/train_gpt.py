"""A Lightning user's script: `python train_gpt.py --out DIR`. Lightning's launcher starts the second process (it
runs this script again). A small GPT-2 from transformers trains with AdamW, a warmup schedule stepped by Lightning,
accumulation 2 and clipping 1.0, under strategy="ddp" (the reference) and under TiersStrategy; then the same loop in
Fabric under DDP and under TiersFabricStrategy. Each process writes its losses and the final weights (rank 0) to
DIR/rank<r>.pt."""

import argparse
import os
from contextlib import nullcontext

import lightning as L
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from engine.integrations.lightning import TiersFabricStrategy, TiersStrategy

VOCAB, SEQ, SAMPLES, BATCH = 96, 16, 64, 4
ACCUMULATION, CLIP, EPOCH_STEPS = 2, 1.0, 4  # 64 samples / 2 processes / 4 per batch / 2 per update

ZERO_2 = {"zero_optimization": {"stage": 2, "chunk_size": 4096}}
ZERO_3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "train_batch_size": "auto",  # the default persistence threshold: biases and
          "zero_optimization": {"stage": 3, "chunk_size": 4096}}    # norms whole, the rest sharded (two chunk kinds)


def gpt() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def loader() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens), batch_size=BATCH)


def optimizer_and_warmup(parameters):
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, eps=1e-6, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return optimizer, warmup


class GPTModule(L.LightningModule):
    def __init__(self, loss_ceiling: float = float("inf")):
        super().__init__()
        self.save_hyperparameters()  # an infinite float: not JSON, saved beside the engine's checkpoint
        self.model = gpt()

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer, warmup = optimizer_and_warmup(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(strategy, ckpt_path=None, checkpoint_dir=None, precision="32-true"):
    """Two epochs; with checkpoint_dir, a checkpoint after each epoch's last batch (epoch=0-step=4.ckpt, ...)."""
    module, callbacks = GPTModule(), [LossRecorder()]
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_train_steps=EPOCH_STEPS))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2 * EPOCH_STEPS,
                        accumulate_grad_batches=ACCUMULATION, gradient_clip_val=CLIP, callbacks=callbacks,
                        logger=False, enable_checkpointing=checkpoint_dir is not None, enable_progress_bar=False,
                        enable_model_summary=False, precision=precision)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": callbacks[0].losses, "state": state, "rank": trainer.global_rank}


def fabric_run(strategy, tiers: bool, save_to=None, resume_from=None):
    """Fabric's loop as its docs write accumulation (under Tiers the config clips; fabric.clip_gradients is DDP's);
    two epochs, or with resume_from the second one after fabric.load; with save_to, fabric.save after the first."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = gpt()
    optimizer, warmup = optimizer_and_warmup(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    data = fabric.setup_dataloaders(loader())
    state = {"model": model, "optimizer": optimizer, "scheduler": warmup, "epoch": 0}
    if resume_from is not None:
        fabric.load(resume_from, state)
    losses = []
    for epoch in range(state["epoch"], 2):
        for i, (ids,) in enumerate(data):
            accumulating = (i + 1) % ACCUMULATION != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = model(input_ids=ids, labels=ids).loss
                fabric.backward(loss / ACCUMULATION)
            losses.append(loss.item())
            if not accumulating:
                if not tiers:
                    fabric.clip_gradients(model, optimizer, max_norm=CLIP)
                optimizer.step()
                optimizer.zero_grad()
                warmup.step()
        if save_to is not None and epoch == 0:
            fabric.save(save_to, {**state, "epoch": 1})
    weights = fabric.strategy.get_module_state_dict(model._forward_module) if tiers else model.state_dict()
    return {"losses": losses, "state": weights, "rank": fabric.global_rank}


def refused(run) -> str | None:
    """The message of what `run` raised on this process (every process raises it alike), or None."""
    try:
        run()
    except (ValueError, RuntimeError, TypeError) as e:
        return str(e)
    return None


def fabric_loop(strategy, accumulating, clip: bool = False, declare: bool = True, zero_grad: str = "after_step",
                steps: int = 4, load_model_only=None):
    """A Fabric loop stepping where accumulating(i) is False; declare: say so with no_backward_sync; zero_grad:
    "after_step", "every_batch" (before its forward) or "never"; load_model_only: a checkpoint fabric.load restores
    without the model."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model, optimizer = fabric.setup(*optimizer_and_warmup_setup())
    if load_model_only is not None:
        fabric.load(load_model_only, {"optimizer": optimizer})
    for i, (ids,) in zip(range(steps), fabric.setup_dataloaders(loader())):
        if zero_grad == "every_batch":
            optimizer.zero_grad()
        with fabric.no_backward_sync(model, enabled=accumulating(i)) if declare else nullcontext():
            fabric.backward(model(input_ids=ids, labels=ids).loss)
        if not accumulating(i):
            if clip:
                fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            if zero_grad == "after_step":
                optimizer.zero_grad()


def optimizer_and_warmup_setup():
    model = gpt()
    return model, optimizer_and_warmup(model.parameters())[0]


class GradNormLogger(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.log("grad_norm", torch.stack([p.grad.norm() for p in pl_module.parameters()]).norm())


def trainer_fit(strategy, **arguments):
    trainer = L.Trainer(**{**dict(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False),
                           **arguments})
    trainer.fit(GPTModule(), loader())


def refusals(fabric_checkpoint: str) -> dict[str, str | None]:
    fabric_config = {**ZERO_2, "gradient_accumulation_steps": ACCUMULATION}
    with_optimizer = {**ZERO_2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    every_second = lambda i: (i + 1) % ACCUMULATION != 0  # noqa: E731
    return {
        "accumulation_schedule": refused(lambda: trainer_fit(TiersStrategy(ZERO_2), callbacks=[
            GradientAccumulationScheduler({0: 1, 1: 2})])),
        "sync_batchnorm": refused(lambda: trainer_fit(TiersStrategy(ZERO_2), sync_batchnorm=True)),
        "gradient_hook": refused(lambda: trainer_fit(TiersStrategy(ZERO_2), callbacks=[GradNormLogger()])),
        "ddp_arguments": refused(lambda: TiersStrategy(ZERO_2, find_unused_parameters=True)),
        "fabric_zero_grad_inside": refused(lambda: fabric_loop(TiersFabricStrategy(fabric_config), every_second,
                                                               zero_grad="every_batch")),
        "fabric_no_zero_grad": refused(lambda: fabric_loop(TiersFabricStrategy(fabric_config), every_second,
                                                           zero_grad="never")),
        "fabric_load_without_model": refused(lambda: fabric_loop(TiersFabricStrategy(fabric_config), every_second,
                                                                 load_model_only=fabric_checkpoint)),
        "partial_accumulation": refused(lambda: trainer_fit(TiersStrategy(ZERO_2), accumulate_grad_batches=3)),
        "accumulation_contradiction": refused(lambda: trainer_fit(
            TiersStrategy({**ZERO_2, "gradient_accumulation_steps": 4}), accumulate_grad_batches=2)),
        "clip_by_value": refused(lambda: trainer_fit(TiersStrategy(ZERO_2), gradient_clip_val=1.0,
                                                     gradient_clip_algorithm="value")),
        "half_true": refused(lambda: trainer_fit(TiersStrategy(ZERO_2), precision="bf16-true")),
        "config_and_module_optimizers": refused(lambda: trainer_fit(TiersStrategy(with_optimizer))),
        "fabric_docs_accumulation": refused(lambda: fabric_loop(TiersFabricStrategy(fabric_config),
                                                               lambda i: i % ACCUMULATION != 0)),
        "fabric_clip": refused(lambda: fabric_loop(TiersFabricStrategy(fabric_config),
                                                   lambda i: (i + 1) % ACCUMULATION != 0, clip=True)),
        "fabric_early_step": refused(lambda: fabric_loop(TiersFabricStrategy(
            {**ZERO_2, "gradient_accumulation_steps": 4}), lambda i: (i + 1) % ACCUMULATION != 0, declare=False)),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checkpoints = os.path.join(args.out, "checkpoints")
    results = {"ddp": fit("ddp"),
               "tiers_zero2": fit(TiersStrategy(ZERO_2), checkpoint_dir=checkpoints),
               "tiers_zero3": fit(TiersStrategy(ZERO_3)),
               "ddp_bf16": fit("ddp", precision="bf16-mixed"),
               "tiers_bf16": fit(TiersStrategy(ZERO_2), precision="bf16-mixed")}
    first_epoch = os.path.join(checkpoints, f"epoch=0-step={EPOCH_STEPS}.ckpt")
    results["tiers_resumed"] = fit(TiersStrategy(ZERO_2), ckpt_path=first_epoch)
    fabric_zero2 = {**ZERO_2, "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ACCUMULATION,
                    "gradient_clipping": CLIP}
    fabric_checkpoint = os.path.join(args.out, "fabric-epoch-1")
    results["fabric_ddp"] = fabric_run("ddp", tiers=False)
    results["fabric_tiers_zero2"] = fabric_run(TiersFabricStrategy(fabric_zero2), tiers=True, save_to=fabric_checkpoint)
    results["fabric_tiers_resumed"] = fabric_run(TiersFabricStrategy(fabric_zero2), tiers=True,
                                                 resume_from=fabric_checkpoint)
    results["refusals"] = refusals(fabric_checkpoint)
    rank = results["ddp"]["rank"]
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
