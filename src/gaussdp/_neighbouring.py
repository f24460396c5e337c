"""The one neighbouring relation for hidden states, shared by the privatizer, split mode, the service
and the CLI (core level: no torch, no FastAPI, so each of them can import it).

Default: **replace-one** (``"replace"``). A released row is one token's (or one sequence's) hidden
state clipped to L2 norm ``C``; two neighbouring requests differ in one row's *content*, which can
move anywhere in the C-ball, so the row's L2 sensitivity is ``2C``. A request's rows are always
present (the server sees how many it receives), so "add or remove a row" (the zero vector against a
state, sensitivity ``C``) does not describe what a client wants hidden: what the text was. The
alternative ``"add-remove"`` stays available where a caller states it explicitly, at half the noise
for the same epsilon (the private inference server's ``Delta_f = 1`` for a clip of 1).

Every surface defaults to :data:`DEFAULT_HIDDEN_STATE_NEIGHBOURING` and names the relation it used
in its answer, so a client that calibrates ``sigma`` for an epsilon with the default is charged
exactly that epsilon on every path (before issue 20 ``/hidden-state`` defaulted to add/remove while the
privatizer and ``/lora-delta`` used replace-one, and such a client was charged 2.15 instead of 1).
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "DEFAULT_HIDDEN_STATE_NEIGHBOURING",
    "HIDDEN_STATE_NEIGHBOURINGS",
    "HiddenStateNeighbouring",
    "hidden_state_sensitivity",
]

HiddenStateNeighbouring = Literal["replace", "add-remove"]
HIDDEN_STATE_NEIGHBOURINGS: tuple[str, ...] = ("replace", "add-remove")
DEFAULT_HIDDEN_STATE_NEIGHBOURING: HiddenStateNeighbouring = "replace"


def hidden_state_sensitivity(clip_norm: float, neighbouring: str) -> float:
    """L2 sensitivity of one released row clipped to ``clip_norm``: ``2C`` (replace), ``C`` (add-remove)."""
    if neighbouring == "replace":
        return 2.0 * clip_norm
    if neighbouring == "add-remove":
        return float(clip_norm)
    raise ValueError(f"neighbouring must be 'replace' or 'add-remove', got neighbouring={neighbouring!r}")
