"""``POST /v1/sessions/{id}/lora-delta``: split mode with an untrusted server, charged per row first.

The client clips and noises; the server computes ``scaling * B @ (A @ h)`` with an adapter it holds
and charges the session the client's declared spend (one Gaussian event per row), refusing with 409
once the budget cannot pay. Also: the ``/hidden-state`` endpoint's explicit neighbouring relation.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("torch")

from gaussdp.accounting import GaussianEvent, SelfComposedEvent, accountant
from gaussdp.calibration import sigma_for

D, RANK, D_OUT, SCALING = 16, 4, 12, 0.5
CLIP, SIGMA = 1.0, 8.0


@pytest.fixture
def lora():
    rng = np.random.default_rng(7)
    return rng.normal(size=(RANK, D)) / 4, rng.normal(size=(D_OUT, RANK))


@pytest.fixture
def lora_client(service, lora):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from gaussdp.service.app import create_app

    app = create_app(ledger=service.ledger, max_body_bytes=64 * 1024, lora_adapters={"ad": (*lora, SCALING)})
    with TestClient(app) as c:
        yield c


def new_session(client, service, key=None, **budget):  # type: ignore[no-untyped-def]
    body = {"epsilon": 3.0, "delta": 1e-5, **budget}
    r = client.post("/v1/sessions", json=body, headers=service.headers(key or service.key_a))
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def body_for(rows, **extra):  # type: ignore[no-untyped-def]
    return {"adapter": "ad", "noised": np.asarray(rows).tolist(), "clip_norm": CLIP, "sigma": SIGMA, **extra}


def test_delta_is_scaling_B_A_h_per_row_and_charged(service, lora_client, lora) -> None:  # type: ignore[no-untyped-def]
    A, B = lora
    sid = new_session(lora_client, service)
    h = np.random.default_rng(1).normal(size=(3, D)) * SIGMA
    r = lora_client.post(
        f"/v1/sessions/{sid}/lora-delta", json=body_for(h), headers=service.headers(service.key_a)
    )
    assert r.status_code == 200, r.text
    out = r.json()
    expected = np.stack([SCALING * B @ (A @ row) for row in h])
    np.testing.assert_allclose(np.asarray(out["delta"]), expected, rtol=1e-12, atol=1e-12)
    assert (out["rows"], out["d_out"], out["adapter"]) == (3, D_OUT, "ad")
    # default relation: replace, sensitivity 2C (as gaussdp.inference's privatizer)
    assert out["neighbouring"] == "replace_one" and out["sensitivity"] == 2 * CLIP
    assert out["noise_multiplier"] == SIGMA / (2 * CLIP)
    hist = service.ledger.history(f"tenant-a/{sid}")
    assert len(hist) == 1 and hist[0].charge_id == out["charge_id"]
    assert hist[0].event == SelfComposedEvent(GaussianEvent(SIGMA / (2 * CLIP)), 3).to_dict()
    exact = accountant("pld").compose(GaussianEvent(SIGMA / (2 * CLIP)), 3).epsilon(1e-5)
    assert out["spent"]["epsilon"] == pytest.approx(exact, rel=0.02)

    # add-remove: sensitivity C; one row is one plain GaussianEvent; base64 in, base64 out.
    raw = base64.b64encode(h[:1].astype("<f4").tobytes()).decode()
    r = lora_client.post(
        f"/v1/sessions/{sid}/lora-delta",
        json={
            "adapter": "ad",
            "noised_b64": raw,
            "clip_norm": CLIP,
            "sigma": SIGMA,
            "neighbouring": "add_remove",
        },
        headers=service.headers(service.key_a),
    )
    assert r.status_code == 200, r.text
    out = r.json()
    got = np.frombuffer(base64.b64decode(out["delta_b64"]), "<f4").reshape(1, D_OUT)
    h32 = h[:1].astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(got, SCALING * (h32 @ A.T) @ B.T, rtol=1e-5, atol=1e-6)
    assert out["sensitivity"] == CLIP and out["noise_multiplier"] == SIGMA / CLIP
    assert service.ledger.history(f"tenant-a/{sid}")[-1].event == GaussianEvent(SIGMA / CLIP).to_dict()


def test_refused_with_409_once_the_budget_is_spent(service, lora_client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(lora_client, service, epsilon=2.0)
    event = GaussianEvent(SIGMA / (2 * CLIP))
    allowed = 0
    while accountant("pld").compose(event, 2 * (allowed + 1)).epsilon(1e-5) <= 2.0:
        allowed += 1
    assert allowed >= 1
    h = service.headers(service.key_a)
    statuses = [
        lora_client.post(
            f"/v1/sessions/{sid}/lora-delta", json=body_for(np.ones((2, D))), headers=h
        ).status_code
        for _ in range(allowed + 2)
    ]
    assert statuses == [200] * allowed + [409, 409]
    r = lora_client.post(f"/v1/sessions/{sid}/lora-delta", json=body_for(np.ones((2, D))), headers=h)
    assert r.json()["error"] == "budget_exhausted" and "delta" not in r.json()
    assert len(service.ledger.history(f"tenant-a/{sid}")) == allowed


def test_another_tenant_gets_404_and_nothing_is_charged(service, lora_client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(lora_client, service, session_id="mine")
    r = lora_client.post(
        f"/v1/sessions/{sid}/lora-delta",
        json=body_for(np.ones((1, D))),
        headers=service.headers(service.key_b),
    )
    assert r.status_code == 404
    assert service.ledger.history(f"tenant-a/{sid}") == []


def test_oversized_body_is_413(service, lora_client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(lora_client, service)
    h = {**service.headers(service.key_a), "Content-Type": "application/json"}
    rows = b"[" + b",".join([b"[" + b",".join([b"1.0"] * D) + b"]"] * 2000) + b"]"
    big = b'{"adapter": "ad", "clip_norm": 1.0, "sigma": SIGMA, "noised": ' + rows + b"}"
    assert len(big) > 64 * 1024
    r = lora_client.post(f"/v1/sessions/{sid}/lora-delta", content=big, headers=h)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
    assert service.ledger.history(f"tenant-a/{sid}") == []


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            b'{"adapter": "ad", "clip_norm": 1.0, "sigma": 8.0, "noised": [[NaN'
            + b", 1.0" * (D - 1)
            + b"]]}",
            "noised",
        ),
        (
            {
                "adapter": "ad",
                "clip_norm": 1.0,
                "sigma": SIGMA,
                "noised_b64": base64.b64encode(np.full(D, np.nan, "<f4").tobytes()).decode(),
            },
            "noised_b64",
        ),
        ({"adapter": "ad", "clip_norm": 1.0, "sigma": SIGMA, "noised": [[1.0] * (D - 1)]}, "noised"),
        ({"adapter": "ad", "clip_norm": 1.0, "sigma": SIGMA, "noised": [[1.0] * D, [1.0]]}, "noised"),
        ({"adapter": "ad", "clip_norm": 1.0, "sigma": SIGMA, "noised": [[1e308] * D]}, "overflows"),
        ({"adapter": "nope", "clip_norm": 1.0, "sigma": SIGMA, "noised": [[1.0] * D]}, "adapter"),
        ({"adapter": "ad", "clip_norm": 1.0, "noised": [[1.0] * D]}, "sigma"),
        ({"adapter": "ad", "clip_norm": 0, "sigma": SIGMA, "noised": [[1.0] * D]}, "clip_norm"),
        (
            {"adapter": "ad", "clip_norm": 1, "sigma": SIGMA, "noised": [[1.0] * D], "neighbouring": "x"},
            "neighbouring",
        ),
    ],
)
def test_invalid_input_is_422_and_not_charged(service, lora_client, body, named) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(lora_client, service)
    h = {**service.headers(service.key_a), "Content-Type": "application/json"}
    if isinstance(body, bytes):
        r = lora_client.post(f"/v1/sessions/{sid}/lora-delta", content=body, headers=h)
    else:
        r = lora_client.post(f"/v1/sessions/{sid}/lora-delta", json=body, headers=h)
    assert r.status_code == 422, r.text
    assert named in r.text
    assert service.ledger.history(f"tenant-a/{sid}") == []


def test_a_retried_idempotency_key_is_charged_once(service, lora_client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(lora_client, service)
    h = service.headers(service.key_a)
    body = body_for(np.ones((1, D)), idempotency_key="req-1")
    assert lora_client.post(f"/v1/sessions/{sid}/lora-delta", json=body, headers=h).status_code == 200
    again = lora_client.post(f"/v1/sessions/{sid}/lora-delta", json=body, headers=h)
    assert again.status_code == 409 and "already charged" in again.json()["detail"]
    assert len(service.ledger.history(f"tenant-a/{sid}")) == 1


def test_a_server_without_adapters_answers_422(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    r = client.post(
        f"/v1/sessions/{sid}/lora-delta",
        json=body_for(np.ones((1, D))),
        headers=service.headers(service.key_a),
    )
    assert r.status_code == 422 and "adapter" in r.text
    assert service.ledger.history(f"tenant-a/{sid}") == []


def test_hidden_state_names_its_neighbouring_relation(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service, epsilon=10.0)
    h = service.headers(service.key_a)
    x = np.full(8, 3.0)
    r = client.post(
        f"/v1/sessions/{sid}/hidden-state", json={"hidden_state": x.tolist(), "clip_norm": 0.5}, headers=h
    )
    assert r.status_code == 200, r.text
    out = r.json()  # the default of every hidden-state surface: replace-one, sensitivity 2 * clip_norm
    assert (out["neighbouring"], out["sensitivity"]) == ("replace_one", 1.0)
    assert out["sigma"] == pytest.approx(sigma_for(epsilon=1.0, delta=1e-5, sensitivity=1.0), rel=1e-5)
    r = client.post(
        f"/v1/sessions/{sid}/hidden-state",
        json={"hidden_state": x.tolist(), "clip_norm": 0.5, "neighbouring": "add_remove"},
        headers=h,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["neighbouring"], out["sensitivity"]) == ("add_remove", 0.5)
    assert out["sigma"] == pytest.approx(sigma_for(epsilon=1.0, delta=1e-5, sensitivity=0.5), rel=1e-5)
    # replace costs twice the noise for the same epsilon: both charges are for (1, 1e-5) per request
    events = [c.event for c in service.ledger.history(f"tenant-a/{sid}")]
    assert events[0]["noise_multiplier"] == pytest.approx(events[1]["noise_multiplier"], rel=1e-9)


def test_one_default_relation_charges_a_client_its_epsilon_on_every_path(service, lora_client, lora) -> None:  # type: ignore[no-untyped-def]
    """Issue 20: /hidden-state defaulted to add/remove, the privatizer and /lora-delta to replace-one,
    so a client that calibrated sigma with one default and sent it to the other route was charged 2.15
    instead of 1. Every path now defaults to one relation and names it in its answer."""
    import torch

    from gaussdp.budget import Budget, Ledger
    from gaussdp.calibration import epsilon_for, epsilon_for_mu
    from gaussdp.inference import HiddenStatePrivatizer, client_forward

    eps, delta = 1.0, 1e-5
    h = service.headers(service.key_a)

    def charged_epsilon(event: dict) -> float:  # exact epsilon of one charged row, at delta
        return epsilon_for(sigma=event["noise_multiplier"], delta=delta, sensitivity=1.0)

    # 1. the privatizer's default, and split mode's client half through it (in process)
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D))
    ledger = Ledger("memory://")
    priv = HiddenStatePrivatizer(
        model, "1", clip_norm=CLIP, epsilon=eps, delta=delta, ledger=ledger, session_id="c",
        budget=Budget(10.0, delta),
    )  # fmt: skip
    sent = client_forward(model, torch.randn(1, D), None, priv)
    (charge,) = ledger.history("c")
    assert charged_epsilon(charge.event) == pytest.approx(eps, rel=1e-9)
    # 2. /hidden-state with only the state: the same relation, sigma and charge as the privatizer
    sid = new_session(lora_client, service, epsilon=10.0)
    r = lora_client.post(f"/v1/sessions/{sid}/hidden-state", json={"hidden_state": [3.0] * D}, headers=h)
    assert r.status_code == 200, r.text
    hs = r.json()
    assert (hs["neighbouring"], hs["sensitivity"]) == (priv.neighbouring, priv.sensitivity)
    assert hs["sigma"] == pytest.approx(priv.sigma, rel=1e-5)
    # 3. /lora-delta with the sigma of either default, relation left out: charged exactly eps per row
    for sigma in (priv.sigma, hs["sigma"]):
        body = {"adapter": "ad", "noised": sent.tolist(), "clip_norm": CLIP, "sigma": sigma}
        r = lora_client.post(f"/v1/sessions/{sid}/lora-delta", json=body, headers=h)
        assert r.status_code == 200, r.text
        assert r.json()["neighbouring"] == priv.neighbouring
    events = [c.event for c in service.ledger.history(f"tenant-a/{sid}")]
    assert len(events) == 3
    assert [charged_epsilon(e) for e in events] == pytest.approx([eps] * 3, rel=1e-5)
    # the ledger's composed figure is an upper bound just above the exact composition of the 3 rows
    # (Gaussian releases compose to mu-GDP with mu^2 the sum of 1/z^2: Dong, Roth & Su, Cor. 3.3)
    mu = sum(e["noise_multiplier"] ** -2 for e in events) ** 0.5
    exact3 = epsilon_for_mu(mu=mu, delta=delta)
    assert exact3 * (1 - 1e-9) <= service.ledger.spent(f"tenant-a/{sid}").epsilon <= exact3 * 1.01


def test_client_half_plus_endpoint_equals_in_process_split_mode(service, lora_client, lora) -> None:  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    from gaussdp.inference import HiddenStatePrivatizer, client_finish, client_forward, server_lora_delta

    A, _ = lora
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, D), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D_OUT)).double()
    # hidden = the output of model[1]; the LoRA delta has d_out = D to be added back there
    A_h, B_h = A, np.random.default_rng(2).normal(size=(D, RANK))
    app_adapters = {"ad": (torch.as_tensor(A_h), torch.as_tensor(B_h), SCALING)}
    from fastapi.testclient import TestClient

    from gaussdp.service.app import create_app

    sid = new_session(lora_client, service, epsilon=50.0)
    priv = HiddenStatePrivatizer(None, model[1], clip_norm=CLIP, sigma=SIGMA, noise="fast")  # ledger=None
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    with priv:  # the hook is removed on exit: client_finish must run the clean layer
        noised = client_forward(model, ids, model[1], priv)  # (2, D): clipped and noised on the client
    assert noised.shape == (2, D) and not priv.attached

    with TestClient(create_app(ledger=service.ledger, lora_adapters=app_adapters)) as c:
        r = c.post(
            f"/v1/sessions/{sid}/lora-delta",
            json={"adapter": "ad", "noised": noised.tolist(), "clip_norm": CLIP, "sigma": SIGMA},
            headers=service.headers(service.key_a),
        )
    assert r.status_code == 200, r.text
    served = np.asarray(r.json()["delta"])
    local = server_lora_delta(noised, torch.as_tensor(A_h), torch.as_tensor(B_h), SCALING)
    np.testing.assert_allclose(served, local.numpy(), rtol=1e-12, atol=1e-12)
    out_served = client_finish(model, ids, model[1], torch.as_tensor(served), clip_norm=CLIP)
    out_local = client_finish(model, ids, model[1], local, clip_norm=CLIP)
    torch.testing.assert_close(out_served, out_local, rtol=1e-12, atol=1e-12)
    # the server charged what the client's privatizer spent: 2 rows of sigma / 2C
    (charge,) = service.ledger.history(f"tenant-a/{sid}")
    assert charge.event == SelfComposedEvent(GaussianEvent(priv.noise_multiplier), 2).to_dict()
