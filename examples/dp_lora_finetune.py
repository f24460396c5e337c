"""The fine-tuning service's central DP: fine-tune only the LoRA adapters of a small causal LM with DP-SGD.

A GPT-2-shaped model is built from a config (2 layers, width 64: no download), wrapped with peft
LoRA adapters (r=8) on its attention projections; the base model stays frozen, so only the adapters
are clipped per sample, noised and trained. Each training record is one line of text; the privacy
unit is that line (add/remove one record). The script prints epsilon after training, and the model
keeps working as a Hugging Face model (``generate()``, ``state_dict`` keys) because gaussdp does not
wrap it.

The loss is computed per record (mean over its own tokens) and then averaged over the batch: the
built-in Hugging Face loss averages over all tokens of the batch, which makes each record's gradient
depend on the other records' lengths.

Run: ``.venv/bin/python examples/dp_lora_finetune.py --steps 30``
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gaussdp.torch import PrivacyEngine

TEXT = """the quick brown fox jumps over the lazy dog
privacy is a budget that every release spends
noise calibrated to the sensitivity protects each record
a clipped gradient cannot say too much about one person
the accountant adds up what every step has cost
small adapters learn while the base model stays frozen
differential privacy bounds what anyone can learn about one line
gaussian noise hides the contribution of every example"""


def build_data(seq_len: int = 32, copies: int = 32) -> tuple[TensorDataset, dict[str, int]]:
    """Character-level records (one line each, padded with a pad token) and the vocabulary."""
    lines = TEXT.splitlines()
    vocab = {c: i + 1 for i, c in enumerate(sorted(set(TEXT) - {"\n"}))}  # 0 = pad
    rows = []
    for k in range(copies):
        line = lines[k % len(lines)]
        ids = [vocab[c] for c in line][:seq_len]
        rows.append(ids + [0] * (seq_len - len(ids)))
    ids = torch.tensor(rows)
    return TensorDataset(ids), vocab


def build_model(vocab_size: int, seq_len: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=64,
        n_layer=2,
        n_head=2,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    base = GPT2LMHeadModel(config)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    return get_peft_model(base, lora)


def per_record_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each record over its own non-pad tokens, averaged over the batch."""
    logits = model(input_ids=ids).logits[:, :-1]
    target = ids[:, 1:]
    tok = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    mask = (target != 0).to(tok.dtype)
    per_record = (tok * mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_record.mean() if len(ids) else per_record.sum()


def main(
    steps: int = 30,
    target_epsilon: float = 8.0,
    delta: float = 1e-5,
    lr: float = 2e-2,
    verbose: bool = True,
) -> dict[str, float]:
    """Train the adapters for ``steps`` private steps; return epsilon and what changed."""
    warnings.filterwarnings("ignore", module="peft")
    seq_len = 32
    data, vocab = build_data(seq_len)
    model = build_model(len(vocab) + 1, seq_len)
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen_name, frozen = next(
        (n, p.detach().clone()) for n, p in model.named_parameters() if not p.requires_grad
    )
    keys = list(model.state_dict())
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    loader = DataLoader(data, batch_size=8)
    engine = PrivacyEngine()
    epochs = max(1, -(-steps // len(loader)))
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=target_epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=1.0,
    )
    model.train()
    done, first_loss, last_loss = 0, float("nan"), float("nan")
    while done < steps:
        for (ids,) in loader:
            loss = per_record_loss(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if len(ids):
                first_loss = float(loss.detach()) if done == 0 else first_loss
                last_loss = float(loss.detach())
            done += 1
            if done >= steps:
                break
    eps = engine.get_epsilon(delta)
    moved = sum(
        float((p.detach() - trainable[n]).norm()) for n, p in model.named_parameters() if n in trainable
    )
    base_same = torch.equal(dict(model.named_parameters())[frozen_name].detach(), frozen)
    model.eval()
    inv = {i: c for c, i in vocab.items()}
    prompt = torch.tensor([[vocab[c] for c in "the "]])
    with torch.no_grad():
        out = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    sample = "".join(inv.get(int(i), "?") for i in out[0])
    result = {
        "epsilon": eps,
        "delta": delta,
        "noise_multiplier": float(optimizer.noise_multiplier),
        "steps": float(done),
        "adapter_change": moved,
        "base_unchanged": float(base_same),
        "state_dict_keys_unchanged": float(list(model.state_dict()) == keys),
        "first_loss": first_loss,
        "last_loss": last_loss,
    }
    if verbose:
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_all = sum(p.numel() for p in model.parameters())
        print(f"trainable parameters: {n_train} of {n_all} (LoRA adapters only)")
        print(f"noise multiplier {result['noise_multiplier']:.3f} for target epsilon {target_epsilon}")
        print(f"steps {done}: loss {first_loss:.3f} -> {last_loss:.3f}")
        print(f"epsilon spent: {eps:.3f} at delta={delta:g} (PLD accountant, add/remove one line)")
        print(f"adapters moved by {moved:.4f}; base weights unchanged: {base_same}")
        print(f"generate() after training: {sample!r}")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--epsilon", type=float, default=8.0)
    args = ap.parse_args()
    main(steps=args.steps, target_epsilon=args.epsilon)
