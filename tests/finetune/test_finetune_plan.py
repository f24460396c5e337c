"""FinetuneConfig validation (each bad argument named) and plan_finetune's numbers and event."""

from __future__ import annotations

import math
import time

import pytest

from gaussdp.accounting import SelfComposedEvent, SubsampledGaussianEvent
from gaussdp.accounting import accountant as make_accountant
from gaussdp.errors import InvalidParameter
from gaussdp.finetune import (
    MAX_STEPS,
    FinetuneConfig,
    FinetunePlan,
    check_plan,
    default_target_modules,
    plan_finetune,
)

OK = {"target_epsilon": 8.0, "delta": 1e-5}


@pytest.mark.parametrize(
    ("changes", "error", "named"),
    [
        ({"lora_rank": 0}, InvalidParameter, "lora_rank"),
        ({"lora_rank": 2.0}, TypeError, "lora_rank"),
        ({"lora_rank": True}, TypeError, "lora_rank"),
        ({"lora_alpha": -1.0}, InvalidParameter, "lora_alpha"),
        ({"lora_alpha": math.nan}, InvalidParameter, "lora_alpha"),
        ({"lora_dropout": 1.0}, InvalidParameter, "lora_dropout"),
        ({"lora_dropout": "0.1"}, TypeError, "lora_dropout"),
        ({"target_modules": ()}, InvalidParameter, "target_modules"),
        ({"target_modules": "c_attn"}, TypeError, "target_modules"),
        ({"target_modules": ("c_attn", "")}, InvalidParameter, "target_modules"),
        ({"epochs": 0}, InvalidParameter, "epochs"),
        ({"epochs": 1.5}, TypeError, "epochs"),
        ({"batch_size": 0}, InvalidParameter, "batch_size"),
        ({"learning_rate": 0.0}, InvalidParameter, "learning_rate"),
        ({"learning_rate": math.inf}, InvalidParameter, "learning_rate"),
        ({"max_seq_len": 1}, InvalidParameter, "max_seq_len"),
        ({"clip_norm": 0.0}, InvalidParameter, "clip_norm"),
        ({"clip_norm": math.nan}, InvalidParameter, "clip_norm"),
        ({"delta": None}, InvalidParameter, "delta"),
        ({"delta": 1.0}, InvalidParameter, "delta"),
        ({"delta": 0.0}, InvalidParameter, "delta"),
        ({"target_epsilon": -1.0}, InvalidParameter, "target_epsilon"),
        ({"target_epsilon": math.inf}, InvalidParameter, "target_epsilon"),
        ({"target_epsilon": None}, InvalidParameter, "exactly one of target_epsilon and noise_multiplier"),
        ({"noise_multiplier": 1.0}, InvalidParameter, "exactly one of target_epsilon and noise_multiplier"),
        ({"target_epsilon": None, "noise_multiplier": 0.0}, InvalidParameter, "noise_multiplier"),
        ({"target_epsilon": None, "noise_multiplier": math.nan}, InvalidParameter, "noise_multiplier"),
        ({"accountant": "gdp"}, InvalidParameter, "accountant"),
        ({"accountant": 3}, TypeError, "accountant"),
    ],
)
def test_config_refuses_each_bad_argument_by_name(changes, error, named):
    with pytest.raises(error, match=named):
        FinetuneConfig(**{**OK, **changes})


def test_config_normalises_and_round_trips():
    c = FinetuneConfig(target_modules=["q_proj", "v_proj"], accountant="RDP", **OK)
    assert c.target_modules == ("q_proj", "v_proj") and c.accountant == "rdp"
    assert FinetuneConfig.from_dict(c.to_dict()) == c
    with pytest.raises(InvalidParameter, match="unknown FinetuneConfig fields"):
        FinetuneConfig.from_dict({**c.to_dict(), "evil": 1})


