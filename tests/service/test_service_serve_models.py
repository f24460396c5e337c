"""``gaussdp serve --model NAME=PATH --adapter NAME=PATH[#MODULE]``: loaded once at start-up, from
local directories only, and the adapter served by ``/lora-delta`` (issue 20)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from typer.testing import CliRunner  # noqa: E402

from gaussdp.cli import build_app  # noqa: E402


@pytest.fixture
def saved(tmp_path):
    """A tiny GPT-2 and a peft LoRA adapter on its last block's attention projection, saved to disk."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "model")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["attn.c_proj"], layers_to_transform=[1],
        init_lora_weights=False, fan_in_fan_out=True,
    )  # fmt: skip
    pm = peft.get_peft_model(model, lora)
    pm.save_pretrained(tmp_path / "adapter")
    module = pm.base_model.model.transformer.h[1].attn.c_proj
    a = module.lora_A["default"].weight.detach().double().numpy()
    b = module.lora_B["default"].weight.detach().double().numpy()
    return tmp_path, a, b, module


def _serve(monkeypatch, args):  # type: ignore[no-untyped-def]
    """Run ``gaussdp serve ARGS`` up to the point it would listen; return (result, app).

    The app is the one each worker builds (``gaussdp.service.config:app_from_env``) from the
    environment ``serve`` set up; the variables are restored afterwards.
    """
    import gaussdp.service.server as server
    from gaussdp.service import config

    started = {}

    def fake_serve_factory(factory, **kwargs):  # type: ignore[no-untyped-def]
        assert factory == "gaussdp.service.config:app_from_env"
        started["app"] = config.app_from_env()

    served = (config.MODELS_ENV, config.ADAPTERS_ENV, config.DTYPE_ENV, config.DEVICE_ENV)
    for var in (*config.ENV.values(), *served):
        monkeypatch.delenv(var, raising=False)  # restored by monkeypatch after the test
    monkeypatch.setattr(server, "serve_factory", fake_serve_factory)
    result = CliRunner().invoke(build_app(), ["serve", *args])
    for var in (*config.ENV.values(), *served):
        monkeypatch.delenv(var, raising=False)
    return result, started.get("app")


def test_serve_loads_a_model_and_serves_a_peft_adapter(saved, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key

    root, a, b, module = saved
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(db) as ledger:
        key = create_api_key(ledger.store, "t")
    result, app = _serve(
        monkeypatch,
        ["--db", db, "--model", f"tiny={root / 'model'}", "--adapter", f"ad={root / 'adapter'}"],
    )
    assert result.exit_code == 0, result.output
    assert isinstance(app.state.models["tiny"], transformers.GPT2LMHeadModel)
    h = {"Authorization": f"Bearer {key}"}
    with TestClient(app) as client:
        r = client.post("/v1/sessions", json={"epsilon": 5.0, "delta": 1e-5}, headers=h)
        sid = r.json()["session_id"]
        x = np.random.default_rng(0).normal(size=(2, 64))
        r = client.post(
            f"/v1/sessions/{sid}/lora-delta",
            json={"adapter": "ad", "noised": x.tolist(), "clip_norm": 1.0, "sigma": 4.0},
            headers=h,
        )
        assert r.status_code == 200, r.text
        out = r.json()
    # the served delta is peft's own: lora_B(lora_A(x)) * scaling, with scaling = alpha / r = 2
    with torch.no_grad():
        ref = module.lora_B["default"](module.lora_A["default"](torch.as_tensor(x, dtype=torch.float32)))
    expected = (ref * module.scaling["default"]).double().numpy()
    assert module.scaling["default"] == 2.0
    np.testing.assert_allclose(np.asarray(out["delta"]), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["delta"]), 2.0 * x @ a.T @ b.T, rtol=1e-9)
    assert out["neighbouring"] == "replace_one"


def test_serve_refuses_what_is_not_a_local_directory(saved, tmp_path, monkeypatch):
    root, *_ = saved
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    for args, message in [
        (["--adapter", "ad=gpt2"], "not a local directory"),  # a hub name is never downloaded
        (["--model", "m=openai-community/gpt2"], "not a local directory"),
        (["--adapter", f"ad={root / 'model'}"], "not a peft adapter"),
        (["--adapter", f"ad={root / 'adapter'}#mlp.c_fc"], "no module matches"),
        (["--adapter", f"{root / 'adapter'}"], "NAME=PATH"),
    ]:
        result, app = _serve(monkeypatch, ["--db", db, *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.replace("│", " ").split()), (args, result.output)
        assert app is None  # the server never started


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_serve_loads_the_model_in_the_dtype_asked_on_the_cpu(saved, tmp_path, monkeypatch, dtype):
    root, *_ = saved
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    args = ["--db", db, "--model", f"tiny={root / 'model'}", "--dtype", dtype, "--device", "cpu"]
    result, app = _serve(monkeypatch, args)
    assert result.exit_code == 0, result.output
    weights = {p.dtype for p in app.state.models["tiny"].parameters()}
    assert weights == {getattr(torch, dtype)}
    assert {p.device.type for p in app.state.models["tiny"].parameters()} == {"cpu"}
    assert f"model tiny: GPT2LMHeadModel, {dtype} on cpu" in result.output


def test_serve_keeps_the_checkpoint_s_dtype_by_default_and_refuses_a_missing_device(
    saved, tmp_path, monkeypatch
):
    root, *_ = saved
    half = tmp_path / "half"
    transformers.GPT2LMHeadModel.from_pretrained(root / "model", dtype=torch.float16).save_pretrained(half)
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    result, app = _serve(monkeypatch, ["--db", db, "--model", f"tiny={half}"])
    assert result.exit_code == 0, result.output
    assert {p.dtype for p in app.state.models["tiny"].parameters()} == {torch.float16}
    result, app = _serve(monkeypatch, ["--db", db, "--model", f"tiny={half}", "--dtype", "int8"])
    assert result.exit_code == 2 and app is None
    if not torch.cuda.is_available():
        result, app = _serve(monkeypatch, ["--db", db, "--model", f"tiny={half}", "--device", "cuda"])
        assert result.exit_code == 2 and app is None
        assert "no CUDA device" in " ".join(result.output.replace("│", " ").split()), result.output
