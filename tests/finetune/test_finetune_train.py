"""A real DP-LoRA run on a tiny GPT-2 over Lee corpus lines: plan kept, adapter saved and reloaded,
card and JSON state the plan's epsilon, cancellation, refusals."""

from __future__ import annotations

import io
import json
import warnings
import zipfile

import pytest

torch = pytest.importorskip("torch")

from gaussdp.errors import InvalidParameter, NotPrivateWarning  # noqa: E402
from gaussdp.finetune import (  # noqa: E402
    ADAPTER_FILES,
    FinetuneCancelled,
    FinetuneConfig,
    adapter_zip,
    check_model,
    model_card,
    plan_finetune,
    run_finetune,
    save_adapter,
)

CONFIG = FinetuneConfig(
    target_epsilon=8.0, delta=1e-4, batch_size=16, epochs=1, max_seq_len=24, learning_rate=5e-2
)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, lee_lines, tmp_path_factory):
    """One real run (3 steps of Poisson batches of about 16 records), saved as an adapter."""
    plan = plan_finetune(CONFIG, n_records=len(lee_lines))
    seen = []
    result = run_finetune(tiny_model_dir, lee_lines, CONFIG, plan, progress=seen.append, report_loss=True)
    out = save_adapter(
        result,
        tmp_path_factory.mktemp("adapter"),
        local_dp={"mechanism": "gaussian", "sigma": 0.4, "epsilon_per_word": 3.2, "vocabulary": "lee-50d"},
        corpus_name="lee_background.cor",
    )
    return plan, result, seen, out


