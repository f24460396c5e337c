"""stream_generate starts a transformers model from an empty Cache object: no deprecation warning
from transformers on any stream, the same charges (the prompt's rows, then one row per token)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.inference import HiddenStatePrivatizer, stream_generate  # noqa: E402
from gaussdp.inference.generation import _fresh_cache  # noqa: E402


@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_llama"])
def test_a_stream_warns_nothing_and_charges_the_prompt_then_one_row_per_token(name, request, prompt) -> None:  # type: ignore[no-untyped-def]
    model = request.getfixturevalue(name)
    assert isinstance(_fresh_cache(model), transformers.DynamicCache)
    ledger = Ledger("memory://")
    ledger.open("alice", Budget(1e6, 1e-5))
    priv = HiddenStatePrivatizer(
        model, clip_norm=10.0, sigma=1.0, delta=1e-5, ledger=ledger, session_id="alice"
    )
    passed = []  # the cache each forward pass was given

    def record(module, args, kwargs):  # type: ignore[no-untyped-def]
        passed.append(type(kwargs.get("cache", kwargs.get("past_key_values"))).__name__)

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tokens = list(stream_generate(model, prompt, privatizer=priv, max_new_tokens=4))
    handle.remove()
    assert len(tokens) == 4
    assert passed == ["DynamicCache"] * 4  # from the first pass on: never None, never a tuple
    assert [str(w.message) for w in seen] == []
    assert [h.event.get("count", 1) for h in ledger.history("alice")] == [prompt.shape[1], 1, 1, 1]


def test_a_model_that_is_not_a_transformers_model_builds_its_own_cache() -> None:
    assert _fresh_cache(torch.nn.Linear(2, 2)) is None
