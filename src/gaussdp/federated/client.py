"""Client side of federated learning: clip the update, optionally noise it locally, sanitize coresets.

* :func:`clip_update` clips the **difference** between the client's locally trained model and the
  global model it started from (the update), by its global L2 norm over all parameters. The federated
  parameter-dict API clips the model parameters themselves, which bounds nothing useful: the server averages
  updates.
* :class:`LocalGaussian` is local DP: the client clips and noises its own update, so that nothing it
  sends needs a trusted server. Each client is charged in its **own** ledger principal
  (``"client/<id>"``) before the noisy update leaves it.
* :func:`sanitize_coreset` is the federated anomaly detector's flow: a client sanitizes its embedding coreset
  with :class:`gaussdp.embeddings.EmbeddingSanitizer` before sending it, charged first to its principal
  with the round number, so that the server's report groups the spends by round.

Local DP neighbouring relation: the noisy update must hide *any* change of the client's data, i.e.
the replacement of its clipped update by any other one in the ``C``-ball: the L2 sensitivity is
``2C`` (not ``C`` as in Flower's ``LocalDpMod``, which also calibrates with the classical formula
outside its range). In gaussdp's add/remove accounting this is a Gaussian event with noise multiplier
``sigma / (2C)``.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import numpy as np

from gaussdp._validate import SetOnce, check_positive
from gaussdp.accounting.events import check_noise_multiplier
from gaussdp.errors import InvalidParameter, NotPrivateWarning, PrivacyError
from gaussdp.federated._tree import flatten, tree_sub, unflatten_like
from gaussdp.federated.rounds import RoundLedger

__all__ = ["LocalGaussian", "client_principal", "clip_update", "sanitize_coreset"]


def client_principal(client_id: Any) -> str:
    """The ledger principal of one client: ``"client/<id>"``."""
    return f"client/{client_id}"


def clip_update(update: Any, global_params: Any, clip_norm: float) -> tuple[Any, float]:
    """Clip the client's model delta ``update - global_params`` to global L2 norm ``clip_norm``.

    Args:
        update: the client's locally trained parameters (dict or list of numpy arrays / torch tensors).
        global_params: the global parameters the client started from (same structure and shapes).
        clip_norm: C > 0.

    Returns:
        ``(clipped_delta, norm)``: the clipped difference (same structure) and its norm before clipping.

    Raises:
        UnsafeInput: different structures or shapes, NaN/Inf.

    >>> import numpy as np
    >>> delta, norm = clip_update([np.array([4.0, 3.0])], [np.array([1.0, -1.0])], 1.0)
    >>> norm, delta[0].round(6).tolist()
    (5.0, [0.6, 0.8])
    """
    from gaussdp.clipping import clip_tree

    c = check_positive("clip_norm", clip_norm)
    return clip_tree(tree_sub(update, global_params), c)


class LocalGaussian(SetOnce):
    """Local DP for a client's update: clip the delta, charge the client's ledger, add noise, send.

    Give either ``epsilon`` and ``delta`` (per release; sigma calibrated exactly, Balle & Wang 2018,
    for sensitivity ``2 C``) or ``noise_multiplier`` (sigma = ``noise_multiplier * 2 C``).

    Args:
        clip_norm: C, bound on the norm of the update.
        epsilon, delta: per-release target (replacement neighbouring relation, see the module doc).
        noise_multiplier: alternatively, sigma / (2C).
        ledger: a :class:`gaussdp.budget.Ledger` or URL; every client gets principal ``client/<id>``.
        budget_epsilon, budget_delta: each client's total budget (default: 10 releases' worth is not
            assumed: both must be given when ``ledger`` is).
        accountant: the ledger accountant for the client principals.
        noise: ``"secure"`` (default) or ``"fast"``.
        seed: reproducible noise for experiments, **not private**.
    """

    _CALIBRATED = frozenset({"clip_norm", "sensitivity", "sigma"})  # gaussdp._validate.SetOnce

    def __init__(
        self,
        *,
        clip_norm: float,
        epsilon: float | None = None,
        delta: float | None = None,
        noise_multiplier: float | None = None,
        ledger: Any = None,
        budget_epsilon: float | None = None,
        budget_delta: float | None = None,
        accountant: str = "pld",
        noise: Any = "secure",
        seed: int | None = None,
    ) -> None:
        from gaussdp.calibration import sigma_for

        self.clip_norm = check_positive("clip_norm", clip_norm)
        self.sensitivity = 2.0 * self.clip_norm
        if noise_multiplier is not None:
            if epsilon is not None:
                raise InvalidParameter("give epsilon and delta, or noise_multiplier, not both")
            self.sigma = check_noise_multiplier(noise_multiplier) * self.sensitivity
        elif epsilon is None or delta is None:
            raise InvalidParameter("LocalGaussian needs epsilon and delta, or noise_multiplier")
        else:
            self.sigma = sigma_for(epsilon=epsilon, delta=delta, sensitivity=self.sensitivity)
        self.noise = noise
        self.seed = seed
        self._releases = 0
        if seed is not None:
            warnings.warn(
                "LocalGaussian(seed=...) gives reproducible noise anyone who knows the seed can remove: "
                "the updates are not private",
                NotPrivateWarning,
                stacklevel=2,
            )
        self._ledger = None
        if ledger is not None:
            if budget_epsilon is None or budget_delta is None:
                raise InvalidParameter("with a ledger, give each client's budget_epsilon and budget_delta")
            from gaussdp.federated.rounds import _as_ledger

            self._ledger = _as_ledger(ledger)
        self._budget = (budget_epsilon, budget_delta)
        self.accountant = accountant
        self._clients: dict[str, RoundLedger] = {}

    @property
    def noise_multiplier(self) -> float:
        """sigma / (2C) (add/remove units, see the module doc)."""
        return self.sigma / self.sensitivity

    @property
    def event(self) -> Any:
        """One local release: ``GaussianEvent(sigma / (2C))`` (times ``1/(1 + GRID_SLACK)`` when the
        release is float-safe, as :class:`gaussdp.mechanism.GaussianMechanism` accounts it)."""
        from gaussdp.mechanism import GaussianMechanism

        return GaussianMechanism(sigma=self.sigma, sensitivity=self.sensitivity, noise=self.noise).event

    def epsilon(self, delta: float, releases: int = 1) -> float:
        """Per-client epsilon after ``releases`` local releases (PLD accountant)."""
        from gaussdp.accounting import accountant

        return float(accountant("pld").compose(self.event, releases).epsilon(delta))

    def client_ledger(self, client_id: Any) -> RoundLedger:
        """The client's own principal on the ledger (opened on first use)."""
        if self._ledger is None:
            raise InvalidParameter("this LocalGaussian has no ledger")
        p = client_principal(client_id)
        if p not in self._clients:
            eps, dlt = self._budget
            if eps is None or dlt is None:  # checked in __init__ when a ledger is given
                raise InvalidParameter("a LocalGaussian with a ledger needs epsilon and delta budgets")
            self._clients[p] = RoundLedger(
                self._ledger, p, epsilon=eps, delta=dlt, accountant=self.accountant
            )
        return self._clients[p]

    def privatize(
        self, update: Any, global_params: Any, *, client_id: Any, round_num: int | None = None
    ) -> Any:
        """Clip ``update - global_params``, charge the client, return the noisy delta (same structure).

        Raises:
            BudgetExhausted: the client's budget is spent; nothing is released.
            UnsafeInput: NaN/Inf or mismatched trees.
        """
        delta, _ = clip_update(update, global_params, self.clip_norm)
        if self._ledger is not None:
            led = self.client_ledger(client_id)
            r = round_num if round_num is not None else led.rounds_done + 1
            led.charge_round(r, self.event)
        self._releases += 1
        return self._noised(delta, client_id, round_num)

    def privatize_rows(self, deltas: np.ndarray, client_ids: Any, *, round_num: int) -> np.ndarray:
        """Vectorised :meth:`privatize` for a ``[clients, params]`` matrix of deltas (simulator)."""
        from gaussdp.clipping import clip_rows

        clipped, _ = clip_rows(deltas, self.clip_norm)
        if self._ledger is not None:
            for cid in np.asarray(client_ids).tolist():
                self.client_ledger(cid).charge_round(round_num, self.event)
        self._releases += 1  # a seeded run draws fresh noise every round
        return self._noised([clipped], "rows", round_num)[0]

    def _noised(self, tree: Any, client_id: Any, round_num: int | None) -> Any:
        from gaussdp.mechanism import GaussianMechanism

        seed = None
        if self.seed is not None:
            ss = np.random.SeedSequence([self.seed, zlib.crc32(str(client_id).encode()), self._releases])
            seed = int(ss.generate_state(1, dtype=np.uint64)[0]) >> 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)  # warned once, at construction
            mech = GaussianMechanism(
                sigma=self.sigma, sensitivity=self.sensitivity, noise=self.noise, seed=seed
            )
            # One release over the whole update: one float-safe grid, whose rounding slack the
            # mechanism accounts for (leaf-by-leaf calls would each add their own slack).
            vec, _ = flatten(tree, "update")
            return unflatten_like(np.asarray(mech.add_noise(vec)), tree)