def test_run_follows_the_plan_and_reports_progress(trained):
    plan, result, seen, _ = trained
    assert plan.steps == 3 and result.steps_done == 3
    assert [p.step for p in seen] == [1, 2, 3] and all(p.steps == 3 for p in seen)
    eps = [p.epsilon_so_far for p in seen]
    assert 0 < eps[0] < eps[1] < eps[2] == plan.epsilon == result.epsilon <= 8.0
    assert len(result.losses) == 3 and all(2.0 < loss < 20.0 for loss in result.losses)
    assert result.private
    assert "keystream" in result.noise_stream or "OS CSPRNG" in result.noise_stream
    assert result.target_modules == ("c_attn",) and result.tokens > 0
    assert 0 < result.train_seconds < result.seconds
    # the engine charged exactly the plan: its step event, once per step
    assert result.charged == ((plan.event.event, plan.steps),)
    assert plan.event.event.noise_multiplier == plan.noise_multiplier
    assert plan.event.event.sample_rate == plan.sample_rate
    # only the LoRA parameters were trainable
    names = [n for n, p in result.peft_model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # transformers, via peft
def test_adapter_reloads_with_peft_and_generates(trained, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, result, _, out = trained
    assert sorted(p.name for p in out.iterdir()) == sorted(ADAPTER_FILES)
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert weights and all("lora_" in k for k in weights)
    # training moved the adapters: lora_B starts at zero
    assert any(k.endswith("lora_B.weight") and float(v.abs().sum()) > 0 for k, v in weights.items())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = PeftModel.from_pretrained(base, out).eval()
    ids = tok("the government said", return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        # the reloaded adapter is the trained one: same logits as the model in memory
        same = torch.allclose(model(**ids).logits, result.peft_model(**ids).logits, atol=1e-5)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 4 and same


def test_card_and_json_state_the_plans_epsilon_and_both_guarantees(trained):
    from gaussdp.finetune import epsilon_text

    plan, result, _, out = trained
    info = json.loads((out / "gaussdp_privacy.json").read_text())
    c = info["central_dp"]
    assert c["epsilon"] == plan.epsilon and c["delta"] == plan.delta
    assert c["steps"] == plan.steps and c["noise_multiplier"] == plan.noise_multiplier
    assert c["sample_rate"] == plan.sample_rate and c["neighbouring"] == "add_remove"
    assert c["event"] == plan.event.to_dict() and c["accountant"] == "pld"
    assert info["local_dp"]["sigma"] == 0.4 and info["private"] is True
    card = (out / "README.md").read_text()
    assert f"epsilon = {epsilon_text(plan.epsilon)}, delta = 0.0001" in card
    assert float(epsilon_text(plan.epsilon)) >= plan.epsilon  # printed rounded up
    assert "add/remove one record" in card and "Local DP of the upload" in card and "sigma: 0.4" in card
    assert "lee\\_background.cor" in card
    assert card == model_card(
        result,
        local_dp={"mechanism": "gaussian", "sigma": 0.4, "epsilon_per_word": 3.2, "vocabulary": "lee-50d"},
        corpus_name="lee_background.cor",
    )
    assert "Local DP of the upload: not declared" in model_card(result)
    blob = adapter_zip(out)
    assert blob == adapter_zip(out)  # deterministic
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        assert sorted(zf.namelist()) == sorted(ADAPTER_FILES)
        assert zf.read("gaussdp_privacy.json") == (out / "gaussdp_privacy.json").read_bytes()


def test_bad_local_dp_and_incomplete_dirs_are_refused(trained, tmp_path):
    result = trained[1]
    with pytest.raises(InvalidParameter, match="finite"):
        save_adapter(result, tmp_path / "a", local_dp={"sigma": float("nan")})
    with pytest.raises(TypeError, match="local_dp"):
        save_adapter(result, tmp_path / "b", local_dp="gaussian")  # type: ignore[arg-type]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written
    (tmp_path / "c").mkdir()
    with pytest.raises(InvalidParameter, match="lacks"):
        adapter_zip(tmp_path / "c")


def test_cancellation_stops_between_steps(tiny_model_dir, lee_lines):
    cfg = FinetuneConfig(noise_multiplier=1.0, delta=1e-5, batch_size=8, max_seq_len=16)
    plan = plan_finetune(cfg, n_records=len(lee_lines))
    polls = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) > 2  # two steps run, the third is refused

    with pytest.raises(FinetuneCancelled) as info:
        run_finetune(tiny_model_dir, lee_lines, cfg, plan, should_stop=should_stop)
    assert info.value.steps_done == 2 and 0 < info.value.epsilon < plan.epsilon


def test_losses_are_withheld_by_default_and_seed_is_not_private(tiny_model_dir, lee_lines):
    cfg = FinetuneConfig(noise_multiplier=1.0, delta=1e-5, batch_size=24, max_seq_len=16)
    plan = plan_finetune(cfg, n_records=len(lee_lines))
    seen = []
    with pytest.warns(NotPrivateWarning):
        res = run_finetune(tiny_model_dir, lee_lines, cfg, plan, progress=seen.append, seed=3)
    assert res.losses == () and all(p.loss is None for p in seen)
    assert res.private is False and "NOT PRIVATE" in model_card(res)
    with pytest.warns(NotPrivateWarning):
        again = run_finetune(tiny_model_dir, lee_lines, cfg, plan, seed=3)
    a = {k: v for k, v in res.peft_model.state_dict().items() if "lora_" in k}
    b = {k: v for k, v in again.peft_model.state_dict().items() if "lora_" in k}
    assert all(torch.equal(a[k], b[k]) for k in a)  # reproducible: that is why it is not private


def test_off_plan_runs_are_refused(tiny_model_dir, lee_lines, tmp_path):
    plan = plan_finetune(CONFIG, n_records=len(lee_lines))
    with pytest.raises(InvalidParameter, match="n_records=48"):
        run_finetune(tiny_model_dir, lee_lines[:-1], CONFIG, plan)
    other = FinetuneConfig(target_epsilon=8.0, delta=1e-4, batch_size=8, max_seq_len=24)
    with pytest.raises(InvalidParameter, match="steps_per_epoch"):
        run_finetune(tiny_model_dir, lee_lines, other, plan)
    with pytest.raises(InvalidParameter, match="records\\[1\\]"):
        run_finetune(tiny_model_dir, [lee_lines[0], "  ", *lee_lines[2:]], CONFIG, plan)
    with pytest.raises(InvalidParameter, match="model_path"):
        run_finetune(tmp_path / "nowhere", lee_lines, CONFIG, plan)
    with pytest.raises(InvalidParameter, match="device"):
        run_finetune(tiny_model_dir, lee_lines, CONFIG, plan, device="warp-drive")
    bad_targets = FinetuneConfig(**{**CONFIG.to_dict(), "target_modules": ("q_proj",)})
    with pytest.raises(InvalidParameter, match="target_modules"):
        run_finetune(
            tiny_model_dir, lee_lines, bad_targets, plan_finetune(bad_targets, n_records=len(lee_lines))
        )


def test_llama_gets_q_and_v_projections(tiny_model_dir, lee_lines, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=len(tok),
            max_position_embeddings=64,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    llama.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = FinetuneConfig(noise_multiplier=1.0, delta=1e-5, batch_size=24, max_seq_len=16)
    plan = plan_finetune(cfg, n_records=len(lee_lines))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotPrivateWarning)
        res = run_finetune(tmp_path, lee_lines, cfg, plan, max_physical_batch_size=5)
    assert res.target_modules == ("q_proj", "v_proj") and res.steps_done == plan.steps == 2
    assert res.epsilon == plan.epsilon


def test_check_model_refuses_before_any_weight_is_loaded(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer, BertConfig

    assert check_model(tiny_model_dir, CONFIG) == ("gpt2", ("c_attn",))
    too_long = FinetuneConfig(**{**CONFIG.to_dict(), "max_seq_len": 129})  # the model has 128 positions
    with pytest.raises(InvalidParameter, match="max_seq_len=129"):
        check_model(tiny_model_dir, too_long)
    with pytest.raises(InvalidParameter, match="target_modules"):
        check_model(tiny_model_dir, FinetuneConfig(**{**CONFIG.to_dict(), "target_modules": ("q_proj",)}))
    BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(InvalidParameter, match="encoder, not a causal language model"):
        check_model(tmp_path, CONFIG)
    (tmp_path / "config.json").unlink()
    with pytest.raises(InvalidParameter, match="no Hugging Face model config"):
        check_model(tmp_path, CONFIG)


def test_empty_poisson_batches_still_take_a_noised_step(tiny_model_dir):
    # 3 records at sample rate 1/3: about 30% of the steps draw no record. The seed fixes which
    # (a seeded run is not private; here it only makes the empty batches certain).
    cfg = FinetuneConfig(noise_multiplier=2.0, delta=1e-5, batch_size=1, epochs=4, max_seq_len=8)
    plan = plan_finetune(cfg, n_records=3)
    with pytest.warns(NotPrivateWarning):
        res = run_finetune(
            tiny_model_dir, ["the cat sat", "a dog ran", "it rained"], cfg, plan, seed=1, report_loss=True
        )
    empty = [loss != loss for loss in res.losses]  # nan: no record in that step's batch
    assert res.steps_done == plan.steps == 12 and any(empty) and not all(empty)
    assert res.epsilon == plan.epsilon
