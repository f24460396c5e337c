"""Split mode: client and server halves compose to the hooked model's output (noise off)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.errors import BudgetExhausted, NotPrivateWarning, UnsafeInput  # noqa: E402
from gaussdp.inference import (  # noqa: E402
    HiddenStatePrivatizer,
    LoRABackend,
    PlainLoRABackend,
    client_finish,
    client_forward,
    find_last_block,
    server_lora_delta,
)

RANK = 4
SCALING = 0.5


@pytest.fixture
def lora():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(RANK, 64, generator=g, dtype=torch.float64) / 8
    B = torch.randn(64, RANK, generator=g, dtype=torch.float64)
    return A, B


def _off(model, clip_norm):
    with pytest.warns(NotPrivateWarning):
        return HiddenStatePrivatizer(model, clip_norm=clip_norm, noise=False)


def _reference_logits(model, ids, A, B, *, clip_norm=None):
    """The model with a LoRA delta computed by torch nn.Linear layers on the last position's state."""
    lora_a = nn.Linear(64, RANK, bias=False).double()
    lora_b = nn.Linear(RANK, 64, bias=False).double()
    lora_a.weight.data.copy_(A)
    lora_b.weight.data.copy_(B)
    block = find_last_block(model)[1]

    def hook(module, inputs, output):
        h = output[0] if isinstance(output, tuple) else output
        last = h[:, -1, :].double()
        if clip_norm is not None:
            last = last * torch.clamp(clip_norm / last.norm(dim=-1, keepdim=True), max=1.0)
        out = h.clone()
        out[:, -1, :] = h[:, -1, :] + (SCALING * lora_b(lora_a(last))).to(h.dtype)
        return (out, *output[1:]) if isinstance(output, tuple) else out

    handle = block.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("model_name", ["tiny_gpt2", "tiny_llama"])
def test_client_half_equals_hooked_layer_output(model_name, request):
    model = request.getfixturevalue(model_name)
    ids = torch.tensor([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
    block = find_last_block(model)[1]
    with _off(model, 0.1) as priv:
        seen = []
        handle = block.register_forward_hook(lambda m, i, o: seen.append(o))
        with torch.no_grad():
            model(ids)
        handle.remove()
        hooked_last = seen[0][:, -1, :]
        sent = client_forward(model, ids, None, priv)
    assert sent.shape == (2, 64)
    assert torch.equal(sent, hooked_last)
    assert priv.last_release.rows == 2  # only the positions sent were released


@pytest.mark.parametrize("rescale", [True, False])
def test_halves_compose_to_the_hooked_model(tiny_llama, lora, rescale):
    A, B = lora
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 7, 8, 9, 10, 11]])
    clip = 0.2
    priv = _off(None, clip)  # no module: client_forward privatizes what it captures
    sent = client_forward(tiny_llama, ids, "model.layers.1", priv)
    delta = server_lora_delta(sent, A, B, SCALING)
    assert isinstance(delta, torch.Tensor) and delta.shape == (2, 64)
    logits = client_finish(tiny_llama, ids, "model.layers.1", delta, clip_norm=clip, rescale=rescale).logits
    # rescale=True undoes the clip's scale on the client: the exact LoRA delta on the real state;
    # rescale=False: the delta on the clipped state, as the server computed it.
    expected = _reference_logits(tiny_llama, ids, A, B, clip_norm=None if rescale else clip)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    plain = _reference_logits(tiny_llama, ids, A * 0, B)
    assert not torch.allclose(logits, plain, atol=1e-4)  # the delta did something


def test_server_delta_matches_torch_lora_and_numpy(lora):
    A, B = lora
    h = torch.randn(3, 64, dtype=torch.float64)
    ref = SCALING * (h @ A.T @ B.T)
    torch.testing.assert_close(server_lora_delta(h, A, B, SCALING), ref)
    out_np = server_lora_delta(h.numpy(), A.numpy(), B.numpy(), SCALING)
    assert isinstance(out_np, np.ndarray)
    np.testing.assert_allclose(out_np, ref.numpy(), rtol=1e-12)
    one = server_lora_delta(h[0].numpy(), A.numpy(), B.numpy(), SCALING)
    assert one.shape == (64,)
    assert isinstance(PlainLoRABackend(), LoRABackend)


def test_server_delta_refuses_bad_input(lora):
    A, B = lora
    with pytest.raises(UnsafeInput, match="A has shape"):
        server_lora_delta(np.zeros((2, 63)), A, B)
    with pytest.raises(UnsafeInput, match="B has shape"):
        server_lora_delta(np.zeros((2, 64)), A, B[:, :2])
    with pytest.raises(UnsafeInput, match="NaN"):
        server_lora_delta(np.full((1, 64), np.nan), A, B)


def test_client_forward_charges_one_row_per_sequence_and_refuses(tiny_gpt2):
    ledger = Ledger("memory://")
    ledger.open("s1", Budget(3.0, 1e-5))
    ids = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    # the hooked privatizer is paused during the client pass: only the sent rows are charged
    with HiddenStatePrivatizer(
        tiny_gpt2, clip_norm=1.0, epsilon=1.0, delta=1e-5, ledger=ledger, session_id="s1"
    ) as priv:
        sent = client_forward(tiny_gpt2, ids, None, priv)
        assert sent.shape == (2, 64)
        assert [h.event.get("count") for h in ledger.history("s1")] == [2]
        with pytest.raises(BudgetExhausted):
            for _ in range(50):
                client_forward(tiny_gpt2, ids, None, priv)
    assert ledger.spent("s1").epsilon <= 3.0


def test_ckks_backend_matches_plain(lora):
    pytest.importorskip("tenseal")
    from gaussdp.inference import CKKSLoRABackend

    A, B = lora
    h = torch.randn(2, 64, dtype=torch.float64)
    plain = server_lora_delta(h, A, B, SCALING)
    backend = CKKSLoRABackend()
    assert isinstance(backend, LoRABackend)
    ckks = server_lora_delta(h, A, B, SCALING, backend=backend)
    # CKKS is approximate (scale 2**40): errors around 1e-6 of the values' scale
    torch.testing.assert_close(ckks, plain, rtol=0, atol=1e-4)
