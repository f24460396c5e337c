"""Whole-text perturbation: tokenisation rule, unknown-word policies, input limits, statistics, CLI."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.text import (
    GaussianWordMechanism,
    TruncatedExponentialWordMechanism,
    Vocabulary,
    decode_text,
    perturb_text,
    plausible_deniability,
    read_text,
    words,
)
from gaussdp.text.corpus import DEMO_PARAGRAPH, shipped_vocabulary


@pytest.fixture(scope="module")
def vocab():
    return shipped_vocabulary()


def test_text_tokenisation_rule():
    assert words("Harry couldn't believe it, \u201cHarry\u2019s\u201d friend!") == [
        "harry",
        "couldn't",
        "believe",
        "it",
        "harry's",
        "friend",
    ]
    assert words("snake_case x2 ..., -- 'quoted'") == ["snake", "case", "x2", "quoted"]
    assert words("Ünïcödé wörds") == ["ünïcödé", "wörds"]


def test_text_input_limits(tmp_path):
    with pytest.raises(UnsafeInput, match="UTF-8"):
        decode_text(b"caf\xe9")
    with pytest.raises(UnsafeInput, match="over the limit"):
        decode_text(b"a" * 101, max_bytes=100)
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(20_000_001)  # sparse: one byte over 20 MB without writing it
    with pytest.raises(UnsafeInput, match="20 MB"):
        read_text(big)
    ok = tmp_path / "ok.txt"
    ok.write_bytes("\ufeffhello w\u00f6rld".encode())
    assert read_text(ok) == "hello w\u00f6rld"


def test_text_unknown_words_are_never_passed_through(vocab):
    text = "the dog Zorblatt slept, Qwxyz!"
    mech = GaussianWordMechanism(vocab, sigma=0.05)
    out = perturb_text(text, mech)
    assert out.n_unknown == 2 and out.n_words == 5
    assert all(w in vocab for w in out.text.split())
    assert "zorblatt" not in out.text and "qwxyz" not in out.text
    assert len(perturb_text(text, mech, unknown="drop").text.split()) == 3
    sampled = perturb_text(text, mech, unknown="sample").text.split()
    assert len(sampled) == 5 and all(w in vocab for w in sampled)
    with pytest.raises(UnsafeInput, match="not in the vocabulary"):
        perturb_text(text, mech, unknown="error")
    with pytest.raises(InvalidParameter):
        perturb_text(text, mech, unknown="keep")


def test_text_perturb_keeps_lines_and_reports_guarantees(vocab):
    mech = GaussianWordMechanism(vocab, sigma=0.4, delta=1e-6)
    out = perturb_text(DEMO_PARAGRAPH, mech, batch_size=7)
    assert out.text.count("\n") == DEMO_PARAGRAPH.count("\n")
    assert [len(line.split()) for line in out.text.splitlines()] == [
        len(words(line)) for line in DEMO_PARAGRAPH.splitlines()
    ]
    n = out.n_words
    d_max = vocab.diameter_bound
    assert out.guarantee_worst.words == n
    assert out.guarantee_worst.rho == pytest.approx(n * d_max**2 / (2 * 0.16))
    assert out.guarantee_neighbour.epsilon < out.guarantee_worst.epsilon
    assert 0.0 < out.fraction_changed < 1.0 and -1.0 <= out.mean_cosine <= 1.0
    summary = json.loads(json.dumps(out.summary()))
    assert summary["per_word"]["worst_case"]["distance"] == pytest.approx(d_max)


def test_text_plausible_deniability_moves_with_noise(vocab):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        low = GaussianWordMechanism(vocab, sigma=0.01, seed=1)
        high = GaussianWordMechanism(vocab, sigma=2.0, seed=2)
        tem = TruncatedExponentialWordMechanism(vocab, epsilon=5.0, seed=3)
    pd_low = plausible_deniability(low, ["dog", "rain"], samples=200)
    pd_high = plausible_deniability(high, ["dog", "rain"], samples=200)
    assert pd_low["dog"]["N_w"] == 1.0 and pd_low["dog"]["S_w"] == 1.0
    assert pd_low["dog"]["cosine"] == pytest.approx(1.0)
    assert pd_high["dog"]["N_w"] < 0.2 and pd_high["dog"]["S_w"] > 50
    assert plausible_deniability(tem, ["dog"], samples=200)["dog"]["S_w"] > 1


def test_text_cli_perturb_train_stats(tmp_path):
    from typer.testing import CliRunner

    from gaussdp.cli import build_app
    from gaussdp.text.corpus import demo_corpus

    app = build_app()
    runner = CliRunner()
    src = tmp_path / "in.txt"
    src.write_text(DEMO_PARAGRAPH, encoding="utf-8")
    dst = tmp_path / "out.txt"
    rep = tmp_path / "report.json"
    res = runner.invoke(app, ["perturb-text", str(src), str(dst), "--sigma", "0.3", "--report", str(rep)])
    assert res.exit_code == 0, res.output
    assert len(dst.read_text().split()) == len(words(DEMO_PARAGRAPH))
    assert json.loads(rep.read_text())["params"]["sigma"] == 0.3

    # every epsilon in the report and on the screen says what it is about (one word or the whole text)
    def epsilons(d, where=""):  # type: ignore[no-untyped-def]
        if isinstance(d, dict):
            if "epsilon" in d:
                yield where, d
            for k, v in d.items():
                yield from epsilons(v, f"{where}.{k}")

    found = list(epsilons(json.loads(rep.read_text())))
    assert len(found) == 4 and all("what" in g for _, g in found), found
    assert sum("whole text" in g["what"] for _, g in found) == 2
    assert "one word vs its typical nearest neighbour" in res.output and "whole text" in res.output
    res = runner.invoke(app, ["perturb-text", str(src), str(dst), "--mechanism", "tem", "--epsilon", "10"])
    assert res.exit_code == 0, res.output
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    res = runner.invoke(app, ["perturb-text", str(bad), str(dst), "--sigma", "0.3"])
    assert res.exit_code == 2 and "UTF-8" in res.output

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(s) for s in demo_corpus(2000, seed=5)), encoding="utf-8")
    out_vocab = tmp_path / "v.npz"
    res = runner.invoke(app, ["vocab", "train", str(corpus), str(out_vocab), "--epochs", "1"])
    assert res.exit_code == 0, res.output
    assert len(Vocabulary.load(out_vocab)) > 100
    res = runner.invoke(app, ["vocab", "stats", str(out_vocab), "--sigma", "0.1"])
    assert res.exit_code == 0 and "nearest-neighbour" in res.output


def test_text_demo_section_runs(tmp_path):
    from rich.console import Console

    from gaussdp.cli.text import demo

    console = Console(record=True, width=120)
    demo(console, tmp_path)
    text = console.export_text()
    assert "often-claimed epsilon ~96.9" in text and "plausible deniability" in text
    assert (tmp_path / "text_perturbed.txt").exists()
    assert np.isfinite(len(text))


def test_unknown_words_get_subword_vectors_and_do_not_collapse():
    """At low noise, distinct unknown words of a real paragraph (gensim's Lee corpus) release many
    different words (with the zero vector they all released the same one)."""
    import os
    import warnings

    gensim = pytest.importorskip("gensim")
    from gaussdp.errors import NotPrivateWarning
    from gaussdp.text import GaussianWordMechanism, perturb_text
    from gaussdp.text.corpus import shipped_vocabulary
    from gaussdp.text.tokenize import words

    path = os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", "lee_background.cor")
    with open(path, encoding="utf-8") as fh:
        paragraph = fh.readline()
    vocab = shipped_vocabulary()
    assert vocab.subwords is not None
    oov = sorted({w for w in words(paragraph) if w not in vocab})
    assert len(oov) > 50
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        mech = GaussianWordMechanism(vocab, sigma=0.01, seed=3)
    vecs, known = vocab.vectors_for(oov)
    assert not known.any()
    released = vocab.lookup(mech.perturb_vectors(vecs))
    assert len(set(released)) >= 20, len(set(released))
    # Every unknown vector stays inside the box and the ball the worst-case bound assumes.
    assert np.abs(vecs).max() <= vocab.clip
    assert np.linalg.norm(vecs.astype(np.float64), axis=1).max() <= vocab.max_norm * (1 + 1e-6)
    # The zero-vector policy (no table) collapses them: the old behaviour, for contrast.
    zero = vocab.lookup(mech.perturb_vectors(np.zeros_like(vecs)))
    assert len(set(zero)) <= 3
    result = perturb_text(paragraph, mech)
    assert result.summary()["unknown_word_vectors"] == "subwords"


def test_subword_vectors_match_gensim_hashes_and_survive_save_load(tmp_path):
    pytest.importorskip("gensim")
    from gensim.models.fasttext import ft_ngram_hashes

    from gaussdp.text import Vocabulary
    from gaussdp.text.corpus import shipped_vocabulary
    from gaussdp.text.subwords import ngram_hashes

    for w in ["zorblatt", "café", "naïve", "日本語", "a", "don't", "€uro"]:
        assert ngram_hashes(w, 3, 6, 4096) == list(ft_ngram_hashes(w, 3, 6, 4096)), w
    vocab = shipped_vocabulary()
    again = Vocabulary.load(vocab.save(tmp_path / "v.npz"))
    assert again.subwords is not None
    np.testing.assert_array_equal(again.subwords.vectors(["zorblatt"]), vocab.subwords.vectors(["zorblatt"]))
