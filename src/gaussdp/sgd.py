"""Framework-free DP-SGD on numpy gradients: a DP-SGD ``PrivacyManager`` and ``DPSGDTrainer``.

The flow of every step is the library's: **clip** (:mod:`gaussdp.clipping`) -> **charge** one
step to the run's accountant -> **noise** (:class:`gaussdp.mechanism.GaussianMechanism`) ->
release. Gradients are numpy arrays or dicts of numpy arrays; the L2 norm is taken over all of
them together.

Calibration, unlike the original DP-SGD privacy manager, which splits its budget as
``epsilon / sqrt(T)`` per round and calls that "advanced composition": by the theorem that split does not keep
the total under ``epsilon``. Here the whole run is fixed up front (``num_rounds`` noisy steps, each on a
Poisson sample with probability ``sample_rate``) and the noise multiplier is the smallest one for
which the tight accountant (``accountant="pld"``, privacy loss distributions) certifies the whole
run at ``(epsilon, delta)`` (:func:`gaussdp.accounting.noise_for_epsilon`, through the DP-SGD privacy
manager's run budget :class:`gaussdp.accounting.run_budget.PrivacyBudget`, the manager's ``privacy_budget``).
After ``num_rounds`` steps the manager refuses further releases with
:class:`gaussdp.errors.BudgetExhausted` (nothing is noised or released), and
:meth:`PrivacyManager.get_privacy_status` reports the accountant's epsilon of the steps taken.

What one step protects (neighbouring relation: add/remove of one record):

* ``per_example=True`` (DP-SGD): the leading axis of the gradients indexes examples; each
  example's gradient is clipped to ``clip_norm``, the clipped gradients are summed (sensitivity
  ``clip_norm``), noised, and divided by ``expected_batch_size`` (or by the batch size when none
  was given: only a post-processing if the batch size is public, i.e. not with Poisson sampling).
  A record is one example.
* ``per_example=False`` (the DP-SGD privacy manager's use, e.g. one client's update in federated learning):
  the whole gradient is one contribution, clipped to ``clip_norm`` and noised. A record is that
  contribution (one client); ``sample_rate`` is then the client sampling rate.

Only clipped data keeps the guarantee: :meth:`PrivacyManager.add_gaussian_noise` alone noises
whatever it is given (it is the release step, so it is what charges the budget).

References:
    Abadi, M. et al. (2016). Deep Learning with Differential Privacy. CCS (DP-SGD).
    Doroshenko, V., Ghazi, B., Kamath, P., Kumar, R. & Manurangsi, P. (2022). Connect the Dots:
    Tighter Discrete Approximations of Privacy Loss Distributions. PETS (the PLD accountant).
    Dwork, C. & Roth, A. (2014), Theorem 3.20 (advanced composition, for comparison).
"""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from gaussdp import mechanism as _mechanism
from gaussdp._validate import (
    SetOnce,
    check_choice,
    check_delta,
    check_epsilon,
    check_positive,
    check_probability,
)
from gaussdp.clipping import clip_rows, clip_tree
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.noise import SourceKind
from gaussdp.paramdict import GaussianDifferentialPrivacy, add_noise_to_tree

__all__ = [
    "DPSGDTrainer",
    "GaussianDifferentialPrivacy",
    "PrivacyManager",
]

Gradients = Any  # a numpy array, or a dict name -> numpy array

