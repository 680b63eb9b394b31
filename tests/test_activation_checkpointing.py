"""Activation checkpointing: with dropout on, the same losses and gradients as without it (stage 0, ZeRO-3,
1D and 2D tensor parallelism), fewer saved bytes, and a lower peak RSS."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from engine import initialize
from engine.config import ConfigError
from tests.distributed import run_distributed
from tests.reference import micro_batches, tiny_gpt, token_batches

transformers = pytest.importorskip("transformers")

DROPOUT = 0.1
STEPS = 2
GLOBAL_BATCH = 4
SEQ = 32
RTOL = 1e-6


def example_gpt(n_layer: int = 2) -> nn.Module:
    return tiny_gpt(0, dropout=DROPOUT, n_layer=n_layer)


def hf_gpt2(use_cache: bool = False) -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, resid_pdrop=DROPOUT,
                                  embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {
    "gpt": (example_gpt, lambda engine, x: engine(x, x)),
    "hf_gpt2": (hf_gpt2, lambda engine, x: engine(input_ids=x, labels=x).loss),
}
STRATEGIES = {  # name: (config additions, processes)
    "stage0": ({}, 1),
    "zero3": ({"zero_optimization": {"stage": 3, "chunk_size": 20_000, "stage3_param_persistence_threshold": 0}}, 2),
    "tp1d": ({"tensor_parallel": {"size": 2}}, 2),
}
TP_2D = ({"tensor_parallel": {"size": 4, "mode": "2d"}}, 4)  # one model only: 4 processes on 2 cores


def config(strategy: str, checkpointing: dict | None = None) -> dict:
    additions = TP_2D[0] if strategy == "tp2d" else STRATEGIES[strategy][0]
    cfg = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "gradient_clipping": 1.0, "steps_per_print": 10**6, "seed": 5, **additions}
    if checkpointing is not None:
        cfg["activation_checkpointing"] = checkpointing
    return cfg


def losses_and_gradients(engine, loss_fn) -> tuple[list[float], list[torch.Tensor]]:
    """Per step: the loss and this rank's reduced gradients (every element it steps), before the update."""
    losses, grads = [], []
    for x in token_batches(STEPS, GLOBAL_BATCH, seq=SEQ):
        (micro,) = micro_batches(x, engine.dp_rank, engine.dp_world_size, 1)
        loss = loss_fn(engine, micro)
        engine.backward(loss)
        grads.append(torch.cat([g.detach().flatten() for g in engine.chunked.grad_shards()]).clone())
        engine.step()
        losses.append(loss.item())
    return losses, grads


def _with_and_without_worker(rank, world, model_name, strategy, variants):
    build, loss_fn = MODELS[model_name]
    return {name: losses_and_gradients(initialize(build(), config(strategy, checkpointing)), loss_fn)
            for name, checkpointing in variants.items()}


def assert_same_training(results: dict, baseline: str = "off") -> None:
    ref_losses, ref_grads = results[baseline]
    for name, (losses, grads) in results.items():
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= RTOL * abs(b), f"{name}, step {step}: loss {a} vs {b} without checkpointing"
        for step, (a, b) in enumerate(zip(grads, ref_grads)):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-12,
                                       msg=lambda m, name=name, step=step: f"{name}, step {step}: {m}")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_checkpointing_changes_no_loss_or_gradient_with_dropout(model_name, strategy):
    """Every block checkpointed (the default selection) against none, dropout 0.1 everywhere: the recompute
    draws the forward's masks, also from the per-rank tensor-parallel stream, and ZeRO-3 gathers again."""
    variants = {"off": None, "on": {"enabled": True}}
    if strategy == "tp1d":
        variants["partitioned"] = {"enabled": True, "partition_activations": True}
    processes = STRATEGIES[strategy][1]
    if processes == 1:
        results = [_with_and_without_worker(0, 1, model_name, strategy, variants)]
    else:
        results = run_distributed(_with_and_without_worker, processes, args=(model_name, strategy, variants),
                                  timeout_s=180)
    for per_rank in results:
        assert_same_training(per_rank)


def test_checkpointing_changes_no_loss_or_gradient_under_2d_tensor_parallelism():
    """The example GPT on a 2×2 mesh, where the whole model runs on the per-rank dropout stream."""
    variants = {"off": None, "on": {"enabled": True}}
    for per_rank in run_distributed(_with_and_without_worker, TP_2D[1], args=("gpt", "tp2d", variants), timeout_s=180):
        assert_same_training(per_rank)


