"""LR schedules against closed forms written here from DeepSpeed's definitions.

Convention (DeepSpeed's): the scheduler is built with last_batch_iteration = -1 and stepped after
every optimizer step, so the optimizer step number k runs at the lr for iteration k - 1.
"""

import math

import pytest
import torch

from engine.lr_schedules import REQUIRED, SCHEDULE_PARAMS, build_lr_scheduler


def adamw(lr=1e-3, **kw):
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=lr, **kw)


def sgd(lr=1e-3, momentum=0.9):
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=lr, momentum=momentum)


def run(opt, sched, n, key="lr"):
    """Train n steps; return {iteration: value of `key` the optimizer held during that step}."""
    seen, start = {}, sched.last_batch_iteration
    for k in range(n):
        group = opt.param_groups[0]
        seen[start + k] = group["betas"][0] if key == "beta1" else group[key]
        assert sched.last_batch_iteration == start + k
        opt.zero_grad()
        sum(p.sum() for g in opt.param_groups for p in g["params"]).backward()
        opt.step()
        sched.step()
    return seen


# ---- closed forms (DeepSpeed) ----

def warmup_gamma(i, w, kind):
    w = max(2, w)
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


def warmup_lr(i, lo, hi, w, kind):
    if i < 0:
        return lo
    return lo + (hi - lo) * (warmup_gamma(i, w, kind) if i < max(2, w) else 1.0)


def warmup_decay_lr(i, lo, hi, w, total, kind):
    if i < 0:
        return lo
    w2 = max(2, w)
    gamma = warmup_gamma(i, w, kind) if i < w2 else max(0.0, (total - i) / max(1, total - w2))
    return lo + (hi - lo) * gamma


def cosine_lr(i, peak, total, w, wmin, cmin, kind):
    if i < 0:
        return 0.0
    if i < max(2, w):
        return peak * (wmin + (1 - wmin) * warmup_gamma(i, w, kind))
    progress = min(1.0, (i - max(2, w) + 1) / max(1, total - max(2, w)))
    return peak * (cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress)))


def one_cycle(i, lo, hi, mlo, mhi, first, second, decay_size=0, lr_rate=0.0, mom_rate=0.0):
    """(lr, momentum) at iteration i; the cycle is indexed by i + 1."""
    total = first + second
    if i < total:
        c = (i + 1) % total
        s = c / first if c <= first else (total - c) / second
        return lo + (hi - lo) * s, mhi - (mhi - mlo) * s
    if decay_size == 0:
        return lo, mhi
    d = (i - total + 1) / decay_size
    lr = lo if lr_rate == 0 else lo / (1 + lr_rate * d)
    mom = mhi if mom_rate == 0 else mhi * (1 + mom_rate * d)
    return lr, mom


# ---- WarmupLR / WarmupDecayLR ----

@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_sequence(kind):
    opt = adamw()
    sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                                                 "warmup_num_steps": 10, "warmup_type": kind})
    seen = run(opt, sched, 40)
    for i in (-1, 0, 1, 5, 9, 10, 11, 38):
        assert seen[i] == pytest.approx(warmup_lr(i, 0.01, 0.1, 10, kind), rel=1e-12), i
    assert seen[-1] == seen[0] == pytest.approx(0.01)  # DeepSpeed runs the floor twice
    # log reaches the peak at iteration W - 1 (log W / log W); linear only at W
    assert seen[9] == pytest.approx(0.1 if kind == "log" else 0.091)
    assert seen[5] < seen[9] and seen[10] == pytest.approx(0.1) and seen[38] == pytest.approx(0.1)
    assert sched.get_last_lr() == [pytest.approx(0.1)]


def test_warmup_lr_log_and_linear_differ_mid_warmup():
    log = warmup_lr(4, 0.0, 1.0, 10, "log")
    lin = warmup_lr(4, 0.0, 1.0, 10, "linear")
    for kind, want in (("log", log), ("linear", lin)):
        opt = adamw()
        sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": kind})
        assert sched.lr_at(4) == [pytest.approx(want)]
    assert log == pytest.approx(math.log(5) / math.log(10)) and lin == pytest.approx(0.4)


