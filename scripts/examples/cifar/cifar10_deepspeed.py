"""DeepSpeedExamples' training/cifar/cifar10_deepspeed.py in its own shape (the same calls in the same order, its
imports unchanged), for `tiers launch --as-deepspeed`. Adapted for a CPU-only machine without torchvision: the
CIFAR-10 sets are random images of CIFAR's shape (FakeCIFAR10, --train-size / --test-size images), and the
transforms are left out (the images are already normalized tensors); the config leaves out two keys at their off
values that this Tiers config does not read yet (zero_optimization.cpu_offload and fp16.fp16_master_weights_and_grads,
both false); the per-class accuracy table is left out.

    tiers launch --as-deepspeed --num_gpus 2 scripts/examples/cifar/cifar10_deepspeed.py --dtype fp32 --epochs 1 \\
        [--moe --num-experts 2 --moe-param-group] [--stage 2]
"""

import argparse
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=30, type=int, help="number of total epochs (default: 30)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2000, help="output logging information at an interval")
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="number of experts list")
    parser.add_argument("--mlp-type", type=str, default="standard", help="[standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int, help="(moe) minimum capacity of an expert")
    parser.add_argument("--noisy-gate-policy", default=None, type=str, help="(moe) None, RSample or Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true", help="(moe) separate param groups")
    parser.add_argument("--train-size", default=50000, type=int, help="images in the fake training set")
    parser.add_argument("--test-size", default=10000, type=int, help="images in the fake test set")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    return args


class FakeCIFAR10(torch.utils.data.Dataset):
    """CIFAR-10's shape: normalized 3x32x32 images and labels 0-9, each drawn from its index."""

    def __init__(self, root, train, download, transform=None, size=50000):
        self.size, self.offset = size, 0 if train else 10**6

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + index)
        return torch.rand(3, 32, 32, generator=g) * 2 - 1, int(torch.randint(10, (1,), generator=g))


def create_moe_param_groups(model):
    """Create separate parameter groups for each expert."""
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    """Get the DeepSpeed configuration dictionary."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                 "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True},
    }


class Net(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList([
                deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                                        use_residual=args.mlp_type == "residual", k=args.top_k,
                                        min_capacity=args.min_capacity, noisy_gate_policy=args.noisy_gate_policy)
                for n_e in args.num_experts])
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def test(model_engine, testset, local_device, target_dtype, test_batch_size=4):
    """Accuracy on the test set (rank 0 prints it)."""
    testloader = torch.utils.data.DataLoader(testset, batch_size=test_batch_size, shuffle=False, num_workers=0)
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total : .0f} %")


def main(args):
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()  # (the example lets rank 0 download first)
    trainset = FakeCIFAR10(root="./data", train=True, download=True, size=args.train_size)
    testset = FakeCIFAR10(root="./data", train=False, download=True, size=args.test_size)
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
    print("Finished Training")
    test(model_engine, testset, local_device, target_dtype)


if __name__ == "__main__":
    main(add_argument())
