"""The docstring examples of gaussdp.mf run."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["gaussdp.mf._strategy", "gaussdp.mf._plan", "gaussdp.mf._noise"])
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
