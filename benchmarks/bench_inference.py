"""Benchmarks of private inference: the hook's overhead, and the LoRA delta back ends.

1. Forward pass of a small GPT-2 (4 layers, d=256, 64 tokens) clean (the reference) and with a
   HiddenStatePrivatizer hooked on its last block (secure float-safe noise, and "fast" noise).
2. The LoRA delta ``scaling * B @ (A @ h)`` of one token at d=1536, rank 32 (the inference server): plain
   numpy float64 (the reference), CKKS today's way (:class:`CKKSLoRABackend`: one process holds the
   keys, 32 ``dot`` products on the ciphertext, ``B`` applied in the clear), and CKKS packed across
   the wire (:mod:`gaussdp.inference.ckks`: the client keeps the secret key, the server computes the
   whole delta on ciphertext with baby-step/giant-step diagonals). Seconds per token (medians) and
   each one's relative error against the plain delta. Not a test.

    .venv/bin/python benchmarks/bench_inference.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def timed(fn, repeats):
    times = []
    out = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--skip-ckks", action="store_true")
    args = parser.parse_args()
    bench_hook(args.repeats)
    if not args.skip_ckks:
        bench_ckks(args)


def bench_hook(repeats: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gaussdp.inference import HiddenStatePrivatizer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)
    ).eval()
    ids = torch.randint(0, 1000, (1, 64))
    n = max(repeats, 10)
    with torch.no_grad():
        model(ids)
        clean_s, _ = timed(lambda: model(ids), n)
        clean_s, _ = timed(lambda: model(ids), n)  # twice: the machine's load varies
        print(f"clean forward (GPT-2 4x256, 64 tokens): median {clean_s * 1e3:.2f} ms")
        for noise in ("secure", "fast"):
            with HiddenStatePrivatizer(model, clip_norm=1.0, epsilon=8.0, delta=1e-5, noise=noise):
                model(ids)  # warm-up: first use imports the accountant and the noise source
                hooked_s, _ = timed(lambda: model(ids), n)
            print(
                f"privatized forward, noise={noise!r}: median {hooked_s * 1e3:.2f} ms "
                f"({hooked_s / clean_s:.2f}x clean)"
            )


def bench_ckks(args: argparse.Namespace) -> None:
    """Seconds per token of the LoRA delta ``scaling * B @ (A @ h)`` (d -> r -> d), three ways."""
    d, r = args.dim, args.rank
    rng = np.random.default_rng(0)  # data only
    h = rng.standard_normal(d)
    A = rng.standard_normal((r, d)) / np.sqrt(d)
    B = rng.standard_normal((d, r)) / np.sqrt(r)
    scaling = 2.0
    plain_s, ref = timed(lambda: scaling * (B @ (A @ h)), max(args.repeats, 100))
    print(f"plain numpy delta (d={d}, rank {r}): median {plain_s * 1e6:.1f} us/token")
    try:
        import tenseal  # noqa: F401
    except ImportError:
        print("tenseal not installed: CKKS back ends not measured")
        return
    from gaussdp.inference.backends import CKKSLoRABackend
    from gaussdp.inference.ckks import CKKSClient, CKKSLoRAPlan, CKKSPublicContext

    def rel(x: np.ndarray) -> float:
        return float(np.linalg.norm(np.ravel(x) - ref) / np.linalg.norm(ref))

    backend = CKKSLoRABackend()  # today's way: one process holds the keys; 32 dot products
    old_s, old = timed(lambda: backend.delta(h[None, :], A, B, scaling), args.repeats)
    print(
        f"CKKS CKKSLoRABackend (encrypt, {r} dots, decrypt, B in the clear): median {old_s:.3f} s/token, "
        f"relative error {rel(old):.1e}"
    )
    t = time.perf_counter()
    client = CKKSClient(rank=r)
    keygen_s = time.perf_counter() - t
    public = client.public_context()
    t = time.perf_counter()
    server_ctx = CKKSPublicContext(public)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    plan = CKKSLoRAPlan(A, B, scaling)
    plan_s = time.perf_counter() - t
    print(
        f"CKKS packed, once per session: keys {keygen_s:.2f} s, public context {len(public) / 1e6:.2f} MB "
        f"(loaded by the server in {load_s:.2f} s); adapter encoded once in {plan_s:.2f} s"
    )
    ct = client.encrypt(h)
    server_cpu = []

    def server() -> bytes:
        c0 = time.thread_time()
        out = plan.delta(server_ctx, ct)
        server_cpu.append(time.thread_time() - c0)
        return out

    server_s, answer = timed(server, args.repeats)
    total_s, got = timed(
        lambda: client.decrypt_delta(plan.delta(server_ctx, client.encrypt(h))), args.repeats
    )
    print(
        f"CKKS packed (encrypt, server delta B(Ah) on ciphertext, decrypt): median {total_s:.3f} s/token "
        f"({old_s / total_s:.1f}x faster than CKKSLoRABackend), relative error {rel(got):.1e}; "
        f"server part {server_s:.3f} s ({statistics.median(server_cpu):.3f} s CPU); "
        f"ciphertext {len(ct) / 1e3:.0f} kB in, {len(answer) / 1e3:.0f} kB out"
    )


if __name__ == "__main__":
    main()
