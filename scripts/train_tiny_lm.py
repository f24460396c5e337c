"""Train the small causal LM that ``gaussdp inference-report --model DIR`` measures (no downloads).

    python scripts/train_tiny_lm.py tiny-lm/          # same as: gaussdp train-tiny-lm tiny-lm/
    gaussdp inference-report --model tiny-lm/

A GPT-2 (2 blocks, width 128, about 0.9 M parameters, under 4 MB) with a word-level tokenizer, both
built from gensim's Lee background corpus (installed with gensim) and trained on CPU in minutes; every
tenth document is held out for the report. See :mod:`gaussdp.inference.tiny_lm`.
"""

from __future__ import annotations

import argparse

from gaussdp.inference.tiny_lm import train_tiny_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to save the model and its tokenizer to")
    parser.add_argument("--corpus", default=None, help="text file, one document per line (default: Lee)")
    parser.add_argument("--steps", type=int, default=600, help="training steps (batches of 16 x 64 tokens)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    r = train_tiny_lm(args.out_dir, corpus=args.corpus, steps=args.steps, seed=args.seed)
    print(
        f"saved {r.path}: {r.parameters / 1e6:.2f} M parameters, vocabulary {r.vocab_size}; held-out "
        f"perplexity {r.perplexity_before:.0f} (untrained) -> {r.perplexity_after:.1f}, {r.seconds:.0f} s"
    )


if __name__ == "__main__":
    main()
