"""A training script written for DeepSpeed, in the shape of DeepSpeed's CIFAR example, with one line changed:
`import deepspeed` became `from engine.compat import deepspeed`. tests/test_deepspeed_compat.py runs it under
torchrun on 2 ranks.

    torchrun --nproc_per_node 2 tests/deepspeed_style_train.py --deepspeed --deepspeed_config ds.json \\
        --epochs 2 --checkpoint_dir ckpt --out result.pt [--resume] [--stop_after_epoch 0]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.compat import deepspeed  # was: import deepspeed


def get_args():
    parser = argparse.ArgumentParser(description="a DeepSpeed user's classifier")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data")
    parser.add_argument("--checkpoint_dir", type=str, required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--stop_after_epoch", type=int, default=-1)
    parser.add_argument("--out", type=str, required=True, help="where each rank writes what it saw")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc1 = nn.Linear(6 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def trainset():
    g = torch.Generator().manual_seed(7)
    images, labels = torch.randn(50, 3, 8, 8, generator=g), torch.randint(0, 10, (50,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def main():
    args = get_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                                   training_data=trainset())
    criterion = nn.CrossEntropyLoss()
    start_epoch, seen = 0, {"losses": [], "applied": [], "batches": []}
    if args.resume:
        _, client_state = model_engine.load_checkpoint(args.checkpoint_dir)
        start_epoch = client_state["epoch"] + 1
    for epoch in range(start_epoch, args.epochs):
        trainloader.data_sampler.set_epoch(epoch)
        for data in trainloader:
            inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
            if model_engine.bfloat16_enabled():
                inputs = inputs.to(torch.bfloat16)
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            seen["losses"].append(loss.item())
            seen["applied"].append(model_engine.was_step_applied())
            seen["batches"].append(labels.tolist())
        model_engine.save_checkpoint(args.checkpoint_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch})
        if epoch == args.stop_after_epoch:
            break
    seen["accessors"] = {"global_rank": model_engine.global_rank, "world_size": model_engine.world_size,
                         "local_rank": model_engine.local_rank, "micro": model_engine.train_micro_batch_size_per_gpu(),
                         "accumulation": model_engine.gradient_accumulation_steps(),
                         "batch": model_engine.train_batch_size(), "stage": model_engine.zero_optimization_stage(),
                         "bf16": model_engine.bfloat16_enabled(), "fp16": model_engine.fp16_enabled(),
                         "steps": model_engine.global_steps, "norm": model_engine.get_global_grad_norm()}
    seen["state"] = model_engine.full_state_dict()
    torch.save(seen, f"{args.out}.rank{model_engine.global_rank}")


if __name__ == "__main__":
    main()
