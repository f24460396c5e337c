"""Inference in any dtype (issue 28): bfloat16/float16 hidden states are clipped and noised in float32
and cast back; a failing forward pass is never retried as another code path (it was charged twice)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scipy import stats  # noqa: E402

import gaussdp.noise  # noqa: E402
from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.clipping import clip_rows  # noqa: E402
from gaussdp.errors import InvalidParameter, NotPrivateWarning  # noqa: E402
from gaussdp.inference import (  # noqa: E402
    HiddenStatePrivatizer,
    client_finish,
    client_forward,
    stream_generate,
    utility_report,
)
from gaussdp.inference.generation import takes_cache  # noqa: E402
from gaussdp.inference.privatizer import working_dtype  # noqa: E402
from gaussdp.noise import add_gaussian_rows, noise_source  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
HALF = [torch.bfloat16, torch.float16]


def qwen2(dtype: torch.dtype) -> torch.nn.Module:
    """A Qwen2-shaped causal LM (random weights) in ``dtype``, as Qwen2 checkpoints ship in bfloat16."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).to(dtype).eval()


def session(ledger: Ledger, name: str = "s") -> str:
    ledger.open(name, Budget(1e6, 1e-5))
    return name


@pytest.fixture
def noised(monkeypatch):  # type: ignore[no-untyped-def]
    """Each call of the core's row noise by the privatizer: (what was noised, what came back)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    core = gaussdp.noise.add_gaussian_rows

    def spy(X, sigma, **kwargs):  # type: ignore[no-untyped-def]
        out = core(X, sigma, **kwargs)
        if isinstance(X, torch.Tensor):  # not the core's own call on the numpy copy
            seen.append((X.clone(), out.clone()))
        return out

    monkeypatch.setattr(gaussdp.noise, "add_gaussian_rows", spy)
    return seen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_privatize_clips_and_noises_in_float32_and_casts_back(dtype, noised):
    rows, dim, clip, sigma = 200, 64, 1.0, 0.3
    g = torch.Generator().manual_seed(1)
    # row norms from 0.01 to 1000: most rows clipped, some not
    scale = torch.logspace(-2, 3, rows, dtype=torch.float64)[:, None]
    hidden = (torch.randn(rows, dim, generator=g, dtype=torch.float64) / math.sqrt(dim) * scale).to(dtype)
    with pytest.warns(NotPrivateWarning):
        priv = HiddenStatePrivatizer(None, clip_norm=clip, sigma=sigma, seed=7)
    out = priv.privatize(hidden)
    assert out.dtype == dtype and out.shape == hidden.shape
    (x, released), = noised  # fmt: skip
    # what is noised: the exact widening of the state, clipped in the working precision
    assert x.dtype == released.dtype == working_dtype(dtype)
    assert working_dtype(dtype) == (torch.float64 if dtype == torch.float64 else torch.float32)
    norms = torch.linalg.vector_norm(x, dim=1, dtype=torch.float64)
    assert float(norms.max()) <= clip
    expected, _ = clip_rows(hidden.to(working_dtype(dtype)), clip)
    assert torch.equal(x, expected)
    assert priv.last_release is not None and 0.5 < priv.last_release.fraction_clipped < 0.9
    # the model gets the float32 release rounded to its dtype (post-processing), nothing else
    assert torch.equal(out, released.to(dtype))
    # the noise added is N(0, sigma^2) per value: chi-square and z bounds at error rate 1e-6 each
    z = (released - x).double().numpy().ravel()
    n = z.size
    var_lo, var_hi = stats.chi2.ppf([5e-7, 1 - 5e-7], n) / n
    assert var_lo < float(np.mean(z**2)) / sigma**2 < var_hi
    assert abs(float(z.mean())) < 5.0 * sigma / math.sqrt(n)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_core_row_noise_takes_half_precision_tensors(dtype):
    x, _ = clip_rows(torch.randn(8, 32).to(dtype), 1.0)
    with pytest.warns(NotPrivateWarning):
        source = noise_source(seed=3)
    out = add_gaussian_rows(x, 0.5, sensitivity=1.0, source=source)
    assert out.dtype == dtype and out.shape == x.shape and bool(torch.isfinite(out).all())
    assert float((out.float() - x.float()).std()) == pytest.approx(0.5, rel=0.2)


def test_the_core_row_noise_fails_closed_when_float16_overflows():
    with pytest.warns(NotPrivateWarning):
        source = noise_source(seed=3)
    # sigma 1e5: nearly every value lands past float16's largest, 65504
    with pytest.raises(FloatingPointError, match="overflow float16"):
        add_gaussian_rows(np.zeros((4, 64), np.float16), 1e5, sensitivity=1.0, source=source)
    with pytest.raises(FloatingPointError, match=r"overflow torch\.float16"):
        add_gaussian_rows(torch.zeros(4, 64, dtype=torch.float16), 1e5, sensitivity=1.0, source=source)
    with pytest.raises(FloatingPointError, match="overflow float16"):
        add_gaussian_rows(np.zeros((4, 64), np.float16), 1e5, sensitivity=1.0, source=noise_source("fast"))


def test_a_float16_state_whose_noise_could_overflow_is_refused_before_any_charge():
    ledger = Ledger("memory://")
    sid = session(ledger)
    # |noise| < 10 sigma on the float-safe grid: 1 + 10 * 7000 > 65504 could overflow float16
    priv = HiddenStatePrivatizer(None, clip_norm=1.0, sigma=7000.0, ledger=ledger, session_id=sid)
    with pytest.raises(InvalidParameter, match=r"sigma=7000 .* past the largest torch.float16"):
        priv.privatize(torch.ones(3, 16, dtype=torch.float16))
    assert ledger.history(sid) == []
    for dtype in (torch.bfloat16, torch.float32):  # their range holds it
        assert priv.privatize(torch.ones(3, 16, dtype=dtype)).dtype == dtype
    assert [h.event["count"] for h in ledger.history(sid)] == [3, 3]
    ok = HiddenStatePrivatizer(None, clip_norm=1.0, sigma=6000.0, ledger=ledger, session_id=sid)
    assert ok.privatize(torch.ones(3, 16, dtype=torch.float16)).dtype == torch.float16


def test_an_overflow_after_the_charge_fails_closed_and_says_it_was_charged(monkeypatch):
    ledger = Ledger("memory://")
    sid = session(ledger)
    priv = HiddenStatePrivatizer(None, clip_norm=1.0, sigma=1.0, ledger=ledger, session_id=sid, noise="fast")
    # "fast" noise has no hard tail bound: stand in for a draw far out in it
    monkeypatch.setattr(gaussdp.noise, "add_gaussian_rows", lambda X, sigma, **kw: X + 1e6)
    with pytest.raises(FloatingPointError, match="its 3 rows were charged"):
        priv.privatize(torch.ones(3, 16, dtype=torch.float16))
    assert [h.event["count"] for h in ledger.history(sid)] == [3]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_precision_qwen2_streams_with_its_cache_and_no_deprecation_warning(dtype):
    model = qwen2(dtype)
    ledger = Ledger("memory://")
    sid = session(ledger)
    priv = HiddenStatePrivatizer(model, clip_norm=1.0, sigma=2.0, ledger=ledger, session_id=sid)
    prompt = torch.tensor([[5, 17, 42, 8, 99]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = list(stream_generate(model, prompt, privatizer=priv, max_new_tokens=6))
    assert len(tokens) == 6 and all(t.shape == (1,) for t in tokens)
    # one charge per forward pass: the prompt's 5 rows, then one row per token (the cache is used)
    counts = [h.event.get("count", 1) for h in ledger.history(sid)]
    assert counts == [5, 1, 1, 1, 1, 1]
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    # the hook itself, in the model's dtype: finite logits, one charge for the 5 rows
    with priv, torch.no_grad():
        logits = model(prompt).logits
    assert logits.dtype == dtype and bool(torch.isfinite(logits).all())
    assert ledger.history(sid)[-1].event["count"] == 5


def test_a_failing_privatizer_is_not_retried_and_charges_once_per_pass(monkeypatch):
    model = qwen2(torch.bfloat16)
    ledger = Ledger("memory://")
    sid = session(ledger)
    priv = HiddenStatePrivatizer(model, clip_norm=1.0, sigma=2.0, ledger=ledger, session_id=sid)
    passes = []
    model.register_forward_pre_hook(lambda m, args: passes.append(1))
    release = HiddenStatePrivatizer._release
    calls = []

    def failing(self, clipped):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:  # the error the bfloat16 bug raised, after the second pass's charge
            raise TypeError("Got unsupported ScalarType BFloat16")
        return release(self, clipped)

    monkeypatch.setattr(HiddenStatePrivatizer, "_release", failing)
    stream = stream_generate(model, torch.tensor([[5, 17, 42]]), privatizer=priv, max_new_tokens=5)
    assert next(stream).shape == (1,)
    with pytest.raises(TypeError, match="BFloat16"):
        next(stream)
    # two forward passes, two charges (the prompt's, then the failed token's): no retry without
    # the cache (which charged the whole sequence again and failed the same way)
    assert len(passes) == 2
    assert [h.event.get("count", 1) for h in ledger.history(sid)] == [3, 1]
    with pytest.raises(StopIteration):
        next(stream)


class _NoCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Embedding(16, 8)])
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids):  # type: ignore[no-untyped-def]
        return self.head(self.layers[0](ids))


class _OldCacheName(_NoCache):
    def forward(self, ids, past_key_values=None, use_cache=False):  # type: ignore[no-untyped-def]
        return self.head(self.layers[0](ids))


def test_takes_cache_reads_the_forward_signature():
    peft = pytest.importorskip("peft")
    model = qwen2(torch.float32)
    assert takes_cache(model) == "cache"
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"])
    assert takes_cache(peft.get_peft_model(model, lora)) == "cache"  # passed through by PEFT
    assert takes_cache(_NoCache()) is None
    assert takes_cache(_OldCacheName()) == "past_key_values"


def test_a_model_without_a_cache_re_releases_the_whole_sequence_each_pass():
    model = _NoCache().to(torch.bfloat16)
    ledger = Ledger("memory://")
    sid = session(ledger)
    priv = HiddenStatePrivatizer(model, "layers.0", clip_norm=1.0, sigma=2.0, ledger=ledger, session_id=sid)
    tokens = list(stream_generate(model, torch.tensor([[1, 2, 3]]), privatizer=priv, max_new_tokens=3))
    assert len(tokens) == 3
    assert [h.event["count"] for h in ledger.history(sid)] == [3, 4, 5]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_split_mode_sends_the_float32_release_of_a_half_precision_model(dtype):
    model = qwen2(dtype)
    ledger = Ledger("memory://")
    sid = session(ledger)
    priv = HiddenStatePrivatizer(model, clip_norm=1.0, sigma=0.5, ledger=ledger, session_id=sid)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    sent = client_forward(model, ids, None, priv)
    assert sent.dtype == torch.float32 and sent.shape == (1, 64)  # not rounded to the model's dtype
    assert [h.event for h in ledger.history(sid)] == [{"type": "gaussian", "noise_multiplier": 0.25}]
    logits = client_finish(model, ids, None, torch.zeros(1, 64), clip_norm=1.0).logits
    assert logits.dtype == dtype and bool(torch.isfinite(logits).all())


def test_utility_report_on_a_bfloat16_model():
    report = utility_report(
        qwen2(torch.bfloat16), [[1, 2, 3, 4], [5, 6, 7]], clip_norm=1.0, sigma=0.1, seed=0
    )
    assert report.dim == 64 and math.isfinite(report.kl) and 0.0 <= report.agreement <= 1.0
