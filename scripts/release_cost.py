"""CPU cost of one release, for the gaussdp on ``PYTHONPATH``: ``Ledger.charge`` and
``Ledger.release`` on ``memory://`` and SQLite, and ``POST /v1/sessions/{id}/release`` in process
(FastAPI's test client), as microseconds of this process's CPU time per operation (all threads).

CPU time moves far less with a shared machine's load than wall time does. Compare two trees back to
back, alternating, e.g. ``for i in 1 2 3; do (cd OLD && PYTHONPATH=src python
$NEW/scripts/release_cost.py); (cd NEW && PYTHONPATH=src python scripts/release_cost.py); done``,
and take the medians.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def main() -> None:
    from fastapi.testclient import TestClient

    from gaussdp.accounting import GaussianEvent
    from gaussdp.budget import Budget, Ledger
    from gaussdp.mechanism import GaussianMechanism
    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    tmp = Path(tempfile.mkdtemp(prefix="gaussdp-release-cost-"))
    out: dict[str, float] = {}

    def cpu(name: str, fn: Callable[[], object], k: int) -> None:
        fn()
        t0 = time.process_time()
        for _ in range(k):
            fn()
        out[name] = round((time.process_time() - t0) / k * 1e6, 1)

    event = GaussianEvent(noise_multiplier=1000.0)  # tiny spend: the budget never binds
    mech = GaussianMechanism(sigma=1000.0, sensitivity=1.0)
    x = np.ones(16)
    for url in ("memory://", f"sqlite:///{tmp / 'ledger.db'}?synchronous=normal"):
        tag = url.split(":")[0]
        with Ledger(url) as led:
            led.open("p", Budget(1e4, 1e-5))
            led.open("q", Budget(1e4, 1e-5))
            cpu(f"{tag}_charge_us", lambda led=led: led.charge("p", event), n)
            cpu(f"{tag}_release_us", lambda led=led: led.release("q", mech, x), n)
    with Ledger(f"sqlite:///{tmp / 'service.db'}?synchronous=normal") as led:
        key = create_api_key(led.store, "bench")
        with TestClient(create_app(ledger=led, metrics="off")) as client:
            h = {"Authorization": f"Bearer {key}"}
            opened = client.post(
                "/v1/sessions", json={"session_id": "s", "epsilon": 100.0, "delta": 1e-5}, headers=h
            )
            if opened.status_code != 201:
                raise RuntimeError(opened.text)
            body = {"vector": [0.1] * 16, "sigma": 1000.0}

            def one() -> None:
                r = client.post("/v1/sessions/s/release", json=body, headers=h)
                if r.status_code != 200:
                    raise RuntimeError(r.text)

            cpu("http_release_us", one, max(1, n // 4))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
