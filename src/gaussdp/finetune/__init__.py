"""DP fine-tuning of LoRA adapters of a Hugging Face causal LM (extras ``torch`` and ``hf``).

A data owner perturbs a corpus word by word (local DP, :mod:`gaussdp.text`) and uploads it; a data
scientist trains only LoRA adapters of a causal LM on it with DP-SGD (central DP,
:class:`gaussdp.torch.PrivacyEngine`) and gets a private peft adapter:

>>> records = read_corpus("corpus.txt")                                   # doctest: +SKIP
>>> config = FinetuneConfig(target_epsilon=8.0, delta=1e-5, epochs=2)    # doctest: +SKIP
>>> plan = plan_finetune(config, n_records=len(records))                 # doctest: +SKIP
>>> ledger.charge(principal, plan.event)   # BEFORE training             # doctest: +SKIP
>>> result = run_finetune("model_dir", records, config, plan)            # doctest: +SKIP
>>> save_adapter(result, "adapter_dir", local_dp={"mechanism": "gaussian", "sigma": 0.4})  # doctest: +SKIP

Guarantee: the adapter is ``(plan.epsilon, delta)``-DP with respect to adding or removing one record
(one line, or one JSONL object) of the corpus; ``plan.epsilon`` is a real accountant's upper bound
(PLD by default) for ``plan.event``. Noise comes from the OS CSPRNG; a ``seed`` makes a run
reproducible and NOT private. Training losses are not private and are only reported on request.

Command line: ``gaussdp finetune CORPUS --model DIR --epsilon 8 --delta 1e-5 --out ADAPTER_DIR``.
"""

from __future__ import annotations

from gaussdp._extras import require_extra

require_extra("hf", feature="gaussdp.finetune")

from gaussdp.finetune.adapter import (
    ADAPTER_FILES,
    adapter_zip,
    check_local_dp,
    model_card,
    privacy_summary,
    save_adapter,
)
from gaussdp.finetune.checkpoint import FinetuneCheckpoint
from gaussdp.finetune.corpus import CORPUS_FORMATS, read_corpus
from gaussdp.finetune.model import check_model, load_base_model
from gaussdp.finetune.plan import (
    ACCOUNTANTS,
    MAX_STEPS,
    FinetuneConfig,
    FinetunePlan,
    check_plan,
    default_target_modules,
    epsilon_text,
    plan_finetune,
)
from gaussdp.finetune.tiny import tiny_causal_lm
from gaussdp.finetune.train import (
    FinetuneCancelled,
    FinetuneProgress,
    FinetuneResult,
    run_finetune,
)

__all__ = [
    "ACCOUNTANTS",
    "ADAPTER_FILES",
    "CORPUS_FORMATS",
    "MAX_STEPS",
    "FinetuneCancelled",
    "FinetuneCheckpoint",
    "FinetuneConfig",
    "FinetunePlan",
    "FinetuneProgress",
    "FinetuneResult",
    "adapter_zip",
    "check_local_dp",
    "check_model",
    "check_plan",
    "default_target_modules",
    "epsilon_text",
    "load_base_model",
    "model_card",
    "plan_finetune",
    "privacy_summary",
    "read_corpus",
    "run_finetune",
    "save_adapter",
    "tiny_causal_lm",
]
