"""`tiers launch --as-colossalai`: `colossalai run`'s arguments in its formats, and a script written for ColossalAI
(tests/colossalai_style_train.py, its imports unchanged) on 2 ranks, each plugin equal to plain PyTorch on the whole
batches, its model saved sharded and loaded into a freshly boosted one."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import MultiStepLR

from engine.compat.colossalai.booster.checkpoint_io import load_state_dict
from engine.compat.colossalai.booster.optimizer_io import load_optimizer_file
from engine.launcher import LaunchError, make_plan, node_commands
from engine.launcher.colossalai_args import ColossalAIRun, colossalai_options
from engine.launcher.commands import SHIM_DIR
from engine.topology import free_port
from tests.colossalai_style_gpt_model import LR, STEPS, GPTLMLoss, gpt2_tiny, token_batch
from tests.colossalai_style_model import LEARNING_RATE, Net, trainset
from tests.reference import FP32_RTOL, assert_close_relative, assert_params_close, step_masters
from tests.test_deepspeed_launch import _child_env
from tests.test_mixed_precision import LOSS_RTOL, WEIGHT_RTOL

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "colossalai_style_train.py"
EPOCHS, GLOBAL_BATCH = 2, 8
# plugin -> (precision, clipping norm), as the script builds it
PLUGINS = {"torch_ddp": (torch.float32, 0.0), "low_level_zero_1_cpu_offload": (torch.float32, 0.0),
           "low_level_zero_2": (torch.float32, 1.0), "gemini_static": (torch.bfloat16, 0.0),
           "gemini_auto": (torch.bfloat16, 0.0)}


def _plan(tmp_path, **given):
    run = ColossalAIRun(**{"script": "train.py", "nproc_per_node": 2, **given})
    return make_plan(colossalai_options(run), environ={}, cwd=str(tmp_path))


def test_colossalai_runs_arguments_in_its_own_formats(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-1\n\nworker-2\nworker-3\n")
    plan = _plan(tmp_path, hostfile=str(hostfile), exclude="worker-2", ssh_port=2222,
                 extra_launch_args="monitor_interval=1,standalone,master_port=29600")
    assert [n.host for n in plan.nodes] == ["worker-1", "worker-3"] and plan.master_port == 29600
    assert [len(n.slots) for n in plan.nodes] == [2, 2] and plan.master_addr == "worker-1"
    command = node_commands(plan)[0]
    assert command.argv[:6] == ("ssh", "-tt", "-o", "BatchMode=yes", "-p", "2222")
    assert "--monitor_interval=1 --standalone train.py" in command.argv[-1]
    assert _plan(tmp_path, host="worker-1,worker-2", include="worker-2", num_nodes=-1).nodes[0].host == "worker-2"
    local = _plan(tmp_path, host="127.0.0.1", script="pkg.train", module=True, script_args=("--x", "1"))
    (command,) = node_commands(local)
    assert local.launcher.value == "local" and command.argv[-4:] == ("-m", "pkg.train", "--x", "1")
    assert command.env["PYTHONPATH"].split(os.pathsep)[0] == SHIM_DIR


@pytest.mark.parametrize("given,message", [
    ({"nproc_per_node": None}, "--nproc_per_node is required"),
    ({"host": "a,a"}, "a listed twice"),
    ({"hostfile": "HOSTFILE"}, "one name per line"),
    ({"host": "a", "hostfile": "HOSTFILE"}, "give one of them"),
    ({"extra_launch_args": "nnodes=2"}, "not a torchrun flag this launcher leaves to you"),
    ({"script": "train"}, "runs a .py script"),
    ({"script": "train.py", "module": True}, "takes a module name"),
])
def test_what_colossalai_run_would_not_take_is_refused_by_name(tmp_path, given, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-1 slots=2\n")  # DeepSpeed's format
    given = {k: str(hostfile) if v == "HOSTFILE" else v for k, v in given.items()}
    with pytest.raises(LaunchError, match=message):
        _plan(tmp_path, **given)


def test_one_framework_at_a_time_on_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--as-colossalai", "--as-deepspeed", "--nproc_per_node", "2",
           "--dry-run", "train.py"]
    run = subprocess.run(cmd, cwd=tmp_path, env={**_child_env(tmp_path), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--as-deepspeed and --as-colossalai" in run.stderr


def test_the_shim_is_colossalai_only_in_the_launched_processes():
    assert importlib.util.find_spec("colossalai") is None
    with pytest.raises(ImportError, match="import engine.compat.colossalai instead"):
        importlib.import_module("engine.compat.shim.colossalai")


def _reference(dtype: torch.dtype, clip: float):
    """Plain PyTorch on the whole batches: the same model, data, AdamW and per-epoch schedule (16-bit: the model in
    bf16 under autocast, fp32 masters stepped from its gradients, as DeepSpeed's bf16 mode and reference.py)."""
    model = Net()
    criterion = nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(trainset(), batch_size=GLOBAL_BATCH, drop_last=True)
    masters = None
    if dtype != torch.float32:
        model.to(dtype)
        masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters or model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    scheduler = MultiStepLR(optimizer, milestones=[1], gamma=0.5)
    losses = []
    for _ in range(EPOCHS):
        for images, labels in loader:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = criterion(model(images).float(), labels)
            loss.backward()
            if masters is not None:
                step_masters(masters, list(model.parameters()), optimizer, clip)
            else:
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        scheduler.step()
    if masters is not None:
        return losses, {n: m.detach() for (n, _), m in zip(model.named_parameters(), masters)}
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _read_sharded(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(directory.glob("model-*.safetensors")):
        state.update(load_file(file))
    return state


def test_a_colossalai_script_runs_unchanged_and_each_plugin_trains_like_plain_pytorch(tmp_path):
    out = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--as-colossalai", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(SCRIPT), "--plugin", ",".join(PLUGINS), "--checkpoint", str(tmp_path / "ckpt"),
           "--out", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, env={**_child_env(tmp_path), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    results = torch.load(out, weights_only=False)
    for name, (dtype, clip) in PLUGINS.items():
        losses, params = _reference(dtype, clip)
        seen = results[name]
        assert_close_relative(seen["losses"], losses, rtol=FP32_RTOL if dtype == torch.float32 else LOSS_RTOL[dtype])
        saved = _read_sharded(tmp_path / "ckpt" / name)
        assert len(list((tmp_path / "ckpt" / name).glob("model-*.safetensors"))) >= 1
        assert (tmp_path / "ckpt" / name / "model.safetensors.index.json").exists()
        for key, expected in params.items():
            rtol, atol = (FP32_RTOL * 10, 1e-6) if dtype == torch.float32 else (WEIGHT_RTOL[dtype], 1e-3)
            torch.testing.assert_close(saved[key], expected.float(), rtol=rtol, atol=atol,
                                       msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        reloaded = torch.load(tmp_path / "ckpt" / f"{name}_reloaded.pt", weights_only=True)
        assert reloaded.keys() == saved.keys()
        for key in saved:
            torch.testing.assert_close(reloaded[key], saved[key], rtol=0, atol=0)
        states, groups = load_optimizer_file(str(tmp_path / "ckpt" / f"{name}_optimizer"))
        assert [g["params"] for g in groups] == [list(range(len(params)))]  # torch's numbering: one group
        assert {float(s["step"]) for s in states.values()} == {float(EPOCHS * 32 // GLOBAL_BATCH)}
        reloaded_states, _ = load_optimizer_file(str(tmp_path / "ckpt" / f"{name}_optimizer_reloaded.pt"))
        assert reloaded_states.keys() == states.keys() == set(range(len(params)))
        for pid, state in states.items():  # what the freshly boosted optimizer holds after loading: the same
            for kind, value in state.items():
                torch.testing.assert_close(reloaded_states[pid][kind], value, rtol=0, atol=0, msg=f"{name} {pid}")
        assert seen["lr"] == seen["trained_lr"] == [LEARNING_RATE * 0.5]


GPT_SCRIPT = REPO / "tests" / "colossalai_style_gpt.py"
GPT_PLANS = {"CAI_TP2": 1e-4, "CAI_ZeRO2": FP32_RTOL}  # the demo's --distplan -> the tolerance against one process


def _gpt_reference():
    """Plain PyTorch: the demo's GPTLMModel, GPTLMLoss and AdamW with clipping at 1.0 on the same batches; the
    losses, the weights and the AdamW states (torch's numbering) after the last step."""
    model = gpt2_tiny()
    criterion = GPTLMLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids = token_batch(step)
        loss = criterion(model(ids, torch.ones_like(ids)), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}, optimizer.state_dict()


def test_a_train_gpt_demo_shaped_script_runs_unchanged_with_tensor_parallelism_and_zero(tmp_path):
    """HybridParallelPlugin(tp_size=2) and LowLevelZeroPlugin(stage=2) on a LazyInitContext-built Hugging Face GPT-2:
    losses and saved weights equal plain PyTorch; the sharded optimizer file holds torch's AdamW states; a freshly
    boosted model loads both and holds the same weights and optimizer states."""
    pytest.importorskip("transformers")
    out = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--as-colossalai", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(GPT_SCRIPT), "--distplan", ",".join(GPT_PLANS), "--checkpoint",
           str(tmp_path / "ckpt"), "--out", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, env={**_child_env(tmp_path), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    results = torch.load(out, weights_only=False)
    ref_losses, ref_params, ref_optimizer = _gpt_reference()
    for plan, rtol in GPT_PLANS.items():
        assert_close_relative(results[plan]["losses"], ref_losses, rtol=rtol)
        directory = tmp_path / "ckpt" / plan
        saved = load_state_dict(str(directory / "model"))
        # near-zero biases: Adam's step on a near-zero gradient turns the last bits of the clipping coefficient (the
        # norm summed in another order) into up to ~2e-6 here, so an absolute floor of lr / 100
        assert_params_close({k: saved[k] for k in ref_params}, ref_params, rtol=rtol, atol=LR / 100)
        state, groups = load_optimizer_file(str(directory / "optimizer"))
        assert [g["params"] for g in groups] == [g["params"] for g in ref_optimizer["param_groups"]]
        for pid, expected in ref_optimizer["state"].items():
            assert_params_close({k: state[pid][k] for k in ("exp_avg", "exp_avg_sq")},
                                {k: expected[k] for k in ("exp_avg", "exp_avg_sq")}, rtol=rtol)
        reloaded = torch.load(directory / "model_reloaded.bin", weights_only=True)
        assert all(torch.equal(reloaded[k], saved[k]) for k in saved)
        reloaded_state, _ = load_optimizer_file(str(directory / "optimizer_reloaded.bin"))
        assert reloaded_state.keys() == state.keys()
        assert all(torch.equal(reloaded_state[p][k], state[p][k]) for p in state for k in state[p])
