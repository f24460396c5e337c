"""The neighbouring relation, in one spelling everywhere: :class:`Neighbouring` (``"add_remove"`` or
``"replace_one"``), and the relation for hidden states shared by the privatizer, split mode, the
service and the CLI (core level: no torch, no FastAPI, so each of them can import it).

Events, accountants, row releases (:mod:`gaussdp._rows`, :mod:`gaussdp.embeddings`), the hidden-state
privatizer, the CLI's ``--neighbouring`` and the service's JSON all take these two values and no
other: an older spelling (``"replace"``, ``"add-remove"``) is refused with an error naming the one to
write (:func:`check_neighbouring`).

Hidden states default to **replace-one** (``"replace_one"``). A released row is one token's (or one
sequence's) hidden state clipped to L2 norm ``C``; two neighbouring requests differ in one row's
*content*, which can move anywhere in the C-ball, so the row's L2 sensitivity is ``2C``. A request's
rows are always present (the server sees how many it receives), so "add or remove a row" (the zero
vector against a state, sensitivity ``C``) does not describe what a client wants hidden: what the
text was. The alternative ``"add_remove"`` stays available where a caller states it explicitly, at
half the noise for the same epsilon (the private inference server's ``Delta_f = 1`` for a clip of 1).

Every surface defaults to :data:`DEFAULT_HIDDEN_STATE_NEIGHBOURING` and names the relation it used
in its answer, so a client that calibrates ``sigma`` for an epsilon with the default is charged
exactly that epsilon on every path (before issue 20 ``/hidden-state`` defaulted to add/remove while the
privatizer and ``/lora-delta`` used replace-one, and such a client was charged 2.15 instead of 1).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from gaussdp.errors import InvalidParameter

__all__ = [
    "DEFAULT_HIDDEN_STATE_NEIGHBOURING",
    "HIDDEN_STATE_NEIGHBOURINGS",
    "HiddenStateNeighbouring",
    "Neighbouring",
    "check_neighbouring",
    "hidden_state_sensitivity",
]


class Neighbouring(StrEnum):
    """Which datasets are neighbours: the relation a guarantee is stated under.

    A ``str`` enum: its members equal, print and serialise (JSON) as their values.
    """

    #: One record added or removed (Poisson-subsampled DP-SGD; an absent row counts as zero).
    ADD_REMOVE = "add_remove"
    #: One record replaced by another (the dataset size is public: fixed batches, hidden states).
    REPLACE_ONE = "replace_one"


# Spellings earlier versions of gaussdp accepted, refused now with the one to write instead.
_OLD_SPELLINGS = {
    "replace": Neighbouring.REPLACE_ONE,
    "replace-one": Neighbouring.REPLACE_ONE,
    "add-remove": Neighbouring.ADD_REMOVE,
}


def check_neighbouring(value: Any, name: str = "neighbouring") -> Neighbouring:
    """``value`` as a :class:`Neighbouring`: ``"add_remove"`` or ``"replace_one"`` (or a member).

    Raises:
        TypeError: not a string.
        InvalidParameter: any other string; an older spelling gets the one to write in the message.
    """
    if isinstance(value, Neighbouring):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be 'add_remove' or 'replace_one', got {name}={value!r}")
    try:
        return Neighbouring(value)
    except ValueError:
        pass
    right = _OLD_SPELLINGS.get(value)
    if right is not None:
        raise InvalidParameter(f"{name}={value!r} is not accepted: write {name}={right.value!r}")
    raise InvalidParameter(f"{name} must be 'add_remove' or 'replace_one', got {name}={value!r}")


#: The relations as a type for annotations and JSON schemas (the values of :class:`Neighbouring`).
HiddenStateNeighbouring = Literal["replace_one", "add_remove"]
HIDDEN_STATE_NEIGHBOURINGS: tuple[str, ...] = tuple(n.value for n in Neighbouring)
DEFAULT_HIDDEN_STATE_NEIGHBOURING: HiddenStateNeighbouring = "replace_one"  # Neighbouring.REPLACE_ONE


def hidden_state_sensitivity(clip_norm: float, neighbouring: str) -> float:
    """L2 sensitivity of one row clipped to ``clip_norm``: ``2C`` (replace_one), ``C`` (add_remove)."""
    if check_neighbouring(neighbouring) is Neighbouring.REPLACE_ONE:
        return 2.0 * clip_norm
    return float(clip_norm)
