"""A training script written for ColossalAI, in the shape of its examples/images/resnet/train.py (a plugin chosen on
the command line, launch_from_torch, DistCoordinator, HybridAdam, the plugin's data loader, a scheduler stepped per
epoch, the model saved and loaded back through the booster), its imports as ColossalAI's. It runs under
`tiers launch --as-colossalai --nproc_per_node 2` (tests/test_colossalai_launch.py), which answers `import colossalai`
with engine.compat.colossalai; it trains each plugin given in turn and rank 0 writes what it saw.

    tiers launch --as-colossalai --nproc_per_node 2 tests/colossalai_style_train.py --plugin torch_ddp,gemini \\
        --checkpoint ckpt --out result.pt
"""

import argparse

import colossalai
import torch
import torch.nn as nn
from colossalai.accelerator import get_accelerator
from colossalai.booster import Booster
from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from colossalai.booster.plugin.dp_plugin_base import DPPluginBase
from colossalai.cluster import DistCoordinator
from colossalai.nn.optimizer import HybridAdam
from torch.optim.lr_scheduler import MultiStepLR

from tests.colossalai_style_model import LEARNING_RATE, Net, trainset

EPOCHS = 2
BATCH_SIZE = 4

PLUGINS = {
    "torch_ddp": lambda: TorchDDPPlugin(),
    "low_level_zero_1_cpu_offload": lambda: LowLevelZeroPlugin(stage=1, precision="fp32", cpu_offload=True),
    "low_level_zero_2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", max_norm=1.0),
    "gemini_static": lambda: GeminiPlugin(placement_policy="static", precision="bf16", shard_param_frac=1.0,
                                          offload_optim_frac=1.0, offload_param_frac=1.0),
    "gemini_auto": lambda: GeminiPlugin(placement_policy="auto", precision="bf16"),
}


def train_epoch(epoch, model, optimizer, criterion, train_dataloader, booster, coordinator, losses):
    model.train()
    for images, labels in train_dataloader:
        images = images.to(get_accelerator().get_current_device())
        labels = labels.to(get_accelerator().get_current_device())
        outputs = model(images)
        loss = criterion(outputs.float(), labels)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / coordinator.world_size)


def run(name, args, coordinator):
    plugin = PLUGINS[name]()
    booster = Booster(plugin=plugin)
    train_dataloader = plugin.prepare_dataloader(trainset(), batch_size=BATCH_SIZE, shuffle=False, drop_last=True)
    model = Net()
    criterion = nn.CrossEntropyLoss()
    optimizer = HybridAdam(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    lr_scheduler = MultiStepLR(optimizer, milestones=[1], gamma=0.5)
    model, optimizer, criterion, _, lr_scheduler = booster.boost(model, optimizer, criterion=criterion,
                                                                 lr_scheduler=lr_scheduler)
    assert isinstance(plugin, DPPluginBase)
    losses = []
    for epoch in range(EPOCHS):
        train_epoch(epoch, model, optimizer, criterion, train_dataloader, booster, coordinator, losses)
        lr_scheduler.step()
    saved_dir = f"{args.checkpoint}/{name}"
    booster.save_model(model, saved_dir, shard=True, size_per_shard=1, use_safetensors=True)
    booster.save_optimizer(optimizer, f"{saved_dir}_optimizer", shard=True, size_per_shard=1)
    booster.save_lr_scheduler(lr_scheduler, f"{args.checkpoint}/{name}_lr_scheduler.pth")
    fresh = Booster(plugin=PLUGINS[name]())
    other = Net(seed=5)
    other_optimizer = HybridAdam(other.parameters(), lr=LEARNING_RATE)
    other_scheduler = MultiStepLR(other_optimizer, milestones=[1], gamma=0.5)
    other, other_optimizer, _, _, other_scheduler = fresh.boost(other, other_optimizer, lr_scheduler=other_scheduler)
    fresh.load_model(other, saved_dir)
    fresh.load_optimizer(other_optimizer, f"{saved_dir}_optimizer")
    fresh.load_lr_scheduler(other_scheduler, f"{args.checkpoint}/{name}_lr_scheduler.pth")
    fresh.save_model(other, f"{saved_dir}_reloaded.pt")  # what the freshly boosted model holds now, in one file
    fresh.save_optimizer(other_optimizer, f"{saved_dir}_optimizer_reloaded.pt")  # and its optimizer states
    return {"losses": losses, "lr": other_scheduler.get_last_lr(), "trained_lr": lr_scheduler.get_last_lr()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--plugin", type=str, default="torch_ddp",
                        help="comma-separated, of " + ", ".join(PLUGINS))
    parser.add_argument("-c", "--checkpoint", type=str, default="./checkpoint")
    parser.add_argument("--out", type=str, required=True)
    args = parser.parse_args()

    colossalai.launch_from_torch()
    coordinator = DistCoordinator()
    results = {name: run(name, args, coordinator) for name in args.plugin.split(",")}
    if coordinator.is_master():
        torch.save(results, args.out)
    coordinator.block_all()


if __name__ == "__main__":
    main()
