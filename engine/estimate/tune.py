"""`tiers tune`: short trials of the strategies the estimate says fit; the fastest that fits wins.

Note [tuning]
1. The estimate (Note [peak memory estimate]) rules out every strategy whose peaks exceed a budget.
2. The rest are tried in the estimate's order (DDP, ZeRO-1/2, TP, ZeRO-3, pipelines, CPU offload,
   NVMe; NVMe only with a directory to swap to), each for a few steps on this machine (trials.py).
   With a time budget, a trial starts only if the trials so far plus one more as long as the longest
   so far stay within it (the first always runs). Pipelined strategies (Note [estimating a
   pipeline]) are listed with their estimate and bubble, and tried like the others, their steps run
   by engine.train_batch (Note [a pipelined step]).
3. A trial's measured memory is checked too: peak RSS against the CPU budget; the device budget
   against max_memory_allocated on CUDA, or, where the compute device is the CPU, against the peak
   RSS less the runtime and less what the offload manager held in CPU memory (the device tier's
   share of host memory).
4. Of the trials that finished within budget, the one with the shortest median step wins; its
   config is the user's config with that strategy's keys set.
5. A config with DeepSpeed's `autotuning` section also sets the micro batches tried, the metric that wins, the
   trials' steps and how many trials run (Note [autotuning section]).
"""

from __future__ import annotations

import enum
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from engine.estimate.autotuning import (
    Metric,
    TuningPlan,
    data_parallel_size,
    global_batch,
    samples_per_second,
    tuning_plan,
)
from engine.estimate.estimator import (
    Estimate,
    EstimateSettings,
    RankBudgets,
    StrategyEstimate,
    default_strategies,
    estimate,
)
from engine.estimate.report import bubble_cell, human_bytes, markdown_table, starved_advice
from engine.estimate.trials import TrialError, TrialResult, run_trial

DEFAULT_CONFIG = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


class Verdict(enum.Enum):
    CHOSEN = "chosen: fastest that fits"
    FITS = "fits"
    OVER_ESTIMATE = "rejected by the estimate"
    OVER_MEASURED = "rejected: measured over budget"
    FAILED = "failed"
    NOT_TRIED = "not tried: time budget spent"
    OUT_OF_BOUNDS = "not tried: train batch outside autotuning's bounds"
    STOPPED = "not tried: autotuning's trial limit or early stopping"


@dataclass
class Candidate:
    row: StrategyEstimate
    verdict: Verdict
    reason: str = ""
    trial: TrialResult | None = None


@dataclass
class TuneResult:
    estimate: Estimate
    candidates: list[Candidate] = field(default_factory=list)
    plan: TuningPlan = field(default_factory=lambda: TuningPlan(micro_sizes=(None,)))

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.verdict is Verdict.CHOSEN), None)

    def tried(self) -> list[Candidate]:
        return [c for c in self.candidates if c.trial is not None]


@dataclass(frozen=True)
class TuneSettings:
    """How a tuning run searches: where NVMe-offloading strategies put their files (None: none tried), the wall time
    it may take (None: unbounded), each trial's timed steps after its warm-up steps, the sequence length (None: the
    model's own), and tensor- and pipeline-parallel sizes tried besides the config's."""

    nvme_path: str | None = None
    time_budget_s: float | None = None
    steps: int = 3
    warmup: int = 1
    seq_len: int | None = None
    tp_sizes: tuple[int, ...] = ()
    pp_sizes: tuple[int, ...] | None = None


def tune(factory: Callable[[], nn.Module], world: int, budgets: RankBudgets, config: dict | None = None,
         settings: TuneSettings | None = None) -> TuneResult:
    """Note [tuning]; with an `autotuning` section, Note [autotuning section]."""
    settings = settings if settings is not None else TuneSettings()
    nvme_path, time_budget_s, seq_len = settings.nvme_path, settings.time_budget_s, settings.seq_len
    pp_sizes = list(settings.pp_sizes) if settings.pp_sizes is not None else None
    started, longest = time.monotonic(), 0.0
    config = config or DEFAULT_CONFIG
    plan = tuning_plan(config, settings.steps, settings.warmup)
    tp_sizes = [*settings.tp_sizes, *plan.tp_sizes]
    rows, estimates = [], []
    for micro in plan.micro_sizes:
        at_micro = plan.config_at(config, micro)
        strategies = default_strategies(at_micro, world, tp_sizes, nvme=nvme_path is not None, pp_sizes=pp_sizes)
        estimates.append(estimate(factory, at_micro, world, strategies,
                                  EstimateSettings(budgets, seq_len, nvme_path=nvme_path)))
        rows += estimates[-1].rows
    if plan.shuffled:
        random.Random(0).shuffle(rows)
    result = TuneResult(estimates[0], plan=plan)
    best, since_best, trials = None, 0, 0
    for row in rows:
        dp = data_parallel_size(world, row.strategy.tp, row.strategy.pp)
        skip = _not_tried(row, plan, dp, trials, since_best)
        if skip is None and time_budget_s is not None and time.monotonic() - started + longest > time_budget_s:
            skip = (Verdict.NOT_TRIED, "")
        if skip is not None:
            result.candidates.append(Candidate(row, *skip))
            continue
        trial_start = time.monotonic()
        trials += 1
        try:
            left = 600.0 if time_budget_s is None else max(time_budget_s - (time.monotonic() - started), 30.0)
            measured = run_trial(factory, row.config, world, estimates[0].seq_len, steps=plan.steps,
                                 warmup=plan.warmup, timeout_s=min(left, 600.0))
        except TrialError as e:
            longest = max(longest, time.monotonic() - trial_start)
            result.candidates.append(Candidate(row, Verdict.FAILED, str(e).strip().splitlines()[-1]))
            since_best += 1
            continue
        longest = max(longest, time.monotonic() - trial_start)
        misfits = measured_misfits(measured, row, budgets, estimates[0].compute_on_cpu)
        result.candidates.append(Candidate(row, Verdict.OVER_MEASURED if misfits else Verdict.FITS,
                                           "; ".join(misfits), measured))
        throughput = samples_per_second(row.config, dp, measured.step_s) if plan.metric is Metric.THROUGHPUT else 0.0
        score = (throughput, measured.step_s)
        if not misfits and plan.better(*score, best):
            best, since_best = score, 0
        else:
            since_best += 1
    fitting = [c for c in result.candidates if c.verdict is Verdict.FITS]
    if fitting:
        min(fitting, key=lambda c: _rank(c, plan, world)).verdict = Verdict.CHOSEN
    return result


