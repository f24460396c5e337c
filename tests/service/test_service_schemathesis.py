"""Property-based API testing with schemathesis against the app's own OpenAPI: no 5xx, ever."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.specs.openapi.checks import negative_data_rejection  # noqa: E402

from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.service.app import create_app  # noqa: E402
from gaussdp.service.keys import create_api_key  # noqa: E402

_DIR = Path(tempfile.mkdtemp(prefix="gaussdp-schemathesis-"))
_LEDGER = Ledger(f"sqlite:///{_DIR / 'ledger.db'}")
atexit.register(shutil.rmtree, _DIR, True)
atexit.register(_LEDGER.close)
_KEY = create_api_key(_LEDGER.store, "fuzz")
_LEDGER.open("fuzz/s1", Budget(epsilon=50.0, delta=1e-5))  # a session the fuzzer can really spend
try:  # the fine-tuning routes (corpora, models, jobs) when their extras are installed
    import gaussdp.finetune  # noqa: F401

    _FINETUNE = {"data_dir": str(_DIR / "data"), "model_paths": {"tiny": str(_DIR / "no-model")}}
except ImportError:
    _FINETUNE = {}
APP = create_app(ledger=_LEDGER, max_body_bytes=256 * 1024, **_FINETUNE)
# The whole OpenAPI document: every route, including those other topics contribute (/text/...) and
# the WebSocket stream's GET (its close codes are documented there; a plain GET answers 426).
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx, value):  # type: ignore[no-untyped-def]  # corpus uploads: a raw text body
    return value.encode("utf-8") if isinstance(value, str) else str(value).encode("utf-8")


# Every check schemathesis has (its "--checks all"). One setting differs from its defaults: a request
# the schema allows may still be refused with 422 for its values together (sigma/sensitivity outside
# the float range, NaN in base64 floats, rows of unequal length, an adapter this server lacks), as
# the OpenAPI documents for each route, and the WebSocket route's GET answers a plain HTTP request
# 426 (upgrade required), as documented; every other status and every body is checked as it is.
schema.config.checks.positive_data_acceptance.expected_statuses = [
    *schema.config.checks.positive_data_acceptance.expected_statuses,
    "422",
    "426",
]


def test_the_websocket_route_and_its_close_codes_are_in_the_document() -> None:
    from fastapi.testclient import TestClient

    from gaussdp.service.errors import websocket_close_codes

    with TestClient(APP) as client:
        paths = client.get("/openapi.json").json()["paths"]
    stream = paths["/v1/sessions/{session_id}/generate"]["get"]
    assert stream["x-websocket-close-codes"] == websocket_close_codes()
    assert {"101", "401", "426", "429"} <= set(stream["responses"])
    assert any(p.startswith("/text") for p in paths)  # the whole document is fuzzed below


def _negative(case, location: str) -> bool:  # type: ignore[no-untyped-def]
    meta = case.meta
    if meta is None:
        return False
    return any(
        getattr(loc, "value", loc) == location and info.mode.is_negative
        for loc, info in meta.components.items()
    )


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_all_checks_pass(case) -> None:  # type: ignore[no-untyped-def]
    if (
        case.path_parameters
        and "session_id" in case.path_parameters
        and not _negative(case, "path")
        and hash(repr(case.body)) % 2
    ):
        case.path_parameters["session_id"] = "s1"  # half the cases reach an existing session
    # the key, unless the case is about a missing or malformed Authorization header
    headers = {} if _negative(case, "header") else {"Authorization": f"Bearer {_KEY}"}
    excluded = []
    if (
        case.operation.method.upper() == "POST"
        and case.operation.path == "/v1/corpora"
        and _negative(case, "body")
    ):
        # A corpus is a raw text body: a "non-string" body serialises to text too, and any text is
        # a corpus (or refused with 422 for its content), so there is no invalid type to reject.
        excluded = [negative_data_rejection]
    case.call_and_validate(headers=headers, excluded_checks=excluded)
