"""Fixtures for the service tests: an app over a fresh SQLite ledger, and API keys for two tenants."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")


@dataclass
class Service:
    app: object
    ledger: object
    key_a: str
    key_b: str

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def service(tmp_path) -> Iterator[Service]:  # type: ignore[no-untyped-def]
    from gaussdp.budget import Ledger
    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key

    with Ledger(f"sqlite:///{tmp_path / 'service.db'}") as ledger:
        app = create_app(ledger=ledger, max_body_bytes=64 * 1024)
        yield Service(
            app, ledger, create_api_key(ledger.store, "tenant-a"), create_api_key(ledger.store, "tenant-b")
        )


@pytest.fixture
def client(service: Service):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(service.app) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A tiny causal LM (and tokenizer) saved to a directory, as `gaussdp serve --model` takes it."""
    finetune = pytest.importorskip("gaussdp.finetune")
    return finetune.tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="session")
def perturbed_corpus():  # type: ignore[no-untyped-def]
    """(text, sigma, vocabulary id): gensim's Lee corpus perturbed word by word with the page's
    mechanism (Gaussian, the shipped vocabulary), one record per line."""
    from pathlib import Path

    gensim = pytest.importorskip("gensim")
    from gaussdp.service.finetune import vocabulary_id
    from gaussdp.text import GaussianWordMechanism, perturb_text
    from gaussdp.text.corpus import shipped_vocabulary

    lee = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    lines = lee.read_text(encoding="utf-8").splitlines()[:160]
    vocab = shipped_vocabulary()
    sigma = 0.5
    out = perturb_text("\n".join(lines), GaussianWordMechanism(vocab, sigma=sigma))
    return out.text, sigma, vocabulary_id(vocab)
