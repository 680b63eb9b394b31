"""What `bench_scale.py` measures of the machine before it picks a model size, and the floors a step is judged by.

A step's floor is the slowest of three things it cannot beat on this machine, each measured here:
- disk: its swap traffic at the raw sequential bandwidth dd gets from the same directory (O_DIRECT);
- compute: its matmul FLOPs (6 per parameter per token, plus attention's 12 · layers · seq² · width per sequence),
  a third each at the measured bf16 rate of the three matmuls of an MLP weight: the forward's x·Wᵀ, backward's
  input gradient dy·W and weight gradient dyᵀ·x (a CPU without bf16 units runs them at very different rates);
- update: one pass of the layout's optimizer update over every parameter, timed on a tensor of `UPDATE_SAMPLE`
  elements in memory (the same optimizer class and layout the engine builds; compiled where the config compiles).
The size is picked from predicted steps (the three added, as if nothing overlapped) and the estimate's disk peak
(Note [estimating model states]); figures of the full size are projected from the run's own ratios and marked so.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import time
from dataclasses import dataclass

import torch

UPDATE_SAMPLE = 1 << 24  # elements the update is timed on
MATMUL_REPEATS = 3


@dataclass(frozen=True)
class MachineRates:
    matmul_flops: tuple[float, float, float]  # FLOP/s of an MLP weight's forward, input and weight gradient
    update_s_per_element: float  # one pass of the layout's update, in memory
    free_disk: int  # bytes free in the swap directory

    def compute_s(self, flops: float) -> float:
        """A step's matmuls: a third of its FLOPs at each of the three rates."""
        return sum(flops / 3 / rate for rate in self.matmul_flops)

    def update_s(self, params: int) -> float:
        return params * self.update_s_per_element


def step_flops(params: int, layers: int, width: int, seq: int, micro_batch: int) -> float:
    """Forward + backward matmul FLOPs of one micro-batch step: 6 per parameter per token, and attention's
    scores and weighted sums (4 · seq² · width per layer forward, ×3 with backward)."""
    return 6.0 * params * seq * micro_batch + 12.0 * layers * seq * seq * width * micro_batch


def matmul_flops(width: int, tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float, float]:
    """FLOP/s in `dtype` of an MLP weight W[4·width, width]'s three matmuls over `tokens` rows, as autograd runs
    them: x·Wᵀ (forward), dy·W (input gradient), dyᵀ·x (weight gradient); each the median of a few runs."""
    x = torch.randn(tokens, width, dtype=dtype)
    w = torch.randn(4 * width, width, dtype=dtype)
    dy = torch.randn(tokens, 4 * width, dtype=dtype)
    flops = 2.0 * tokens * width * 4 * width
    return tuple(flops / _median_seconds(f) for f in (lambda: torch.nn.functional.linear(x, w), lambda: dy @ w,
                                                      lambda: dy.t() @ x))


def _median_seconds(run) -> float:
    run()  # warm-up: kernel selection
    times = []
    for _ in range(MATMUL_REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_update(config: dict, elements: int):
    """The step of the optimizer the engine builds for `config` (its layout: bf16 masters, stochastic rounding,
    block-wise states, compiled or not) over one tensor of `elements` parameters with a gradient, laid out as the
    engine lays out a chunk holding one parameter."""
    from engine.config import load_config
    from engine.optim import build_optimizer, tiled_layout
    from engine.optimizers.stochastic_rounding import KeySpan

    cfg = load_config(config)
    dtype = torch.bfloat16 if cfg.bf16.bf16_master_weights_and_grads else torch.float32
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(elements, generator=g).to(dtype).requires_grad_()
    weights.grad = (torch.randn(elements, generator=g) * 1e-3).to(dtype)
    tiled = tiled_layout(cfg, frozenset([id(weights)]), lambda: {id(weights): [KeySpan(0, elements, 1, 0)]})
    return build_optimizer(cfg.optimizer, [{"params": [weights]}], tiled=tiled).step


def update_seconds_per_element(config: dict) -> float:
    """One step of engine_update over UPDATE_SAMPLE elements held in memory, after a warm-up step (which compiles
    where the config compiles); seconds per element."""
    step = engine_update(config, UPDATE_SAMPLE)
    step()  # warm-up: compiles, allocates the states
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) / UPDATE_SAMPLE


def compute_dtype(config: dict) -> torch.dtype:
    """The dtype the config's matmuls run in: bf16 where its bf16 section is on, else fp32."""
    return torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32


def measure_machine(directory: str, width: int, tokens: int, config: dict) -> MachineRates:
    return MachineRates(matmul_flops(width, tokens, compute_dtype(config)), update_seconds_per_element(config),
                        shutil.disk_usage(directory).free)


