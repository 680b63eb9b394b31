"""`tiers tune` reads DeepSpeed's `autotuning` section (Note [autotuning section]): the micro batches it tries,
the metric that wins, the trial steps, the trial limit; what it cannot do is refused by name."""

from __future__ import annotations

import pytest

from engine.config import ConfigError
from engine.estimate import RankBudgets
from engine.estimate.autotuning import Metric, micro_sizes, samples_per_second, tuning_plan
from engine.estimate.tune import TuneSettings, Verdict, format_tune, tune
from engine.models import gpt_tiny

BASE = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def test_plan_without_the_section_is_the_tuners_own():
    plan = tuning_plan(BASE, steps=3, warmup=1)
    assert (plan.micro_sizes, plan.metric, plan.steps, plan.warmup, plan.max_trials) == ((None,), Metric.LATENCY, 3,
                                                                                        1, None)


def test_plan_reads_deepspeeds_keys():
    plan = tuning_plan({**BASE, "autotuning": {
        "enabled": True, "metric": "throughput", "start_profile_step": 2, "end_profile_step": 5,
        "min_train_micro_batch_size_per_gpu": 2, "max_train_micro_batch_size_per_gpu": 32,
        "num_tuning_micro_batch_sizes": 3, "tuner_num_trials": 7, "tuner_early_stopping": 2, "tuner_type": "random",
        "max_train_batch_size": 64, "mp_size": 2, "arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"},
        "overwrite": False}}, steps=3, warmup=1)
    assert plan.micro_sizes == (2, 8, 32) and plan.metric is Metric.THROUGHPUT
    assert (plan.warmup, plan.steps, plan.max_trials, plan.early_stopping, plan.shuffled) == (2, 3, 7, 2, True)
    assert plan.train_batch_bounds == (1, 64) and plan.tp_sizes == (2,)
    assert plan.unused == ("overwrite", "arg_mappings")
    assert plan.config_at({**BASE, "train_batch_size": 8}, 8)["train_micro_batch_size_per_gpu"] == 8
    assert "train_batch_size" not in plan.config_at({**BASE, "train_batch_size": 8}, 8)
    assert micro_sizes(1, 1024, 3) == (1, 32, 1024) and micro_sizes(4, 4, 3) == (4,)
    assert samples_per_second({**BASE, "gradient_accumulation_steps": 2}, 4, 0.5) == 16.0


@pytest.mark.parametrize("section, fragments", [
    ({"metric": "flops"}, ["autotuning.metric", "flops", "throughput"]),
    ({"tuner_type": "model_based"}, ["autotuning.tuner_type", "model_based", "gridsearch"]),
    ({"start_profile_step": 5, "end_profile_step": 5}, ["autotuning.end_profile_step", "larger"]),
    ({"tuner_typ": "random"}, ["autotuning.tuner_typ: unknown key", "Did you mean 'autotuning.tuner_type'?"]),
    ({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 2},
     ["autotuning.min_train_micro_batch_size_per_gpu", "swap"]),
])
def test_what_tiers_tune_cannot_do_is_refused_by_name(section, fragments):
    with pytest.raises(ConfigError) as info:
        tuning_plan({**BASE, "autotuning": section}, steps=3, warmup=1)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_tune_tries_the_sections_micro_batches_within_its_trial_limit():
    config = {**BASE, "autotuning": {"enabled": True, "metric": "throughput", "start_profile_step": 1,
                                     "end_profile_step": 2, "min_train_micro_batch_size_per_gpu": 1,
                                     "max_train_micro_batch_size_per_gpu": 4, "num_tuning_micro_batch_sizes": 2,
                                     "tuner_num_trials": 1, "max_train_batch_size": 4}}
    result = tune(gpt_tiny, 1, RankBudgets(), config, TuneSettings(seq_len=16))
    micros = {c.row.config["train_micro_batch_size_per_gpu"] for c in result.candidates}
    assert micros == {1, 4}
    tried = result.tried()
    assert len(tried) == 1 and any(c.verdict is Verdict.STOPPED for c in result.candidates)
    chosen = result.chosen
    assert chosen is not None
    rate = {id(c): c.row.config["train_micro_batch_size_per_gpu"] / c.trial.step_s for c in tried
            if c.verdict in (Verdict.FITS, Verdict.CHOSEN)}
    assert rate[id(chosen)] == max(rate.values())  # the throughput metric: samples per second
    assert f"mb{chosen.row.config['train_micro_batch_size_per_gpu']}" in format_tune(result)
