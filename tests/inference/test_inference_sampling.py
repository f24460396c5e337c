"""The sampler (gaussdp.inference.sampling): greedy, temperature, top-k, top-p, a seed only by name,
and no extra charge (sampling is post-processing of the noised state)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.errors import InvalidParameter  # noqa: E402
from gaussdp.inference import HiddenStatePrivatizer, Sampler, stream_generate  # noqa: E402

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None, :]


def _frequencies(sampler: Sampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    draws = sampler(logits.expand(n, -1))
    return torch.bincount(draws, minlength=logits.shape[-1]).double() / n


def test_greedy_is_argmax_and_top_k_1_or_a_tiny_top_p_are_too() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(dim=-1)
    assert torch.equal(Sampler()(logits), best)
    assert torch.equal(Sampler(temperature=2.0, top_k=1)(logits), best)
    assert torch.equal(Sampler(temperature=2.0, top_p=1e-9)(logits), best)


def test_temperature_one_draws_from_the_softmax() -> None:
    # 40000 draws: each frequency's standard error is at most 0.0025; 5 of them is a false alarm
    # rate below 1e-6 per token (seeded: the test is deterministic)
    n = 40_000
    freq = _frequencies(Sampler(temperature=1.0, seed=0), LOGITS, n)
    bound = 5 * torch.sqrt(PROBS * (1 - PROBS) / n)
    assert torch.all((freq - PROBS.double()).abs() < bound), freq


def test_temperature_sharpens_and_top_k_top_p_cut_the_tail() -> None:
    n = 40_000
    sharp = PROBS**2 / (PROBS**2).sum()  # temperature 0.5: p^(1/0.5), renormalised
    freq = _frequencies(Sampler(temperature=0.5, seed=1), LOGITS, n)
    assert torch.all((freq - sharp.double()).abs() < 5 * torch.sqrt(sharp * (1 - sharp) / n))
    top2 = _frequencies(Sampler(temperature=1.0, top_k=2, seed=2), LOGITS, n)
    assert top2[2:].sum() == 0 and abs(top2[0] - 0.5 / 0.8) < 0.02
    # top_p=0.7: 0.5 < 0.7 keeps the second token, 0.8 >= 0.7 drops the rest
    nucleus = _frequencies(Sampler(temperature=1.0, top_p=0.7, seed=3), LOGITS, n)
    assert nucleus[2:].sum() == 0 and abs(nucleus[0] - 0.5 / 0.8) < 0.02


def test_a_seed_by_name_reproduces_and_marks_the_sampler_not_private() -> None:
    logits = torch.randn(256, 30, generator=torch.Generator().manual_seed(4))
    a, b = Sampler(temperature=1.0, seed=7), Sampler(temperature=1.0, seed=7)
    assert torch.equal(a(logits), b(logits)) and not a.private
    fresh = [Sampler(temperature=1.0) for _ in range(2)]
    assert all(s.private for s in fresh)
    assert not torch.equal(fresh[0](logits), fresh[1](logits))  # OS entropy: 256 draws differ
    with pytest.raises(TypeError):
        Sampler(1.0)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": "1"}, "seed"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidParameter, match=name):
        Sampler(**kwargs)


def test_sampling_adds_no_charge(tiny_gpt2, prompt) -> None:  # type: ignore[no-untyped-def]
    counts = {}
    for label, sample in (("greedy", None), ("sampled", Sampler(temperature=1.0, top_p=0.9, top_k=20))):
        ledger = Ledger("memory://")
        ledger.open("alice", Budget(1e6, 1e-5))
        priv = HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, sigma=1.0, delta=1e-5, ledger=ledger)
        gen = stream_generate(
            tiny_gpt2, prompt, privatizer=priv, max_new_tokens=4, session_id="alice", sample=sample
        )
        tokens = list(gen)
        assert len(tokens) == 4
        counts[label] = [h.event.get("count", 1) for h in ledger.history("alice")]
    assert counts["greedy"] == counts["sampled"] == [prompt.shape[1], 1, 1, 1]