# --- saved-activation bytes ---------------------------------------------------------------------


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward, the model's parameters and buffers aside
    (counted with saved_tensors_hooks); `outside` counts those saved while no block is running, `device`
    those on the CUDA device."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module]):
        self.skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.seen: set[int] = set()
        self.total = self.outside = self.device = 0
        self.depth = 0
        self.handles = [h for b in blocks for h in (b.register_forward_pre_hook(self._enter),
                                                    b.register_forward_hook(self._leave, always_call=True))]

    def _enter(self, *_):
        self.depth += 1

    def _leave(self, *_):
        self.depth -= 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip | self.seen and storage.nbytes() > 0:
            self.seen.add(storage.data_ptr())
            self.total += storage.nbytes()
            self.outside += storage.nbytes() if self.depth == 0 else 0
            self.device += storage.nbytes() if t.device.type == "cuda" else 0
        return t


def saved_bytes_of_one_step(engine, x: torch.Tensor) -> SavedBytes:
    counter = SavedBytes(engine.module, list(engine.module.blocks))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    for handle in counter.handles:
        handle.remove()
    return counter


def block_input_bytes(n_layer: int, batch: int) -> int:
    """What a checkpointed step keeps of its blocks: each block's input, batch × SEQ × n_embd fp32."""
    return n_layer * batch * SEQ * 64 * 4


def _saved_bytes_worker(rank, world, strategy, variants):
    x = token_batches(1, GLOBAL_BATCH, seq=SEQ)[0]
    counts = {}
    for name, checkpointing in variants.items():
        counter = saved_bytes_of_one_step(initialize(example_gpt(n_layer=4), config(strategy, checkpointing)), x)
        counts[name] = {"total": counter.total, "outside": counter.outside, "device": counter.device}
    return counts


def test_saved_activations_drop_to_the_block_inputs():
    """4 blocks, batch 4 × 32 tokens × 64 features: checkpointing every block keeps 4 × 4×32×64 × 4 B = 128 KiB of
    block inputs and, outside the blocks, exactly what the step kept without checkpointing."""
    counts = _saved_bytes_worker(0, 1, "stage0", {"off": None, "on": {"enabled": True}})
    off, on = counts["off"], counts["on"]
    assert block_input_bytes(4, GLOBAL_BATCH) == 131072
    assert on["total"] == off["outside"] + 131072
    assert on["total"] < off["total"] / 3, (on["total"], off["total"])


def test_partitioned_activations_halve_the_block_inputs_at_tp_2():
    """Under tp 2 (dp 1, the whole batch on each rank) a rank keeps half of each block input."""
    variants = {"off": None, "on": {"enabled": True}, "partitioned": {"enabled": True, "partition_activations": True}}
    for counts in run_distributed(_saved_bytes_worker, 2, args=("tp1d", variants), timeout_s=120):
        whole = block_input_bytes(4, GLOBAL_BATCH)
        assert counts["on"]["total"] == counts["off"]["outside"] + whole
        assert counts["partitioned"]["total"] == counts["off"]["outside"] + whole // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cpu_checkpointing moves saved inputs off a CUDA device")
def test_cpu_checkpointing_changes_no_loss_or_gradient_on_cuda():
    variants = {"off": None, "cpu": {"enabled": True, "cpu_checkpointing": True}}
    assert_same_training(_with_and_without_worker(0, 1, "gpt", "stage0", variants))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cpu_checkpointing moves saved inputs off a CUDA device")
def test_cpu_checkpointing_leaves_no_block_input_on_the_device():
    counts = _saved_bytes_worker(0, 1, "stage0", {"off": None, "on": {"enabled": True},
                                                  "cpu": {"enabled": True, "cpu_checkpointing": True}})
    assert counts["on"]["device"] == counts["off"]["outside"] + block_input_bytes(4, GLOBAL_BATCH)
    assert counts["cpu"]["device"] == counts["off"]["outside"]  # the outside-block tensors are all on the device


# --- which modules ------------------------------------------------------------------------------


def wrapped(model: nn.Module, **checkpointing) -> list[str]:
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "activation_checkpointing": {"enabled": True, **checkpointing}}
    return initialize(model, cfg).activation_checkpointing.wrapped


