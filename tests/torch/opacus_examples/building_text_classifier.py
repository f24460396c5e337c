# The code cells of Opacus's tutorial tutorials/building_text_classifier.ipynb
# (https://github.com/meta-pytorch/opacus, commit 88919b66, Apache License 2.0), in order, for
# gaussdp's drop-in tests (tests/torch/test_torch_opacus_examples.py). Running this file runs the
# tutorial. What changed, cell by cell (every other line is the tutorial's own):
#   - cell 31: `from opacus import PrivacyEngine` imports gaussdp's instead (cell 33 keeps Opacus's
#     own BatchMemoryManager, which works with gaussdp's engine);
#   - data loading (no download; no pandas, and transformers 5 has no glue processors): cells 4-9
#     build a small synthetic SNLI-like table instead of downloading SNLI, and cell 20's
#     `_df_to_features` tokenises it with the tokenizer's own call (the same four tensors);
#     `MAX_SEQ_LENGHT` is 32 instead of 128;
#   - cell 12: BERT is built from a small BertConfig (2 layers, width 32) with a local vocabulary,
#     not downloaded (`from_pretrained`); cells 37 and 41 likewise rebuild it from that config;
#   - cell 14 (an image) is left out; cell 29 uses `tqdm` instead of `tqdm.notebook` (no widgets);
#   - cells 38 and 50: `device` is the CPU instead of "cuda:0";
#   - cells 27 and 49: EPOCHS = 2 and LOGGING_INTERVAL = 4 instead of 3 and 5000 (a few steps);
#   - three added lines marked "(for the test)" keep each part's engine for the test to check.
# ruff: noqa

# %% cells 4-9 (changed: synthetic data instead of downloading SNLI)
import os
import random
import tempfile

LABEL_WORDS = {"entailment": "indeed", "contradiction": "never", "neutral": "perhaps"}
FILLER = "a man woman dog plays runs in the park street with ball red blue sits".split()


def _synthetic_snli(n, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = rng.choice(sorted(LABEL_WORDS))
        s1 = " ".join(rng.choice(FILLER) for _ in range(6))
        s2 = " ".join([LABEL_WORDS[label]] + [rng.choice(FILLER) for _ in range(4)])
        rows.append({"sentence1": s1, "sentence2": s2, "gold_label": label})
    return rows


class _Rows(list):  # what the tutorial uses of a pandas DataFrame
    def iterrows(self):
        return enumerate(self)


df_train = _Rows(_synthetic_snli(256, 1))
df_test = _Rows(_synthetic_snli(64, 2))

# %% cell 12 (changed: a small config and a local vocabulary instead of from_pretrained)
from transformers import BertConfig, BertTokenizer, BertForSequenceClassification

_vocab = os.path.join(tempfile.mkdtemp(), "vocab.txt")
with open(_vocab, "w") as f:
    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *LABEL_WORDS.values(), *FILLER]))
config = BertConfig(
    vocab_size=5 + len(LABEL_WORDS) + len(FILLER),
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    num_labels=3,
)
tokenizer = BertTokenizer(_vocab, do_lower_case=False)
model = BertForSequenceClassification(config)

# %% cell 15
trainable_layers = [model.bert.encoder.layer[-1], model.bert.pooler, model.classifier]
total_params = 0
trainable_params = 0

for p in model.parameters():
        p.requires_grad = False
        total_params += p.numel()

for layer in trainable_layers:
    for p in layer.parameters():
        p.requires_grad = True
        trainable_params += p.numel()

print(f"Total parameters count: {total_params:,}") # ~108M
print(f"Trainable parameters count: {trainable_params:,}") # ~7M

# %% cell 19
import torch
import torch.nn as nn
import transformers
from torch.utils.data import TensorDataset

# %% cell 20 (changed: features from the tokenizer's own call; no glue processors in transformers 5)
LABEL_LIST = ['contradiction', 'entailment', 'neutral']
MAX_SEQ_LENGHT = 32


def _df_to_features(df, set_type):
    rows = [r for _, r in df.iterrows() if r["gold_label"] in LABEL_LIST]
    enc = tokenizer(
        [r["sentence1"] for r in rows],
        [r["sentence2"] for r in rows],
        max_length=MAX_SEQ_LENGHT,
        padding="max_length",
        truncation=True,
    )
    return [
        {"input_ids": i, "attention_mask": a, "token_type_ids": t, "label": LABEL_LIST.index(r["gold_label"])}
        for i, a, t, r in zip(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], rows)
    ]


def _features_to_dataset(features):
    """ Convert features from `_df_to_features` into a single dataset
    """
    all_input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
    all_attention_mask = torch.tensor(
        [f["attention_mask"] for f in features], dtype=torch.long
    )
    all_token_type_ids = torch.tensor(
        [f["token_type_ids"] for f in features], dtype=torch.long
    )
    all_labels = torch.tensor([f["label"] for f in features], dtype=torch.long)
    dataset = TensorDataset(
        all_input_ids, all_attention_mask, all_token_type_ids, all_labels
    )

    return dataset

