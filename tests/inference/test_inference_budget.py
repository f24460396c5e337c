"""Per-session budgets: charged before release, refused at exhaustion, sessions independent."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.calibration import epsilon_for_mu  # noqa: E402
from gaussdp.errors import BudgetExhausted, InvalidParameter, PrivacyWarning  # noqa: E402
from gaussdp.inference import HiddenStatePrivatizer, stream_generate  # noqa: E402

DELTA = 1e-5
CLIP = 1.0
SIGMA = 4.8448  # document 000's sigma


def exact_epsilon(rows: int, noise_multiplier: float) -> float:
    """``rows`` Gaussian releases compose exactly to sqrt(rows)/z-GDP (Dong, Roth & Su, Cor. 3.3)."""
    return epsilon_for_mu(mu=math.sqrt(rows) / noise_multiplier, delta=DELTA)


def budget_between(rows_ok: int, rows_refused: int, z: float) -> Budget:
    """A budget that fits ``rows_ok`` rows and not ``rows_refused`` (midpoint of the exact epsilons)."""
    lo, hi = exact_epsilon(rows_ok, z), exact_epsilon(rows_refused, z)
    return Budget((lo + hi) / 2, DELTA)


def make(model, ledger, session="alice"):
    return HiddenStatePrivatizer(
        model, clip_norm=CLIP, sigma=SIGMA, delta=DELTA, ledger=ledger, session_id=session
    )


def test_refused_at_exhaustion_and_nothing_released(tiny_gpt2, prompt):
    ledger = Ledger("memory://")
    z = SIGMA / (2 * CLIP)  # replace-one relation: sensitivity 2C
    T = prompt.shape[1]
    ledger.open("alice", budget_between(3 * T, 4 * T, z))
    outputs = []
    with make(tiny_gpt2, ledger) as priv:
        assert priv.noise_multiplier == pytest.approx(z)
        for _ in range(3):
            outputs.append(tiny_gpt2(prompt).logits)
        spent = ledger.spent("alice").epsilon
        with pytest.raises(BudgetExhausted):
            outputs.append(tiny_gpt2(prompt).logits)
    assert len(outputs) == 3
    assert ledger.spent("alice").epsilon == spent  # the refused request charged nothing
    history = ledger.history("alice")
    assert len(history) == 3
    assert all(
        h.event == {"type": "self_composed", "event": {"type": "gaussian", "noise_multiplier": z}, "count": T}
        for h in history
    )
    # the ledger's (PLD) figure is an upper bound of the exact composition, and close to it
    exact = exact_epsilon(3 * T, z)
    # (1e-12: the two compute mu = sqrt(rows)/z in a different order, one ulp apart)
    assert exact * (1 - 1e-12) <= spent <= exact * 1.01


def test_warn_policy_is_opt_in(tiny_gpt2, prompt):
    ledger = Ledger("memory://", policy="warn")
    z = SIGMA / (2 * CLIP)
    T = prompt.shape[1]
    ledger.open("alice", budget_between(T, 2 * T, z))
    with make(tiny_gpt2, ledger) as priv:
        tiny_gpt2(prompt)
        with pytest.warns(PrivacyWarning, match="exhausted"):
            tiny_gpt2(prompt)
        assert priv.spent() > ledger.budget("alice").epsilon


def test_concurrent_sessions_are_independent(tiny_gpt2, prompt):
    ledger = Ledger("memory://")
    z = SIGMA / (2 * CLIP)
    T = prompt.shape[1]
    ledger.open("alice", budget_between(2 * T, 3 * T, z))
    ledger.open("bob", budget_between(6 * T, 7 * T, z))
    results: dict[str, list[str]] = {"alice": [], "bob": []}
    barrier = threading.Barrier(2)

    def client(session: str, n: int) -> None:
        barrier.wait()
        for _ in range(n):
            with priv.session(session):
                try:
                    tiny_gpt2(prompt)
                    results[session].append("ok")
                except BudgetExhausted:
                    results[session].append("refused")

    with make(tiny_gpt2, ledger, session="nobody") as priv, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(client, "alice", 4), pool.submit(client, "bob", 5)]
        for f in futures:
            f.result()
        assert priv.session_id == "nobody"  # the per-thread session never leaked out
    assert results["alice"] == ["ok", "ok", "refused", "refused"]
    assert results["bob"] == ["ok"] * 5
    assert len(ledger.history("alice")) == 2
    assert len(ledger.history("bob")) == 5
    assert ledger.spent("bob").epsilon < ledger.budget("bob").epsilon


def test_streaming_generation_charged_per_token(tiny_gpt2, prompt):
    ledger = Ledger("memory://")
    z = SIGMA / (2 * CLIP)
    T = prompt.shape[1]
    ledger.open("alice", budget_between(T + 3, T + 4, z))
    tokens = []
    with make(tiny_gpt2, ledger) as priv:
        with pytest.raises(BudgetExhausted):
            for tok in stream_generate(tiny_gpt2, prompt, privatizer=priv, max_new_tokens=10):
                tokens.append(tok)
    # the prompt pass charges T rows (token 1), then each cached step one row (tokens 2-4);
    # the step that would be row T+4 is refused before it returns
    history = ledger.history("alice")
    counts = [h.event.get("count", 1) for h in history]
    assert counts == [T, 1, 1, 1]
    assert len(tokens) == 4
    assert all(t.shape == (1,) for t in tokens)


def test_local_accounting_without_ledger(tiny_gpt2, prompt):
    priv = HiddenStatePrivatizer(tiny_gpt2, clip_norm=CLIP, sigma=SIGMA, delta=DELTA)
    z = SIGMA / (2 * CLIP)
    with priv:
        assert priv.spent() == 0.0
        tiny_gpt2(prompt)
        tiny_gpt2(prompt)
        with priv.session("other"):
            tiny_gpt2(prompt)
    exact2 = exact_epsilon(2 * prompt.shape[1], z)
    assert exact2 <= priv.spent() <= exact2 * 1.01
    assert priv.spent(session_id="other") < priv.spent()


def test_hf_generate_is_charged_per_forward_pass(tiny_gpt2, prompt):
    ledger = Ledger("memory://")
    with HiddenStatePrivatizer(
        tiny_gpt2, clip_norm=CLIP, sigma=SIGMA, ledger=ledger, session_id="alice", budget=Budget(1e6, DELTA)
    ):
        # min_new_tokens: the tiny model's EOS is token 0, which the noised states may pick (greedy),
        # and an early stop would make the number of forward passes random
        out = tiny_gpt2.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, prompt.shape[1] + 3)
    # with the key/value cache: the prompt's T rows, then one row for each later token
    assert [h.event.get("count", 1) for h in ledger.history("alice")] == [prompt.shape[1], 1, 1]


def test_calibrated_settings_cannot_be_reassigned(tiny_gpt2):
    """clip_norm, sigma and the rest are set once: a larger clip_norm reassigned later would release
    at a sensitivity the per-row charge was not computed for."""
    priv = HiddenStatePrivatizer(tiny_gpt2, clip_norm=CLIP, sigma=SIGMA, ledger=None)
    for name, value in [
        ("clip_norm", 10.0),
        ("sigma", 0.1),
        ("noise_multiplier", 0.1),
        ("neighbouring", "add_remove"),
    ]:
        with pytest.raises(AttributeError, match="fixed"):
            setattr(priv, name, value)
    assert (priv.clip_norm, priv.sigma) == (CLIP, SIGMA)
    priv.last_release = None  # other attributes stay assignable
    priv.remove()


def test_constructing_a_privatizer_neither_hooks_nor_charges(tiny_gpt2, prompt):
    """Issue 20: the hook attached at construction, so a "clean" generate() outside ``with`` was
    noised and spent the session's budget. Now only ``with`` / attach() activate it."""
    with torch.no_grad():
        clean = tiny_gpt2(prompt).logits
    ledger = Ledger("memory://")
    priv = HiddenStatePrivatizer(
        tiny_gpt2, clip_norm=CLIP, sigma=SIGMA, ledger=ledger, session_id="alice", budget=Budget(1e6, DELTA)
    )
    assert not priv.attached
    with torch.no_grad():
        assert torch.equal(tiny_gpt2(prompt).logits, clean)
    tiny_gpt2.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert ledger.history("alice") == [] and ledger.spent("alice").epsilon == 0.0
    with priv:
        assert priv.attached
        with torch.no_grad():
            assert not torch.equal(tiny_gpt2(prompt).logits, clean)
    assert not priv.attached
    assert [h.event.get("count", 1) for h in ledger.history("alice")] == [prompt.shape[1]]
    with torch.no_grad():
        assert torch.equal(tiny_gpt2(prompt).logits, clean)  # clean again after the block
    assert len(ledger.history("alice")) == 1


