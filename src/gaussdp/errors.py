"""Exceptions and warnings raised by gaussdp.

Every range or safety error is a :class:`PrivacyError`, which subclasses :class:`ValueError`, so code
that already catches ``ValueError`` keeps working. Type errors stay :class:`TypeError`.
"""

from __future__ import annotations

__all__ = [
    "BudgetExhausted",
    "InvalidParameter",
    "NotPrivateWarning",
    "NumericalFault",
    "PrivacyError",
    "PrivacyWarning",
    "UnsafeInput",
    "WorkLimitExceeded",
]


class PrivacyError(ValueError):
    """Base class of every privacy-related error in gaussdp; nothing was released when it is raised."""


class InvalidParameter(PrivacyError):
    """A privacy or shape parameter is out of range, e.g. ``delta must be in (0, 1), got delta=1.5``."""


class NumericalFault(InvalidParameter):
    """A privacy computation hit a numerical fault (overflow, NaN, a failed inversion, an answer
    below a certified lower bound): it fails closed, no number is returned and nothing is charged."""


class UnsafeInput(PrivacyError):
    """Input data would break the guarantee (NaN, Inf, empty, wrong shape, too large)."""


class BudgetExhausted(PrivacyError):
    """A charge would take a principal's spent privacy past its budget; nothing was charged."""


class WorkLimitExceeded(TimeoutError):
    """A computation ran past the CPU time allowed to it (:func:`gaussdp._worklimit.cpu_limit`).

    Raised before anything is charged or released: the request asked for more numeric work than the
    caller allows one request to do. Not a :class:`PrivacyError` on purpose: code that treats a
    failing privacy computation as "no bound, refuse" must not turn a time-out into a refusal.
    """


class PrivacyWarning(UserWarning):
    """Something weakens the guarantee (a large epsilon, a warn-only budget policy)."""


class NotPrivateWarning(PrivacyWarning):
    """Output was produced from a fixed seed: anyone who knows the seed can remove the noise."""
