"""Which optional extras are installed, and the ImportError that names the one that is missing.

Each subpackage that needs an extra calls :func:`require_extra` when it is imported (or, where only
part of it needs the extra, where that part starts), so that a missing dependency reads
``gaussdp.torch needs the 'torch' extra: pip install 'gaussdp[torch]'`` rather than a bare
``No module named 'torch'``. Presence is checked with :func:`importlib.util.find_spec`, which does not
import the package (importing torch to check for it would cost seconds).
"""

from __future__ import annotations

import importlib.util

# extra name (as in pyproject.toml's [project.optional-dependencies]) -> top-level modules it provides
EXTRAS: dict[str, tuple[str, ...]] = {
    "cli": ("typer", "rich"),
    "plot": ("matplotlib",),
    "torch": ("torch",),
    "hf": ("torch", "transformers", "peft"),
    "service": ("fastapi", "uvicorn", "pydantic", "httpx"),
    "client": ("httpx", "websockets"),
    "text": ("gensim",),
    "federated": ("flwr",),
    "he": ("tenseal",),
    "data": ("pyarrow", "fsspec"),
    "ray": ("ray",),
}


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that are not installed (empty when the extra is complete)."""
    try:
        modules = EXTRAS[extra]
    except KeyError:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(sorted(EXTRAS))}") from None
    return [name for name in modules if importlib.util.find_spec(name) is None]


def extra_installed(extra: str) -> bool:
    """True where every module of ``extra`` is importable."""
    return not missing_modules(extra)


def require_extra(extra: str, *, feature: str) -> None:
    """Raise an ImportError naming ``extra`` and its pip line where any of its modules is missing.

    Args:
        extra: the extra's name in pyproject.toml (``"torch"``, ``"service"``, ...).
        feature: what needs it, for the message (``"gaussdp.torch"``).

    Raises:
        ModuleNotFoundError: (an ImportError) with ``name`` set to the first missing module.
    """
    missing = missing_modules(extra)
    if missing:
        raise ModuleNotFoundError(
            f"{feature} needs the '{extra}' extra ({', '.join(missing)} not installed): "
            f"pip install 'gaussdp[{extra}]'",
            name=missing[0],
        )
