"""Split mode through the service's ``POST /v1/sessions/{id}/hidden-state`` endpoint.

The endpoint privatizes a hidden state on the service side (clip to ``clip_norm``, noise, charge
the session, 409 once the budget is spent); the LoRA delta and the end of the forward pass are
:func:`server_lora_delta` and :func:`client_finish`.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from gaussdp.calibration import sigma_for  # noqa: E402
from gaussdp.inference import client_finish, find_last_block, server_lora_delta  # noqa: E402


@pytest.fixture
def service():
    from fastapi.testclient import TestClient

    from gaussdp.budget import Ledger
    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key

    with Ledger("memory://") as ledger:
        app = create_app(ledger=ledger)
        key = create_api_key(ledger.store, "client-a")
        with TestClient(app) as client:
            yield client, {"Authorization": f"Bearer {key}"}, ledger


def test_split_mode_through_the_service(service, tiny_gpt2):
    client, headers, ledger = service
    r = client.post("/v1/sessions", json={"epsilon": 3.0, "delta": 1e-5}, headers=headers)
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    seen = []
    block = find_last_block(tiny_gpt2)[1]
    handle = block.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        tiny_gpt2(ids)
    handle.remove()
    h_last = seen[0][0, -1, :].double().numpy()
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4, 64, generator=g, dtype=torch.float64)
    B = torch.randn(64, 4, generator=g, dtype=torch.float64)
    statuses = []
    for _ in range(10):
        r = client.post(
            f"/v1/sessions/{sid}/hidden-state",
            json={"hidden_state": h_last.tolist(), "clip_norm": 0.1, "epsilon": 1.0, "delta": 1e-5},
            headers=headers,
        )
        statuses.append(r.status_code)
        if r.status_code != 200:
            break
        body = r.json()
        # the service calibrates for sensitivity 2 * clip_norm (replace-one, the default relation for
        # hidden states, as the privatizer's), analytically
        assert body["neighbouring"] == "replace_one"
        assert body["sigma"] == pytest.approx(sigma_for(epsilon=1.0, delta=1e-5, sensitivity=0.2))
        noised = np.asarray(body["noised"])
        delta = server_lora_delta(noised, A, B, 0.5)
        assert delta.shape == (64,)
        logits = client_finish(tiny_gpt2, ids, None, torch.as_tensor(delta)[None, :], clip_norm=0.1).logits
        assert logits.shape == (1, 6, 100) and torch.isfinite(logits).all()
    assert statuses[-1] == 409  # the session's budget refused the next request
    assert statuses.count(200) == len(ledger.history(f"client-a/{sid}"))
    assert statuses.count(200) >= 1