# Keys of the DP-SGD privacy manager's ``privacy:`` YAML block, and the ones gaussdp adds.
_YAML_KEYS = {
    "use_differential_privacy",
    "epsilon",
    "delta",
    "clip_norm",
    "composition",
    "num_rounds",
    "sample_rate",
    "expected_batch_size",
    "accountant",
    "noise",
}


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidParameter(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def _as_gradients(gradients: Any, name: str = "gradients") -> Gradients:
    """A float numpy array or a dict of them (integers become float64); TypeError otherwise."""
    if isinstance(gradients, Mapping):
        if len(gradients) == 0:
            raise UnsafeInput(f"{name} must not be an empty dict")
        return {k: _as_leaf(v, f"{name}[{k!r}]") for k, v in gradients.items()}
    return _as_leaf(gradients, name)


def _as_leaf(value: Any, name: str) -> np.ndarray:
    if type(value).__module__.split(".")[0] == "torch":
        raise TypeError(f"{name}: gaussdp.sgd works on numpy gradients; use gaussdp.torch for tensors")
    try:
        arr = np.asarray(value)
    except ValueError as exc:
        raise UnsafeInput(f"{name} is not a regular array: {exc}") from None
    if arr.dtype.kind in "bc" or arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    if arr.size == 0:
        raise UnsafeInput(f"{name} is empty (shape {arr.shape})")
    return arr if arr.dtype.kind == "f" else arr.astype(np.float64)


def _float_from_config(name: str, value: Any) -> Any:
    # PyYAML (YAML 1.1) reads ``1e-5`` without a dot as the string "1e-5".
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise TypeError(f"{name} must be a number, got {name}={value!r}") from None
    return value


class PrivacyManager(SetOnce):
    """The DP-SGD privacy manager, calibrated so the whole run is ``(epsilon, delta)``-DP.

    Args:
        epsilon, delta: the guarantee of the *whole run* of ``num_rounds`` steps (add/remove of
            one record; see the module docstring for what a record is).
        clip_norm: L2 bound per record (per example, or per contribution), > 0.
        num_rounds: number of noisy steps the run may take (the manager refuses more).
        sample_rate: Poisson sampling probability of a record per step, in (0, 1] (1: every
            record takes part in every step).
        expected_batch_size: denominator of the averaged gradient in per-example mode (Poisson
            sampling: ``sample_rate * dataset size``); None divides by the actual batch size.
        accountant: accountant used to calibrate and report (``"pld"``, tight, by default).
        noise: ``"secure"`` (default, floating-point safe) or ``"fast"`` (bulk training noise).
        seed: reproducible noise, **not private** (warns :class:`NotPrivateWarning`).

    Raises:
        InvalidParameter / TypeError: a parameter out of range or of the wrong type.
    """

    # the clip bound and the noise were calibrated together: set once (gaussdp._validate.SetOnce),
    # since clipping to a larger bound than the noise was scaled for would under-noise
    _CALIBRATED = frozenset({"clip_norm", "noise_multiplier"})

    def __init__(
        self,
        epsilon: float,
        delta: float,
        clip_norm: float = 1.0,
        num_rounds: int = 1,
        *,
        sample_rate: float = 1.0,
        expected_batch_size: float | None = None,
        accountant: str = "pld",
        noise: SourceKind = "secure",
        seed: int | None = None,
    ) -> None:
        from gaussdp.accounting.run_budget import PrivacyBudget

        self.epsilon = check_epsilon(epsilon)
        self.delta = check_delta(delta)
        self.clip_norm = check_positive("clip_norm", clip_norm)
        self.num_rounds = _check_count("num_rounds", num_rounds)
        self.sample_rate = check_probability("sample_rate", sample_rate)
        self.expected_batch_size = (
            None
            if expected_batch_size is None
            else check_positive("expected_batch_size", expected_batch_size)
        )
        check_choice("noise", noise, ("secure", "fast"))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"seed must be an int or None, got seed={seed!r}")
        self.accountant_name = accountant
        # The DP-SGD privacy manager's run budget (gaussdp.accounting): the smallest noise multiplier whose
        # num_rounds (sub)sampled Gaussian steps compose to (epsilon, delta) under the accountant,
        # and a round counter that refuses step num_rounds + 1.
        self.privacy_budget = PrivacyBudget(
            self.epsilon, self.delta, self.num_rounds, sample_rate=self.sample_rate, accountant=accountant
        )
        self.noise_multiplier = float(self.privacy_budget.noise_multiplier)
        self.noise = noise
        self.seed = seed
        self.composition_requested: str | None = None
        if seed is not None:
            warnings.warn(
                "PrivacyManager(seed=...) gives reproducible noise that anyone who knows the seed can "
                "remove: the training run is not private",
                NotPrivateWarning,
                stacklevel=2,
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)  # warned above
            mech = _mechanism.GaussianMechanism(
                sigma=self.noise_multiplier * self.clip_norm,
                sensitivity=self.clip_norm,
                noise=noise,
                seed=seed,
            )
            if mech.accounted_sensitivity != self.clip_norm:
                # The float-safe release accounts for a sensitivity a hair above clip_norm (grid
                # rounding, gaussdp.noise.GRID_SLACK): scale sigma so the accounted noise
                # multiplier is exactly the calibrated one.
                mech = _mechanism.GaussianMechanism(
                    sigma=self.noise_multiplier * mech.accounted_sensitivity,
                    sensitivity=self.clip_norm,
                    noise=mech.source,
                )
        self._mechanism = mech
        self._last_norms: np.ndarray = np.zeros(0)

    # -- configuration -----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any], **overrides: Any) -> PrivacyManager | None:
        """Build from the DP-SGD privacy manager's ``privacy:`` block (or a mapping holding one).

        Keys: ``use_differential_privacy`` (False -> returns None), ``epsilon``, ``delta``,
        ``clip_norm``, ``num_rounds``, ``sample_rate``, ``expected_batch_size``, ``accountant``,
        ``noise``, and the DP-SGD privacy manager's ``composition`` ("basic" or "advanced"), which is recorded
        but not used: every accountant gives a valid bound for the same noise, and calibrating with
        the tight one (``accountant``, default "pld") gives the same guarantee with less noise.
        Unknown keys are refused (a misspelt epsilon must not fall back to a default).
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        block = config.get("privacy", config)
        if not isinstance(block, Mapping):
            raise TypeError("the 'privacy' entry of config must be a mapping")
        unknown = sorted(set(block) - _YAML_KEYS)
        if unknown:
            raise InvalidParameter(
                f"unknown privacy config keys {unknown}; expected a subset of {sorted(_YAML_KEYS)}"
            )
        enabled = block.get("use_differential_privacy", True)
        if not isinstance(enabled, bool):
            raise TypeError(f"use_differential_privacy must be true or false, got {enabled!r}")
        if not enabled:
            return None
        for required in ("epsilon", "delta"):
            if required not in block and required not in overrides:
                raise InvalidParameter(f"privacy config needs '{required}'")
        composition = block.get("composition")
        if composition is not None:
            check_choice("composition", composition, ("basic", "advanced"))
        kwargs: dict[str, Any] = {
            k: _float_from_config(k, block[k])
            for k in ("epsilon", "delta", "clip_norm", "sample_rate", "expected_batch_size")
            if k in block
        }
        for k in ("num_rounds", "accountant", "noise"):
            if k in block:
                kwargs[k] = block[k]
        kwargs.update(overrides)
        manager = cls(**kwargs)
        manager.composition_requested = composition
        return manager

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **overrides: Any) -> PrivacyManager | None:
        """Build from a YAML file with the DP-SGD privacy manager's ``privacy:`` block (needs pyyaml)."""
        try:
            import yaml
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError("PrivacyManager.from_yaml needs pyyaml: pip install 'gaussdp[cli]'") from None
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if not isinstance(data, Mapping):
            raise InvalidParameter(f"{os.fspath(path)!r} does not hold a YAML mapping")
        return cls.from_config(data, **overrides)

    # -- clip --------------------------------------------------------------------------------------
    def _clip(self, gradients: Any, per_example: bool) -> tuple[Gradients, np.ndarray]:
        grads = _as_gradients(gradients)
        if not per_example:
            if isinstance(grads, dict):
                clipped, norm = clip_tree(grads, self.clip_norm)
            else:
                clipped, norm = clip_tree([grads], self.clip_norm)
                clipped = clipped[0]
            return clipped, np.array([norm])
        leaves = grads if isinstance(grads, dict) else {"": grads}
        sizes = {k: v.shape[0] if v.ndim else None for k, v in leaves.items()}
        batch = set(sizes.values())
        if None in batch or len(batch) != 1:
            raise UnsafeInput(
                f"per-example gradients need one leading batch axis shared by every array, got {sizes}"
            )
        b = int(next(iter(leaves.values())).shape[0])
        if b == 0:
            raise UnsafeInput("per-example gradients hold no example (batch axis of length 0)")
        if len({v.dtype for v in leaves.values()}) > 1:
            # Mixed dtypes: clip each example's tree on its own, so that the cast back to each
            # leaf's dtype is inside clip_tree's norm guarantee.
            per = [clip_tree({k: v[i] for k, v in leaves.items()}, self.clip_norm) for i in range(b)]
            stacked = {k: np.stack([p[0][k] for p in per]) for k in leaves}
            norms_mixed = np.array([p[1] for p in per])
            return (stacked if isinstance(grads, dict) else stacked[""]), norms_mixed
        flat = np.concatenate([v.reshape(b, -1) for v in leaves.values()], axis=1)
        clipped_flat, norms = clip_rows(flat, self.clip_norm)
        out: dict[str, np.ndarray] = {}
        col = 0
        for k, v in leaves.items():
            width = int(np.prod(v.shape[1:], dtype=np.int64))
            out[k] = clipped_flat[:, col : col + width].reshape(v.shape)
            col += width
        return (out if isinstance(grads, dict) else out[""]), np.asarray(norms)

    def clip_gradients(self, gradients: Gradients, *, per_example: bool = False) -> Gradients:
        """Clip to L2 norm ``clip_norm`` over all arrays together (per example if asked).

        Args:
            gradients: a numpy array or a dict of numpy arrays.
            per_example: the leading axis of every array indexes examples; each example's
                gradient (across all arrays) is clipped on its own.

        Returns:
            The clipped gradients, same structure, shapes and float dtypes.

        Raises:
            UnsafeInput: NaN/Inf, empty arrays or dicts, mismatched batch axes.
        """
        clipped, norms = self._clip(gradients, per_example)
        self._last_norms = norms
        return clipped

    # -- charge and noise --------------------------------------------------------------------------
    @property
    def rounds_used(self) -> int:
        """Noisy steps taken so far."""
        return int(self.privacy_budget.rounds_used)

    def _charge_one_round(self) -> None:
        # Raises BudgetExhausted, charging nothing, once num_rounds steps were taken.
        self.privacy_budget.use_round()

    def add_gaussian_noise(self, gradients: Gradients) -> Gradients:
        """Charge one step, then add ``N(0, get_noise_scale()^2)`` to every coordinate.

        The guarantee needs the input to be clipped (or a sum of per-example clipped gradients).

        Raises:
            BudgetExhausted: ``num_rounds`` steps were already taken (nothing released).
        """
        grads = _as_gradients(gradients)
        leaves = grads if isinstance(grads, dict) else {"": grads}
        for k, v in leaves.items():
            if not np.isfinite(v).all():
                raise UnsafeInput(f"gradients{'' if k == '' else f'[{k!r}]'} contains NaN or Inf")
        self._charge_one_round()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)  # warned at construction
            noisy = add_noise_to_tree(self._mechanism, leaves)
        return noisy if isinstance(grads, dict) else noisy[""]

    def apply_privacy(self, gradients: Gradients, *, per_example: bool = False) -> Gradients:
        """One DP step: clip, charge, noise (and, per example, sum and average).

        Args:
            gradients: a numpy array or dict of arrays; with ``per_example=True`` a batch of
                per-example gradients (leading axis = examples).
            per_example: see :meth:`clip_gradients`.

        Returns:
            The noisy gradient (per example: the noisy *average* gradient, without the batch axis).

        Raises:
            BudgetExhausted: no step left (nothing released). UnsafeInput: NaN/Inf or bad shapes.
        """
        clipped, norms = self._clip(gradients, per_example)
        self._last_norms = norms
        if per_example:
            leaves = clipped if isinstance(clipped, dict) else {"": clipped}
            # The sum stays float64 until it is noised: rounding it to float32 first would move two
            # neighbouring sums by more than the sensitivity the noise is calibrated for.
            summed = {k: v.sum(axis=0, dtype=np.float64) for k, v in leaves.items()}
            noisy = self.add_gaussian_noise(summed)
            denom = self.expected_batch_size or float(norms.shape[0])
            out = {k: (v / denom).astype(leaves[k].dtype, copy=False) for k, v in noisy.items()}
            return out if isinstance(clipped, dict) else out[""]
        return self.add_gaussian_noise(clipped)

    # -- status ------------------------------------------------------------------------------------
    def get_noise_scale(self) -> float:
        """Standard deviation of the noise added per coordinate (``noise_multiplier * clip_norm``)."""
        return float(self._mechanism.sigma)

    def epsilon_spent(self) -> float:
        """The accountant's epsilon, at the run's delta, of the steps taken so far."""
        return float(self.privacy_budget.epsilon_spent())

    def whole_run_epsilon(self) -> float:
        """The accountant's epsilon, at the run's delta, of all ``num_rounds`` steps (<= epsilon)."""
        from gaussdp.accounting import accountant as make_accountant

        acct = make_accountant(self.accountant_name).compose(self.privacy_budget.event, self.num_rounds)
        return float(acct.epsilon(self.delta))

    def get_privacy_status(self) -> dict[str, Any]:
        """The DP-SGD privacy manager's status dict: the run budget's figures plus clipping and noise."""
        status = dict(self.privacy_budget.get_status())
        status.update(
            clip_norm=self.clip_norm,
            noise_scale=self.get_noise_scale(),
            noise=self.noise,
            composition_requested=self.composition_requested,
            budget_exhausted=self.rounds_used >= self.num_rounds,
            private=self.seed is None,
        )
        return status