def test_the_default_is_the_model_s_repeated_blocks():
    assert wrapped(example_gpt(n_layer=3)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert wrapped(hf_gpt2()) == ["transformer.h.0", "transformer.h.1"]
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2))
    assert wrapped(llama) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_modules_by_class_name_or_glob_every_n_and_outermost_only():
    assert wrapped(example_gpt(n_layer=4), modules=["MLP"]) == [f"blocks.{i}.mlp" for i in range(4)]
    assert wrapped(example_gpt(n_layer=4), modules=["blocks.[13]"]) == ["blocks.1", "blocks.3"]
    assert wrapped(example_gpt(n_layer=5), every_n=2) == ["blocks.0", "blocks.2", "blocks.4"]
    assert wrapped(example_gpt(n_layer=2), modules=["*.attn", "Block"]) == ["blocks.0", "blocks.1"]


class ExpertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(sum(e(x) for e in self.experts))


class MixtureOfExperts(nn.Module):
    """Two layers, each with a list of four experts: the longest lists are the experts', but the layers' list
    holds more parameters."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(ExpertLayer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_default_prefers_the_list_holding_more_parameters():
    assert wrapped(MixtureOfExperts()) == ["layers.0", "layers.1"]


def test_wrapping_leaves_names_and_state_dict_keys_alone():
    model = example_gpt()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    wrapped(model)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == names


def test_selection_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"'Blok' is neither.*did you mean 'Block'"):
        wrapped(example_gpt(), modules=["Blok"])
    with pytest.raises(ConfigError, match=r"Sequential has no nn.ModuleList.*name the modules"):
        wrapped(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(ConfigError, match=r"'blocks' is a ModuleList.*select its children.*\"blocks\.\*\""):
        wrapped(example_gpt(), modules=["blocks"])


def test_a_deep_copy_of_a_wrapped_model_runs_its_own_weights():
    model = example_gpt()
    wrapped(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.mul_(0.5)
    x = token_batches(1, 2, seq=SEQ)[0]
    model.eval(), twin.eval()  # no dropout: the two differ by their weights alone
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]
    assert not torch.equal(model(x, x), twin(x, x))
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.mul_(2.0)
    assert torch.equal(model(x, x), twin(x, x))


def test_a_retained_graph_recomputes_again_with_the_same_masks():
    """Two backward passes through one checkpointed forward (retain_graph): each recomputes every block, with
    the forward's dropout masks both times."""
    engine = initialize(example_gpt(), config("stage0", {"enabled": True}))
    x = token_batches(1, GLOBAL_BATCH, seq=SEQ)[0]
    loss = engine(x, x)
    weight = engine.module.wte.weight
    (first,) = torch.autograd.grad(loss, weight, retain_graph=True)
    (second,) = torch.autograd.grad(loss, weight)
    assert engine.activation_checkpointing.recomputes == 2 * 2
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.manual_seed(11)
    plain = initialize(example_gpt(), config("stage0"))
    reference = torch.autograd.grad(plain(x, x), plain.module.wte.weight)[0]
    torch.testing.assert_close(first, reference, rtol=RTOL, atol=1e-12)  # the same seed, the same masks


def per_head_scores(t: torch.Tensor) -> torch.Tensor:
    return t.sin()


def _partition_refuses_split_inputs_worker(rank, world):
    engine = initialize(example_gpt(), config("tp1d", {"enabled": True, "partition_activations": True}))
    per_rank = torch.full((4, 8), float(rank), requires_grad=True)  # like an attention module's heads
    try:
        engine.checkpoint(per_head_scores, per_rank)
    except RuntimeError as e:
        return str(e)
    return None


def test_partitioning_an_input_that_differs_between_tp_ranks_is_an_error():
    for message in run_distributed(_partition_refuses_split_inputs_worker, 2, timeout_s=60):
        assert (message is not None
                and "the input of per_head_scores differs between the tensor-parallel ranks" in message)


