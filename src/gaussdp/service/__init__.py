"""The gaussdp service: budgets and Gaussian releases over HTTP (FastAPI + uvicorn, ``service`` extra).

``create_app(ledger_url=...)`` builds the app; ``gaussdp serve`` runs it. Tenants authenticate with
API keys (``gaussdp keys create TENANT``), stored hashed in the ledger's database.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """See :func:`gaussdp.service.app.create_app` (imported lazily: FastAPI is an extra)."""
    from gaussdp.service.app import create_app as _create_app

    return _create_app(*args, **kwargs)