def test_attach_and_detach_explicitly(tiny_gpt2, prompt):
    ledger = Ledger("memory://")
    priv = HiddenStatePrivatizer(
        tiny_gpt2, clip_norm=CLIP, sigma=SIGMA, ledger=ledger, session_id="alice", budget=Budget(1e6, DELTA)
    )
    assert priv.attach() is priv and priv.attach() is priv  # idempotent
    with torch.no_grad():
        tiny_gpt2(prompt)
        with priv:  # a block inside an explicit attach leaves it attached on exit
            tiny_gpt2(prompt)
        assert priv.attached
        tiny_gpt2(prompt)
        priv.detach()
        assert not priv.attached
        tiny_gpt2(prompt)
        priv.detach()  # idempotent
        with priv:
            with priv:  # nested blocks share one hook, removed by the outermost exit
                tiny_gpt2(prompt)
            assert priv.attached
        assert not priv.attached
    assert len(ledger.history("alice")) == 4
    assert all(len(m._forward_hooks) == 0 for m in tiny_gpt2.modules())


def test_a_privatizer_without_a_module_refuses_to_activate():
    priv = HiddenStatePrivatizer(None, clip_norm=CLIP, sigma=SIGMA)
    with pytest.raises(InvalidParameter, match="no module"):
        priv.attach()
    with pytest.raises(InvalidParameter, match="no module"), priv:
        pass
    assert not priv.attached


def test_stream_generate_activates_the_hook_only_during_its_passes(tiny_gpt2, prompt):
    ledger = Ledger("memory://")
    priv = make(tiny_gpt2, ledger)
    ledger.open("alice", Budget(1e6, DELTA))
    with torch.no_grad():
        clean = tiny_gpt2(prompt).logits
    tokens = 0
    for _ in stream_generate(tiny_gpt2, prompt, privatizer=priv, max_new_tokens=3):
        tokens += 1
        assert not priv.attached  # not across a yield: the consumer's own passes are clean
        with torch.no_grad():
            assert torch.equal(tiny_gpt2(prompt).logits, clean)
    assert tokens == 3
    assert [h.event.get("count", 1) for h in ledger.history("alice")] == [prompt.shape[1], 1, 1]


def test_stream_generate_refuses_a_privatizer_of_another_model(tiny_gpt2, tiny_llama, prompt):
    priv = HiddenStatePrivatizer(tiny_llama, clip_norm=CLIP, sigma=SIGMA)
    with pytest.raises(InvalidParameter, match="module of this model"):
        next(stream_generate(tiny_gpt2, prompt, privatizer=priv, max_new_tokens=1))
