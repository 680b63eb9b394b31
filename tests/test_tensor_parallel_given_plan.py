"""A plan the user gives ({glob: style}, or a built-in plan named for a model of another class) gets the gradients
of the whole parameters that meet its splits summed, or is refused where no sum is right (Note [partial gradients
under a given plan]): Qwen3's per-head q/k norms under the Llama-shaped plan train like one process."""

from __future__ import annotations

import pytest
import torch

from engine import initialize
from engine.tensor_parallel.derive import derive_plan
from engine.tensor_parallel.derive.given_plan import partial_gradients_of
from engine.tensor_parallel.plans import BUILT_IN
from tests.distributed import results_by_case, run_cases, run_distributed
from tests.reference import assert_close_relative, assert_params_close, param_snapshot, train_reference
from tests.test_data_parallel import adamw
from tests.test_tensor_parallel_derived import GatedByTheHiddenState, ScaledOnBothSides

pytest.importorskip("transformers")

from tests import hf_zoo, zoo_cells  # noqa: E402 (after the skip: they import transformers)

LLAMA_SHAPED = {"model.embed_tokens": "vocab", "model.layers.*.self_attn.[qkv]_proj": "colwise",
                "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.[gu][ap]*_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather"}
PLANS = {"globs": LLAMA_SHAPED, "built-in plan of another class": "LlamaForCausalLM"}


def test_the_given_plan_finds_the_parameters_the_derived_plan_sums():
    qwen3 = hf_zoo.build("qwen3")
    assert partial_gradients_of(qwen3, LLAMA_SHAPED, 2) == derive_plan(qwen3, 2).partial_gradients != ()
    assert partial_gradients_of(hf_zoo.build("qwen3"), BUILT_IN["LlamaForCausalLM"].styles, 2) == \
        derive_plan(qwen3, 2).partial_gradients
    assert partial_gradients_of(hf_zoo.build("llama"), LLAMA_SHAPED, 2) == ()


@pytest.mark.parametrize("model,why", [
    (ScaledOnBothSides, "parameter 'alpha' meets activations split by up and is also used on whole ones"),
    (GatedByTheHiddenState, "mul combines a split tensor with a whole one a gradient flows through")])
def test_a_given_plan_no_gradient_sum_makes_right_is_refused(model, why):
    with pytest.raises(ValueError, match=why):
        partial_gradients_of(model(), {"up": "colwise", "down": "rowwise"}, 2)


def _config(plan) -> dict:
    return {**zoo_cells.config("tp_auto"), "tensor_parallel": {"size": 2, "plan": plan}}


def _run(which: str) -> tuple:
    engine = initialize(hf_zoo.build("qwen3"), _config(PLANS[which]))
    try:
        return zoo_cells._train(engine, False), zoo_cells._params(engine)
    finally:
        engine.close()


def _worker(rank: int, world: int) -> dict:
    return run_cases(rank, [(which,) for which in PLANS], _run)


def test_qwen3_under_a_given_llama_shaped_plan_trains_like_one_process():
    results = results_by_case(run_distributed(_worker, 2, timeout_s=240))
    model = hf_zoo.build("qwen3")
    ref_losses, _ = train_reference(model, zoo_cells.batches(), adamw, clip=1.0, loss_fn=hf_zoo.hf_loss)
    ref_params = param_snapshot(model)
    for which in PLANS:
        for losses, params in results[(which,)]:
            assert_close_relative(losses, ref_losses, rtol=1e-4)
            assert_params_close(params, ref_params, rtol=1e-4)
            assert not torch.equal(params["model.layers.0.self_attn.q_norm.weight"],
                                   hf_zoo.build("qwen3").state_dict()["model.layers.0.self_attn.q_norm.weight"])
