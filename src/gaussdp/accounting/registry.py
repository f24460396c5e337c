"""Accountants by name: the ``accountant(name)`` factory (the way budgets, engines and the CLI get one).

Lives apart from :mod:`gaussdp.accounting.base` so that the interface module imports no backend:
every backend imports ``base``, and this module imports every backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gaussdp.accounting.advanced import AdvancedComposition
from gaussdp.accounting.base import Accountant
from gaussdp.accounting.basic import BasicComposition
from gaussdp.accounting.gdp import GDPAccountant
from gaussdp.accounting.pld import PLDAccountant
from gaussdp.accounting.rdp import RDPAccountant
from gaussdp.errors import InvalidParameter

__all__ = ["ACCOUNTANTS", "accountant", "available_accountants"]


#: Every accountant by its name, in the order :func:`available_accountants` lists them.
ACCOUNTANTS: Mapping[str, type[Accountant]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (BasicComposition, AdvancedComposition, RDPAccountant, PLDAccountant, GDPAccountant)
    }
)


def available_accountants() -> tuple[str, ...]:
    """Names accepted by :func:`accountant`: basic, advanced, rdp, pld (default, tightest), gdp."""
    return tuple(ACCOUNTANTS)


def accountant(name: str = "pld", *, allow_approximate: bool = False, **options: Any) -> Accountant:
    """A fresh accountant by name: ``"pld"`` (default, tightest), ``"rdp"``, ``"advanced"`` or ``"basic"``.

    Every one of these returns upper bounds on epsilon(delta), so whatever calibrates noise, enforces a
    budget or prints a guarantee from this factory prints a bound. ``"gdp"`` (central-limit
    approximation, which can fall below the true epsilon) is refused unless ``allow_approximate=True``
    is given by name: it is for plots and comparisons only, and says so (``approximate`` is True).

    >>> from gaussdp.accounting import SubsampledGaussianEvent
    >>> acc = accountant("rdp").compose(SubsampledGaussianEvent(1.1, 256 / 60000), count=14063)
    >>> 2.4 < acc.epsilon(1e-5) < 2.7
    True
    >>> accountant("gdp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gaussdp.errors.InvalidParameter: accountant='gdp' is an approximation, not an upper bound: ...
    >>> accountant("gdp", allow_approximate=True).approximate
    True
    """
    if not isinstance(name, str):
        raise TypeError(f"accountant name must be a string, got name={name!r}")
    reg = ACCOUNTANTS
    key = name.lower()
    if key not in reg:
        raise InvalidParameter(f"unknown accountant name={name!r}; choose one of {sorted(reg)}")
    cls = reg[key]
    if cls.approximate and allow_approximate is not True:
        raise InvalidParameter(
            f"accountant={name!r} is an approximation, not an upper bound: use 'pld', 'rdp', 'advanced' "
            "or 'basic' (pass allow_approximate=True to get it for a plot or a comparison)"
        )
    return cls(**options)
