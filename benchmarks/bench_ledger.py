"""Ledger throughput and latency: SQLite and PostgreSQL, direct and over HTTP, beside pgbench.

Run: ``.venv/bin/python benchmarks/bench_ledger.py [--seconds 3] [--clients 8] [--pg URL]``.

Each line: charges/s and p50/p99 latency of ``Ledger.charge`` (direct) or of
``POST /v1/sessions/{id}/release`` (HTTP, a real uvicorn server in a thread of this process,
``--clients`` concurrent httpx clients in a forked process). Each client charges its own principal,
as sessions do; one warm-up charge per principal first (the allowance for that history is then
cached, so the
steady state measures the store). The reference is ``pgbench -N`` (simple-update: BEGIN; UPDATE;
SELECT; INSERT; END) on the same server, with the same number of clients, in the same run.
Goals: SQLite >= 2000 charges/s with p99 < 10 ms (one client); PostgreSQL >= 50% of pgbench's TPS.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gaussdp.accounting import GaussianEvent
from gaussdp.budget import Budget, Ledger

EVENT = GaussianEvent(noise_multiplier=1000.0)  # tiny spend: the budget never binds during a run
BUDGET = Budget(epsilon=1e4, delta=1e-5)


def _run_clients(clients: int, seconds: float, one: Callable[[int], None]) -> tuple[float, np.ndarray]:
    """Call ``one(client_index)`` in a loop from ``clients`` threads for ``seconds``; (rate, latencies ms)."""
    lat: list[list[float]] = [[] for _ in range(clients)]
    stop = time.perf_counter() + seconds
    barrier = threading.Barrier(clients + 1)

    def loop(i: int) -> None:
        barrier.wait()
        out = lat[i]
        while time.perf_counter() < stop:
            t = time.perf_counter()
            one(i)
            out.append(time.perf_counter() - t)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    all_lat = np.concatenate([np.asarray(x) for x in lat]) * 1e3
    return len(all_lat) / wall, all_lat


def bench_direct(url: str, clients: int, seconds: float) -> tuple[float, np.ndarray]:
    with Ledger(url) as ledger:
        names = [f"bench-{secrets.token_hex(4)}-{i}" for i in range(clients)]
        for p in names:
            ledger.open(p, BUDGET)
            ledger.charge(p, EVENT)  # warm-up
        return _run_clients(clients, seconds, lambda i: ledger.charge(names[i], EVENT))


def _http_load(base: str, key: str, sids: list[str], seconds: float, conn: Any) -> None:
    """The client side of the HTTP benchmark, in its own process (its own GIL)."""
    import httpx

    h = {"Authorization": f"Bearer {key}"}
    https = [httpx.Client(base_url=base, headers=h, timeout=60) for _ in sids]
    body = {"vector": [0.1] * 16, "sigma": EVENT.noise_multiplier}

    def one(i: int) -> None:
        r = https[i].post(f"/v1/sessions/{sids[i]}/release", json=body)
        if r.status_code != 200:
            raise RuntimeError(r.text)

    for i in range(len(sids)):
        one(i)  # warm-up
    rate, lat = _run_clients(len(sids), seconds, one)
    conn.send((rate, lat))


def bench_http(url: str, clients: int, seconds: float) -> tuple[float, np.ndarray]:
    """``clients`` concurrent httpx clients in a separate process against a uvicorn server thread."""
    import multiprocessing as mp

    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key
    from gaussdp.service.server import ServerThread

    with Ledger(url) as ledger:
        key = create_api_key(ledger.store, "bench")
        sids = [f"s{secrets.token_hex(4)}" for _ in range(clients)]
        for sid in sids:  # what POST /v1/sessions does
            ledger.open(f"bench/{sid}", Budget(epsilon=1000.0, delta=1e-5))
        server = ServerThread(create_app(ledger=ledger))  # port bound; no thread yet
        ctx = mp.get_context("fork")  # fork before the server thread exists
        parent, child = ctx.Pipe()
        start = ctx.Event()

        def run_child() -> None:
            start.wait()
            _http_load(server.url, key, sids, seconds, child)

        proc = ctx.Process(target=run_child)
        proc.start()
        with server:
            start.set()
            rate, lat = parent.recv()
        proc.join()
        return rate, lat


def fsync_ms(directory: Path, n: int = 200) -> float:
    """Median time of one small write + fsync in ``directory``: the floor of a durable commit."""
    lat = []
    with open(directory / "fsync.probe", "wb") as f:
        for _ in range(n):
            f.write(b"x" * 64)
            t = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
            lat.append(time.perf_counter() - t)
    return float(np.median(lat)) * 1e3


def pgbench_tps(pg_url: str, clients: int, seconds: float) -> float | None:
    """pgbench -N (simple-update) TPS on a scratch database of the same server; None if unavailable."""
    exe = shutil.which("pgbench") or next(
        iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"))), None
    )
    if exe is None:
        return None
    import psycopg

    db = f"gaussdp_pgbench_{os.getpid()}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    try:
        info = psycopg.conninfo.conninfo_to_dict(pg_url)
        args = ["-h", str(info.get("host", "127.0.0.1")), "-p", str(info.get("port", 5432))]
        args += ["-U", str(info.get("user", "postgres"))]
        subprocess.run([str(exe), *args, "-i", "-s", "1", "-q", db], check=True, capture_output=True)
        out = subprocess.run(
            [
                str(exe),
                *args,
                "-N",
                "-c",
                str(clients),
                "-j",
                str(min(clients, os.cpu_count() or 1)),
                "-T",
                str(max(1, round(seconds))),
                db,
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        m = re.search(r"tps = ([0-9.]+)", out)
        return float(m.group(1)) if m else None
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {db}")


def pg_reachable(url: str) -> bool:
    try:
        import psycopg

        with psycopg.connect(url, connect_timeout=2):
            return True
    except Exception:
        return False


def line(label: str, rate: float, lat: np.ndarray, extra: str = "") -> None:
    p50, p99 = np.percentile(lat, [50, 99])
    print(f"{label:<44} {rate:9.0f} charges/s   p50 {p50:7.3f} ms   p99 {p99:7.3f} ms   {extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--only", choices=("sqlite", "postgres"), help="run one store's rows only")
    ap.add_argument("--repeats", type=int, default=3, help="pgbench/ledger pairs per PostgreSQL row")
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gaussdp-bench-"))
    print(
        f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
        f"{args.seconds:g} s per measurement"
    )
    print(f"one write+fsync in {tmp}: median {fsync_ms(tmp):.3f} ms (synchronous=full pays one per charge)")
    try:
        for sync in ("normal", "full") if args.only != "postgres" else ():
            url = f"sqlite:///{tmp / f'{sync}.db'}?synchronous={sync}"
            rate, lat = bench_direct(url, 1, args.seconds)
            ok = rate >= 2000 and np.percentile(lat, 99) < 10
            line(
                f"sqlite synchronous={sync} direct, 1 client",
                rate,
                lat,
                f"goal >=2000/s & p99<10ms: {'met' if ok else 'NOT met'}",
            )
            rate, lat = bench_direct(url, args.clients, args.seconds)
            line(f"sqlite synchronous={sync} direct, {args.clients} clients", rate, lat)
        if args.only != "postgres":
            url = f"sqlite:///{tmp / 'full.db'}"
            rate, lat = bench_http(url, args.clients, args.seconds)
            line(f"sqlite (full) HTTP, {args.clients} clients", rate, lat)
        if args.only == "sqlite":
            return
        if not pg_reachable(args.pg):
            print(f"PostgreSQL unreachable at {args.pg}: skipped")
            return
        schema = f"gdp_bench_{os.getpid()}"
        pg = f"{args.pg}{'&' if '?' in args.pg else '?'}schema={schema}&pool_size={max(args.clients, 2)}"
        try:
            for clients in (1, args.clients):
                # Interleaved (pgbench, ledger) pairs: the machine's load drifts; the median ratio of
                # pairs measured back to back is what the goal is judged on.
                refs, rates, lats = [], [], []
                for _ in range(args.repeats):
                    refs.append(pgbench_tps(args.pg, clients, args.seconds))
                    rate, lat = bench_direct(pg, clients, args.seconds)
                    rates.append(rate)
                    lats.append(lat)
                lat = np.concatenate(lats)
                if refs[0] is None:
                    line(
                        f"postgresql direct, {clients} client(s)", float(np.median(rates)), lat, "no pgbench"
                    )
                    continue
                ratios = [r / f for r, f in zip(rates, refs, strict=True) if f]
                ratio, ref = float(np.median(ratios)), float(np.median([f for f in refs if f]))
                line(
                    f"postgresql direct, {clients} client(s)",
                    float(np.median(rates)),
                    lat,
                    f"pgbench -N -c {clients}: {ref:.0f} tps; ratio {ratio:.2f} "
                    f"(pairs: {', '.join(f'{x:.2f}' for x in ratios)}; goal >= 0.50: "
                    f"{'met' if ratio >= 0.5 else 'NOT met'})",
                )
            rate, lat = bench_http(pg, args.clients, args.seconds)
            line(
                f"postgresql HTTP, {args.clients} clients",
                rate,
                lat,
                f"ratio to pgbench {rate / ref:.2f}" if ref else "",
            )
        finally:
            import psycopg

            with psycopg.connect(args.pg, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