def test_warmup_num_steps_is_clamped_to_two():
    opt = adamw()
    sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 1, "warmup_type": "linear"})
    seen = run(opt, sched, 4)
    assert [seen[i] for i in (-1, 0, 1, 2)] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    opt = adamw()  # log with 1 step would divide by log(1) = 0 without the clamp
    sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 1})
    assert [sched.lr_at(i)[0] for i in (0, 1, 2)] == pytest.approx([0.0, 1.0, 1.0])


def test_warmup_lr_defaults_and_optimizer_really_uses_the_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)  # lr is overwritten
    sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_type": "linear"})
    p = opt.param_groups[0]["params"][0]
    before = p.item()
    run(opt, sched, 501)  # grad of p.sum() is 1, so SGD moves p by exactly -lr each step
    want = sum(warmup_lr(i, 0.0, 0.001, 1000, "linear") for i in range(-1, 500))
    assert before - p.item() == pytest.approx(want, rel=1e-5)
    assert sched.lr_at(999) == [pytest.approx(0.000999)] and sched.lr_at(1000) == [pytest.approx(0.001)]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_sequence(kind):
    opt = adamw()
    sched = build_lr_scheduler(opt, "WarmupDecayLR", {"total_num_steps": 30, "warmup_min_lr": 0.01,
                                                      "warmup_max_lr": 0.1, "warmup_num_steps": 10,
                                                      "warmup_type": kind})
    seen = run(opt, sched, 45)
    for i in (-1, 0, 5, 9, 10, 15, 20, 29, 30, 31, 43):
        assert seen[i] == pytest.approx(warmup_decay_lr(i, 0.01, 0.1, 10, 30, kind), rel=1e-12), i
    assert seen[10] == pytest.approx(0.1)
    assert seen[20] == pytest.approx(0.055)  # halfway down the linear decay
    assert seen[30] == seen[43] == pytest.approx(0.01)  # back at warmup_min_lr, held there


# ---- WarmupCosineLR ----

@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_sequence(kind):
    opt = adamw(lr=0.5)  # the optimizer's lr is the peak
    sched = build_lr_scheduler(opt, "WarmupCosineLR", {"total_num_steps": 30, "warmup_min_ratio": 0.1,
                                                       "warmup_num_steps": 10, "cos_min_ratio": 0.01,
                                                       "warmup_type": kind})
    seen = run(opt, sched, 60)
    for i in (-1, 0, 4, 9, 10, 19, 20, 28, 29, 30, 45, 58):
        assert seen[i] == pytest.approx(cosine_lr(i, 0.5, 30, 10, 0.1, 0.01, kind), rel=1e-12, abs=1e-15), i
    assert seen[-1] == 0.0 and seen[0] == pytest.approx(0.05)
    assert seen[29] == pytest.approx(0.005) and seen[58] == pytest.approx(0.005)  # floor, no climb back


