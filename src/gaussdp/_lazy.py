"""A module imported on first use, so that ``import gaussdp`` stays cheap.

``scipy.optimize`` and ``scipy.fft`` take longer to import than numpy and ``scipy.special`` together,
and most programs that ``import gaussdp`` never solve for a noise level or compose a PLD. Modules that
need them write::

    if TYPE_CHECKING:
        from scipy import optimize
    else:
        optimize = lazy_module("scipy.optimize")

and use ``optimize.brentq`` as before: the first attribute access imports the real module (under
Python's import lock, so it is thread-safe); later ones read it from a slot.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for the module ``name`` and imports it on the first attribute access."""

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def _load(self) -> ModuleType:
        module = self._module
        if module is None:
            module = importlib.import_module(self._name)
            self._module = module
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __dir__(self) -> list[str]:
        return dir(self._load())

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not yet imported"
        return f"<lazy module {self._name!r} ({state})>"


def lazy_module(name: str) -> Any:
    """A stand-in for ``importlib.import_module(name)`` that imports on first use."""
    return LazyModule(name)
