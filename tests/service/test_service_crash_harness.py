"""Crash-and-concurrency harness: 64 HTTP clients against two ``gaussdp serve`` processes sharing one
ledger (SQLite, PostgreSQL), the servers SIGKILLed and restarted mid-run.

Every logical release has its own idempotency key; a client whose request failed in transport or
with 503 retries it with the same key on any live server. At the end, from the clients' answers and
the ledger, the harness prints and checks:

- over-spend: charges past a session's allowance (the count that fits its budget): 0;
- released but uncharged: an answered release (200) whose charge is not on record: 0;
- double charges: an idempotency key charged twice, or answered twice: 0;
and reports, without a bound of zero, the budget lost: charges whose answer never reached a client
(in flight at a kill), which are charged and not released (budget, never privacy).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from gaussdp.accounting import GaussianEvent  # noqa: E402
from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.service.keys import create_api_key  # noqa: E402

CLIENTS = 64
SERVERS = 2
KILLS = 4
SESSIONS = ["s0", "s1", "s2", "s3"]
BUDGET = Budget(epsilon=8.0, delta=1e-5)
EVENT = GaussianEvent(noise_multiplier=20.0)
RELEASE = {"vector": [0.1] * 8, "sigma": 20.0, "sensitivity": 1.0}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    pytest.importorskip("psycopg_pool")
    base = os.environ.get("GAUSSDP_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
    try:
        import psycopg

        with psycopg.connect(base, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except Exception:
        pytest.skip(f"PostgreSQL unreachable at {base}")
    schema = f"gdp_crash_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    yield f"{base}?schema={schema}&pool_size=8"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One `gaussdp serve` process on a fixed port (restarted on the same port after a kill)."""

    def __init__(self, db: str, log: Path) -> None:
        self.db, self.port, self.log = db, _free_port(), log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-c", "from gaussdp.cli import main; main()", "serve", "--db", self.db]
        cmd += ["--port", str(self.port), "--text", "off", "--metrics", "off"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _allowance() -> int:
    with Ledger("memory://") as ledger:
        ledger.open("p", BUDGET)
        return ledger.allowance("p", EVENT)


@pytest.mark.slow
def test_64_clients_and_sigkilled_servers_never_overspend_or_release_uncharged(
    url: str, tmp_path: Path
) -> None:
    n = _allowance()
    with Ledger(url) as ledger:
        key = create_api_key(ledger.store, "acme")
        for sid in SESSIONS:
            ledger.open(f"acme/{sid}", BUDGET)
    servers = [Server(url, tmp_path / f"server{i}.log") for i in range(SERVERS)]
    for s in servers:
        s.start()

    answered: list[tuple[str, str, int]] = []  # (session, idempotency key, charge id) of each 200
    replayed: list[str] = []  # keys answered 409 "already charged" on a retry (charged, not released)
    unexpected: list[str] = []
    transport_errors = [0]
    exhausted: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        h = {"Authorization": f"Bearer {key}"}
        with httpx.Client(timeout=30, headers=h) as c:
            while not stop.is_set():
                live = [sid for sid in SESSIONS if sid not in exhausted]
                if not live:
                    return
                sid, ikey = rng.choice(live), uuid.uuid4().hex
                for _ in range(200):  # the same logical release, retried with its key
                    server = rng.choice(servers)
                    try:
                        r = c.post(
                            f"{server.url}/v1/sessions/{sid}/release",
                            json={**RELEASE, "idempotency_key": ikey},
                        )
                    except httpx.TransportError:
                        with lock:
                            transport_errors[0] += 1
                        time.sleep(0.02)
                        continue
                    body = r.json()
                    with lock:
                        if r.status_code == 200:
                            answered.append((sid, ikey, body["charge_id"]))
                        elif r.status_code == 409 and body.get("error") == "budget_exhausted":
                            exhausted.add(sid)
                        elif r.status_code == 409 and "already charged" in body.get("detail", ""):
                            replayed.append(ikey)
                        elif r.status_code in (503,) or body.get("error") == "ledger_contention":
                            continue
                        else:
                            unexpected.append(f"{r.status_code} {r.text[:200]}")
                    break

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    kill_times = []
    try:
        rng = random.Random(18)
        for k in range(KILLS):
            time.sleep(rng.uniform(0.2, 0.6))
            victim = servers[k % SERVERS]
            with lock:
                if len(exhausted) == len(SESSIONS):
                    break  # the run is over: a kill now would test nothing
                kill_times.append(len(answered))  # progress when the server died
            victim.kill()  # mid-run: requests in flight on it are lost
            victim.start()  # restarted on the same port, same ledger
        for t in threads:
            t.join(180)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for s in servers:
            s.stop()
    seconds = time.monotonic() - t0

    with Ledger(url) as ledger:
        charges = {sid: ledger.history(f"acme/{sid}") for sid in SESSIONS}
        spent = {sid: ledger.spent(f"acme/{sid}").epsilon for sid in SESSIONS}
    on_record = {(sid, c.idempotency_key, c.charge_id) for sid, cs in charges.items() for c in cs}
    over_spend = sum(max(0, len(cs) - n) for cs in charges.values())
    uncharged = [a for a in answered if a not in on_record]
    key_counts = Counter(c.idempotency_key for cs in charges.values() for c in cs)
    answer_counts = Counter(k for _, k, _ in answered)
    double = sum(c - 1 for c in key_counts.values() if c > 1) + sum(
        c - 1 for c in answer_counts.values() if c > 1
    )
    lost = sum(len(cs) for cs in charges.values()) - len(answered)
    print(
        f"\n[crash harness] {url.split(':')[0]}: {CLIENTS} clients, {SERVERS} servers, "
        f"{len(kill_times)} SIGKILLs, {seconds:.1f} s; kills after {kill_times} releases; "
        f"allowance {n}/session x {len(SESSIONS)}; released {len(answered)}, "
        f"charged {sum(len(cs) for cs in charges.values())}; over-spend {over_spend}, "
        f"released-but-uncharged {len(uncharged)}, double charges {double}; budget lost (charged, "
        f"answer lost in a kill) {lost}, of which replayed on retry {len(replayed)}; "
        f"transport errors {transport_errors[0]}"
    )
    assert unexpected == []
    assert set(exhausted) == set(SESSIONS), "the run ended before every budget was spent"
    assert over_spend == 0 and all(e <= BUDGET.epsilon for e in spent.values())
    assert uncharged == []
    assert double == 0
    assert all(len(cs) == n for cs in charges.values())  # every session spent to exactly its allowance
    # the kills came mid-run (with work before and after them); timing decides whether all 4 do
    assert len(kill_times) >= 2 and kill_times[-1] < len(answered)
    assert 0 <= lost <= KILLS * CLIENTS