def test_warmup_cosine_defaults_and_per_group_peaks():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 1.0},
                             {"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.1}])
    sched = build_lr_scheduler(opt, "WarmupCosineLR", {"total_num_steps": 3000})
    assert sched.get_last_lr() == [0.0, 0.0]
    for i in (0, 500, 999, 1000, 2000, 2999, 5000):
        want = cosine_lr(i, 1.0, 3000, 1000, 0.0, 1e-4, "log")
        assert sched.lr_at(i) == [pytest.approx(want, abs=1e-15), pytest.approx(want / 10, abs=1e-15)], i
    assert sched.lr_at(5000) == [pytest.approx(1e-4), pytest.approx(1e-5)]


# ---- OneCycle ----

def test_one_cycle_adamw_lr_and_beta1_through_cycle_and_decay():
    opt = adamw(betas=(0.5, 0.95))
    cfg = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "cycle_second_step_size": 6,
           "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}
    sched = build_lr_scheduler(opt, "OneCycle", cfg)
    lrs = run(opt, sched, 20)
    opt2 = adamw(betas=(0.5, 0.95))
    moms = run(opt2, build_lr_scheduler(opt2, "OneCycle", cfg), 20, key="beta1")
    for i in range(-1, 19):
        lr, mom = one_cycle(i, 0.01, 0.1, 0.8, 0.9, 4, 6, 2, 0.5, 0.1)
        assert lrs[i] == pytest.approx(lr, rel=1e-12), i
        assert moms[i] == pytest.approx(mom, rel=1e-12), i
    assert lrs[-1] == pytest.approx(0.01) and moms[-1] == pytest.approx(0.9)  # cycle start
    assert lrs[3] == pytest.approx(0.1) and moms[3] == pytest.approx(0.8)  # peak after first half
    assert lrs[6] == pytest.approx(0.055)  # halfway down the second half
    assert lrs[9] == pytest.approx(0.01)  # first decay iteration: d = 0
    assert lrs[13] == pytest.approx(0.01 / 2.0) and moms[13] == pytest.approx(0.9 * 1.2)
    assert opt.param_groups[0]["betas"][1] == 0.95  # beta2 is not touched


def test_one_cycle_sgd_momentum_without_decay():
    cfg = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 5,
           "decay_lr_rate": 0.5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}
    opt, opt2 = sgd(), sgd()
    lrs = run(opt, build_lr_scheduler(opt, "OneCycle", cfg), 16)
    moms = run(opt2, build_lr_scheduler(opt2, "OneCycle", cfg), 16, key="momentum")
    for i in range(-1, 15):
        lr, mom = one_cycle(i, 0.1, 1.0, 0.85, 0.95, 5, 5)
        assert lrs[i] == pytest.approx(lr) and moms[i] == pytest.approx(mom), i
    assert lrs[4] == pytest.approx(1.0) and moms[4] == pytest.approx(0.85)
    assert lrs[14] == pytest.approx(0.1) and moms[14] == pytest.approx(0.95)  # decay_step_size 0: no decay


def test_one_cycle_staircase():
    opt = adamw()
    sched = build_lr_scheduler(opt, "OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                                                 "cycle_second_step_size": 6, "cycle_first_stair_count": 2,
                                                 "cycle_second_stair_count": 3, "cycle_momentum": False})
    got = [sched.lr_at(i)[0] for i in range(-1, 10)]
    # rising: floor(c * 2 / 4) / 2 for c = 0..4; falling: floor((10 - c) * 3 / 6) / 3 for c = 5..9, then 0
    assert got == pytest.approx([0, 0, 0.5, 0.5, 1, 2 / 3, 2 / 3, 1 / 3, 1 / 3, 0, 0])
    assert "betas" in opt.param_groups[0] and opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_one_cycle_momentum_disabled_for_optimizer_without_momentum():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.ones(1))])
    sched = build_lr_scheduler(opt, "OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0})
    sched.step()
    assert "momentum" not in opt.param_groups[0] and sched.momentum_at(0) is None


# ---- state and surface ----

RESUME_CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 8}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 8, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 8, "warmup_min_ratio": 0.2}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                  "decay_step_size": 2, "decay_lr_rate": 0.3, "decay_mom_rate": 0.05}),
]


@pytest.mark.parametrize("name,params", RESUME_CASES)
def test_state_dict_round_trip_resumes_the_same_sequence(name, params):
    opt = adamw(lr=0.3)
    sched = build_lr_scheduler(opt, name, params)
    run(opt, sched, 7)
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 6}
    tail = run(opt, sched, 15)

    fresh = adamw(lr=0.3)
    resumed = build_lr_scheduler(fresh, name, params)
    assert resumed.last_batch_iteration == -1
    resumed.load_state_dict(state)
    assert resumed.last_batch_iteration == 6
    assert fresh.param_groups[0]["betas"][0] == pytest.approx(opt_beta1_at(name, params, 6))
    assert run(fresh, resumed, 15) == pytest.approx(tail)
    assert tail[6] != tail[13]  # the compared window is not flat