def _not_tried(row: StrategyEstimate, plan: TuningPlan, dp: int, trials: int,
               since_best: int) -> tuple[Verdict, str] | None:
    """Why `row` gets no trial: the estimate, the autotuning batch bounds, its trial limit or early stopping."""
    if not row.fits:
        return Verdict.OVER_ESTIMATE, "; ".join(row.misfits)
    low, high = plan.train_batch_bounds
    batch = global_batch(row.config, dp) if (low, high) != (1, None) else low
    if batch < low or (high is not None and batch > high):
        return Verdict.OUT_OF_BOUNDS, f"train batch {batch}"
    if plan.max_trials is not None and trials >= plan.max_trials:
        return Verdict.STOPPED, f"tuner_num_trials {plan.max_trials}"
    if plan.early_stopping is not None and since_best >= plan.early_stopping:
        return Verdict.STOPPED, f"tuner_early_stopping {plan.early_stopping}"
    return None


def _rank(c: Candidate, plan: TuningPlan, world: int) -> float:
    """Smaller is better: the step time, or under the throughput metric the negated samples per second."""
    if plan.metric is Metric.LATENCY:
        return c.trial.step_s
    return -samples_per_second(c.row.config, data_parallel_size(world, c.row.strategy.tp, c.row.strategy.pp),
                               c.trial.step_s)


def label(row: StrategyEstimate, plan: TuningPlan) -> str:
    """The strategy's name, with its micro batch when the plan tries several."""
    if len(plan.micro_sizes) == 1:
        return row.strategy.name
    return f"{row.strategy.name} mb{row.config['train_micro_batch_size_per_gpu']}"


def measured_misfits(measured: TrialResult, row: StrategyEstimate, budgets: RankBudgets,
                     compute_on_cpu: bool) -> list[str]:
    """Note [tuning] 3: the budgets a trial's measured memory exceeds."""
    device = measured_device_bytes(measured, row, compute_on_cpu)
    out = []
    for tier, used, budget in (("device", device, budgets.device), ("cpu", measured.peak_rss, budgets.cpu)):
        if budget is not None and used > budget:
            out.append(f"{tier} {human_bytes(used)} > budget {human_bytes(budget)}")
    return out


def measured_device_bytes(measured: TrialResult, row: StrategyEstimate, compute_on_cpu: bool) -> int:
    if measured.device_peak is not None and not compute_on_cpu:
        return measured.device_peak
    return max(measured.peak_rss - row.runtime - measured.managed_cpu_peak, 0)


def format_tune(result: TuneResult) -> str:
    """The table of every candidate: estimated and measured memory, step time, and what became of it."""
    on_cpu = result.estimate.compute_on_cpu
    pipelined = any(c.row.pipeline is not None for c in result.candidates)
    headers = ["strategy", "est. device peak", "est. host peak", "step (s)", "peak RSS", "device used", "result"]
    headers += ["bubble"] if pipelined else []
    rows = []
    for c in result.candidates:
        t = c.trial
        rows.append([label(c.row, result.plan), human_bytes(c.row.device_peak), human_bytes(c.row.host_peak),
                     f"{t.step_s:.3f}" if t else "—", human_bytes(t.peak_rss) if t else "—",
                     human_bytes(measured_device_bytes(t, c.row, on_cpu)) if t else "—",
                     c.verdict.value + (f" ({c.reason})" if c.reason else "")]
                    + ([bubble_cell(c.row.pipeline)] if pipelined else []))
    chosen = result.chosen
    verdict = (f"Chosen: {label(chosen.row, result.plan)}, {chosen.trial.step_s:.3f} s/step." if chosen else
               "Nothing fits and finished: raise the budgets, add ranks or NVMe (--nvme), or lower the micro batch.")
    starved = {c.row.strategy.name.split()[0]: c.row.pipeline for c in result.candidates
               if c.row.pipeline is not None and c.row.pipeline.starved}
    warnings = [f"{name}: {starved_advice(p)}" for name, p in starved.items()]
    if result.plan.unused:
        warnings.append(f"autotuning: {', '.join(result.plan.unused)} are DeepSpeed's autotuner's own (where it "
                        "writes, how it runs your script); tiers tune runs its own trials and writes --out")
    return "\n".join([markdown_table(headers, rows), "", verdict, *warnings])


def write_config(result: TuneResult, path: str) -> None:
    """The chosen strategy's config as JSON (the user's config with the strategy's keys set)."""
    chosen = result.chosen
    if chosen is None:
        raise ValueError("no config fits the budgets, so none was written")
    partial = f"{path}.partial"
    with open(partial, "w") as f:  # complete or absent, never half-written
        json.dump(chosen.row.config, f, indent=2)
        f.write("\n")
    os.replace(partial, path)
