"""Ray Train over a Tiers engine: `initialize` inside a TorchTrainer worker trains under the process group Ray set up.

The user script (tests/ray_scripts/train_gpt.py) starts a local Ray cluster and a TorchTrainer of 2 CPU workers,
each training a small GPT-2 from transformers at ZeRO-2 on its half of every batch. The reference is plain PyTorch
in one process on the whole batches: the workers' mean loss per step and the final weights at fp32 1e-5.
"""

import importlib.util
from pathlib import Path

import torch

from tests.distributed import run_user_script
from tests.reference import assert_close_relative, assert_params_close

SCRIPT = Path(__file__).resolve().parent / "ray_scripts" / "train_gpt.py"


def _script():
    spec = importlib.util.spec_from_file_location("ray_train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_pytorch(script) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model, data and optimizer in one process, each step on the 2 workers' batches together."""
    model = script.gpt()
    params = script.CONFIG["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], eps=params["eps"],
                                  weight_decay=params["weight_decay"])
    losses = []
    for ids in script.tokens().split(2 * script.BATCH):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), script.CONFIG["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_two_ray_workers_train_as_one_process(tmp_path):
    run_user_script(SCRIPT, ["--out", str(tmp_path)], cwd=tmp_path, timeout_s=300)
    workers = [torch.load(tmp_path / f"worker{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert [w["world"] for w in workers] == [2, 2]  # the engine runs over Ray's 2-process group
    losses, weights = plain_pytorch(_script())
    assert_close_relative([(a + b) / 2 for a, b in zip(workers[0]["losses"], workers[1]["losses"])], losses)
    for worker in workers:
        assert_params_close({name: worker["state"][name] for name in weights}, weights)
