"""The docstring examples of the core modules run, and the top-level exports are what __all__ says."""

from __future__ import annotations

import doctest
import importlib
import types

import pytest

import gaussdp

CORE_MODULES = [
    "gaussdp.calibration",
    "gaussdp.clipping",
    "gaussdp.noise",
    "gaussdp.mechanism",
    "gaussdp.errors",
    "gaussdp._validate",
    "gaussdp._format",
    "gaussdp.audit",
]


@pytest.mark.parametrize("name", CORE_MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_all_matches_exports():
    exported = set(gaussdp.__all__)
    assert len(exported) == len(gaussdp.__all__), "duplicates in __all__"
    assert gaussdp.__all__ == sorted(gaussdp.__all__), "__all__ is kept sorted"
    for name in exported:
        assert hasattr(gaussdp, name), f"{name} is in __all__ but not defined"
    public = {
        name
        for name, value in vars(gaussdp).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    }
    assert public <= exported, f"public names missing from __all__: {sorted(public - exported)}"
    assert isinstance(gaussdp.__version__, str)


def test_core_imports_no_heavy_dependencies():
    import subprocess
    import sys

    code = (
        "import sys, gaussdp, gaussdp.audit; "
        "heavy = [m for m in ('torch', 'fastapi', 'matplotlib', 'typer') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
