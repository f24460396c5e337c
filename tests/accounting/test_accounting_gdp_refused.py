"""The CLT ("gdp") accountant never calibrates, budgets or prints a guarantee: one test per entry point.

Issue 17: ``noise_for_epsilon(..., accountant="gdp")`` returned sigma 0.6897 "for epsilon <= 1" whose
exact epsilon is 2.48. gdp stays available, asked for by name and labelled, for plots and comparisons.
"""

from __future__ import annotations

import pytest

from gaussdp.accounting import (
    PrivacyBudget,
    SubsampledGaussianEvent,
    accountant,
    compute_delta_from_epsilon,
    compute_epsilon_from_delta,
    estimate_noise_scale,
    noise_for_epsilon,
)
from gaussdp.budget import Budget, Ledger, PrivacyTracker
from gaussdp.errors import InvalidParameter

REFUSED = "accountant='gdp' is an approximation, not an upper bound"
# A setting where the CLT is below the truth: 1000 steps at q = 0.5, where the CLT is far off.
RUN = {"sample_rate": 0.5, "steps": 1000}


def test_the_clt_value_really_is_below_the_bound_here():
    ev = SubsampledGaussianEvent(20.0, 0.5)
    clt = accountant("gdp", allow_approximate=True).compose(ev, 1000).epsilon(1e-5)
    assert clt < accountant("pld").compose(ev, 1000).epsilon(1e-5)


def test_factory_refuses_unless_asked_by_name():
    with pytest.raises(InvalidParameter, match=REFUSED):
        accountant("gdp")
    with pytest.raises(InvalidParameter, match="is an approximation"):
        accountant("GDP", allow_approximate=1)  # only True itself opts in
    acc = accountant("gdp", allow_approximate=True)
    assert acc.approximate and acc.name == "gdp"


def test_noise_for_epsilon():
    with pytest.raises(InvalidParameter, match=REFUSED):
        noise_for_epsilon(target_epsilon=1.0, delta=1e-5, accountant="gdp", **RUN)
    with pytest.raises(InvalidParameter, match=REFUSED):
        noise_for_epsilon(target_epsilon=1.0, delta=1e-5, accountant="gdp")  # q = 1 closed form too


@pytest.mark.parametrize(
    "call",
    [
        lambda: compute_epsilon_from_delta(2.0, 1e-5, accountant="gdp", **RUN),
        lambda: compute_delta_from_epsilon(2.0, 1.0, accountant="gdp", **RUN),
        lambda: estimate_noise_scale(1.0, 1e-5, accountant="gdp", **RUN),
        lambda: PrivacyBudget(1.0, 1e-5, 10, accountant="gdp"),
        lambda: PrivacyTracker(target_epsilon=1.0, accountant="gdp"),
        lambda: Ledger().open("p", Budget(1.0, 1e-5), accountant="gdp"),
    ],
    ids=[
        "compute_epsilon",
        "compute_delta",
        "estimate_noise_scale",
        "PrivacyBudget",
        "PrivacyTracker",
        "ledger",
    ],
)
def test_document_helpers_budgets_and_ledger(call):
    with pytest.raises(InvalidParameter, match=REFUSED):
        call()


def test_sgd_privacy_manager():
    from gaussdp.sgd import PrivacyManager

    with pytest.raises(InvalidParameter, match=REFUSED):
        PrivacyManager(epsilon=1.0, delta=1e-5, clip_norm=1.0, num_rounds=10, accountant="gdp")


def test_federated_round_ledger():
    from gaussdp.federated import RoundLedger

    with pytest.raises(InvalidParameter, match=REFUSED):
        RoundLedger(Ledger(), "server", epsilon=1.0, delta=1e-5, accountant="gdp")


def test_inference_privatizer_refuses_at_construction():
    pytest.importorskip("torch")
    import torch

    from gaussdp.inference import HiddenStatePrivatizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(InvalidParameter, match=REFUSED):
        HiddenStatePrivatizer(model, 0, clip_norm=1.0, sigma=1.0, accountant="gdp")
    assert not model[0]._forward_hooks  # nothing left attached


def test_torch_engine():
    pytest.importorskip("torch")
    from gaussdp.torch import PrivacyEngine

    with pytest.raises(InvalidParameter, match=REFUSED):
        PrivacyEngine(accountant="gdp")


@pytest.mark.parametrize("target", [[], ["--target-epsilon", "1"]], ids=["epsilon", "target-epsilon"])
def test_cli_account(target):
    typer_testing = pytest.importorskip("typer.testing")
    from gaussdp.cli import build_app

    args = ["account", "--noise-multiplier", "20", "--sample-rate", "0.5", "--steps", "1000"]
    res = typer_testing.CliRunner().invoke(build_app(), [*args, "--accountant", "gdp", *target])
    assert res.exit_code == 2  # not a choice of --accountant: upper-bound accountants only
    assert "'gdp' is not one of 'pld', 'rdp'" in res.output
    assert "epsilon =" not in res.output and "noise multiplier =" not in res.output
