"""A tiny causal LM and a LoRA adapter on disk, as ``gaussdp serve --model/--adapter`` take them
(a plain module: the shared ``served_lm`` fixture and the service's abuse tests both use it)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_lm(root: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 (random weights) with a word-level tokenizer of gensim's Lee corpus, and a peft
    LoRA adapter on its last block's attention projection, saved to ``root/model`` and ``root/adapter``."""
    import peft
    import torch
    import transformers

    from gaussdp.inference.tiny_lm import build_tokenizer, corpus_documents

    torch.manual_seed(0)
    tokenizer = build_tokenizer(corpus_documents()[:40], 200)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=300,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["attn.c_proj"], layers_to_transform=[1],
        init_lora_weights=False, fan_in_fan_out=True,
    )  # fmt: skip
    peft.get_peft_model(model, lora).save_pretrained(root / "adapter")
    return root / "model", root / "adapter"
