"""SNR figures (document 000's setting), output-effect measures, the report CLI and checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gaussdp.calibration import classical_sigma, epsilon_for  # noqa: E402
from gaussdp.errors import NotPrivateWarning  # noqa: E402
from gaussdp.inference import (  # noqa: E402
    HiddenStatePrivatizer,
    analytic_snr,
    measure_snr,
    output_effect,
    utility_report,
)
from gaussdp.inference.report import document_000  # noqa: E402

D, C = 1536, 1.0
SIGMA = classical_sigma(epsilon=1.0, delta=1e-5)  # document 000: 4.8448


def test_document_000_analytic_snr():
    f = analytic_snr(dim=D, clip_norm=C, sigma=SIGMA, unclipped_norm=177.5)
    assert SIGMA == pytest.approx(4.8448, abs=1e-4)
    # reference: the mean of sigma * chi(d) from scipy
    assert f.noise_norm_mean == pytest.approx(SIGMA * stats.chi(df=D).mean(), rel=1e-10)
    assert f.noise_norm_rms == pytest.approx(SIGMA * math.sqrt(D), rel=1e-12)
    # the document's own arithmetic: noise L2 = 4.84 * 39.2 = 189.7, SNR 1.0/189.7 = 0.005 ...
    assert f.noise_norm_rms == pytest.approx(189.7, abs=0.5)
    assert f.snr == pytest.approx(1.0 / 189.7, rel=0.01)
    # ... while it reports 177.5/189.7 = 0.94 for the clipped post-transformer state
    assert f.naive_snr == pytest.approx(0.94, abs=0.01)
    assert f.snr < f.naive_snr / 150


def test_document_000_measured_matches_analytic():
    with pytest.warns(NotPrivateWarning):
        doc = document_000(rows=400, seed=7)
    a, m = doc.analytic, doc.measured
    assert m.unclipped_norm == pytest.approx(177.5)
    assert m.signal_norm == pytest.approx(1.0, abs=1e-9)  # every row clipped to exactly C
    # sd of one chi-norm is about sigma/sqrt(2) = 3.43; of a mean over 400 rows 0.17;
    # a 6-sd band has a false-alarm rate below 1e-8
    sd = SIGMA * stats.chi(df=D).std() / math.sqrt(400)
    assert abs(m.noise_norm_mean - a.noise_norm_mean) < 6 * sd
    assert m.snr == pytest.approx(a.snr, rel=0.01)
    assert doc.epsilon_add_remove == pytest.approx(epsilon_for(sigma=SIGMA, delta=1e-5), rel=1e-12)
    assert doc.epsilon_replace == pytest.approx(
        epsilon_for(sigma=SIGMA, delta=1e-5, sensitivity=2.0), rel=1e-12
    )
    assert doc.epsilon_add_remove < 1.0 < doc.epsilon_replace


def test_privatizer_snr_matches_analytic_at_d_1536():
    lin = torch.nn.Identity()
    h = torch.randn(64, D, dtype=torch.float64)
    h = h / h.norm(dim=-1, keepdim=True) * 177.5
    with HiddenStatePrivatizer(None, lin, clip_norm=C, sigma=SIGMA) as priv:
        lin(h)
    s = priv.last_release
    a = analytic_snr(dim=D, clip_norm=C, sigma=SIGMA)
    assert s.fraction_clipped == 1.0
    assert s.mean_clipped_norm == pytest.approx(1.0, abs=1e-6)
    assert s.mean_noise_norm == pytest.approx(a.noise_norm_mean, rel=0.02)  # 64 rows: sd 0.2%
    assert s.snr == pytest.approx(a.snr, rel=0.02)


def test_measure_snr_small_case():
    with pytest.warns(NotPrivateWarning):
        f = measure_snr(np.array([[3.0, 4.0]] * 5000), clip_norm=1.0, sigma=0.5, seed=1)
    assert f.signal_norm == pytest.approx(1.0)
    assert f.noise_norm_mean == pytest.approx(0.5 * stats.chi(df=2).mean(), rel=0.03)


def test_output_effect_identity_and_change():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    same = output_effect(logits, logits, ids)
    assert same.agreement == 1.0 and same.kl == pytest.approx(0.0, abs=1e-12)
    assert same.ppl_clean == same.ppl_private
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert same.ppl_clean == pytest.approx(math.exp(nll.item()), rel=1e-6)
    other = output_effect(logits, -logits, ids)
    assert other.agreement == 0.0 and other.kl > 0.1


def test_utility_report_orders_noise_levels(tiny_gpt2):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    low = utility_report(tiny_gpt2, prompts, clip_norm=1.0, sigma=1e-3, delta=1e-5, seed=0)
    high = utility_report(tiny_gpt2, prompts, clip_norm=1.0, sigma=10.0, delta=1e-5, seed=0)
    assert low.agreement > 0.9
    assert low.kl < high.kl
    assert high.snr < low.snr
    assert low.dim == 64 and low.ppl_clean == pytest.approx(high.ppl_clean)
    assert high.epsilon_per_token == pytest.approx(epsilon_for(sigma=10.0, delta=1e-5, sensitivity=2.0))
    # the model is left as it was found
    assert all(len(m._forward_hooks) == 0 for m in tiny_gpt2.modules())


def test_local_checkpoint_from_pretrained(tiny_llama, tmp_path, prompt):
    tiny_llama.save_pretrained(tmp_path / "ckpt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    with HiddenStatePrivatizer(loaded, clip_norm=1.0, epsilon=4.0, delta=1e-5) as priv:
        assert priv.layer_path == "model.layers.1"
        with torch.no_grad():
            out = loaded(prompt).logits
    assert out.shape == (1, prompt.shape[1], 100)
    assert priv.spent() > 0


def test_inference_report_cli_writes_png(tmp_path):
    """Default prompts: held-out documents of gensim's Lee corpus (real text), untrained model, said so."""
    from typer.testing import CliRunner

    from gaussdp.cli import build_app

    png = tmp_path / "curve.png"
    result = CliRunner().invoke(
        build_app(),
        [
            "inference-report",
            "--epsilons", "1,100",
            "--clip-norms", "0.5",
            "--n-prompts", "2",
            "--prompt-len", "6",
            "--out", str(png),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "0.00527" in result.output  # document 000's true SNR
    assert "189.9" in result.output  # its noise norm
    assert "lee_background.cor" in result.output and "UNTRAINED" in result.output
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inference_report_refuses_a_checkpoint_without_tokenizer(tmp_path, tiny_gpt2):
    """Text prompts need the model's own tokenizer: a checkpoint without one is refused, not guessed."""
    from typer.testing import CliRunner

    from gaussdp.cli import build_app

    tiny_gpt2.save_pretrained(tmp_path / "gpt2")
    result = CliRunner().invoke(
        build_app(), ["inference-report", "--model", str(tmp_path / "gpt2"), "--out", str(tmp_path / "x.png")]
    )
    assert result.exit_code == 2
    words = " ".join(result.output.replace("│", " ").split())  # rich wraps the error in a box
    assert "holds no tokenizer" in words
    assert not (tmp_path / "x.png").exists()
