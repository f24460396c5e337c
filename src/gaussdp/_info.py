"""What this installation of gaussdp has: versions, extras, noise back ends, accountants.

Used by ``gaussdp info``. Nothing here imports torch or another heavy extra: presence is read with
:func:`importlib.util.find_spec` and versions from the installed distributions' metadata.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import sys
from typing import Any

from gaussdp._extras import EXTRAS, missing_modules

# distributions whose versions are reported (the core's, then each extra's main packages)
_PACKAGES = (
    "numpy",
    "scipy",
    "cryptography",
    "typer",
    "rich",
    "matplotlib",
    "torch",
    "transformers",
    "peft",
    "fastapi",
    "uvicorn",
    "pydantic",
    "httpx",
    "gensim",
    "faiss-cpu",
    "flwr",
    "tenseal",
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def c_kernel_status(module: str = "gaussdp._gauss") -> tuple[bool, str]:
    """Whether a compiled kernel imports (the Box-Muller noise kernel ``gaussdp._gauss`` by default;
    ``gaussdp._search``: exact nearest-word search), and why not where it does not."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return False, f"not built ({exc})"
    return True, "built"


def noise_backends() -> dict[str, Any]:
    """The noise back ends this installation uses (see :mod:`gaussdp.noise`, :mod:`gaussdp.torch`)."""
    from gaussdp.noise import noise_source

    stream = getattr(noise_source("secure"), "stream", "unknown")
    kernel_built, kernel_detail = c_kernel_status()
    has_crypto = importlib.util.find_spec("cryptography") is not None
    has_torch = importlib.util.find_spec("torch") is not None
    if not has_torch:
        torch_noise = "unavailable: the 'torch' extra is not installed"
    elif kernel_built and has_crypto:
        torch_noise = "AES-128-CTR keystream through the C kernel (fast, cryptographic)"
    else:
        torch_noise = "torch's generator (the C kernel or cryptography is missing)"
    return {
        "core_secure_stream": stream,
        "core_secure_note": (
            "ChaCha20 keystream (cryptography)"
            if stream == "ChaCha20"
            else "SHAKE-256 fallback: cryptography is not installed, about 4x slower"
        ),
        "c_kernel": {"built": kernel_built, "detail": kernel_detail},
        "cryptography": has_crypto,
        "torch_generator": has_torch,
        "torch_default_noise": torch_noise,
    }


def accountants() -> list[dict[str, Any]]:
    """Every accountant the factory knows, and whether it gives an upper bound (gdp does not)."""
    from gaussdp.accounting.registry import ACCOUNTANTS

    return [
        {"name": name, "upper_bound": not cls.approximate, "class": cls.__name__}
        for name, cls in ACCOUNTANTS.items()
    ]


def environment_info() -> dict[str, Any]:
    """Versions, extras present, noise back ends and accountants, as plain JSON-ready data."""
    import gaussdp

    return {
        "gaussdp": gaussdp.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "packages": {name: _version(name) for name in _PACKAGES},
        "extras": {
            name: {"installed": not missing, "missing": missing}
            for name, missing in ((name, missing_modules(name)) for name in EXTRAS)
        },
        "noise": noise_backends(),
        "text_search_kernel": dict(
            zip(("built", "detail"), c_kernel_status("gaussdp._search"), strict=True),
            fallback="numpy (exact, slower) where the kernel is not built",
        ),
        "accountants": accountants(),
    }
