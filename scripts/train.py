"""Train a small byte-level GPT with Tiers: the example job.

    python scripts/train.py                                    # one process
    torchrun --standalone --nproc_per_node 2 scripts/train.py  # data parallel over 2 processes
    python scripts/train.py --config configs/bf16.json --model tiny --steps 50
    torchrun --standalone --nproc_per_node 2 scripts/train.py --config configs/pipeline.json  # 2 stages
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 \
        scripts/train.py --save-every 50 --resume auto

Everything about *how* it trains (batch sizes, optimizer, lr schedule, precision, ZeRO, TensorBoard)
is in the JSON config; this file is an ordinary PyTorch loop around `model_engine = initialize(...)`
(under a pipeline config, one `model_engine.train_batch(...)` per step instead of forward, backward, step).
The lr schedule's total_num_steps is set to --steps, so the cosine decay spans the run.
With --save-every K it saves a checkpoint every K steps into --save-dir (with the data stream's position),
and with --resume auto it continues from the latest complete one: under torchrun --max-restarts, a rank
that dies makes the job restart from there and end as an uninterrupted run would.
"""

import argparse
import gc
import json
import os
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from engine import initialize
from engine.models import PRESETS, TokenBatches, gpt_from_preset, load_corpus

REPO = Path(__file__).resolve().parent.parent
PRINT_EVERY = 10  # optimizer steps between progress lines

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--config", default=str(REPO / "configs" / "dp.json"), help="Tiers JSON config")
parser.add_argument("--model", default="small", choices=sorted(PRESETS), help="GPT preset")
parser.add_argument("--data", default=None, help="a text file to train on (default: the Python stdlib's sources)")
parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
parser.add_argument("--eval-every", type=int, default=50, help="optimizer steps between eval losses")
parser.add_argument("--eval-batches", type=int, default=8, help="micro-batches per rank in one eval")
parser.add_argument("--seed", type=int, default=None, help="default: the config's seed")
parser.add_argument("--block-size", type=int, default=None, help="context length (default: the preset's)")
parser.add_argument("--save-dir", default="checkpoints", help="where --save-every writes and --resume auto looks")
parser.add_argument("--save-every", type=int, default=0, help="optimizer steps between checkpoints (0: never)")
parser.add_argument("--loss-log", default=None,
                    help="append each optimizer step's loss (mean over micro-batches and dp ranks) to this file as "
                         "JSON lines, from rank 0")
parser.add_argument("--resume", default="none",
                    help="'auto': the latest checkpoint in --save-dir if there is one; 'none'; or a checkpoint path")
args = parser.parse_args()
for flag, path in (("--config", args.config), ("--data", args.data)):
    if path is not None and not os.path.isfile(path):
        parser.error(f"{flag} {path}: no such file")
if args.steps < 1 or args.eval_every < 1 or args.eval_batches < 1 or args.save_every < 0:
    parser.error("--steps, --eval-every and --eval-batches must be >= 1, --save-every >= 0")

# ---- config, model, engine -------------------------------------------------------------------
with open(args.config) as f:
    config = json.load(f)
seed = args.seed if args.seed is not None else config.get("seed", 0)
config["seed"] = seed
schedule = config.get("scheduler", {}).get("params", {})
if "total_num_steps" in schedule:
    schedule["total_num_steps"] = args.steps

torch.manual_seed(seed)
model = gpt_from_preset(args.model, **({"block_size": args.block_size} if args.block_size else {}))
model_engine = initialize(model, config)  # starts torch.distributed itself under torchrun
master = model_engine.mesh.world.rank == 0  # one printer, also when tp ranks share a dp rank
device = model_engine.device
pipelined = model_engine.pipeline is not None
block_size = model.config.block_size

tokens = load_corpus(args.data)
batch_args = dict(block_size=block_size, micro_batch_size=model_engine.train_micro_batch_size_per_gpu,
                  seed=seed, rank=model_engine.dp_rank, world_size=model_engine.dp_world_size)
train_batches = TokenBatches(tokens, split="train", **batch_args)
val_batches = TokenBatches(tokens, split="val", **batch_args)
tokens_per_step = model_engine.train_batch_size * block_size  # over all dp ranks

resumed_from = None
fresh_start = args.resume == "auto" and not os.path.isfile(os.path.join(args.save_dir, "latest"))
if args.resume != "none" and not fresh_start:  # the whole training state, and where the data stream was
    where, tag = (args.save_dir, None) if args.resume == "auto" else os.path.split(os.path.abspath(args.resume))
    resumed_from, client_state = model_engine.load_checkpoint(where, tag)
    train_batches.load_state_dict(client_state["train_batches"])

if master:
    print(f"model {args.model}: {model.num_parameters() / 1e6:.2f}M parameters, block size {block_size} | "
          f"data {args.data or 'Python stdlib sources'}: {tokens.numel() / 1e6:.2f}M tokens")
    dp = model_engine.dp_world_size
    print(f"config {args.config} | {dp} dp rank(s) on {device} | batch {model_engine.train_batch_size} = "
          f"{model_engine.train_micro_batch_size_per_gpu} micro x {model_engine.gradient_accumulation_steps} "
          f"accumulation x {dp} ranks = {tokens_per_step:,} tokens/step | {args.steps} steps", flush=True)


def mean_over_ranks(value: float) -> float:
    if model_engine.dp_world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=model_engine.dp_group)
    return t.item() / model_engine.dp_world_size


