"""Batch-size resolution: train_batch_size = micro × accumulation × data-parallel size (DeepSpeed's rule).

Any two values give the third, one alone means accumulation 1, "auto" is derived, and every
inconsistency is an error that shows the three values and the rule.
"""

from __future__ import annotations

import pytest

from engine.config import BatchSizes, ConfigError, load_config, resolve_batch_sizes
from tests.test_config import raises

# --- batch sizes ------------------------------------------------------------------------------

DPS = [1, 2, 4]


@pytest.mark.parametrize("dp", DPS)
@pytest.mark.parametrize("micro, accum", [(1, 1), (2, 3), (4, 8)])
def test_any_two_batch_values_give_the_third(dp, micro, accum):
    total = micro * accum * dp
    expected = BatchSizes(total, micro, accum)
    combos = [
        {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro},
        {"train_batch_size": total, "gradient_accumulation_steps": accum},
        {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum},
        {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum},
    ]
    for raw in combos:
        assert load_config(raw).batch_sizes(dp) == expected, raw


@pytest.mark.parametrize("dp", DPS)
def test_one_batch_value_alone_means_accumulation_one(dp):
    assert load_config({"train_micro_batch_size_per_gpu": 3}).batch_sizes(dp) == BatchSizes(3 * dp, 3, 1)
    assert load_config({"train_batch_size": 8 * dp}).batch_sizes(dp) == BatchSizes(8 * dp, 8, 1)


@pytest.mark.parametrize("dp", DPS)
def test_auto_batch_values_are_derived(dp):
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": 4})
    assert cfg.batch_sizes(dp) == BatchSizes(8 * dp, 2, 4)
    cfg = load_config({"train_batch_size": 16 * dp, "train_micro_batch_size_per_gpu": "auto",
                       "gradient_accumulation_steps": 2})
    assert cfg.batch_sizes(dp) == BatchSizes(16 * dp, 8, 2)
    cfg = load_config({"train_batch_size": 12 * dp, "train_micro_batch_size_per_gpu": 3,
                       "gradient_accumulation_steps": "auto"})
    assert cfg.batch_sizes(dp) == BatchSizes(12 * dp, 3, 4)
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 5})
    assert cfg.batch_sizes(dp) == BatchSizes(5 * dp, 5, 1)  # accumulation absent: 1, as in DeepSpeed


@pytest.mark.parametrize("dp", DPS)
def test_inconsistent_batch_values_show_all_three_and_the_rule(dp):
    cfg = load_config({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError) as info:
        cfg.batch_sizes(dp)
    msg = str(info.value)
    for fragment in ("train_batch_size=100", "train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=2",
                     f"data-parallel size={dp}", f"4×2×{dp} = {8 * dp}",
                     "train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × "
                     "data-parallel size"):
        assert fragment in msg, msg


@pytest.mark.parametrize("dp", [2, 4])
def test_batch_consistent_for_one_dp_is_inconsistent_for_another(dp):
    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    assert cfg.batch_sizes(1) == BatchSizes(8, 4, 2)
    with pytest.raises(ConfigError, match="inconsistent"):
        cfg.batch_sizes(dp)


@pytest.mark.parametrize("dp", DPS)
def test_non_divisible_batch_values_are_errors(dp):
    # total not a multiple of micro × dp
    cfg = load_config({"train_batch_size": 4 * dp + 1, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError) as info:
        cfg.batch_sizes(dp)
    msg = str(info.value)
    assert f"train_batch_size={4 * dp + 1}" in msg and "train_micro_batch_size_per_gpu=4" in msg
    assert f"not a multiple of micro × dp = {4 * dp}" in msg
    # total not a multiple of accumulation × dp
    cfg = load_config({"train_batch_size": 3 * dp + 1, "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match=rf"not a multiple of accumulation × dp = {3 * dp}"):
        cfg.batch_sizes(dp)
    # total smaller than micro × dp gives zero accumulation steps
    cfg = load_config({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match="not a multiple of micro"):
        cfg.batch_sizes(dp)


def test_total_not_divisible_by_dp_alone():
    cfg = load_config({"train_batch_size": 6})
    assert cfg.batch_sizes(2) == BatchSizes(6, 3, 1)
    with pytest.raises(ConfigError, match="not a multiple of accumulation × dp = 4"):
        cfg.batch_sizes(4)


def test_gradient_accumulation_steps_alone_is_an_error():
    raises({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps alone",
           "train_batch_size", "train_micro_batch_size_per_gpu")
    raises({"gradient_accumulation_steps": 4, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
           'train_batch_size, train_micro_batch_size_per_gpu: "auto" with nothing to derive it from', "Hugging Face")


@pytest.mark.parametrize("raw, unfilled", [
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, "train_batch_size, train_micro_batch"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": "auto"},
     "train_batch_size, gradient_accumulation_steps"),
    ({"train_batch_size": 64, "gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
])
def test_auto_batch_values_nothing_determines_name_the_integrations(raw, unfilled):
    """An "auto" the other batch keys leave open (HF Trainer fills it from its arguments) is refused at load."""
    msg = raises(raw, f'{unfilled}', '"auto" with nothing to derive it from', "Hugging Face Trainer", "accelerate")
    assert msg.startswith(unfilled)


@pytest.mark.parametrize("raw", [{}])
def test_no_batch_size_is_an_error(raw):
    cfg = load_config(raw)
    with pytest.raises(ConfigError) as info:
        cfg.batch_sizes(1)
    msg = str(info.value)
    assert "set train_batch_size or train_micro_batch_size_per_gpu" in msg
    assert "train_batch_size=None" in msg


def test_resolve_batch_sizes_directly():
    assert resolve_batch_sizes(64, None, 2, 4) == BatchSizes(64, 8, 2)
    assert resolve_batch_sizes(None, 8, None, 4) == BatchSizes(32, 8, 1)
    with pytest.raises(ConfigError):
        resolve_batch_sizes(None, None, 2, 1)
