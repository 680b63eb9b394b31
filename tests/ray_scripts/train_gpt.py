"""A Ray Train user's script: `python train_gpt.py --out DIR`. A local Ray cluster runs a TorchTrainer of 2 CPU
workers. Each worker wraps a small GPT-2 from transformers with Tiers' initialize (under the process group Ray set
up), trains on its share of each batch (ray.train.torch.prepare_data_loader adds the distributed sampler), and
writes its losses and the final weights to DIR/worker<rank>.pt."""

import argparse
import os

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_data_loader
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from engine import initialize

VOCAB, SEQ, SAMPLES, BATCH = 96, 16, 32, 4
CONFIG = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1}},
          "zero_optimization": {"stage": 2, "chunk_size": 4096}}


def gpt() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))


def train_loop_per_worker(settings: dict) -> None:
    engine = initialize(gpt(), settings["config"])  # the process group is Ray's
    losses = []
    for ids in prepare_data_loader(DataLoader(tokens(), batch_size=BATCH)):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    rank = ray.train.get_context().get_world_rank()
    torch.save({"losses": losses, "state": state, "world": engine.dp_world_size},
               os.path.join(settings["out"], f"worker{rank}.pt"))
    ray.train.report({"loss": losses[-1]})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False)
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={"config": CONFIG, "out": args.out},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=os.path.join(args.out, "ray_results")))
    trainer.fit()


if __name__ == "__main__":
    main()
