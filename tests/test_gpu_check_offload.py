"""The `offload` section of scripts/gpu_check.py on the CPU seam (--simulate): it runs to the end, every run trains
the same model on the same batches, and the ratios it reports are taken from what it timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_offload_section_runs_every_system_on_the_same_model(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--simulate", "--only", "offload"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    section = json.loads((tmp_path / "gpu_check.json").read_text())["offload"]
    assert "error" not in section, section
    runs = ["plain_pytorch", "tiers_stage3_offload_cpu", "tiers_stage2_offload_optimizer", "fsdp2_cpu_offload"]
    first = section["plain_pytorch"]["losses"][0]
    for name in runs:
        run = section[name]
        assert len(run["losses"]) == 3 and run["total_s"] > 0, name
        assert abs(run["losses"][0] - first) <= 1e-2 * first, (name, run["losses"][0], first)  # bf16 forwards
        assert run["losses"][-1] < run["losses"][0], name  # and it learned
    for name in runs[1:3]:
        assert section[name]["bus_bytes_per_step"] > 0, name  # the seam counted its copies
    floor = section["host_floor"]["step_s"]
    stage3 = section["tiers_stage3_offload_cpu"]["total_s"]
    assert section["ratios"]["stage3_step_over_host_floor"] == round(stage3 / floor, 3)
    assert section["ratios"]["stage3_step_over_fsdp2_offload_step"] == round(
        stage3 / section["fsdp2_cpu_offload"]["total_s"], 3)
