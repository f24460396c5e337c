"""Load and abuse: well-behaved tenants streaming while a hostile tenant (and unauthenticated clients)
runs each attack of issue 29 against ``gaussdp serve`` (a tiny GPT-2, the default limits).

Phases of ``--phase-s`` seconds each: idle, then one attack at a time, run from other processes (so
that the measuring process's own threads do not compete with the attackers for a GIL):

- ``unauthenticated flood``: 6 connections without a key, 34 text frames of 16 MiB each, offering
  permessage-deflate (16 kB each on the wire where a server accepts it), over and over;
- ``deep JSON``: start frames nested 50,000 deep, and streams whose acks nest 200 deep;
- ``slot hog``: 32 streams at ``noise_multiplier=1e9`` (no privacy cost) that never ack;
- ``padded acks``: acks padded with 16 MiB of spaces;
- ``CKKS contexts``: 8.7 MB public contexts (every rotation key) uploaded for 16 sessions in turn;
- ``20 MB corpora``: perturbed-text corpora (checked against the vocabulary) uploaded and deleted.

Meanwhile ``--tenants`` well-behaved tenants each stream generations of 8 tokens (pull-driven,
``window=1``): the table gives their first-token latency (connect to token 0), p50 and p99, and
p99 against the idle phase's; the server's RSS (before, peak); and whether every session's ledger
charges equal the tokens its client received. The goal of issue 29: p99 under attack <= 2x idle.

    .venv/bin/python benchmarks/bench_abuse.py [--phase-s 8] [--tenants 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 1 << 20
START = {"model": "tiny", "prompt_ids": [1, 2, 3], "noise_multiplier": 8.0, "stop_at_eos": False}


# -- the server ---------------------------------------------------------------------------------------
def _tiny_lm(root: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 (random weights, no tokenizer) and a peft LoRA adapter on its last block."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=200, n_positions=300)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(root / "model")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["attn.c_proj"], layers_to_transform=[1],
        init_lora_weights=False, fan_in_fan_out=True,
    )  # fmt: skip
    peft.get_peft_model(model, lora).save_pretrained(root / "adapter")
    return root / "model", root / "adapter"


class Server:
    def __init__(self, root: Path) -> None:
        import httpx

        from gaussdp.budget import Ledger

        model, adapter = _tiny_lm(root)
        self.db = f"sqlite:///{root / 'ledger.db'}"
        Ledger(self.db).close()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(root / "serve.log", "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GAUSSDP_")}
        env["PYTHONPATH"] = str(Path(__import__("gaussdp").__file__).resolve().parents[1])
        cmd = [
            sys.executable, "-m", "gaussdp.cli", "serve", "--db", self.db, "--port", str(port),
            "--model", f"tiny={model}", "--adapter", f"ad={adapter}", "--data-dir", str(root / "data"),
            "--finetune-workers", "0",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("gaussdp serve did not start: " + (root / "serve.log").read_text()[-2000:])

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_s(self) -> float:
        return _cpu_s(self.proc.pid)

    def key(self, tenant: str) -> str:
        from gaussdp.budget import Ledger
        from gaussdp.service.keys import create_api_key

        with Ledger(self.db) as ledger:
            return create_api_key(ledger.store, tenant)

    def charges(self, principal: str) -> int:
        from gaussdp.budget import Ledger

        with Ledger(self.db) as ledger:
            return sum(ledger.store.groups(principal).values())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its finished children (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _session(url: str, key: str, epsilon: float = 1000.0) -> str:
    import httpx

    r = httpx.post(
        url + "/v1/sessions", json={"epsilon": epsilon, "delta": 1e-5}, headers=_auth(key), timeout=60
    )
    r.raise_for_status()
    return str(r.json()["session_id"])


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _ws(url: str, sid: str, key: str | None, **kw: object):  # type: ignore[no-untyped-def]
    from websockets.sync.client import connect

    ws_url = url.replace("http://", "ws://") + f"/v1/sessions/{sid}/generate"
    return connect(
        ws_url, additional_headers=_auth(key) if key else None, open_timeout=30, close_timeout=2, **kw
    )


# -- the attacks (each in its own process, until ``stop`` is set) --------------------------------------
def _quietly(fn) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception:
        pass


def attack_flood(url: str, key: str, stop) -> None:  # type: ignore[no-untyped-def]
    sid = _session(url, key)
    payload = " " * (16 * MiB)

    def one() -> None:
        while not stop.is_set():

            def flood() -> None:
                with _ws(url, sid, None, compression="deflate", max_size=None) as ws:
                    for _ in range(34):
                        ws.send(payload)
                    ws.recv(timeout=5)

            _quietly(flood)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def attack_deep(url: str, key: str, stop) -> None:  # type: ignore[no-untyped-def]
    sid = _session(url, key)
    while not stop.is_set():

        def start_frame() -> None:
            with _ws(url, sid, key) as ws:
                ws.send("[" * 50_000)
                ws.recv(timeout=10)

        def mid_stream() -> None:
            with _ws(url, sid, key) as ws:
                ws.send(json.dumps({**START, "window": 1, "max_new_tokens": 4}))
                ws.recv(timeout=10)
                ws.recv(timeout=10)
                ws.send("[" * 200 + "]" * 200)
                ws.recv(timeout=10)

        _quietly(start_frame)
        _quietly(mid_stream)


def attack_slots(url: str, key: str, stop) -> None:  # type: ignore[no-untyped-def]
    sid = _session(url, key)
    held: list = []  # type: ignore[type-arg]
    while not stop.is_set():
        held = [ws for ws in held if ws.close_code is None]
        while len(held) < 32 and not stop.is_set():
            try:
                ws = _ws(url, sid, key).__enter__()
                ws.send(json.dumps({**START, "window": 1, "max_new_tokens": 256, "noise_multiplier": 1e9}))
                held.append(ws)
            except Exception:
                break
        time.sleep(0.5)
    for ws in held:
        _quietly(ws.close)


def attack_padded(url: str, key: str, stop) -> None:  # type: ignore[no-untyped-def]
    sid = _session(url, key)
    padded = '{"ack": 1}' + " " * (16 * MiB)
    while not stop.is_set():

        def pad() -> None:
            with _ws(url, sid, key) as ws:
                ws.send(json.dumps({**START, "window": 1, "max_new_tokens": 4}))
                ws.recv(timeout=10)
                for _ in range(10):
                    ws.send(padded)

        _quietly(pad)


def attack_ckks(url: str, key: str, stop) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from gaussdp.inference.ckks import CKKSClient

    public = CKKSClient().public_context()
    sids = [_session(url, key) for _ in range(16)]
    headers = {**_auth(key), "Content-Type": "application/octet-stream"}
    for i in range(1_000_000):
        if stop.is_set():
            break
        sid = sids[i % 16]
        _quietly(
            lambda sid=sid: httpx.post(
                f"{url}/v1/sessions/{sid}/ckks-context", content=public, headers=headers, timeout=60
            )
        )


def attack_corpora(url: str, key: str, stop) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from gaussdp.service.finetune import vocabulary_id
    from gaussdp.text.corpus import shipped_vocabulary
    from gaussdp.text.tokenize import words

    vocab = shipped_vocabulary()
    clean = sorted(w for w in vocab.words if words(w) == [w])
    rng = random.Random(0)
    corpus = ("\n".join(" ".join(rng.choices(clean, k=12)) for _ in range(260_000)) + "\n").encode()
    params = {"name": "big", "mechanism": "gaussian", "sigma": 0.5, "vocabulary": vocabulary_id(vocab)}
    headers = {**_auth(key), "Content-Type": "text/plain"}
    while not stop.is_set():
        try:
            r = httpx.post(url + "/v1/corpora", params=params, content=corpus, headers=headers, timeout=120)
            if r.status_code == 201:
                httpx.delete(f"{url}/v1/corpora/{r.json()['id']}", headers=_auth(key), timeout=60)
        except Exception:
            continue


ATTACKS = {
    "unauthenticated flood": attack_flood,
    "deep JSON": attack_deep,
    "slot hog": attack_slots,
    "padded acks": attack_padded,
    "CKKS contexts": attack_ckks,
    "20 MB corpora": attack_corpora,
}


# -- the well-behaved tenants -------------------------------------------------------------------------
def well_behaved(url: str, key: str, sid: str, until: float, out: dict) -> None:  # type: ignore[type-arg]
    """Generations of 8 tokens, pull-driven, one after another: first-token latencies, tokens."""
    while time.monotonic() < until:
        t0 = time.perf_counter()
        try:
            with _ws(url, sid, key) as ws:
                ws.send(json.dumps({**START, "window": 1, "max_new_tokens": 8}))
                first = json.loads(ws.recv(timeout=60))
                if first["type"] != "start":
                    out["refused"] += 1
                    continue
                tokens = 0
                while True:
                    m = json.loads(ws.recv(timeout=60))
                    if m["type"] != "token":
                        break
                    if tokens == 0:
                        out["first"].append(time.perf_counter() - t0)
                    tokens += 1
                    out["tokens"] += 1  # counted as received, whatever happens next
                    if tokens < 8:  # the server ends the stream after the 8th
                        ws.send(json.dumps({"ack": tokens}))
                if m.get("tokens_sent") != tokens:
                    out["mismatch"] += 1
        except Exception as exc:
            out["errors"].append(repr(exc)[:200])


def run_phase(server: Server, name: str, phase_s: float, users: list[tuple[str, str, str]]) -> dict:  # type: ignore[type-arg]
    stop = mp.Event()
    attacker = None
    if name in ATTACKS:
        attacker = mp.Process(target=ATTACKS[name], args=(server.url, server.key("mallory"), stop))
        attacker.start()
        time.sleep(2.0)  # the attack gets going
    rss_before = server.rss()
    server_cpu0, attacker_cpu0, t0 = (
        server.cpu_s(),
        _cpu_s(attacker.pid) if attacker else 0.0,
        time.monotonic(),
    )
    results = [{"first": [], "tokens": 0, "refused": 0, "mismatch": 0, "errors": []} for _ in users]
    until = time.monotonic() + phase_s
    threads = [
        threading.Thread(target=well_behaved, args=(server.url, key, sid, until, out))
        for (_, key, sid), out in zip(users, results, strict=True)
    ]
    for t in threads:
        t.start()
    peak = rss_before
    while any(t.is_alive() for t in threads):
        peak = max(peak, server.rss())
        time.sleep(0.1)
    wall = time.monotonic() - t0
    server_cpu = (server.cpu_s() - server_cpu0) / wall
    attacker_cpu = (_cpu_s(attacker.pid) - attacker_cpu0) / wall if attacker else 0.0
    stop.set()
    if attacker is not None:
        attacker.join(timeout=60)
        if attacker.is_alive():
            attacker.terminate()
    first = sorted(x for r in results for x in r["first"])
    return {
        "phase": name,
        "streams": len(first),
        "p50": first[len(first) // 2] if first else float("nan"),
        "p99": first[min(len(first) - 1, int(0.99 * len(first)))] if first else float("nan"),
        "rss_before": rss_before,
        "rss_peak": peak,
        "server_cpu": server_cpu,
        "attacker_cpu": attacker_cpu,
        "tokens": sum(r["tokens"] for r in results),
        "refused": sum(r["refused"] for r in results),
        "mismatch": sum(r["mismatch"] for r in results),
        "errors": [e for r in results for e in r["errors"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="attack names (default: all)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--dir", default=None, help="where the server's ledger and data go (default: tmp)")
    args = parser.parse_args()
    mp.set_start_method("spawn")
    root = Path(tempfile.mkdtemp(prefix="gaussdp-bench-abuse-", dir=args.dir))
    server = Server(root)
    try:
        users = []
        for i in range(args.tenants):
            key = server.key(f"tenant-{i}")
            users.append((f"tenant-{i}", key, _session(server.url, key)))
        run_phase(server, "warm-up", 2.0, users)
        before = {name: server.charges(f"{name}/{sid}") for name, _, sid in users}
        rows = []
        for name in ["idle", *(args.only or ATTACKS)]:
            rows.append(run_phase(server, name, args.phase_s, users))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "errors"}), flush=True)
        tokens = sum(r["tokens"] for r in rows)
        charged = sum(server.charges(f"{name}/{sid}") - before[name] for name, _, sid in users)
    finally:
        server.stop()
    idle = rows[0]["p99"]
    lines = [
        f"bench_abuse: {args.tenants} well-behaved tenants streaming 8-token generations (window=1) "
        f"for {args.phase_s:g} s per phase; gaussdp serve, default limits, tiny GPT-2; {os.cpu_count()} CPUs",
        "",
        f"{'phase':<24}{'streams':>8}{'first token p50':>17}{'p99':>10}{'p99/idle':>10}"
        f"{'RSS MiB (peak)':>17}{'server CPU':>12}{'attacker CPU':>14}",
    ]
    for r in rows:
        lines.append(
            f"{r['phase']:<24}{r['streams']:>8}{r['p50'] * 1e3:>14.1f} ms{r['p99'] * 1e3:>7.1f} ms"
            f"{r['p99'] / idle:>10.2f}{r['rss_before'] / MiB:>10.0f} ({r['rss_peak'] / MiB:.0f})"
            f"{r['server_cpu']:>11.0%}{r['attacker_cpu']:>14.0%}"
        )
    lines += [
        "",
        "CPU: share of one core over the phase (the attacker runs on the same machine: on 2 cores its",
        "own sending competes with the server and the well-behaved clients).",
        f"streams refused to the well-behaved tenants: {sum(r['refused'] for r in rows)}; tokens received "
        f"by the well-behaved clients: {tokens}; charged to their sessions: {charged} "
        f"({'equal' if tokens == charged else 'NOT EQUAL'}); end messages disagreeing with the tokens "
        f"received: {sum(r['mismatch'] for r in rows)}; client errors: {sum(len(r['errors']) for r in rows)}",
    ]
    errors = [e for r in rows for e in r["errors"]][:5]
    if errors:
        lines.append("first errors: " + "; ".join(errors))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
