"""DP-LoRA on the architectures a user fine-tunes (issue 32): Qwen2, Llama, Mistral, Gemma and Phi,
each built from a tiny config (no download) with grouped-query attention, in bf16, with the default
LoRA targets. Their RMSNorm / LayerNorm, rotary embeddings and GQA are frozen; the per-record
gradient norms of the adapters that the DP hooks compute in bf16 must equal a float64 loop over the
records, one autograd call each. The same holds for an fp16 base."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from gaussdp.finetune import FinetuneConfig, default_target_modules  # noqa: E402
from gaussdp.finetune.train import per_record_loss, wrap_lora  # noqa: E402
from gaussdp.torch import PerSampleClipper  # noqa: E402

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
)  # fmt: skip
ARCHS = {
    "qwen2": {},
    "llama": {},
    "mistral": {"sliding_window": None},
    "gemma": {"head_dim": 8},
    "phi": {"partial_rotary_factor": 0.5},
}


def _model(model_type: str):  # type: ignore[no-untyped-def]
    cfg = transformers.AutoConfig.for_model(model_type, **TINY, **ARCHS[model_type])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double()
    peft_model, targets = wrap_lora(
        model, FinetuneConfig(noise_multiplier=1.0, delta=1e-5, lora_rank=4, max_seq_len=16)
    )
    with torch.no_grad():  # B starts at zero in LoRA: give it values, so that A's gradient is not zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return peft_model, targets


def _batch(n: int = 6, width: int = 12):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (n, width), generator=g)
    lengths = [width, 5, 9, width, 3, 7][:n]  # right-padded records of different lengths
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, k in enumerate(lengths):
        mask[i, :k] = 1
    return ids, mask, lengths


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_dp_lora_per_record_norms_in_16_bits_match_a_float64_loop(model_type, dtype):  # type: ignore[no-untyped-def]
    model64, targets = _model(model_type)
    assert targets == default_target_modules(model_type)
    ids, mask, lengths = _batch()
    params64 = [p for p in model64.parameters() if p.requires_grad]
    assert params64 and all(p.dtype == torch.float64 for p in params64)
    ref = []
    for i, k in enumerate(lengths):  # one record at a time, unpadded, float64
        loss = per_record_loss(model64, ids[i : i + 1, :k], mask[i : i + 1, :k]).sum()
        grads = torch.autograd.grad(loss, params64)
        ref.append(torch.sqrt(sum((g**2).sum() for g in grads)))
    ref_norms = torch.stack(ref)
    assert bool((ref_norms > 0).all())

    model = copy.deepcopy(model64).to(getattr(torch, dtype))  # the whole model in 16 bits, as loaded
    clipper = PerSampleClipper(model, max_grad_norm=1e6, loss_reduction="sum")
    try:
        per_record_loss(model, ids, mask).sum().backward()
        norms = clipper.last_norms
    finally:
        clipper.remove()
    assert norms.dtype == torch.float32  # accumulated in float32 from 16-bit parts
    torch.testing.assert_close(norms.double(), ref_norms, rtol=0.02, atol=0.0)  # bf16: measured <= 0.8 %
