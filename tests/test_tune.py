"""`tiers tune`: with a host-memory budget that rules out plain data parallelism, it tries the strategies the
estimate lets through, on real ranks, and writes the fastest one that fits (measured) as a loadable config."""

from __future__ import annotations

import json

from engine.cli import main
from engine.config import load_config
from engine.estimate import RankBudgets
from engine.estimate.tune import TuneSettings, Verdict, format_tune, measured_misfits, tune, write_config
from engine.models import gpt_bench30m
from tests.rss import MALLOC_ENV

# bench30m at micro batch 1 on 2 ranks: DDP's estimated host peak is ~0.91 GB per rank, ZeRO-1/2/3's 0.75-0.81 GB
BUDGETS = RankBudgets(cpu=860_000_000)


def test_tune_picks_the_fastest_fitting_config_and_writes_it(tmp_path, monkeypatch):
    monkeypatch.setenv(*MALLOC_ENV)  # freed memory goes back to the OS, so peak RSS is memory in use (tests/rss.py)
    result = tune(gpt_bench30m, 2, BUDGETS, settings=TuneSettings(time_budget_s=30, steps=2))
    ddp = result.candidates[0]
    assert ddp.row.strategy.stage == 0 and ddp.verdict is Verdict.OVER_ESTIMATE and ddp.trial is None
    chosen = result.chosen
    assert chosen is not None and (chosen.row.strategy.stage > 0 or chosen.row.strategy.pp > 1)  # not DDP
    assert chosen.trial.peak_rss <= BUDGETS.cpu  # it fits, measured
    assert measured_misfits(chosen.trial, chosen.row, BUDGETS, result.estimate.compute_on_cpu) == []
    assert len(result.tried()) >= 2  # a choice was made between trials
    fitting = [c for c in result.tried() if c.verdict in (Verdict.FITS, Verdict.CHOSEN)]
    assert all(chosen.trial.step_s <= c.trial.step_s for c in fitting)
    for c in result.tried():  # what the trials measured agrees with the estimate (the 15%)
        assert abs(c.trial.peak_rss - c.row.host_peak) <= 0.15 * c.trial.peak_rss, c.row.strategy.name

    table = format_tune(result)
    assert "rejected by the estimate (cpu" in table and f"Chosen: {chosen.row.strategy.name}," in table
    out = tmp_path / "tuned.json"
    write_config(result, str(out))
    written = json.loads(out.read_text())
    assert written == chosen.row.config
    assert load_config(written).zero_optimization.stage == chosen.row.strategy.stage
    assert load_config(written).pipeline.stages == chosen.row.strategy.pp


def test_tune_and_estimate_commands_name_bad_input(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    assert main(["tune", "--model", "engine.models:gpt_tiny", "--world", "2", "--nvme", str(tmp_path / "no")]) == 2
    assert "--nvme" in capsys.readouterr().err
    assert main(["estimate", "--model", "engine.models", "--config", str(config)]) == 2
    assert "package.module:factory" in capsys.readouterr().err
    assert main(["estimate", "--model", "engine.models:no_such", "--config", str(config)]) == 2
    assert "no callable 'no_such'" in capsys.readouterr().err
    assert main(["estimate", "--model", "engine.models:gpt_tiny", "--config", str(config), "--world", "2",
                 "--device-memory", "lots"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def test_estimate_command_prints_every_strategy_and_what_fits(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    assert main(["estimate", "--model", "engine.models:gpt_small", "--config", str(config), "--world", "4",
                 "--tp", "2", "--cpu-memory", "4GB", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    for name in ("| DDP ", "| ZeRO-1 ", "| ZeRO-2 ", "| ZeRO-3 ", "| TP2 DDP ", "| TP2 ZeRO-3 ", "optim->cpu",
                 "optim->nvme param->nvme"):
        assert name in printed
    assert "Largest model that fits: ~" in printed


def test_candidates_put_pipelines_after_the_cheaper_strategies_and_their_config_has_the_section():
    from engine.estimate import Strategy, candidate_strategies

    names = [s.name for s in candidate_strategies(4, [1], nvme=False, pp_sizes=[2, 4])]
    assert names.index("PP2-1f1b DDP") > names.index("ZeRO-3")  # pipelines after every strategy without offload
    assert names.index("PP4-1f1b DDP") > names.index("PP2-1f1b ZeRO-1")  # shorter pipelines first
    assert names.index("PP4-1f1b DDP") < names.index("ZeRO-1 optim->cpu")
    assert "PP4-1f1b ZeRO-1" not in names and "PP4-1f1b ZeRO-1 optim->cpu" in names  # one data-parallel rank
    assert candidate_strategies(4, [1], nvme=False) == candidate_strategies(4, [1], nvme=False, pp_sizes=[1])
    base = {"pipeline": {"stages": 2, "partition": "uniform"}, "train_micro_batch_size_per_gpu": 1}
    assert Strategy(1, pp=4, schedule="interleaved", virtual_stages=2).config(base, None)["pipeline"] == {
        "stages": 4, "schedule": "interleaved", "virtual_stages": 2, "partition": "uniform"}
    assert "pipeline" not in Strategy(1).config(base, None)  # like tensor_parallel: a strategy without one drops it


def test_tune_lists_pipelines_at_world_4_with_their_bubble_and_tries_them(monkeypatch):
    import engine.estimate.tune as tune_module
    from engine.estimate.trials import TrialResult

    tried = []

    def fake_trial(factory, config, world, seq_len, **kwargs):  # the trials themselves are tested above
        tried.append(config)
        return TrialResult(step_s=1.0 + len(tried), peak_rss=0, device_peak=None, managed_cpu_peak=0)

    monkeypatch.setattr(tune_module, "run_trial", fake_trial)
    result = tune(gpt_bench30m, 4, RankBudgets(), settings=TuneSettings(steps=1))
    names = [c.row.strategy.name for c in result.candidates]
    pipelined = [c for c in result.candidates if c.row.pipeline is not None]
    assert {"PP2-1f1b DDP", "PP2-1f1b ZeRO-1", "PP4-1f1b DDP"} <= {c.row.strategy.name for c in pipelined}
    assert all(c.trial is not None for c in pipelined)
    assert sum("pipeline" in config for config in tried) == len(pipelined) and len(tried) == len(names)
    assert names.index("PP2-1f1b DDP") > names.index("ZeRO-3")
    assert result.chosen.row.strategy.name == "DDP"  # the first trial was the fastest here
    table = format_tune(result)
    # the default config gives 1 micro-batch per step: the bubble of 2 and 4 stages is shown, and what to set
    assert "50.0% (m=1, only 1 < 2 stages!)" in table and "75.0% (m=1, only 1 < 4 stages!)" in table
    assert "PP4-1f1b: gradient_accumulation_steps gives 1 micro-batch(es) per step for 4 pipeline stages" in table
