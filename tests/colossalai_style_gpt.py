"""A training script written for ColossalAI, in the shape of its examples/language/gpt/gemini/train_gpt_demo.py: the
demo's GPTLMModel (a Hugging Face GPT-2) built under LazyInitContext, random token batches, GPTLMLoss, a plugin by
name (the demo's --distplan), booster.boost / backward / step, then the model and optimizer saved sharded and loaded
into a freshly boosted model. Its imports are ColossalAI's; it runs under `tiers launch --as-colossalai
--nproc_per_node 2` (tests/test_colossalai_launch.py) and rank 0 writes what it saw.

    tiers launch --as-colossalai --nproc_per_node 2 tests/colossalai_style_gpt.py --distplan CAI_TP2 \\
        --checkpoint ckpt --out result.pt
"""

import argparse

import colossalai
import torch
from colossalai.accelerator import get_accelerator
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin
from colossalai.cluster import DistCoordinator
from colossalai.lazy import LazyInitContext
from colossalai.nn.optimizer import HybridAdam

from tests.colossalai_style_gpt_model import LR, STEPS, GPTLMLoss, gpt2_tiny, token_batch

PLANS = {
    "CAI_TP2": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", max_norm=1.0),
    "CAI_ZeRO2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", max_norm=1.0),
}


def boosted(plan: str, seed: int):
    booster = Booster(plugin=PLANS[plan]())
    with LazyInitContext(default_device=get_accelerator().get_current_device()):
        model = gpt2_tiny(seed)
    optimizer = HybridAdam(model.parameters(), lr=LR, weight_decay=0.0)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def run(plan: str, args, coordinator) -> dict:
    booster, model, optimizer = boosted(plan, seed=0)
    criterion = GPTLMLoss()
    losses = []
    for step in range(STEPS):
        input_ids = token_batch(step).to(get_accelerator().get_current_device())  # the whole batch on every rank
        attn_mask = torch.ones_like(input_ids)
        outputs = model(input_ids, attn_mask)
        loss = criterion(outputs, input_ids)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    directory = f"{args.checkpoint}/{plan}"
    booster.save_model(model, f"{directory}/model", shard=True, size_per_shard=1)
    booster.save_optimizer(optimizer, f"{directory}/optimizer", shard=True, size_per_shard=1)
    fresh, other, other_optimizer = boosted(plan, seed=5)
    fresh.load_model(other, f"{directory}/model")
    fresh.load_optimizer(other_optimizer, f"{directory}/optimizer")
    fresh.save_model(other, f"{directory}/model_reloaded.bin")  # what the fresh one holds now, in one file each
    fresh.save_optimizer(other_optimizer, f"{directory}/optimizer_reloaded.bin")
    return {"losses": losses}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--distplan", type=str, default="CAI_TP2", help="comma-separated, of " + ", ".join(PLANS))
    parser.add_argument("--checkpoint", type=str, default="./checkpoint")
    parser.add_argument("--out", type=str, required=True)
    args = parser.parse_args()

    colossalai.launch_from_torch()
    coordinator = DistCoordinator()
    results = {plan: run(plan, args, coordinator) for plan in args.distplan.split(",")}
    if coordinator.is_master():
        torch.save(results, args.out)
    coordinator.block_all()


if __name__ == "__main__":
    main()