@torch.no_grad()
def evaluate() -> float:
    """Mean loss over the same --eval-batches val batches every time (per rank), averaged over ranks."""
    model_engine.eval()
    val_batches.reset()
    if pipelined:  # whole steps of micro-batches through the schedule; eval_batch averages over the ranks
        rounds = max(args.eval_batches // model_engine.gradient_accumulation_steps, 1)
        total = sum(model_engine.eval_batch(step_micro_batches_of(val_batches)) for _ in range(rounds))
        model_engine.train()
        return total / rounds
    total = 0.0
    for _ in range(args.eval_batches):
        batch = val_batches.next_batch()
        total += model_engine(batch["input_ids"].to(device), batch["labels"].to(device)).item()
    model_engine.train()
    return mean_over_ranks(total / args.eval_batches)


def step_micro_batches_of(batches: TokenBatches):
    """An iterator over one step's micro-batches, as train_batch / eval_batch take them."""
    return iter([{"input_ids": b["input_ids"].to(device), "labels": b["labels"].to(device)}
                 for b in (batches.next_batch() for _ in range(model_engine.gradient_accumulation_steps))])


def memory() -> str:
    shown = f"rss {psutil.Process().memory_info().rss / 2**20:,.0f} MiB"
    if device.type == "cuda":
        shown += f", cuda {torch.cuda.memory_allocated(device) / 2**20:,.0f} MiB"
    return shown


def duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


# ---- training loop: one micro-batch per iteration (a whole step under a pipeline); the engine updates every
# accumulation boundary ----
eval_loss = evaluate()
if master:
    resumed = f" | resumed from {resumed_from}" if resumed_from else ""
    print(f"step {model_engine.global_step:>5}/{args.steps} | eval loss {eval_loss:.4f}{resumed}", flush=True)
train_loss = last_step_loss = float("nan")
loss_sum, loss_count = torch.zeros((), device=device), 0
step_loss_sum, step_micro_batches = 0.0, 0
loss_log = open(args.loss_log, "a") if args.loss_log and master else None
t_start = t_mark = time.perf_counter()
step_at_mark = first_step = model_engine.global_step
while model_engine.global_step < args.steps:
    if pipelined:  # the step's micro-batches through the pipeline schedule, and the update
        loss = torch.tensor(model_engine.train_batch(step_micro_batches_of(train_batches)))
        updated = True
    else:
        batch = train_batches.next_batch()
        loss = model_engine(batch["input_ids"].to(device), batch["labels"].to(device))
        model_engine.backward(loss)
        updated = model_engine.is_gradient_accumulation_boundary()
        model_engine.step()
    loss_sum += loss.detach().float()
    loss_count += 1
    if args.loss_log:
        step_loss_sum, step_micro_batches = step_loss_sum + loss.item(), step_micro_batches + 1
    if not updated:
        continue

    step = model_engine.global_step
    if args.loss_log:
        step_loss = mean_over_ranks(step_loss_sum / step_micro_batches)
        step_loss_sum, step_micro_batches = 0.0, 0
        if loss_log:
            loss_log.write(json.dumps({"step": step, "loss": step_loss}) + "\n")
            loss_log.flush()
    last = step == args.steps
    if last:
        last_step_loss = mean_over_ranks(loss.item())
    if args.save_every and step % args.save_every == 0:
        model_engine.save_checkpoint(args.save_dir, client_state={"train_batches": train_batches.state_dict()})
    if step % PRINT_EVERY == 0 or last:
        elapsed = time.perf_counter() - t_mark
        per_step = elapsed / (step - step_at_mark)
        train_loss = mean_over_ranks(loss_sum.item() / loss_count)  # mean over the steps since the last line
        loss_sum.zero_()
        loss_count = 0
        if master:
            print(f"step {step:>5}/{args.steps} | loss {train_loss:.4f} | lr {model_engine.get_lr()[0]:.2e} | "
                  f"{tokens_per_step / per_step:,.0f} tok/s | {memory()} | "
                  f"eta {duration((args.steps - step) * per_step)}", flush=True)
    if step % args.eval_every == 0 or last:
        eval_loss = evaluate()
        if master:
            print(f"step {step:>5}/{args.steps} | eval loss {eval_loss:.4f}", flush=True)
    if step % PRINT_EVERY == 0 or step % args.eval_every == 0:
        t_mark, step_at_mark = time.perf_counter(), step  # throughput and ETA leave eval time out

# ---- summary ------------------------------------------------------------------------------------
if loss_log:
    loss_log.close()
if master:
    print(f"done: {args.steps - first_step} steps in {duration(time.perf_counter() - t_start)} | "
          f"final train loss {train_loss:.4f} | final eval loss {eval_loss:.4f} | last step loss {last_step_loss!r}")
    log_dir = getattr(model_engine.monitor, "log_dir", None)
    print(f"tensorboard: tensorboard --logdir {log_dir}" if log_dir else "tensorboard: off (enable it in the config)",
          flush=True)
model_engine.close()
# The engine holds its process groups. Free it (and the model its hooks hang on) before destroying them, so gloo's
# worker threads are joined now and not during interpreter shutdown, where one can abort the process (see the note
# at the top of engine/topology.py).
model_engine = model = None
gc.collect()
if dist.is_initialized():
    dist.destroy_process_group()