def sanitize_coreset(
    sanitizer: Any,
    coreset: Any,
    *,
    client_id: Any,
    round_num: int,
    ledger: Any = None,
    budget_epsilon: float | None = None,
    budget_delta: float | None = None,
    accountant: str = "pld",
) -> np.ndarray:
    """The anomaly detector's client step: charge the client, then ``sanitizer.sanitize(coreset)``.

    The charge (``sanitizer.event``, keyed by round) is durable before the sanitized coreset exists, so
    the server's :func:`~gaussdp.federated.rounds.round_report` sees every spend grouped by round.
    Each row of the coreset is one record (add/remove of one row; see :mod:`gaussdp.embeddings`).

    Raises:
        BudgetExhausted: the client's budget would be exceeded; nothing is sanitized or sent.
        InvalidParameter: the sanitizer is disabled (the federated anomaly detector would send raw embeddings:
            refused).
    """
    if getattr(sanitizer, "mechanism", None) is None:
        raise InvalidParameter(
            "the sanitizer is disabled (DPConfig(enabled=False)): that would send the raw coreset; "
            "refused (enable DP or do not call sanitize_coreset)"
        )
    if ledger is not None:
        if budget_epsilon is None or budget_delta is None:
            raise InvalidParameter("with a ledger, give the client's budget_epsilon and budget_delta")
        led = RoundLedger(
            ledger,
            client_principal(client_id),
            epsilon=budget_epsilon,
            delta=budget_delta,
            accountant=accountant,
        )
        led.charge_round(round_num, sanitizer.event, tag="coreset")
    out = sanitizer.sanitize(coreset)
    if out is coreset:  # pragma: no cover - sanitize returns its input only when disabled
        raise PrivacyError("the sanitizer returned its input unchanged: nothing private to send")
    return np.asarray(out)