def opt_beta1_at(name, params, i):
    if name != "OneCycle":
        return 0.9  # untouched AdamW default
    return one_cycle(i, 0.01, 0.1, 0.8, 0.9, 5, 5, 2, 0.3, 0.05)[1]


def test_get_last_lr_and_explicit_step_index():
    opt = adamw()
    sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": "linear"})
    sched.step(7)
    assert sched.last_batch_iteration == 7
    assert sched.get_last_lr() == [pytest.approx(0.7)] and opt.param_groups[0]["lr"] == pytest.approx(0.7)
    assert isinstance(sched.get_last_lr()[0], float)


def test_tensor_lr_is_updated_in_place():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=torch.tensor(0.5), foreach=False)
    lr_tensor = opt.param_groups[0]["lr"]
    sched = build_lr_scheduler(opt, "WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2,
                                                       "warmup_type": "linear", "warmup_min_ratio": 0.5})
    run(opt, sched, 3)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(cosine_lr(2, 0.5, 10, 2, 0.5, 1e-4, "linear"))


def test_schedule_params_match_the_config_spec():
    assert SCHEDULE_PARAMS == {
        "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"},
        "WarmupDecayLR": {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                          "warmup_num_steps": 1000, "warmup_type": "log"},
        "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                           "cos_min_ratio": 1e-4, "warmup_type": "log"},
        "OneCycle": {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
                     "cycle_first_step_size": 2000, "cycle_second_step_size": None, "cycle_first_stair_count": 0,
                     "cycle_second_stair_count": None, "decay_step_size": 0, "cycle_momentum": True,
                     "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0},
    }


# ---- errors ----

@pytest.mark.parametrize("name,params,fragments", [
    ("WarmupDecayLR", {}, ["scheduler.params: WarmupDecayLR requires 'total_num_steps'"]),
    ("OneCycle", {"cycle_min_lr": 0.1}, ["OneCycle requires 'cycle_max_lr'"]),
    ("WarmupLR", {"warmup_type": "cubic"}, ["scheduler.params.warmup_type: 'cubic' is not one of 'log', 'linear'"]),
    ("WarmupLR", {"warmup_max": 0.1}, ["'warmup_max'", "did you mean 'warmup_max_lr'", "WarmupLR"]),
    ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ration": 0.1}, ["'cos_min_ration'", "'cos_min_ratio'"]),
    ("WarmupLR", {"warmup_num_steps": -1}, ["scheduler.params.warmup_num_steps", ">= 0"]),
    ("WarmupLR", {"warmup_num_steps": 2.5}, ["scheduler.params.warmup_num_steps"]),
    ("OneCycle", {"cycle_min_lr": "x", "cycle_max_lr": 1.0}, ["scheduler.params.cycle_min_lr", "number"]),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_momentum": 1}, ["cycle_momentum"]),
    ("warmupLR", {}, ["'warmupLR'", "'WarmupLR'"]),
    ("CosineLR", {}, ["scheduler.type", "'CosineLR'"]),
])
def test_bad_config_raises_value_error_naming_the_problem(name, params, fragments):
    with pytest.raises(ValueError) as err:
        build_lr_scheduler(adamw(), name, params)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_zero_warmup_steps_is_accepted_as_deepspeed_does():
    """DeepSpeed clamps warmup_num_steps to at least 2 (log warmup divides by log(steps)), so 0 is legal."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_lr_scheduler(opt, "WarmupLR", {"warmup_num_steps": 0, "warmup_max_lr": 0.01})
    assert sched.warmup_num_steps == 2
