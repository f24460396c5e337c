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
