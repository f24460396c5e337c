"""Nearest-word search for text perturbation: gaussdp exact search vs faiss IndexFlatL2 vs numpy argmin.

100,000 words perturbed (Gaussian, sigma 0.1 as in text perturbation) over a random 100,000 x 50 float32
vocabulary in [-1, 1]; words/s for each search on the same noisy vectors, in the same process.
gaussdp and faiss run interleaved on the same chunks of queries (so that a busy machine slows both
alike), ``--repeats`` times; the medians are compared. Two thread settings:

* default: gaussdp's own threads (one per CPU, single-threaded BLAS each) vs faiss's OpenMP threads;
* one thread each (``threads=1``; ``faiss.omp_set_num_threads(1)``): the algorithmic difference alone.

Exactness: every gaussdp answer is compared with faiss; each difference must be a query where
faiss's float32 ranking is wrong (gaussdp's word is strictly closer in exact arithmetic) or an exact
tie resolved to the lower index (gaussdp's documented tie rule). A subsample is also checked
against a float64 brute-force reference with the same tie rule (must be identical).

Run: .venv/bin/python benchmarks/bench_text.py [--words N] [--vocab V] [--sigma S] [--no-kernel]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from fractions import Fraction

import numpy as np


def _exact_sq(a: np.ndarray, b: np.ndarray) -> Fraction:
    return sum(
        ((Fraction(float(x)) - Fraction(float(y))) ** 2 for x, y in zip(a, b, strict=True)), Fraction(0)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=100_000)
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=50)
    parser.add_argument("--sigma", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=20_000, help="queries per timed call")
    parser.add_argument("--numpy-words", type=int, default=300)
    parser.add_argument("--reference-words", type=int, default=500)
    parser.add_argument(
        "--no-kernel",
        action="store_true",
        help="gaussdp's numpy path instead of the C kernel gaussdp._search",
    )
    args = parser.parse_args()

    import faiss

    from gaussdp.text import GaussianWordMechanism, Vocabulary
    from gaussdp.text.search import ExactSearch, reference_nearest

    rng = np.random.default_rng(12345)  # benchmark data only, not noise for a release
    matrix = rng.uniform(-1.0, 1.0, size=(args.vocab, args.dim)).astype(np.float32)
    vocab = Vocabulary([f"w{i}" for i in range(args.vocab)], matrix)
    inputs = rng.integers(0, args.vocab, size=args.words)
    mech = GaussianWordMechanism(vocab, sigma=args.sigma)
    noisy = mech._noisy(matrix[inputs])  # the same noisy vectors for every search below

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    print(f"{args.words} words, vocabulary {args.vocab} x {args.dim} float32, sigma={args.sigma}")
    t = time.perf_counter()
    search = ExactSearch(vocab.vectors, kernel=False if args.no_kernel else None)
    print(f"gaussdp path: {'numpy' if search._kernel is None else 'C kernel gaussdp._search'}")
    print(f"gaussdp index build (projection): {time.perf_counter() - t:.2f} s")
    index = faiss.IndexFlatL2(args.dim)
    index.add(matrix)
    default_omp = faiss.omp_get_max_threads()

    ours = np.empty(args.words, dtype=np.int64)
    faiss_ids = np.empty(args.words, dtype=np.int64)
    chunks = [np.arange(lo, min(lo + args.chunk, args.words)) for lo in range(0, args.words, args.chunk)]
    results = {}
    for label, threads in (("default threads", None), ("one thread each", 1)):
        faiss.omp_set_num_threads(default_omp if threads is None else 1)
        ours_rates, faiss_rates = [], []
        for rep in range(args.repeats):
            c = chunks[rep % len(chunks)]
            q = np.ascontiguousarray(noisy[c])
            t = time.perf_counter()
            got = search.nearest(q, threads=threads)
            ours_rates.append(c.size / (time.perf_counter() - t))
            t = time.perf_counter()
            _, ids = index.search(q, 1)
            faiss_rates.append(c.size / (time.perf_counter() - t))
            ours[c], faiss_ids[c] = got, ids[:, 0]
        results[label] = (statistics.median(ours_rates), statistics.median(faiss_rates))
    faiss.omp_set_num_threads(default_omp)
    # Every query answered by both (the timed chunks may not cover all of them).
    ours = search.nearest(noisy)
    _, ids = index.search(noisy, 1)
    faiss_ids = ids[:, 0]

    sub = noisy[: args.numpy_words]
    t = time.perf_counter()
    np_ids = np.array([int(np.argmin(np.sum((matrix - v) ** 2, axis=1))) for v in sub])
    numpy_rate = sub.shape[0] / (time.perf_counter() - t)
    t = time.perf_counter()
    mech.perturb_indices(inputs)  # the vocabulary's own search (the kernel where it is built)
    perturb_rate = args.words / (time.perf_counter() - t)

    print(f"{'search':<44}{'gaussdp w/s':>12}{'faiss w/s':>12}{'ratio':>8}")
    for label, (o, f) in results.items():
        print(f"{label + f' (median of {args.repeats})':<44}{o:>12,.0f}{f:>12,.0f}{o / f:>7.2f}x")
    print(f"{'numpy per-word argmin':<44}{numpy_rate:>12,.0f}   (on {sub.shape[0]} words)")
    print(f"{'gaussdp perturb (noise+search, default)':<44}{perturb_rate:>12,.0f}")
    o, f = results["default threads"]
    print(f"ratio gaussdp / faiss Flat: {o / f:.2f}x   (goal >= 2x)")

    # Exactness. 1) float64 / rational reference on a subsample: identical, tie rule included.
    ref = reference_nearest(matrix, noisy[: args.reference_words])
    same_ref = int(np.sum(ref == ours[: args.reference_words]))
    # 2) every difference with faiss is faiss's float32 error or an exact tie (lower index wins).
    mismatch = np.nonzero(ours != faiss_ids)[0]
    faiss_wrong = ties = bad = 0
    for i in mismatch:
        d_ours = _exact_sq(matrix[ours[i]], noisy[i])
        d_faiss = _exact_sq(matrix[faiss_ids[i]], noisy[i])
        if d_ours < d_faiss:
            faiss_wrong += 1
        elif d_ours == d_faiss and ours[i] < faiss_ids[i]:
            ties += 1
        else:
            bad += 1
    print(f"identical to the exact reference on {same_ref}/{args.reference_words} queries")
    print(
        f"identical to faiss on {args.words - mismatch.size}/{args.words} queries; of {mismatch.size} "
        f"differences, {faiss_wrong} where faiss's float32 ranking is wrong (gaussdp strictly closer), "
        f"{ties} exact ties (lower index), {bad} where gaussdp is wrong"
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if bad or same_ref != args.reference_words or not np.array_equal(np_ids, ours[: args.numpy_words]):
        raise SystemExit("gaussdp exact search is not exact")
    try:
        from threadpoolctl import threadpool_info

        for lib in threadpool_info():
            print(
                f"  {lib['filepath'].split('/')[-1]}: {lib.get('internal_api')}, "
                f"{lib.get('num_threads')} threads"
            )
    except ImportError:  # pragma: no cover
        pass


if __name__ == "__main__":
    main()