def test_default_target_modules():
    assert default_target_modules("gpt2") == ("c_attn",)
    assert default_target_modules("llama") == ("q_proj", "v_proj")
    assert default_target_modules("gpt_neox") == ("query_key_value",)
    with pytest.raises(InvalidParameter, match="target_modules"):
        default_target_modules("some_new_arch")
    with pytest.raises(InvalidParameter, match="not a causal language model"):
        default_target_modules("bert")


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize(("n", "batch", "epochs"), [(48, 16, 2), (1000, 64, 3), (10, 32, 1)])
def test_plan_epsilon_is_the_accountants_value_for_its_event_and_meets_the_target(
    accountant, n, batch, epochs
):
    cfg = FinetuneConfig(
        target_epsilon=2.0, delta=1e-5, batch_size=batch, epochs=epochs, accountant=accountant
    )
    plan = plan_finetune(cfg, n_records=n)
    assert plan.steps_per_epoch == math.ceil(n / batch)
    assert plan.sample_rate == 1.0 / plan.steps_per_epoch
    assert plan.steps == epochs * plan.steps_per_epoch
    assert plan.expected_batch_size <= batch
    step = SubsampledGaussianEvent(plan.noise_multiplier, plan.sample_rate)
    assert plan.event == SelfComposedEvent(step, plan.steps)
    # the accountant's value for the event, composed independently step by step
    acc = make_accountant(accountant)
    for _ in range(plan.steps):
        acc.compose(step)
    assert plan.epsilon == pytest.approx(acc.epsilon(1e-5), rel=1e-6)
    assert plan.epsilon == make_accountant(accountant).compose(plan.event).epsilon(1e-5)
    assert plan.epsilon <= 2.0
    # calibrated to the target: 1% less noise would overshoot it
    less = make_accountant(accountant).compose(
        SubsampledGaussianEvent(plan.noise_multiplier * 0.99, plan.sample_rate), count=plan.steps
    )
    assert less.epsilon(1e-5) > 2.0


def test_plan_from_a_given_noise_multiplier_and_against_dp_accounting():
    dp_accounting = pytest.importorskip("dp_accounting")
    cfg = FinetuneConfig(noise_multiplier=1.1, delta=1e-5, batch_size=256, epochs=2)
    plan = plan_finetune(cfg, n_records=60_000)
    assert plan.noise_multiplier == 1.1 and plan.target_epsilon is None
    ev = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(plan.sample_rate, dp_accounting.GaussianDpEvent(1.1)), plan.steps
    )
    theirs = dp_accounting.pld.PLDAccountant().compose(ev).get_epsilon(1e-5)
    assert theirs * 0.99 <= plan.epsilon <= theirs * 1.02  # an independent PLD implementation


def test_plan_bounds_and_round_trip():
    cfg = FinetuneConfig(delta=1e-5, noise_multiplier=1.0, epochs=101, batch_size=1)
    with pytest.raises(InvalidParameter, match="epochs=101"):
        plan_finetune(cfg, n_records=1000)
    with pytest.raises(InvalidParameter, match="n_records"):
        plan_finetune(FinetuneConfig(**OK), n_records=0)
    # little noise: a large epsilon, honestly reported (the ledger's budget is what refuses it)
    assert plan_finetune(FinetuneConfig(delta=1e-5, noise_multiplier=0.01), n_records=10).epsilon > 1000
    plan = plan_finetune(FinetuneConfig(**OK), n_records=100)
    assert FinetunePlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(TypeError, match=r"plan\.steps"):
        FinetunePlan.from_dict({**plan.to_dict(), "steps": "7"})
    forged = {**plan.to_dict(), "epsilon": plan.epsilon / 2}
    with pytest.raises(InvalidParameter, match="below the accountant"):
        FinetunePlan.from_dict(forged)
    with pytest.raises(InvalidParameter, match="n_records=100"):
        check_plan(plan, n_records=99)
    with pytest.raises(InvalidParameter, match="clip_norm"):
        check_plan(plan, config=FinetuneConfig(clip_norm=2.0, **OK))


def test_plan_cost_is_bounded_at_the_largest_accepted_run():
    # MAX_STEPS steps, calibrated: the most work plan_finetune accepts (< 1 s of CPU alone; the
    # bound here is looser because this machine is shared)
    cfg = FinetuneConfig(target_epsilon=1.0, delta=1e-7, batch_size=1, epochs=1)
    t0 = time.process_time()
    plan = plan_finetune(cfg, n_records=MAX_STEPS)
    assert time.process_time() - t0 < 5.0
    assert plan.steps == MAX_STEPS and plan.epsilon <= 1.0