train_features = _df_to_features(df_train, "train")
test_features = _df_to_features(df_test, "test")

train_dataset = _features_to_dataset(train_features)
test_dataset = _features_to_dataset(test_features)

# %% cell 22
BATCH_SIZE = 32
MAX_PHYSICAL_BATCH_SIZE = 8

# %% cell 23
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

train_dataloader = DataLoader(train_dataset, batch_size=BATCH_SIZE)
test_dataloader = DataLoader(test_dataset, sampler=SequentialSampler(test_dataset), batch_size=BATCH_SIZE)

# %% cell 25
# Move the model to appropriate device
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = model.to(device)

# Set the model to train mode (HuggingFace models load in eval mode)
model = model.train()
# Define optimizer
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, eps=1e-8)

# %% cell 27 (changed: EPOCHS and LOGGING_INTERVAL)
EPOCHS = 2
LOGGING_INTERVAL = 4 # once every how many steps we run evaluation cycle and report metrics
EPSILON = 7.5
DELTA = 1 / len(train_dataloader) # Parameter for privacy accounting. Probability of not achieving privacy guarantees

# %% cell 29 (changed: tqdm instead of tqdm.notebook)
import numpy as np
from tqdm import tqdm

def accuracy(preds, labels):
    return (preds == labels).mean()

# define evaluation cycle
def evaluate(model):
    model.eval()

    loss_arr = []
    accuracy_arr = []

    for batch in test_dataloader:
        batch = tuple(t.to(device) for t in batch)

        with torch.no_grad():
            inputs = {'input_ids':      batch[0],
                      'attention_mask': batch[1],
                      'token_type_ids': batch[2],
                      'labels':         batch[3]}

            outputs = model(**inputs)
            loss, logits = outputs[:2]

            preds = np.argmax(logits.detach().cpu().numpy(), axis=1)
            labels = inputs['labels'].detach().cpu().numpy()

            loss_arr.append(loss.item())
            accuracy_arr.append(accuracy(preds, labels))

    model.train()
    return np.mean(loss_arr), np.mean(accuracy_arr)

# %% cell 31 (changed: the import)
from gaussdp.torch import PrivacyEngine

MAX_GRAD_NORM = 0.1

privacy_engine = PrivacyEngine()

model, optimizer, train_dataloader = privacy_engine.make_private_with_epsilon(
    module=model,
    optimizer=optimizer,
    data_loader=train_dataloader,
    target_delta=DELTA,
    target_epsilon=EPSILON,
    epochs=EPOCHS,
    max_grad_norm=MAX_GRAD_NORM,
)

# %% cell 33
from opacus.utils.batch_memory_manager import BatchMemoryManager

for epoch in range(1, EPOCHS+1):
    losses = []

    with BatchMemoryManager(
        data_loader=train_dataloader,
        max_physical_batch_size=MAX_PHYSICAL_BATCH_SIZE,
        optimizer=optimizer
    ) as memory_safe_data_loader:
        for step, batch in enumerate(tqdm(memory_safe_data_loader)):
            optimizer.zero_grad()

            batch = tuple(t.to(device) for t in batch)
            inputs = {'input_ids':      batch[0],
                    'attention_mask': batch[1],
                    'token_type_ids': batch[2],
                    'labels':         batch[3]}

            outputs = model(**inputs) # output = loss, logits, hidden_states, attentions

            loss = outputs[0]
            loss.backward()
            losses.append(loss.item())

            optimizer.step()

            if step > 0 and step % LOGGING_INTERVAL == 0:
                train_loss = np.mean(losses)
                eps = privacy_engine.get_epsilon(DELTA)

                eval_loss, eval_accuracy = evaluate(model)

                print(
                  f"Epoch: {epoch} | "
                  f"Step: {step} | "
                  f"Train loss: {train_loss:.3f} | "
                  f"Eval loss: {eval_loss:.3f} | "
                  f"Eval accuracy: {eval_accuracy:.3f} | "
                  f"ɛ: {eps:.2f}"
                )

bmm_engine = privacy_engine  # (for the test)

# %% cell 37 (changed: built from the config instead of from_pretrained)
# Let's import the model again and freeze layers as before
model = BertForSequenceClassification(config)

trainable_layers = [model.bert.encoder.layer[-1], model.bert.pooler, model.classifier]

for p in model.parameters():
        p.requires_grad = False
        total_params += p.numel()

for layer in trainable_layers:
    for p in layer.parameters():
        p.requires_grad = True
        trainable_params += p.numel()

# %% cell 38 (changed: the CPU as device)
device = torch.device("cpu")
os.environ["CUDA_LAUNCH_BLOCKING"] = "1"

optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, eps=1e-8)
model = model.train()

privacy_engine = PrivacyEngine()
criterion = nn.CrossEntropyLoss(reduction="mean")

model_gc, optimizer_gc, criterion_gc, train_dataloader = (
    privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_dataloader,
        criterion=criterion,
        target_delta=DELTA,
        target_epsilon=EPSILON,
        epochs=EPOCHS,
        max_grad_norm=MAX_GRAD_NORM,
        grad_sample_mode="ghost",
    )
)

