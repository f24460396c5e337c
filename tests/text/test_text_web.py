"""The text web router, in process (the browser end-to-end test is test_text_browser.py)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the service extra")
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gaussdp.text.corpus import shipped_vocabulary
from gaussdp.text.web import make_router


@pytest.fixture(scope="module")
def client_and_store():
    received = []
    app = FastAPI()
    app.include_router(make_router(shipped_vocabulary(), on_submit=received.append))
    return TestClient(app), received


def test_text_web_page_and_vocab(client_and_store):
    client, _ = client_and_store
    page = client.get("/text")
    assert page.status_code == 200 and "/text/static/text.js" in page.text
    js = client.get("/text/static/text.js")
    assert js.status_code == 200 and "new Worker(" in js.text
    core = client.get("/text/static/text_core.js")
    assert core.status_code == 200 and "crypto.getRandomValues" in core.text
    worker = client.get("/text/static/text_worker.js")
    assert worker.status_code == 200 and "importScripts" in worker.text
    body = client.get("/text/vocab").json()
    vocab = shipped_vocabulary()
    vecs = np.frombuffer(base64.b64decode(body["vectors"]), dtype="<f4").reshape(
        len(body["words"]), body["dim"]
    )
    assert body["words"] == vocab.words
    np.testing.assert_array_equal(vecs, vocab.vectors)
    sw = body["subwords"]
    table = np.frombuffer(base64.b64decode(sw["table"]), dtype="<f2").reshape(sw["buckets"], body["dim"])
    np.testing.assert_array_equal(table, vocab.subwords.table)
    assert sw["max_norm"] == vocab.max_norm and (sw["min_n"], sw["max_n"]) == (3, 6)


def test_text_web_guarantee(client_and_store):
    client, _ = client_and_store
    g = client.get("/text/guarantee", params={"sigma": 0.1}).json()
    assert g["mechanism"] == "gaussian" and g["box_diameter"]["distance"] == pytest.approx(2 * 50**0.5)
    assert client.get("/text/guarantee", params={"sigma": -1}).status_code == 422
    assert "n-grams" in g["unknown_words"]
    lap = client.get("/text/guarantee", params={"mechanism": "laplace", "epsilon": 10}).json()
    assert lap["mechanism"] == "laplace" and lap["box_diameter"]["epsilon"] == pytest.approx(10 * 2 * 50**0.5)
    assert client.get("/text/guarantee", params={"mechanism": "laplace"}).status_code == 422
    assert client.get("/text/guarantee", params={"mechanism": "tem", "epsilon": 1}).status_code == 422


def test_text_web_submit_accepts_only_vocabulary_words(client_and_store):
    client, received = client_and_store
    ok = client.post("/text/submit", json={"text": "the dog slept\nin the barn", "sigma": 0.5})
    assert ok.status_code == 200 and ok.json()["words"] == 6
    assert received[-1].text == "the dog slept\nin the barn"
    raw = client.post("/text/submit", json={"text": "my secret is Zorblatt", "sigma": 0.5})
    assert raw.status_code == 422 and "zorblatt" not in raw.text.lower()
    assert len(received) == 1
    assert client.post("/text/submit", json={"text": "dog", "sigma": 0}).status_code == 422
    assert client.post("/text/submit", json={"text": "dog"}).status_code == 422
    lap = {"text": "dog", "mechanism": "laplace", "epsilon": 5}
    assert client.post("/text/submit", json=lap).status_code == 200
    assert (
        client.post("/text/submit", json={"text": "dog", "mechanism": "laplace", "sigma": 1}).status_code
        == 422
    )


def test_text_web_module_router_is_importable():
    from gaussdp.text.web import router

    paths = {r.path for r in router.routes}
    assert {"/text", "/text/vocab", "/text/submit", "/text/guarantee"} <= paths