def test_a_hugging_face_model_with_its_default_cache_runs_as_transformers_checkpoints_it(caplog):
    """use_cache=True, transformers' default: the checkpointed blocks run without the cache (the recompute would
    update it again), as transformers' own gradient checkpointing runs them, said once; losses and gradients are
    those of the same model trained without checkpointing (and with its cache)."""
    build = lambda: hf_gpt2(use_cache=True)  # noqa: E731
    loss_fn = MODELS["hf_gpt2"][1]
    with caplog.at_level(logging.WARNING, logger="engine.activation_checkpointing.checkpointer"):
        results = {"off": losses_and_gradients(initialize(build(), config("stage0")), loss_fn),
                   "on": losses_and_gradients(initialize(build(), config("stage0", {"enabled": True})), loss_fn)}
    assert_same_training(results)
    told = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(told) == 1 and "transformer.h.0 (GPT2Block)" in told[0].getMessage()


# --- engine.checkpoint, profile ------------------------------------------------------------------


class CheckpointedMLP(nn.Module):
    """Calls `self.checkpoint` the way a model calls torch.utils.checkpoint.checkpoint (a keyword argument too)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 64), nn.Linear(64, 16), nn.Dropout(DROPOUT)
        self.checkpoint = None

    def inner(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.drop(torch.relu(self.up(x))) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.checkpoint(self.inner, x, scale=0.5)).pow(2).mean()


def test_engine_checkpoint_is_a_drop_in_for_torch_checkpoint():
    from functools import partial
    torch.manual_seed(0)
    reference = CheckpointedMLP()
    torch.manual_seed(0)
    model = CheckpointedMLP()
    reference.checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    engine = initialize(model, {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                "steps_per_print": 10**6})
    model.checkpoint = engine.checkpoint
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(2))
    for x in data:
        torch.manual_seed(7)
        ref_loss = reference(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.manual_seed(7)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)
    with pytest.raises(ValueError, match="non-reentrant only"):
        engine.checkpoint(model.inner, data[0], 1.0, use_reentrant=True)


def test_profile_reports_recompute_time_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = config("stage0", {"enabled": True, "profile": True})
    cfg["tensorboard"] = {"enabled": True, "output_path": str(tmp_path), "job_name": "ac"}
    engine = initialize(example_gpt(n_layer=3), cfg)
    losses_and_gradients(engine, MODELS["gpt"][1])
    engine.close()
    assert engine.activation_checkpointing.recomputes == STEPS * 3
    events = EventAccumulator(str(tmp_path / "ac"))
    events.Reload()
    times = [p.value for p in events.Scalars("Time/recompute_ms")]
    assert len(times) == STEPS and all(t > 0 for t in times)
    assert sum(times) == pytest.approx(engine.activation_checkpointing.recompute_seconds * 1000, rel=1e-4)


# --- peak RSS -----------------------------------------------------------------------------------

LONG_SEQ = 3072
HUNDRED_M = dict(n_layer=14, n_head=12, n_embd=768, block_size=LONG_SEQ)  # 101.7M parameters


def _peak_rss_run(checkpointing: bool) -> tuple[int, float, int]:
    """One AdamW step in this (fresh) process: (parameters, loss, peak RSS)."""
    from engine.models import gpt_from_preset
    from tests.rss import peak_rss_bytes
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt_from_preset("small", **HUNDRED_M)
    engine = initialize(model, {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                "steps_per_print": 10**6, "activation_checkpointing": {"enabled": checkpointing}})
    x = torch.randint(0, 256, (1, LONG_SEQ), generator=torch.Generator().manual_seed(0))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    return sum(p.numel() for p in model.parameters()), loss.item(), peak_rss_bytes()


def test_checkpointing_cuts_the_peak_rss_of_a_100m_model_on_a_long_sequence(monkeypatch):
    """One AdamW step of a ~100M-parameter GPT on 3072 tokens, fp32, as two single-process runs side by side
    (fresh processes): every block's activations (several GB) against its input alone. Peak RSS (the whole
    process, torch included) falls by at least 30%."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tests.rss import MALLOC_ENV
    monkeypatch.setenv(*MALLOC_ENV)  # freed memory goes back to the OS (tests/rss.py)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        off, on = [f.result(timeout=300) for f in [pool.submit(_peak_rss_run, False), pool.submit(_peak_rss_run, True)]]
    (psi, loss_off, rss_off), (_, loss_on, rss_on) = off, on
    assert 95e6 < psi < 105e6
    assert loss_on == loss_off
    assert rss_on <= 0.7 * rss_off, \
        f"peak RSS {rss_on / 2**30:.2f} GiB with checkpointing, {rss_off / 2**30:.2f} without"