class DPSGDTrainer:
    """The DP-SGD privacy manager's training wrapper: one :meth:`clip_and_noise_gradients` call per step.

    Args:
        privacy_manager: the :class:`PrivacyManager` of the run.
    """

    def __init__(self, privacy_manager: PrivacyManager) -> None:
        if not isinstance(privacy_manager, PrivacyManager):
            raise TypeError(f"privacy_manager must be a PrivacyManager, got {type(privacy_manager).__name__}")
        self.privacy_manager = privacy_manager
        self._gradients_clipped = 0
        self._gradients_over_norm = 0
        self._noise_added = 0
        self._steps = 0

    def clip_and_noise_gradients(self, gradients: Gradients, *, per_example: bool = False) -> Gradients:
        """Clip, charge, noise: :meth:`PrivacyManager.apply_privacy`, counted in :meth:`get_stats`."""
        pm = self.privacy_manager
        out = pm.apply_privacy(gradients, per_example=per_example)
        norms = pm._last_norms
        self._gradients_clipped += int(norms.shape[0])
        self._gradients_over_norm += int(np.count_nonzero(norms > pm.clip_norm))
        self._noise_added += 1
        self._steps += 1
        return out

    def get_stats(self) -> dict[str, Any]:
        """Counts: gradients clipped (every gradient passed through clipping), of which over the
        norm, noise additions, training steps, and the manager's privacy status."""
        return {
            "gradients_clipped": self._gradients_clipped,
            "gradients_over_norm": self._gradients_over_norm,
            "noise_added": self._noise_added,
            "training_steps": self._steps,
            "privacy_budget": self.privacy_manager.get_privacy_status(),
        }
