"""scripts/scale_plan.py: the sizes bench_scale.py picks and projects to are the model's, and the pick follows the
predicted step and the estimate's disk peak."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from scale_plan import MachineRates, choose_layers, gpt_params, predicted_step_s, step_flops  # noqa: E402

WIDTH, HEADS, SEQ = 64, 2, 16


def lowbit_config(path: str) -> dict:
    offload = {"device": "nvme", "nvme_path": path, "buffer_count": 2}
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW8bit", "params": {"lr": 2e-6}},
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
                     "stochastic_rounding": True},
            "zero_optimization": {"stage": 3, "chunk_size": 8192,
                                  "offload_optimizer": {**offload, "step_in_backward": True},
                                  "offload_param": offload},
            "aio": {"block_size": 4096}}  # small chunks and blocks: the disk peak grows with the layers


@pytest.mark.parametrize("layers,width,seq", [(1, 64, 16), (3, 128, 32), (2, 96, 8)])
def test_the_parameter_count_is_the_models(layers, width, seq):
    from scale_plan import _gpt

    assert gpt_params(layers, width, seq) == _gpt(layers, width, 2, seq).num_parameters()


def test_the_step_flops_are_six_per_parameter_per_token_plus_attention_a_third_at_each_rate():
    assert step_flops(1000, 2, 8, 4, 3) == 6 * 1000 * 4 * 3 + 12 * 2 * 4 * 4 * 8 * 3
    assert MachineRates((1.0, 2.0, 4.0), 0.0, 0).compute_s(3.0) == 1.0 + 0.5 + 0.25


def test_the_largest_size_whose_predicted_step_and_disk_peak_fit_is_picked(tmp_path):
    config = lowbit_config(str(tmp_path))
    rates = MachineRates(matmul_flops=(1e8, 1e8, 1e8), update_s_per_element=1e-8, free_disk=10**12)
    steps = {n: predicted_step_s(n, WIDTH, HEADS, SEQ, 1, config, rates, 1e9, 1e9) for n in range(1, 7)}
    assert all(steps[n][0] < steps[n + 1][0] and steps[n][1] < steps[n + 1][1] for n in range(1, 6))
    full = choose_layers(6, WIDTH, HEADS, SEQ, 1, config, rates, 1e9, 1e9, step_budget_s=steps[6][0])
    assert full.layers == 6 and "the full size" in full.why
    by_time = choose_layers(6, WIDTH, HEADS, SEQ, 1, config, rates, 1e9, 1e9, step_budget_s=steps[4][0])
    assert by_time.layers == 4 and "predicted step" in by_time.why and by_time.params == gpt_params(4, WIDTH, SEQ)
    small_disk = MachineRates((1e8, 1e8, 1e8), 1e-8, free_disk=int(steps[3][1] / 0.9) + 1)
    by_disk = choose_layers(6, WIDTH, HEADS, SEQ, 1, config, small_disk, 1e9, 1e9, step_budget_s=1e9)
    assert by_disk.layers == 3 and "disk peak" in by_disk.why
    nothing = choose_layers(6, WIDTH, HEADS, SEQ, 1, config, rates, 1e9, 1e9, step_budget_s=0.0)
    assert nothing.layers == 1 and "not even one block fits" in nothing.why
