"""Benchmarks of private inference: the hook's overhead, and the LoRA delta back ends.

1. Forward pass of a small GPT-2 (4 layers, d=256, 64 tokens) clean (the reference) and with a
   HiddenStatePrivatizer hooked on its last block (secure float-safe noise, and "fast" noise).
2. One 1536-vector times a 1536x32 matrix (document 000's A @ h).

Plain numpy float64 is the reference; TenSEAL CKKS (optional) is measured two ways: ``matmul`` (one
ciphertext in, one out, rotations inside) and 32 ``dot`` products (one ciphertext per output). Prints
medians and the ratio against the plain reference run in the same process. Not a test.

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
    d, r = args.dim, args.rank
    rng = np.random.default_rng(0)  # data only
    h = rng.standard_normal(d)
    A = rng.standard_normal((r, d)) / np.sqrt(d)
    plain_s, ref = timed(lambda: A @ h, max(args.repeats, 100))
    print(f"plain numpy A @ h ({r}x{d}): median {plain_s * 1e6:.1f} us")
    try:
        import tenseal as ts
    except ImportError:
        print("tenseal not installed: CKKS backend not measured")
        return
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40, 60])
    ctx.global_scale = 2**40
    ctx.generate_galois_keys()
    enc_s, enc = timed(lambda: ts.ckks_vector(ctx, h.tolist()), args.repeats)
    print(f"CKKS encrypt one {d}-vector: median {enc_s:.3f} s")
    dots_s, dots = timed(lambda: [enc.dot(row.tolist()) for row in A], args.repeats)
    dec_dots = np.array([c.decrypt()[0] for c in dots])
    err_dots = float(np.max(np.abs(dec_dots - ref)))
    print(
        f"CKKS {r} dot products: median {dots_s:.3f} s ({dots_s / plain_s:.0f}x plain), "
        f"max abs error {err_dots:.2e}"
    )
    mm_s, mm = timed(lambda: enc.matmul(A.T.tolist()), 1)
    err_mm = float(np.max(np.abs(np.array(mm.decrypt()[:r]) - ref)))
    print(
        f"CKKS matmul (vector x {d}x{r} matrix): {mm_s:.3f} s, one run ({mm_s / plain_s:.0f}x plain), "
        f"max abs error {err_mm:.2e}; matmul / dots = {mm_s / dots_s:.1f}"
    )


if __name__ == "__main__":
    main()
