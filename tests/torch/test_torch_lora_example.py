"""examples/dp_lora_finetune.py runs: only LoRA adapters train, epsilon is reported and kept."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dp_lora_finetune.py"


@pytest.mark.slow
def test_lora_example_few_steps():
    spec = importlib.util.spec_from_file_location("dp_lora_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(steps=4, target_epsilon=4.0, verbose=False)
    assert out["steps"] == 4
    assert 0 < out["epsilon"] <= 4.0 * (1 + 1e-6)
    assert out["adapter_change"] > 0
    assert out["base_unchanged"] == 1.0
    assert out["state_dict_keys_unchanged"] == 1.0
