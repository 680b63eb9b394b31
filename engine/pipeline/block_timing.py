"""pipeline.partition "time": each block's measured forward time on one micro-batch, the same on every rank."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from engine.models.inputs import SEQ_LEN_KEYS, config_seq_len, config_vocab_size, token_model_inputs


def measured_costs(model: nn.Module, blocks: nn.ModuleList, micro_batch: int, device: torch.device,
                   rounds: int = 3) -> tuple[list[float], float, float]:
    """(seconds of each block's forward, of what runs before the first block, of what runs after the last) on one
    synthetic micro-batch of `micro_batch` random token sequences at the config's context length,
    the median of `rounds` forwards after one warm-up. Every rank runs them (a tensor-parallel forward needs its
    whole group); global rank 0's figures go to every rank, so that all of them cut the model at the same blocks."""
    costs = torch.tensor(_time_forwards(model, blocks, micro_batch, device, rounds), dtype=torch.float64)
    if dist.is_initialized():
        dist.broadcast(costs, src=0)
    return costs[1:-1].tolist(), float(costs[0]), float(costs[-1])


def _time_forwards(model: nn.Module, blocks: nn.ModuleList, micro_batch: int, device: torch.device,
                   rounds: int) -> list[float]:
    vocab, seq_len = config_vocab_size(model), config_seq_len(model)
    if vocab is None or seq_len is None:
        raise ValueError(f'pipeline.partition "time" times the blocks of a token language model (a .config with '
                         f"vocab_size and one of {', '.join(SEQ_LEN_KEYS)}); {type(model).__name__} has "
                         f'{"no vocab_size" if vocab is None else "no sequence length"}: use partition '
                         '"parameters", "uniform" or a list of block names')
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    args, kwargs = token_model_inputs(model, ids)
    marks: list[tuple[int, float]] = []  # (block index, or -1 at a block's end), time
    hooks = []
    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda *_, i=i: marks.append((i, time.perf_counter()))))
        hooks.append(block.register_forward_hook(lambda *_: marks.append((-1, time.perf_counter()))))
    samples = []
    try:
        with torch.no_grad():
            for round_ in range(rounds + 1):
                marks.clear()
                start = time.perf_counter()
                model(*args, **kwargs)
                end = time.perf_counter()
                if round_:  # the first is a warm-up
                    samples.append(_split(marks, start, end, len(blocks)))
    finally:
        for h in hooks:
            h.remove()
    return [statistics.median(column) for column in zip(*samples)]


def _split(marks: list[tuple[int, float]], start: float, end: float, count: int) -> list[float]:
    """[before the blocks, block 0, ..., block n-1, after the blocks] from the marks of one forward."""
    seconds = [0.0] * (count + 2)
    begun = {}
    for index, at in marks:
        if index >= 0:
            begun_index = index
            begun[index] = at
        else:
            seconds[begun_index + 1] += at - begun[begun_index]
    first, last_end = marks[0][1], marks[-1][1]
    seconds[0], seconds[-1] = first - start, end - last_end
    return seconds
