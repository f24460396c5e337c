"""A small causal LM trained on real text (gensim's Lee corpus): perplexities that mean something.

Issue 20: ``inference-report`` measured perplexity on random token ids with an untrained model. These
tests build a tiny model in seconds (the shipped defaults train for minutes) and check that training
learned the text, and that hidden-state noise costs perplexity on held-out real text.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from gaussdp.calibration import sigma_for  # noqa: E402
from gaussdp.inference import tiny_lm, utility_report  # noqa: E402

try:
    tiny_lm.default_corpus_path()
except FileNotFoundError:  # pragma: no cover - gensim is a dev dependency
    pytest.skip("gensim's test corpus is not installed", allow_module_level=True)

SMALL = dict(vocab_size=600, n_embd=32, n_layer=1, n_head=2, seq_len=32, batch_size=8, steps=150)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_lm.train_tiny_lm(tmp_path_factory.mktemp("tiny-lm"), learning_rate=1e-2, **SMALL)


def test_the_held_out_documents_are_real_text_never_trained_on():
    docs = tiny_lm.corpus_documents()
    train, held = tiny_lm.held_out_split(docs)
    assert 250 < len(docs) <= 300 and len(set(docs)) == len(docs)  # the corpus repeats a few articles
    assert len(held) == len(docs) // 10 and len(train) == len(docs) - len(held)
    assert not set(train) & set(held)
    assert "bushfire" in docs[0]  # the corpus is gensim's Lee news articles, not text written for us


def test_training_learns_the_corpus_and_saves_a_small_hf_model(trained):
    assert trained.perplexity_after < trained.perplexity_before / 3  # learned, not just initialised
    assert trained.perplexity_after < trained.vocab_size / 3  # far better than uniform over the words
    size = sum(f.stat().st_size for f in trained.path.iterdir())
    assert size < 5e6  # a few MB at most
    model, tokenizer = tiny_lm.load_causal_lm(trained.path)
    assert len(tokenizer) == trained.vocab_size
    held = tiny_lm.held_out_split(tiny_lm.corpus_documents())[1]
    reloaded = tiny_lm.perplexity(model, tokenizer, held, seq_len=SMALL["seq_len"])
    assert reloaded == pytest.approx(trained.perplexity_after, rel=1e-6)


def test_clean_perplexity_below_private_on_held_out_text(trained):
    model, tokenizer = tiny_lm.load_causal_lm(trained.path)
    held = tiny_lm.held_out_split(tiny_lm.corpus_documents())[1]
    prompts = [torch.tensor([tokenizer(d)["input_ids"][:32]]) for d in held[:6]]
    probe = utility_report(model, prompts[:2], clip_norm=1e4, sigma=2.0)  # only its clean norms are read
    clip = probe.mean_hidden_norm
    sigma = sigma_for(epsilon=8.0, delta=1e-5, sensitivity=2 * clip)  # 8 per token, replace-one
    r = utility_report(model, prompts, clip_norm=clip, sigma=sigma, delta=1e-5, seed=3)
    assert math.isfinite(r.ppl_clean) and math.isfinite(r.ppl_private)
    assert r.ppl_clean < r.ppl_private
    assert r.ppl_clean < trained.perplexity_before / 3  # the clean figure is a trained model's


def test_inference_report_with_a_trained_model_and_a_prompts_file(trained, tmp_path):
    from typer.testing import CliRunner

    from gaussdp.cli import build_app

    # real text from an installed package: gensim's other Lee corpus, one prompt per line
    lee = tiny_lm.default_corpus_path().with_name("lee.cor")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lee.read_text(encoding="latin-1").splitlines()[:3]) + "\n", encoding="utf-8")
    png = tmp_path / "curve.png"
    result = CliRunner().invoke(
        build_app(),
        [
            "inference-report",
            "--model", str(trained.path),
            "--prompts", str(prompts),
            "--epsilons", "1,1000",
            "--clip-norms", "5",
            "--neighbouring", "add_remove",
            "--out", str(png),
        ],
        terminal_width=200,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 x <= 32 tokens of real text from " + str(prompts) in result.output.replace("\n", "")
    assert "UNTRAINED" not in result.output and "add_remove" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
