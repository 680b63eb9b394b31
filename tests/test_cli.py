"""The `tiers` console script, run as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiers(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("tiers", path=str(Path(sys.executable).parent))
    cmd = [exe, *args] if exe else [sys.executable, "-m", "engine.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_config_prints_resolved_values():
    out = tiers("config", str(REPO / "configs" / "dp.json"), "--dp", "2")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    raw = json.loads((REPO / "configs" / "dp.json").read_text())
    micro, accum = raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"]
    assert resolved["train_batch_size"] == micro * accum * 2
    assert resolved["fp16"]["loss_scale_window"] == 1000  # defaults filled in
    assert resolved["zero_optimization"]["stage"] == 0


def test_config_error_names_key_and_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "zero_optimisation": {"stage": 0}}))
    out = tiers("config", str(bad))
    assert out.returncode == 2
    assert "zero_optimisation" in out.stderr and "zero_optimization" in out.stderr
