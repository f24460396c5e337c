"""Models and LoRA adapters for ``gaussdp serve``, loaded once at start-up from local directories.

Nothing here is reachable from a request: the service's routes only look adapters up by the names
given on the command line (``--adapter NAME=PATH``), so no request can make the server read a file
or download anything. Loading fails closed, with the path and the reason in the message.

A peft LoRA adapter directory holds ``adapter_config.json`` (``peft_type`` ``LORA``, ``r``,
``lora_alpha``, ``use_rslora``) and ``adapter_model.safetensors`` (``...<module>.lora_A.weight``
``(r, d_in)`` and ``...<module>.lora_B.weight`` ``(d_out, r)`` per adapted module). ``/lora-delta``
serves one module's pair, ``scaling * B @ (A @ h)`` with ``scaling = lora_alpha / r`` (``lora_alpha
/ sqrt(r)`` with rsLoRA): the adapter's only module, or the one named as ``NAME=PATH#MODULE``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = [
    "DEVICES",
    "DTYPES",
    "load_causal_lm",
    "load_lora_adapter",
    "load_tokenizer",
    "parse_named_paths",
    "resolve_device",
]

#: ``gaussdp serve --dtype``: ``auto`` keeps what the checkpoint holds (its config's dtype).
DTYPES = ("auto", "bfloat16", "float16", "float32")
#: ``gaussdp serve --device``: ``auto`` is CUDA when a CUDA device is present, else the CPU.
DEVICES = ("auto", "cpu", "cuda")


def parse_named_paths(option: str, values: list[str] | None) -> dict[str, str]:
    """``["a=/p", "b=/q"]`` -> ``{"a": "/p", "b": "/q"}``; refuses a missing ``=`` or a repeated name."""
    out: dict[str, str] = {}
    for v in values or []:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{option} must be NAME=PATH, got {v!r}")
        if name in out:
            raise ValueError(f"{option}: the name {name!r} is given twice")
        out[name] = path
    return out


def _directory(kind: str, path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{kind} {str(p)!r} is not a local directory (nothing is downloaded)")
    return p


def resolve_device(device: str = "auto") -> str:
    """``"cpu"`` or ``"cuda"``: ``auto`` picks CUDA when present; ``cuda`` without one is refused."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to this process")
    return device


def load_causal_lm(path: str | Path, *, dtype: str = "auto", device: str = "auto") -> Any:
    """A Hugging Face causal LM from a local directory, in eval mode (``local_files_only``), in
    ``dtype`` (``auto``: the checkpoint's) on ``device`` (:func:`resolve_device`).

    The privatizer's noise stays float-safe whatever the dtype (it is drawn and added as
    :mod:`gaussdp.inference.privatizer` says for bfloat16 and float16 states).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    where = resolve_device(device)
    p = _directory("model", path)
    torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {str(p)!r} could not be loaded as a causal LM: {exc}") from None
    return model.to(where).eval()


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved next to a model (``tokenizer.save_pretrained``), or ``None`` when the
    directory holds none (the model then takes ``prompt_ids`` only)."""
    from transformers import AutoTokenizer

    p = _directory("model", path)
    # transformers may build an empty tokenizer from a config alone: look for the files first
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {str(p)!r}: its tokenizer could not be loaded: {exc}") from None


def load_lora_adapter(spec: str | Path) -> tuple[Any, Any, float]:
    """``(A, B, scaling)`` of one module of a peft LoRA adapter directory (``PATH`` or ``PATH#MODULE``).

    Raises:
        ValueError: not a directory, not a LoRA adapter, the module is ambiguous or missing, or the
            weights are not finite 2-D matrices of matching rank.
    """
    import numpy as np
    from safetensors.numpy import load_file

    path_s, _, module = str(spec).partition("#")
    p = _directory("adapter", path_s)
    try:
        config = json.loads((p / "adapter_config.json").read_text(encoding="utf-8"))
        weights = load_file(str(p / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {str(p)!r} is not a peft adapter directory: {exc}") from None
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"adapter {str(p)!r}: peft_type is {config.get('peft_type')!r}, not LORA")
    suffix_a, suffix_b = ".lora_A.weight", ".lora_B.weight"
    modules = sorted(k[: -len(suffix_a)] for k in weights if k.endswith(suffix_a))
    if module:
        chosen = [m for m in modules if m == module or m.endswith("." + module)]
    else:
        chosen = modules
    if len(chosen) != 1:
        what = f"no module matches {module!r}" if not chosen else "choose one module with PATH#MODULE"
        raise ValueError(f"adapter {str(p)!r}: {what}; it adapts {modules}")
    a = np.asarray(weights[chosen[0] + suffix_a], dtype=np.float64)
    b = np.asarray(weights.get(chosen[0] + suffix_b), dtype=np.float64)
    r = int(config.get("r", a.shape[0]))
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
        raise ValueError(f"adapter {str(p)!r}: A {a.shape} and B {b.shape} are not a rank-{r} LoRA pair")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"adapter {str(p)!r}: its weights hold NaN or Inf")
    alpha = float(config.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return a, b, scaling
