"""Federated learning's parameter-dict privatizer: ``GaussianDifferentialPrivacy(clip_norm, seed)``.

``apply_privacy(params, epsilon, delta)`` clips the global L2 norm of a dict of arrays (numpy
arrays or torch tensors) to ``clip_norm`` and adds ``N(0, sigma^2)`` to every entry, ``sigma``
calibrated exactly (Balle & Wang 2018) for ``(epsilon, delta)`` at sensitivity ``clip_norm``. The
flow is clip (:func:`gaussdp.clipping.clip_tree`) -> charge -> noise
(:class:`gaussdp.mechanism.GaussianMechanism`) -> release; nothing is re-implemented here.

**Parameters vs updates.** The federated parameter-dict API clips *the model parameters themselves*. That is
what ``apply_privacy(params, epsilon, delta)`` does when called without ``reference``, and it is rarely
what federated learning needs: a trained model's parameters have a large norm, so clipping them
to ``clip_norm`` destroys the model, and the quantity one client contributes to the aggregate is
its *update* (local model minus the global model it started from). Pass
``reference=global_params``: the difference ``params - reference`` is clipped and noised, and
``reference + noisy update`` is returned. This is the client side of DP-FedAvg.

**What the guarantee covers.** The clipped dict moves by at most ``clip_norm`` in L2 norm when
the contribution is added to or removed from an aggregate (an absent contribution counts as zero):
sensitivity ``clip_norm``, which is what the federated parameter-dict API assumes ("worst-case parameter
change"), and each call is then ``(epsilon, delta)``-DP. If one contribution may instead be *replaced* by
another, two dicts in the ``clip_norm``-ball differ by up to ``2 * clip_norm``: the same call is
then ``(epsilon', delta)``-DP with the larger ``epsilon'`` returned by
:meth:`GaussianDifferentialPrivacy.epsilon_replace`.

**Budget.** ``privacy_budget_consumed`` is the federated parameter-dict API's basic composition (the sum of
the epsilons of every call since the last reset; deltas add up in ``delta_consumed``). It is a valid
upper bound but a loose one; :meth:`GaussianDifferentialPrivacy.privacy_spent` composes the same
releases with the tight accountant of :mod:`gaussdp.accounting`.

**Seeds.** The federated parameter-dict API offers a random seed for reproducibility. A seeded privatizer
warns :class:`gaussdp.errors.NotPrivateWarning` and marks itself ``private=False``: anyone who knows
the seed can subtract the noise.

References:
    Balle, B. & Wang, Y.-X. (2018). Improving the Gaussian Mechanism for Differential Privacy. ICML.
    McMahan, H. B., Ramage, D., Talwar, K. & Zhang, L. (2018). Learning Differentially Private
    Recurrent Language Models (DP-FedAvg: per-client update clipping). ICLR.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from gaussdp import mechanism as _mechanism
from gaussdp._validate import check_choice, check_delta, check_epsilon, check_positive
from gaussdp.clipping import clip_tree
from gaussdp.errors import NotPrivateWarning, UnsafeInput
from gaussdp.noise import SourceKind

__all__ = ["GaussianDifferentialPrivacy"]


def _is_torch_tensor(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach")


def _check_param_dict(params: Any, name: str) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise TypeError(f"{name} must be a dict of arrays or tensors, got {type(params).__name__}")
    if len(params) == 0:
        raise UnsafeInput(f"{name} must not be empty")
    out: dict[str, Any] = {}
    for key, value in params.items():
        if _is_torch_tensor(value):
            if not value.is_floating_point():
                raise UnsafeInput(f"{name}[{key!r}] must be a floating-point tensor, got {value.dtype}")
            out[key] = value
            continue
        arr = value if isinstance(value, np.ndarray) else None
        if arr is None:
            try:
                arr = np.asarray(value)
            except ValueError as exc:  # ragged nested lists
                raise UnsafeInput(f"{name}[{key!r}] is not a regular array: {exc}") from None
        if arr.dtype.kind not in "fiu":
            raise UnsafeInput(f"{name}[{key!r}] must be a real numeric array, got dtype {arr.dtype}")
        if arr.dtype.kind != "f":
            arr = arr.astype(np.float64)
        out[key] = arr
    return out


def _same_structure(params: dict[str, Any], reference: dict[str, Any]) -> None:
    if set(params) != set(reference):
        missing = sorted(map(str, set(params) ^ set(reference)))
        raise UnsafeInput(f"params and reference must have the same keys; differing keys: {missing}")
    for key in params:
        if tuple(params[key].shape) != tuple(reference[key].shape):
            raise UnsafeInput(
                f"params[{key!r}] has shape {tuple(params[key].shape)} but reference[{key!r}] has "
                f"shape {tuple(reference[key].shape)}"
            )
        if _is_torch_tensor(params[key]) != _is_torch_tensor(reference[key]):
            raise TypeError(f"params[{key!r}] and reference[{key!r}] must both be numpy or both torch")


def add_noise_to_tree(mech: Any, tree: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``N(0, sigma^2)`` to every entry of a dict of arrays/tensors, as ONE release.

    The leaves are concatenated (in float64, exact for every float dtype) and noised by a single
    ``mech.add_noise`` call: the floating-point-safe grid of :mod:`gaussdp.noise` bounds its
    rounding cost by the size of the whole vector, which per-leaf calls would not (their rounding
    errors would add up across leaves). Dtypes, array types and torch devices are kept.
    """
    keys = list(tree)
    pieces = []
    for key in keys:
        leaf = tree[key]
        if _is_torch_tensor(leaf):
            import torch

            pieces.append(leaf.detach().to("cpu", dtype=torch.float64).numpy().reshape(-1))
        else:
            pieces.append(np.asarray(leaf, dtype=np.float64).reshape(-1))
    noisy = np.asarray(mech.add_noise(np.concatenate(pieces)))
    out: dict[str, Any] = {}
    offset = 0
    for key, piece in zip(keys, pieces, strict=True):
        leaf = tree[key]
        values = noisy[offset : offset + piece.size].reshape(tuple(leaf.shape))
        offset += piece.size
        if _is_torch_tensor(leaf):
            import torch

            out[key] = torch.from_numpy(np.ascontiguousarray(values)).to(device=leaf.device, dtype=leaf.dtype)
        else:
            out[key] = values.astype(np.asarray(leaf).dtype)
    return out


