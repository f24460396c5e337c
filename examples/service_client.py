"""A client of the gaussdp service: contributors privatize their own data, the server enforces budgets.

Local DP through the HTTP API: each contributor (here, one image of scikit-learn's digits, scaled to
unit L2 norm) has a session of its own with a budget of ``--epsilon``, and asks the service to clip
and noise its image once (sensitivity 1: add/remove of that contributor's image). A second request
on a spent session is refused with 409 ``budget_exhausted``. The analyst builds one centroid per
digit from the noisy images only and classifies held-out (clean) images by the nearest centroid.
Prints the epsilon the server charged per contributor and the accuracy.

Starts ``gaussdp serve`` in a subprocess on a free port with a fresh SQLite ledger and creates an
API key with ``gaussdp keys create`` (or uses ``--url`` and ``--key`` of a running server).

Run: ``python examples/service_client.py [--contributors 600] [--epsilon 8]``. Local DP needs a
large epsilon per contributor for a useful average: every contributor's noise is as large as the
whole image's signal at epsilon about 4.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from sklearn.datasets import load_digits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_server(workdir: Path) -> Iterator[tuple[str, str]]:
    """``gaussdp serve`` on a free port over ``workdir/ledger.db``; yields (url, a release-scope key)."""
    db = f"sqlite:///{workdir / 'ledger.db'}"
    cli = [sys.executable, "-m", "gaussdp.cli"]
    key = subprocess.run(
        [*cli, "keys", "create", "example-tenant", "--db", db],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()[0]  # fmt: skip
    port = free_port()
    server = subprocess.Popen(
        [*cli, "serve", "--db", db, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                err = server.stderr.read().decode() if server.stderr else ""
                raise RuntimeError(f"gaussdp serve did not start: {err[-2000:]}")
            time.sleep(0.2)
        yield url, key
    finally:
        server.terminate()
        server.wait(timeout=30)


def private_centroids(url: str, key: str, args: argparse.Namespace) -> dict[str, object]:
    x, y = load_digits(return_X_y=True)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)  # each image has L2 norm 1
    rng = np.random.default_rng(0)  # which images contribute (not the noise: that is the server's)
    order = rng.permutation(len(x))
    contrib, held_out = order[: args.contributors], order[-args.test :]
    auth = {"Authorization": f"Bearer {key}"}
    noisy, spent = [], []
    with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
        for i in contrib:
            sid = f"contributor-{i}"
            budget = {"epsilon": args.epsilon, "delta": args.delta, "session_id": sid}
            http.post("/v1/sessions", json=budget).raise_for_status()
            body = {"vector": x[i].tolist(), "epsilon": args.epsilon, "delta": args.delta}
            r = http.post(f"/v1/sessions/{sid}/release", json=body)
            r.raise_for_status()
            noisy.append(r.json()["vector"])
            spent.append(r.json()["spent"]["epsilon"])
        # the same contributor asks again: its budget is spent, nothing is released
        again = http.post(f"/v1/sessions/contributor-{contrib[0]}/release", json=body)
    noisy_x = np.array(noisy)
    labels = y[contrib]
    centroids = np.stack([noisy_x[labels == d].mean(axis=0) for d in range(10)])
    pred = np.argmin(((x[held_out, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    return {
        "contributors": len(contrib),
        "epsilon_per_contributor": max(spent),
        "delta": args.delta,
        "second_request_status": again.status_code,
        "second_request_error": again.json().get("error"),
        "test_accuracy": float((pred == y[held_out]).mean()),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running gaussdp service (default: start one)")
    p.add_argument("--key", help="an API key with the release scope (with --url)")
    p.add_argument("--contributors", type=int, default=600)
    p.add_argument("--test", type=int, default=400, help="held-out images to classify")
    p.add_argument("--epsilon", type=float, default=8.0, help="each contributor's budget")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.url:
        result = private_centroids(args.url, args.key, args)
    else:
        with tempfile.TemporaryDirectory() as tmp, local_server(Path(tmp)) as (url, key):
            result = private_centroids(url, key, args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['contributors']} contributors, each charged "
            f"epsilon={result['epsilon_per_contributor']:.3f} (delta={args.delta:g}, "
            "add/remove of its image); "
            "a second request: "
            f"{result['second_request_status']} {result['second_request_error']}; nearest-centroid test "
            f"accuracy {result['test_accuracy']:.3f}"
        )
    return result


if __name__ == "__main__":
    main()