model_gc = model_gc.to(device)
model_gc = model_gc.train()

for epoch in range(1, EPOCHS + 1):
    losses = []
    for step, batch in enumerate(tqdm(train_dataloader)):
        optimizer_gc.zero_grad()
        batch = tuple(t.to(device) for t in batch)
        inputs = {
            "input_ids": batch[0],
            "attention_mask": batch[1],
            "token_type_ids": batch[2],
            "labels": batch[3],
        }
        outputs = model_gc(**inputs)  # output = loss, logits, hidden_states, attentions
        loss = criterion_gc(outputs[1], batch[3])
        loss.backward()
        optimizer_gc.step()
        losses.append(loss.item())

        if step > 0 and step % LOGGING_INTERVAL == 0:
            train_loss = np.mean(losses)
            eval_loss, eval_accuracy = evaluate(model_gc)
            eps = privacy_engine.get_epsilon(DELTA)
            print(
                f"Epoch: {epoch} | "
                f"Step: {step} | "
                f"Train loss: {train_loss:.3f} | "
                f"Eval loss: {eval_loss:.3f} | "
                f"Eval accuracy: {eval_accuracy:.3f} | "
                f"ɛ: {eps:.2f}"
            )

ghost_engine = privacy_engine  # (for the test)

# %% cell 41 (changed: built from the config instead of from_pretrained)
# reset the model
model = BertForSequenceClassification(config)

# %% cell 43
total_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"Total parameters count: {total_params:,}") # ~108M

# %% cell 45
from peft import get_peft_model, LoraConfig, TaskType

lora_config = LoraConfig(
    task_type=TaskType.SEQ_CLS,  # our particular task is sequence classification
    inference_mode=False,  # Enable training mode
    r=32,  # Low-rank dimension
    lora_alpha=32,  # Alpha scaling factor
    lora_dropout=0.05,  # Dropout for LoRA layers
)

model_with_lora = get_peft_model(model, lora_config)
trainable_params = sum(p.numel() for p in model_with_lora.parameters() if p.requires_grad)
print(f"Total trainable parameters with LoRA: {trainable_params:,}") # ~1M

# %% cell 47
attention_layers_to_freeze = model_with_lora.base_model.bert.encoder.layer[:-1]

# Freeze the parameters in the first 11 attention layers
for param in attention_layers_to_freeze.parameters():
    param.requires_grad = False


trainable_params = sum(p.numel() for p in model_with_lora.parameters() if p.requires_grad)
print(f"Total trainable parameters with LoRA after freezing: {trainable_params:,}") # ~1M

# %% cell 49 (changed: EPOCHS and LOGGING_INTERVAL)
EPOCHS = 2
LOGGING_INTERVAL = 4 # once every how many steps we run evaluation cycle and report metrics
DELTA = 1 / len(train_dataloader) # Parameter for privacy accounting. Probability of not achieving privacy guarantees
MAX_GRAD_NORM = 0.1

# %% cell 50 (changed: the CPU as device)
device = torch.device("cpu")
os.environ["CUDA_LAUNCH_BLOCKING"] = "1"

optimizer = torch.optim.AdamW(model_with_lora.parameters(), lr=5e-4, eps=1e-8)
model_with_lora = model_with_lora.train()

privacy_engine = PrivacyEngine()
criterion = nn.CrossEntropyLoss(reduction="mean")

model_lora, optimizer_lora, criterion_lora, train_dataloader = (
    privacy_engine.make_private_with_epsilon(
        module=model_with_lora,
        optimizer=optimizer,
        data_loader=train_dataloader,
        criterion=criterion,
        target_delta=DELTA,
        target_epsilon=EPSILON,
        epochs=EPOCHS,
        max_grad_norm=MAX_GRAD_NORM,
        grad_sample_mode="ghost",
    )
)

model_lora = model_lora.to(device)
model_lora = model_lora.train()

for epoch in range(1, EPOCHS + 1):
    losses = []
    for step, batch in enumerate(tqdm(train_dataloader)):
        optimizer_lora.zero_grad()
        batch = tuple(t.to(device) for t in batch)
        inputs = {
            "input_ids": batch[0],
            "attention_mask": batch[1],
            "token_type_ids": batch[2],
            "labels": batch[3],
        }
        outputs = model_lora(**inputs)  # output = loss, logits, hidden_states, attentions
        loss = criterion_lora(outputs[1], batch[3])
        loss.backward()
        optimizer_lora.step()
        losses.append(loss.item())

        if step > 0 and step % LOGGING_INTERVAL == 0:
            train_loss = np.mean(losses)
            eval_loss, eval_accuracy = evaluate(model_lora)
            eps = privacy_engine.get_epsilon(DELTA)
            print(
                f"Epoch: {epoch} | "
                f"Step: {step} | "
                f"Train loss: {train_loss:.3f} | "
                f"Eval loss: {eval_loss:.3f} | "
                f"Eval accuracy: {eval_accuracy:.3f} | "
                f"ɛ: {eps:.2f}"
            )

lora_engine = privacy_engine  # (for the test)
