"""Cutting a model into pipeline stages (Note [pipeline stages of an unmodified model]): balanced runs of blocks, the
modules before and after them, and what a rank keeps; no process group needed."""

from __future__ import annotations

import pytest
import torch

from engine.config_sections import PipelineConfig
from engine.pipeline.block_timing import measured_costs
from engine.pipeline.model_split import plan_stages, split_model
from engine.pipeline.partition import balanced_starts, starts_from_names
from engine.pipeline.stage_modules import Place, VacantModule
from tests.reference import tiny_gpt
from tests.test_pipeline_engine import example_gpt


def test_balanced_runs_minimize_the_costliest_stage_counting_what_runs_before_and_after_the_blocks():
    assert balanced_starts([1.0] * 4, 2) == [0, 2]
    assert balanced_starts([1.0] * 4, 2, head=2.0) == [0, 1]  # the embeddings weigh on stage 0: it gets 1 block
    assert balanced_starts([1.0] * 4, 2, tail=2.0) == [0, 3]  # the head weighs on the last stage: 1 block
    assert balanced_starts([4.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1]
    assert balanced_starts([1.0] * 6, 3) == [0, 2, 4]
    with pytest.raises(ValueError, match="3 pipeline stages need at least 3 blocks, and the model has 2"):
        balanced_starts([1.0, 1.0], 3)


def test_named_starts():
    names = [f"h.{i}" for i in range(4)]
    assert starts_from_names(names, ["h.2"], 2) == [0, 2]
    assert starts_from_names(names, ["h.0", "h.1", "h.3"], 3) == [0, 1, 3]
    with pytest.raises(ValueError, match="'h.9' is not one of the model's blocks"):
        starts_from_names(names, ["h.9"], 2)
    with pytest.raises(ValueError, match="3 distinct blocks in increasing order start the 3 stages"):
        starts_from_names(names, ["h.2", "h.1"], 3)


def test_the_example_gpt_is_cut_at_its_blocks_with_the_embeddings_first_and_the_head_last():
    model = example_gpt()
    plan = plan_stages(model, PipelineConfig(stages=2, partition="uniform"))
    assert (plan.list_name, plan.starts, plan.block_count) == ("blocks", (0, 2), 4)
    assert plan.outside == (("wte", Place.BEFORE), ("wpe", Place.BEFORE), ("ln_f", Place.AFTER),
                            ("lm_head", Place.AFTER))  # drop has no parameters: it runs on every stage
    by_parameters = plan_stages(model, PipelineConfig(stages=2))
    # the tied embedding counts on both ends (wte + wpe before, ln_f + lm_head after: about equal), so 2 and 2
    assert by_parameters.starts == (0, 2)
    # a 4096-token vocabulary: 262k parameters at each end against ~50k per block, so the middle stage takes two
    big_vocab = tiny_gpt(0, n_layer=4, tie_weights=False, vocab_size=4096)
    assert plan_stages(big_vocab, PipelineConfig(stages=3)).starts == (0, 1, 3)
    assert plan_stages(big_vocab, PipelineConfig(stages=3, partition="uniform")).starts == (0, 1, 2)


def test_partition_time_measures_every_block_and_refuses_a_model_it_cannot_feed():
    model = example_gpt()
    costs, head, tail = measured_costs(model, model.blocks, micro_batch=1, device=torch.device("cpu"), rounds=1)
    assert len(costs) == 4 and min(costs) > 0 and head > 0 and tail > 0
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    with pytest.raises(ValueError, match=r'partition "time" times the blocks of a token language model.*Sequential '
                                         r'has no vocab_size: use partition "parameters", "uniform"'):
        measured_costs(torch.nn.Sequential(*blocks), blocks, micro_batch=1, device=torch.device("cpu"))


def test_a_rank_keeps_its_stage_and_names_what_it_does_not_hold():
    model = example_gpt()
    whole = {n: p for n, p in model.named_parameters()}
    split = split_model(model, plan_stages(model, PipelineConfig(stages=2, partition="uniform")), rank=1)
    kept = {split.names[id(p)] for p in model.parameters()}
    assert kept == {n for n in whole if n.startswith(("blocks.2.", "blocks.3.", "ln_f.", "wte."))}  # wte: lm_head's
    assert split.shared == {id(whole["wte.weight"]): (0, 1)}
    assert isinstance(model.blocks[0], VacantModule) and isinstance(model.wpe, VacantModule)
    with pytest.raises(RuntimeError, match=r"wte is held by pipeline stage 0 \(rank 0, blocks 0-1\) and was "
                                           r"called outside the pipeline.*engine.train_batch"):
        model(torch.zeros(1, 4, dtype=torch.long))


class NormRegisteredFirst(torch.nn.Module):
    """OPT's order: the final norm registered before the blocks, called after them; `between`, when set, is called
    among the blocks."""

    def __init__(self, between: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.final_norm = torch.nn.LayerNorm(8)
        self.mixer = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 16)
        self.between = between

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            x = block(self.mixer(x) if self.between and i == 2 else x)
        return self.head(self.final_norm(x))


def test_modules_beside_the_blocks_go_where_the_forward_calls_them_and_one_called_among_them_is_refused():
    plan = plan_stages(NormRegisteredFirst(), PipelineConfig(stages=2, partition="uniform"))
    assert dict(plan.outside) == {"embed": Place.BEFORE, "final_norm": Place.AFTER, "mixer": Place.BEFORE,
                                  "head": Place.AFTER}  # mixer: never called, so by registration
    with pytest.raises(ValueError, match=r"pipeline: mixer is called among the blocks, and only the modules "
                                         r"called before the block list or after it"):
        plan_stages(NormRegisteredFirst(between=True), PipelineConfig(stages=2, partition="uniform"))


def test_a_stage_config_reads_and_writes_through_to_the_model_config_but_for_its_layer_types():
    from types import SimpleNamespace

    from engine.pipeline.model_split import StageConfig

    config = SimpleNamespace(layer_types=["sliding", "full", "sliding"], sliding_window=4)
    stage = StageConfig(config, ["full", "sliding"])
    assert stage.layer_types == ["full", "sliding"] and stage.sliding_window == 4
    stage.is_causal = True  # transformers sets such flags for a forward and deletes them after it
    assert config.is_causal is True
    del stage.is_causal
    assert not hasattr(config, "is_causal")
    with pytest.raises(AttributeError, match="a pipeline stage's layer_types are its blocks'"):
        stage.layer_types = ["full"]
