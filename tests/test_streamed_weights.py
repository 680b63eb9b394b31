"""Pretrained weights streamed into a model built under zero_init (Note [streamed weights]): transformers'
from_pretrained inside `with zero_init()`, and initialize(weights=...) for a model built from its config, load
what a plain from_pretrained loads, bit for bit (fp32 and bf16 files, one file or shards with an index, tied
embeddings), each rank reading only its part of the files; keys that do not match are errors naming them."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import initialize, zero_init
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.test_zero import zero_config


def llama_config(tied: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def save_llama(directory: str, dtype: torch.dtype, tied: bool = False, shard: str | None = None,
               seed: int = 7) -> str:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(tied)).to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pretrained")
    return {"fp32": save_llama(str(root / "fp32"), torch.float32),
            "bf16": save_llama(str(root / "bf16"), torch.bfloat16),
            "bf16-tied-sharded": save_llama(str(root / "tied"), torch.bfloat16, tied=True, shard="20KB"),
            "bf16-sharded-other": save_llama(str(root / "other"), torch.bfloat16, shard="20KB", seed=8)}


def engine_config(dtype: str, world: int, offload: str | None = None, nvme_dir: str | None = None,
                  stage: int = 3) -> dict:
    cfg = zero_config(stage, 1, 1, chunk_size=4_000)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload:
        for part in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][part] = {"device": offload, "nvme_path": nvme_dir}
        cfg["aio"] = {"block_size": 4096}
        cfg["memory"] = {"cpu_budget": 64 * 1024}  # a few chunks: shards are paged out to NVMe as they load
    return cfg


def loaded(path: str, how: str, cfg: dict) -> tuple[dict, int]:
    """The model's state dict after initialize (fp32 masters under bf16: exact widenings of the bf16 weights) and
    the bytes this rank read from the files."""
    with zero_init():
        if how == "from_pretrained":
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
        else:
            model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(path))
    recording = next(p for p in model.parameters()).tiers_zero_init
    engine = initialize(model, cfg, weights=path if how == "weights" else None)
    state = engine.full_state_dict()
    engine.close()
    return state, recording.read_bytes


def plain(path: str) -> dict:
    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


def assert_bit_exact(state: dict, reference: dict) -> None:
    assert set(state) == set(reference)
    for name, value in reference.items():
        assert torch.equal(state[name].to(value.dtype), value), name
        assert torch.equal(state[name], value.to(state[name].dtype)), name  # no rounding on the way


@pytest.mark.parametrize("how", ["from_pretrained", "weights"])
@pytest.mark.parametrize("files, stage", [("fp32", 3), ("bf16", 3), ("bf16-tied-sharded", 3),
                                          ("bf16-tied-sharded", 1)])  # stage 1: whole chunks
def test_one_process_loads_what_from_pretrained_loads(checkpoints, files, stage, how, caplog):
    path = checkpoints[files]
    with caplog.at_level(logging.WARNING, logger="engine.zero.zero_init"):
        state, read = loaded(path, how, engine_config(files[:4], 1, stage=stage))
    assert not caplog.records  # every weight streamed: none was handed over in memory
    reference = plain(path)
    assert_bit_exact(state, reference)
    assert read == sum(t.numel() * t.element_size() for t in load_file_set(path).values())


def load_file_set(path: str) -> dict:
    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def streamed_case(rank: int, world: int, path: str, how: str, dtype: str, offload: str | None,
                  nvme_dir: str) -> dict:
    swap = os.path.join(nvme_dir, f"r{rank}")
    os.makedirs(swap, exist_ok=True)
    state, read = loaded(path, how, engine_config(dtype, world, offload, swap))
    return {"state": state if rank == 0 else None, "read": read}


def streamed_worker(rank: int, world: int, checkpoints: dict, nvme_dir: str) -> dict:
    cases = [("bf16", "from_pretrained", "bf16", "nvme"), ("fp32", "weights", "fp32", "cpu"),
             ("bf16-tied-sharded", "weights", "bf16", None), ("bf16-or-sharded", "weights", "bf16", None)]
    return run_cases(rank, cases, lambda files, how, dtype, offload: streamed_case(
        rank, world, files_of(checkpoints, files, rank), how, dtype, offload, nvme_dir))


def files_of(checkpoints: dict, files: str, rank: int) -> str:
    """bf16-or-sharded: rank 0 reads one file, rank 1 shards laid out otherwise (holding other values)."""
    return checkpoints[("bf16", "bf16-sharded-other")[rank]] if files == "bf16-or-sharded" else checkpoints[files]


def test_two_ranks_each_read_their_shards_only(checkpoints, tmp_path):
    """Under stage 3 on 2 ranks (shards offloaded to NVMe or CPU, or in memory) the gathered model equals a plain
    from_pretrained bit for bit, and each rank read about half of the files' bytes (its shards: chunk padding moves
    the split by at most a chunk)."""
    per_case = results_by_case(run_distributed(streamed_worker, 2, (checkpoints, str(tmp_path))))
    zero, one = per_case.pop(("bf16-or-sharded", "weights", "bf16", None))
    # files laid out differently on the ranks: every rank gets rank 0's values, broadcast (Note [streamed
    # weights]); rank 1's own files hold other values, so its shards show whether the broadcast happened
    assert_bit_exact(zero["state"], plain(checkpoints["bf16"]))
    assert one["read"] > 0
    for (files, how, _, _), (zero, one) in per_case.items():
        reference = plain(checkpoints[files])
        assert_bit_exact(zero["state"], reference)
        total = sum(t.numel() * t.element_size() for t in load_file_set(checkpoints[files]).values())
        assert zero["read"] + one["read"] == total, (files, how)
        assert max(zero["read"], one["read"]) <= 0.6 * total, (files, how, zero["read"], one["read"])


@pytest.fixture(scope="module")
def single_file(tmp_path_factory, checkpoints) -> dict:
    return load_file(os.path.join(checkpoints["fp32"], "model.safetensors"))


@pytest.mark.parametrize("change, named", [
    ("drop", "model.layers.1.mlp.up_proj.weight"),
    ("add", "model.layers.9.mlp.up_proj.weight"),
    ("reshape", "model.layers.0.self_attn.k_proj.weight"),
])
def test_keys_that_do_not_match_are_errors_naming_them(single_file, tmp_path, change, named):
    tensors = dict(single_file)
    if change == "drop":
        del tensors[named]
    elif change == "add":
        tensors[named] = torch.zeros(3)
    else:
        tensors[named] = tensors[named].reshape(-1)
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    with zero_init():
        model = transformers.LlamaForCausalLM(llama_config(tied=False))
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        initialize(model, engine_config("fp32", 1), weights=path)


def test_a_directory_without_safetensors_is_an_error_naming_what_it_looks_for(tmp_path):
    with zero_init():
        model = transformers.LlamaForCausalLM(llama_config(tied=False))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        initialize(model, engine_config("fp32", 1), weights=str(tmp_path))


def test_a_weight_converted_in_memory_is_held_whole_with_a_warning_and_loads_exactly(checkpoints, caplog):
    """from_pretrained converting a bf16 file to fp32 hands over tensors in memory, not views of the file."""
    path = checkpoints["bf16"]
    with caplog.at_level(logging.WARNING, logger="engine.zero.zero_init"):
        with zero_init():
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert any("not a view of its file" in r.getMessage() for r in caplog.records)
    engine = initialize(model, engine_config("fp32", 1))
    state = engine.full_state_dict()
    engine.close()
    assert_bit_exact(state, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())


def test_a_mapped_view_written_before_zero_init_saw_it_loads_what_it_holds(tmp_path):
    """A view of a mapped file whose pages were written since (copy on write) no longer holds the file's bytes:
    its own values load, not the file's."""
    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, path)
    handle = safe_open(path, framework="pt", device="cpu")
    view = handle.get_slice("w")[...]
    view.mul_(2)
    with zero_init():
        layer = torch.nn.Linear(4, 3, bias=False)
        layer.weight = torch.nn.Parameter(view)
    engine = initialize(layer, engine_config("fp32", 1, stage=0))
    assert torch.equal(engine.module.weight.detach(), torch.arange(12.0).reshape(3, 4) * 2)
    engine.close()


def test_a_model_built_in_two_zero_init_blocks_is_refused_by_name():
    with zero_init():
        first = torch.nn.Linear(4, 4)
    with zero_init():
        second = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="built in another zero_init block"):
        initialize(torch.nn.Sequential(first, second), engine_config("fp32", 1))
