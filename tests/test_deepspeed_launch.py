"""`tiers launch --as-deepspeed`: DeepSpeed scripts run with their own imports (Note [the deepspeed shim]).

The GAN of DeepSpeedExamples (tests/deepspeed_examples/gan, its CUDA lines on the CPU) on 2 ranks must give plain
PyTorch's per-iteration losses: each rank loads the whole fake dataset with the same seed, so both ranks see the
same batches and noise, and DeepSpeed's data-parallel mean of equal gradients is one process's gradient. The
discriminator takes two backward passes per step (real, then fake) and the generator's backward runs through the
discriminator between its zero_grad() calls: a second all-reduce of the first gradients, or the generator's
gradients left in the discriminator's update, changes the losses."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.launcher import LaunchOptions, make_plan, node_commands
from engine.launcher.commands import DEEPSPEED_SCRIPT, SHIM_DIR
from tests.distributed import free_port
from tests.reference import assert_close_relative

REPO = Path(__file__).resolve().parent.parent
GAN = REPO / "tests" / "deepspeed_examples" / "gan"
GAN_ARGS = ["--dataset", "fake", "--workers", "0", "--batchSize", "8", "--nz", "8", "--ngf", "4", "--ndf", "4",
            "--fake_size", "96"]


def _child_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}
    return {**env, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}


def _module_from(path: Path):
    spec = importlib.util.spec_from_file_location(f"gan_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_pytorch_gan(lr: float = 0.0002, beta1: float = 0.5) -> list[tuple[float, ...]]:
    """The GAN loop of gan_deepspeed_train.py in one process with torch alone: loss.backward() and the optimizers'
    own step (the example's "alternative (equivalent) step")."""
    model, utils = _module_from(GAN / "gan_model.py"), _module_from(GAN / "utils.py")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each launched rank (OMP_NUM_THREADS=1): the same summation order in convolutions
    args = utils.get_argument_parser().parse_args(GAN_ARGS)
    utils.set_seed(args.manualSeed)
    dataset = utils.FakeData(size=args.fake_size, image_size=(3, args.imageSize, args.imageSize))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batchSize, shuffle=True, num_workers=0)
    netG = model.Generator(0, args.ngf, 3, args.nz)
    netG.apply(model.weights_init)
    netD = model.Discriminator(0, args.ndf, 3)
    netD.apply(model.weights_init)
    criterion = nn.BCELoss()
    torch.randn(args.batchSize, args.nz, 1, 1)  # the example's fixed_noise
    optD = torch.optim.Adam(netD.parameters(), lr=lr, betas=(beta1, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=lr, betas=(beta1, 0.999))
    losses = []
    for data in loader:
        netD.zero_grad()
        real = data[0]
        label = torch.full((real.size(0),), 1, dtype=real.dtype)
        output = netD(real)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()
        fake = netG(torch.randn(real.size(0), args.nz, 1, 1))
        label.fill_(0)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        optD.step()
        netG.zero_grad()
        label.fill_(1)
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        optG.step()
        losses.append(((errD_real + errD_fake).item(), errG.item(), D_x, D_G_z1, output.mean().item()))
    torch.set_num_threads(threads)
    return losses


def test_the_gan_example_runs_unchanged_on_two_ranks_and_matches_plain_pytorch(tmp_path):
    out = tmp_path / "losses"
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--as-deepspeed", "--num_gpus", "2", "--master_port",
           str(free_port()), str(GAN / "gan_deepspeed_train.py"), *GAN_ARGS, "--outf", str(tmp_path / "out"),
           "--losses_out", str(out), "--deepspeed", "--deepspeed_config", str(GAN / "gan_deepspeed_config.json")]
    run = subprocess.run(cmd, cwd=tmp_path, env={**_child_env(tmp_path), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = plain_pytorch_gan()
    assert len(expected) == 12
    for rank in range(2):
        seen = torch.load(f"{out}.rank{rank}")
        for column in range(5):  # Loss_D, Loss_G, D(x), D(G(z)) before and after D's step
            assert_close_relative([s[column] for s in seen], [e[column] for e in expected])


PROBE = """
import argparse, sys
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import FusedAdam
from deepspeed.utils import logger, RepeatingLoader
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
import engine.compat.deepspeed.ops.adam as compat_adam
assert FusedAdam is compat_adam.FusedAdam and sys.modules["deepspeed.ops.adam"] is compat_adam
try:
    import deepspeed.inference
except ModuleNotFoundError as e:
    assert "deepspeed.inference" in str(e)
else:
    raise AssertionError("deepspeed.inference imported")
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--x")
args = parser.parse_args()
print(deepspeed.__name__, dist.__name__, args.local_rank, args.x, sys.path[0], get_accelerator().device_name())
"""


def test_the_shim_answers_deepspeed_imports_only_in_the_launched_processes(tmp_path):
    """The command each node runs starts the script through the bootstrap with the shim first on PYTHONPATH;
    a process started so gets `--local_rank=N` first and the compat layer for `import deepspeed` (the same module
    objects), while this test process finds no deepspeed at all."""
    assert importlib.util.find_spec("deepspeed") is None
    with pytest.raises(ImportError, match="import engine.compat.deepspeed instead"):
        importlib.import_module("engine.compat.shim.deepspeed")  # never a second name for the compat layer
    plan = make_plan(LaunchOptions(script="probe.py", script_args=("--x", "5"), nproc_per_node=2, as_deepspeed=True),
                     environ={"PYTHONPATH": "/elsewhere"}, cwd=str(tmp_path))
    (command,) = node_commands(plan)
    assert command.argv[-4:] == (DEEPSPEED_SCRIPT, "probe.py", "--x", "5")
    assert command.env["PYTHONPATH"].split(os.pathsep) == [SHIM_DIR, str(REPO), "/elsewhere"]
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**_child_env(tmp_path), "PYTHONPATH": command.env["PYTHONPATH"], "LOCAL_RANK": "1"}
    run = subprocess.run([sys.executable, DEEPSPEED_SCRIPT, "probe.py", "--x", "5"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["engine.compat.deepspeed", "engine.compat.deepspeed.comm", "1", "5", str(tmp_path),
                                  "cpu"]
    run = subprocess.run([sys.executable, DEEPSPEED_SCRIPT, "probe.py"], cwd=tmp_path,
                         env={**env, "TIERS_NO_LOCAL_RANK": "1"}, capture_output=True, text=True, timeout=60)
    assert run.stdout.split()[2] == "-1"  # --no_local_rank