class GaussianDifferentialPrivacy:
    """Gaussian DP for a federated client's dict of parameter arrays (numpy arrays or torch tensors).

    Args:
        clip_norm: global L2 bound of the clipped dict (the sensitivity), > 0. Default 1.0.
        seed: reproducible noise, **not private** (warns :class:`NotPrivateWarning`); each call
            still draws fresh noise from the seeded stream.
        noise: ``"secure"`` (default, floating-point safe) or ``"fast"``.

    Raises:
        InvalidParameter: ``clip_norm`` not > 0.
        TypeError: ``clip_norm`` or ``seed`` of the wrong type.
    """

    def __init__(
        self, clip_norm: float = 1.0, seed: int | None = None, *, noise: SourceKind = "secure"
    ) -> None:
        self._clip_norm = check_positive("clip_norm", clip_norm)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"seed must be an int or None, got seed={seed!r} ({type(seed).__name__})")
        check_choice("noise", noise, ("secure", "fast"))
        self._seed = None if seed is None else int(seed)
        self._noise: SourceKind = noise
        self._calls = 0
        self._epsilon_consumed = 0.0
        self._delta_consumed = 0.0
        self._events: list[Any] = []
        if self._seed is not None:
            warnings.warn(
                "GaussianDifferentialPrivacy(seed=...) gives reproducible noise that anyone who knows "
                "the seed can remove: its outputs are not private",
                NotPrivateWarning,
                stacklevel=2,
            )

    # -- the federated parameter-dict API's accessors --------------------------------------------------------
    @property
    def clip_norm(self) -> float:
        """The global L2 clipping norm (the sensitivity bound)."""
        return self._clip_norm

    @property
    def mechanism_name(self) -> str:
        """Name of the mechanism."""
        return "Gaussian"

    @property
    def private(self) -> bool:
        """False when seeded: the outputs can be de-noised by whoever knows the seed."""
        return self._seed is None

    @property
    def privacy_budget_consumed(self) -> float:
        """Sum of the epsilons of every call since the last reset (basic composition).

        A valid but loose upper bound; see :meth:`privacy_spent` for the tight one.
        """
        return self._epsilon_consumed

    @property
    def delta_consumed(self) -> float:
        """Sum of the deltas of every call since the last reset (the delta of basic composition)."""
        return self._delta_consumed

    def reset_privacy_budget(self) -> None:
        """Forget every call so far. Only when starting an independent run on *other* data:
        resetting in the middle of training makes the reported budget false."""
        self._epsilon_consumed = 0.0
        self._delta_consumed = 0.0
        self._events.clear()

    def privacy_spent(self, delta: float) -> float:
        """Tight epsilon at ``delta`` of every call since the last reset (PLD accountant)."""
        from gaussdp.accounting import accountant

        delta = check_delta(delta)
        if not self._events:
            return 0.0
        acct = accountant("pld")
        for event in self._events:
            acct.compose(event)
        return float(acct.epsilon(delta))

    def epsilon_replace(self, epsilon: float, delta: float) -> float:
        """Epsilon of one ``apply_privacy(..., epsilon, delta)`` call under replace-one neighbours.

        Replacing one contribution by another moves the clipped dict by up to ``2 * clip_norm``:
        the noise calibrated for ``clip_norm`` at ``(epsilon, delta)`` then buys this epsilon.
        """
        mech = self._mechanism(check_epsilon(epsilon), check_delta(delta), seed=None)
        doubled = _mechanism.GaussianMechanism(sigma=mech.sigma, sensitivity=2.0 * self._clip_norm)
        return float(doubled.epsilon(delta))

    # -- the release -------------------------------------------------------------------------------
    def _mechanism(self, epsilon: float, delta: float, seed: int | None) -> Any:
        return _mechanism.GaussianMechanism(
            epsilon=epsilon, delta=delta, sensitivity=self._clip_norm, noise=self._noise, seed=seed
        )

    def apply_privacy(
        self,
        params: Mapping[str, Any],
        epsilon: float,
        delta: float,
        *,
        reference: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Clip the global L2 norm to ``clip_norm``, add calibrated Gaussian noise, charge the budget.

        Without ``reference`` the parameters themselves are clipped (the federated parameter-dict API). With
        ``reference`` (the global model the update started from) the *update*
        ``params - reference`` is clipped and noised and ``reference + noisy update`` returned:
        what federated learning needs.

        Args:
            params: dict name -> numpy array or torch tensor (floating point).
            epsilon, delta: the guarantee of this call (sensitivity ``clip_norm``, add/remove).
            reference: optional dict with the same keys and shapes.

        Returns:
            A new dict with the same keys, array types, dtypes (and torch devices).

        Raises:
            InvalidParameter: epsilon or delta out of range.
            UnsafeInput: empty or ragged dicts, NaN/Inf, keys or shapes that differ from
                ``reference``. Nothing is charged or released.
        """
        epsilon = check_epsilon(epsilon)
        delta = check_delta(delta)
        tree = _check_param_dict(params, "params")
        base: dict[str, Any] | None = None
        if reference is not None:
            base = _check_param_dict(reference, "reference")
            _same_structure(tree, base)
            tree = {k: tree[k] - base[k] for k in tree}
        clipped, _norm = clip_tree(tree, self._clip_norm)
        seed = None
        if self._seed is not None:
            # A fresh, reproducible stream per call: repeating one noise draw across calls would
            # let an observer cancel it by differencing two releases.
            seed = int(np.random.SeedSequence([self._seed, self._calls]).generate_state(1)[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)  # warned once, at construction
            mech = self._mechanism(epsilon, delta, seed)
            # Charge before release: the budget counts this call even if noising fails below.
            self._calls += 1
            self._epsilon_consumed += epsilon
            self._delta_consumed += delta
            self._events.append(mech.event)
            noisy = add_noise_to_tree(mech, clipped)
        if base is not None:
            noisy = {k: base[k] + noisy[k] for k in noisy}
        return noisy

    # -- the federated parameter-dict API's CamelCase names --------------------------------------------------
    def ApplyPrivacy(self, model: Mapping[str, Any], epsilon: float, delta: float) -> dict[str, Any]:
        """Alias of :meth:`apply_privacy` (the federated parameter-dict API's name)."""
        return self.apply_privacy(model, epsilon, delta)

    def GetPrivacyBudgetConsumed(self) -> float:
        """Alias of :attr:`privacy_budget_consumed`."""
        return self.privacy_budget_consumed

    def ResetPrivacyBudget(self) -> None:
        """Alias of :meth:`reset_privacy_budget`."""
        self.reset_privacy_budget()

    def GetMechanismName(self) -> str:
        """Alias of :attr:`mechanism_name`."""
        return self.mechanism_name

    def GetClipNorm(self) -> float:
        """Alias of :attr:`clip_norm`."""
        return self.clip_norm