@dataclass(frozen=True)
class SizePlan:
    layers: int  # the size run
    params: int
    predicted_step_s: float
    predicted_disk_peak: int
    why: str  # why this size (the full one, or what ruled the larger ones out)


@functools.cache
def _estimate_row(layers: int, width: int, heads: int, seq: int, config_json: str):
    """The estimate (one process, everything on NVMe, built under zero_init) of a GPT of `layers` blocks."""
    import json

    from engine.estimate import EstimateSettings, estimate
    from engine.estimate.strategies import Strategy

    config = json.loads(config_json)
    factory = functools.partial(_gpt, layers, width, heads, seq)
    return estimate(factory, config, 1, strategies=[Strategy(3, offload_optimizer="nvme", offload_param="nvme")],
                    settings=EstimateSettings(seq_len=seq, compute_on_cpu=True, zero_init=True,
                                              nvme_path=config["zero_optimization"]["offload_param"]["nvme_path"])
                    ).rows[0]


def _gpt(layers: int, width: int, heads: int, seq: int):
    from engine.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=heads, n_embd=width))


def gpt_params(layers: int, width: int, seq: int) -> int:
    """Ψ of the byte-level GPT (tied embeddings, biases): its blocks and embeddings."""
    per_block = 12 * width * width + 13 * width  # attention 4w² + 4w, MLP 8w² + 5w, two norms 4w
    return layers * per_block + (256 + seq) * width + 2 * width


def estimated(layers: int, width: int, heads: int, seq: int, config: dict):
    import json

    return _estimate_row(layers, width, heads, seq, json.dumps(config, sort_keys=True))


def predicted_step_s(layers: int, width: int, heads: int, seq: int, micro_batch: int, config: dict,
                     rates: MachineRates, read_bw: float, write_bw: float) -> tuple[float, int]:
    """(seconds, disk peak) of one steady step of `layers` blocks: its swap traffic (every resting file read and
    written once, the parameter shards read a second time in backward) at dd's bandwidth, plus its compute, plus
    one update pass; and the estimate's disk peak."""
    params = gpt_params(layers, width, seq)
    read, written, disk = predicted_traffic(layers, width, heads, seq, config)
    seconds = (read / read_bw + written / write_bw
               + rates.compute_s(step_flops(params, layers, width, seq, micro_batch)) + rates.update_s(params))
    return seconds, disk


def predicted_traffic(layers: int, width: int, heads: int, seq: int, config: dict) -> tuple[int, int, int]:
    """(bytes read, bytes written, disk peak) of one steady step where the CPU window is a small part of the states:
    every resting file read and written once, the parameter shards read a second time in backward."""
    row = estimated(layers, width, heads, seq, config)
    return row.disk_peak + row.states.param, row.disk_peak, row.disk_peak


def choose_layers(max_layers: int, width: int, heads: int, seq: int, micro_batch: int, config: dict,
                  rates: MachineRates, read_bw: float, write_bw: float, step_budget_s: float) -> SizePlan:
    """The most blocks (at most `max_layers`) whose predicted step fits `step_budget_s` and whose disk peak fits
    90% of the free disk; one block when none does (named in `why`). Both grow with the blocks: a bisection."""
    room = 0.9 * rates.free_disk

    def predicted(layers: int) -> tuple[float, int]:
        return predicted_step_s(layers, width, heads, seq, micro_batch, config, rates, read_bw, write_bw)

    def fits(layers: int) -> bool:
        step_s, disk = predicted(layers)
        return step_s <= step_budget_s and disk <= room

    if fits(max_layers):
        step_s, disk = predicted(max_layers)
        return SizePlan(max_layers, gpt_params(max_layers, width, seq), step_s, disk,
                        f"the full size ({max_layers} blocks) fits: predicted step and disk peak within the limits")
    step_s, disk = predicted(max_layers)
    limits = [f"predicted step {step_s:.0f} s > {step_budget_s:.0f} s"] if step_s > step_budget_s else []
    limits += [f"disk peak {disk / 1e9:.1f} GB > 90% of {rates.free_disk / 1e9:.1f} GB free"] if disk > room else []
    why = f"{max_layers} blocks do not fit this machine ({'; '.join(limits)}): the largest size that does"
    low, high = 0, max_layers  # fits(low) (0: nothing yet), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    if low == 0:
        low, why = 1, why + "; not even one block fits: one block"
    step_s, disk = predicted(low)
    return SizePlan(low, gpt_params(low, width, seq), step_s, disk, why)
