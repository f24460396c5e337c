"""Server-side DP-FedAvg: Poisson client sampling, clipped sum, one Gaussian noise, fixed denominator.

One round of :class:`DPFedAvg` (McMahan, Ramage, Talwar & Zhang 2018, Algorithm 1, "DP-FedAvg" with
the fixed-denominator estimator ``f_f``):

1. **check** that charging one more round keeps the run within its budget (``would_exceed``); if not,
   stop with :class:`~gaussdp.errors.BudgetExhausted` before any client computes anything;
2. **sample** every client independently with probability ``q`` (Poisson sampling, from OS entropy);
3. the sampled clients that answer send their model **deltas**; the server **clips** each to ``C``
   (client-side clipping, :func:`gaussdp.federated.clip_update`, is welcome but not trusted);
4. **charge** the round to the run's ledger principal: ``SubsampledGaussianEvent(z, q)``;
5. **noise** the sum once, ``sum_i clip(Delta_i) + N(0, (z C)^2 I)``, and **release** it divided by
   the fixed ``m = q N`` (the expected number of clients), never by the number that answered.

Guarantee: client-level (epsilon, delta)-DP of the sequence of released updates under add/remove of
one client's whole data set, with the amplification by Poisson sampling accounted (the neighbouring
relation of every gaussdp event). The ledger records one event per round and refuses a round that
would take the composed epsilon past the budget.

**Dropouts.** A sampled client that does not answer contributes the zero vector (which lies in the
clipping ball) and, with adaptive clipping, the centred bit 0 (within [-1/2, 1/2]); the denominator
stays ``q N``; the round is charged and counts even when every client dropped. The released value is
then still the same mechanism applied to a valid input, so the guarantee and the accounting are
unchanged. (Flower's wrappers instead drop the whole round, or divide by the number of answers, which
leaks that number through the scale.) A client that answers without having been sampled is refused.

**Robust aggregation** (``robust=``): the clipped deltas are combined by a
:class:`~gaussdp.federated.robust.RobustAggregator` and ``N(0, (z 2R)^2 I)`` is added to its output,
``2R`` being the aggregator's L2 sensitivity bound (see :mod:`gaussdp.federated.robust`).

References:
    McMahan, Ramage, Talwar & Zhang 2018, "Learning Differentially Private Recurrent Language
    Models", ICLR (Algorithm 1; the fixed-denominator estimator of Section 2).
    Andrew, Thakkar, McMahan & Ramaswamy 2021 (adaptive clipping; see
    :mod:`gaussdp.federated.adaptive`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gaussdp._format import format_upper
from gaussdp._validate import check_choice, check_positive, check_probability
from gaussdp.accounting.events import check_noise_multiplier
from gaussdp.errors import InvalidParameter, NotPrivateWarning, PrivacyError, UnsafeInput
from gaussdp.federated.adaptive import AdaptiveClipping, effective_noise_multiplier
from gaussdp.federated.robust import RobustAggregator
from gaussdp.federated.rounds import RoundLedger
from gaussdp.noise import GRID_SLACK

__all__ = ["DPFedAvg", "RoundPlan", "RoundResult"]


@dataclass(frozen=True)
class RoundPlan:
    """What the server decided before a round: its number, the sampled clients, the clip norm."""

    round_num: int
    clients: np.ndarray
    clip_norm: float


@dataclass(frozen=True)
class RoundResult:
    """What one round released, and what it cost."""

    round_num: int
    update: np.ndarray = field(repr=False)
    sampled: int
    answered: int
    clipped: int
    clip_norm: float
    next_clip_norm: float
    noise_stddev: float
    epsilon: float
    delta: float


def _round_seed(seed: int | None, round_num: int, stream: int) -> int | None:
    # Independent, reproducible streams per (round, purpose) when seeded; None = OS entropy.
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, round_num, stream]).generate_state(1, dtype=np.uint64)[0]) >> 1


class RoundServer:
    """What the round-based servers share (:class:`DPFedAvg`, :class:`gaussdp.federated.mf.BandedMFServer`):
    the run's ledger, its clip norm, and the round loop ``begin_round`` / clients / ``finish_round``."""

    ledger: Any
    num_params: int | None
    _clip_norm: float

    def begin_round(self) -> RoundPlan:
        raise NotImplementedError

    def finish_round(self, plan: RoundPlan, deltas: Any, answered: Any) -> RoundResult:
        raise NotImplementedError

    @property
    def clip_norm(self) -> float:
        """The clip norm of the next round (moves between rounds with adaptive clipping)."""
        return self._clip_norm

    @property
    def rounds_done(self) -> int:
        """Rounds charged to this run so far (read from the ledger: survives a restart)."""
        return int(self.ledger.rounds_done)

    def epsilon(self) -> float:
        """Client-level epsilon spent so far, at the budget's delta (a justified upper bound)."""
        return float(self.ledger.epsilon_spent())

    def run_round(self, global_params: np.ndarray, client_fn: Any, *, dropout: Any = None) -> RoundResult:
        """``begin_round``, ``client_fn(global_params, client_ids) -> deltas``, ``finish_round``.

        ``dropout(client_ids) -> mask of answering clients`` simulates failures (applied before the
        clients compute, as a real dropout would be).
        """
        plan = self.begin_round()
        ids = plan.clients
        if dropout is not None:
            ids = ids[np.asarray(dropout(ids), dtype=bool)]
        if self.num_params is None:
            self.num_params = int(np.asarray(global_params).size)
        deltas = client_fn(global_params, ids) if ids.size else None
        return self.finish_round(plan, deltas, ids)

    def state_dict(self) -> dict[str, Any]:
        """Public state to checkpoint beside the model (the ledger keeps the privacy state)."""
        return {"clip_norm": self._clip_norm, "rounds_done": self.rounds_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clip norm after a restart (the ledger restores the rest)."""
        self._clip_norm = check_positive("clip_norm", state["clip_norm"])


class DPFedAvg(RoundServer):
    """DP-FedAvg server with client-level accounting in a :class:`gaussdp.budget.Ledger`.

    Args:
        num_clients: N, the size of the client population.
        sample_rate: q in (0, 1], each client's independent probability of being sampled per round.
        noise_multiplier: z. The noise on the clipped sum has stddev ``z C`` (``z_Delta C`` with
            adaptive clipping, so that the round still costs a Gaussian of multiplier ``z``).
        clip_norm: C (ignored when ``adaptive`` is given: its ``initial_clip_norm`` is used).
        ledger: a :class:`gaussdp.budget.Ledger` or a ledger URL (``"sqlite:///run.db"``).
        run_id: the ledger principal of this training run; a new server on the same ledger and
            ``run_id`` resumes it (round numbers and spent budget continue).
        epsilon, delta: the run's budget (client-level).
        accountant: the accountant the ledger composes with (``"pld"``, tight, by default).
        adaptive: an :class:`AdaptiveClipping` to track a quantile of the update norms.
        robust: a :class:`RobustAggregator` (Krum, median, trimmed mean) instead of the sum.
        noise: ``"secure"`` (default, floating-point safe) or ``"fast"``.
        seed: reproducible sampling and noise for experiments; **not private**
            (:class:`~gaussdp.errors.NotPrivateWarning`).

    Raises:
        InvalidParameter: a parameter out of range, named.
    """

    def __init__(
        self,
        *,
        num_clients: int,
        sample_rate: float,
        noise_multiplier: float,
        ledger: Any,
        epsilon: float,
        delta: float,
        clip_norm: float | None = None,
        run_id: str = "dp-fedavg",
        accountant: str = "pld",
        adaptive: AdaptiveClipping | None = None,
        robust: RobustAggregator | None = None,
        noise: Any = "secure",
        seed: int | None = None,
    ) -> None:
        if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer) or num_clients < 1:
            raise InvalidParameter(f"num_clients must be an int >= 1, got num_clients={num_clients!r}")
        self.num_clients = int(num_clients)
        self.sample_rate = check_probability("sample_rate", sample_rate)
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        if adaptive is None:
            if clip_norm is None:
                raise InvalidParameter("give clip_norm (fixed clipping) or adaptive=AdaptiveClipping(...)")
            self._clip_norm = check_positive("clip_norm", clip_norm)
            self.sum_noise_multiplier = self.noise_multiplier
        else:
            if not isinstance(adaptive, AdaptiveClipping):
                raise TypeError(f"adaptive must be an AdaptiveClipping, got {type(adaptive).__name__}")
            self._clip_norm = adaptive.clip_norm
            self.sum_noise_multiplier = effective_noise_multiplier(
                self.noise_multiplier, adaptive.count_stddev
            )
        if robust is not None and not isinstance(robust, RobustAggregator):
            raise TypeError(f"robust must be a RobustAggregator, got {type(robust).__name__}")
        check_choice("noise", noise, ("secure", "fast"))
        self.adaptive = adaptive
        self.robust = robust
        self.noise = noise
        self.seed = seed
        self._slack = GRID_SLACK if noise == "secure" else 0.0
        if seed is not None:
            warnings.warn(
                "DPFedAvg(seed=...) makes client sampling and noise reproducible: anyone who knows the "
                "seed can remove the noise; results are not private",
                NotPrivateWarning,
                stacklevel=2,
            )
        # A client is sampled when its uniform 32-bit word is below floor(q 2^32): the true rate is
        # at most q, and amplification only improves for a smaller rate, so the event's q is an
        # upper bound on what was spent.
        self._threshold = math.floor(self.sample_rate * 2**32)
        # m = qN: the fixed denominator of the estimator (McMahan et al. 2018, Section 2).
        self.expected_clients = self.sample_rate * self.num_clients
        self.ledger = RoundLedger(ledger, run_id, epsilon=epsilon, delta=delta, accountant=accountant)
        self.history: list[RoundResult] = []
        self.num_params: int | None = None

    # -- the event charged per round ---------------------------------------------------------------
    @property
    def event(self) -> Any:
        """The event of one round: ``SubsampledGaussianEvent(z, q)`` (``GaussianEvent(z)`` at q = 1)."""
        from gaussdp.accounting import GaussianEvent, SubsampledGaussianEvent

        # The float-safe ("secure") release rounds the aggregate to a grid, which may move it by
        # GRID_SLACK * sensitivity: account for the sensitivity (1 + GRID_SLACK) * Delta (see
        # gaussdp.mechanism), i.e. the multiplier z / (1 + GRID_SLACK). Exact for noise="fast".
        z = self.noise_multiplier / (1.0 + self._slack)
        if self.sample_rate == 1.0:
            return GaussianEvent(z)
        return SubsampledGaussianEvent(z, self.sample_rate)

    def would_exceed(self, rounds: int = 1) -> bool:
        """Whether ``rounds`` more rounds would take the composed epsilon past the budget."""
        return self.ledger.would_exceed(self.event, rounds)

    # -- one round -----------------------------------------------------------------------------------
    def begin_round(self) -> RoundPlan:
        """Check the budget for one more round, then Poisson-sample the clients.

        Raises:
            BudgetExhausted: the next round would exceed the budget; nothing was sampled or released.
        """
        round_num = self.rounds_done + 1
        self.ledger.check_round(round_num, self.event)
        clients = np.flatnonzero(self._sample_words(round_num) < self._threshold)
        return RoundPlan(round_num=round_num, clients=clients, clip_norm=self._clip_norm)

    def _sample_words(self, round_num: int) -> np.ndarray:
        from gaussdp.noise import noise_source

        # Sampling is part of the mechanism: 32-bit words from the same kind of source as the noise
        # (a CSPRNG keyed from OS entropy by default), so nobody can predict who is sampled.
        if self.seed is None:
            src = noise_source(self.noise)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NotPrivateWarning)  # warned once, at construction
                src = noise_source(seed=_round_seed(self.seed, round_num, 0))
        return src.words(self.num_clients).astype(np.int64)

    def finish_round(
        self,
        plan: RoundPlan,
        deltas: Any,
        answered: Sequence[int] | np.ndarray,
        *,
        norms: np.ndarray | None = None,
    ) -> RoundResult:
        """Clip, (robustly) aggregate, charge, noise and release the round's update.

        Args:
            plan: from :meth:`begin_round` of this round.
            deltas: ``[len(answered), P]`` matrix of the answering clients' model deltas (local model
                minus the global model), in the order of ``answered``; ``None`` or 0 rows when none
                answered (then ``P`` is taken from :attr:`num_params`).
            answered: ids of the sampled clients that answered (the others dropped out).
            norms: the update norms *before* clipping when the clients clipped already (client-side
                clipping, e.g. Flower's ``adaptiveclipping_mod`` through
                :class:`gaussdp.federated.flower.DPFedAvgStrategy`); used only for the adaptive
                clipping bits. By default the norms of ``deltas`` are used.

        Returns:
            :class:`RoundResult` whose ``update`` is the noised average update to add to the global
            model (``global += server_lr * update``).

        Raises:
            UnsafeInput: NaN/Inf or wrong shapes in ``deltas``; an id that was not sampled.
            BudgetExhausted: the ledger refused the charge (nothing released).
        """
        if plan.round_num != self.rounds_done + 1:
            raise PrivacyError(
                f"round {plan.round_num} is not the next round of this run (next is {self.rounds_done + 1}): "
                "a plan is released at most once"
            )
        ids = np.asarray(answered, dtype=np.int64).reshape(-1)
        sampled = set(plan.clients.tolist())
        stray = [int(i) for i in ids if int(i) not in sampled]
        if stray:
            raise UnsafeInput(
                f"clients {stray[:5]} answered round {plan.round_num} without being sampled; their updates "
                "would void the sampling amplification: refused, nothing released"
            )
        if len(set(ids.tolist())) != ids.size:
            raise UnsafeInput(f"a client answered twice in round {plan.round_num}: answered={ids.tolist()}")
        u = self._check_deltas(deltas, ids.size)
        c = plan.clip_norm
        from gaussdp.clipping import clip_rows, clipped_sum

        if self.robust is not None and ids.size:
            clipped, seen = clip_rows(u, c)  # the robust rule needs every clipped row at once
            total = None
        else:
            # Each row scaled by its own factor so that its contribution has norm <= C, summed
            # without a clipped copy of the [clients, params] matrix (see clipped_sum).
            clipped = None
            total, seen = clipped_sum(u, c)
        if norms is not None:
            reported = np.asarray(norms, dtype=np.float64).reshape(-1)
            if reported.shape != seen.shape or not np.isfinite(reported).all():
                raise UnsafeInput(f"norms must be {ids.size} finite numbers, got shape {reported.shape}")
            seen = np.maximum(seen, reported)
        n_clipped = int(np.count_nonzero(seen > c))

        # Everything that depends on the data is computed; charge before anything is released.
        self.ledger.charge_round(plan.round_num, self.event)

        out_dtype = u.dtype if u.dtype in (np.float32, np.float64) else np.dtype(np.float64)
        if self.robust is None:
            if total is None:
                raise RuntimeError("DPFedAvg: no clipped sum was accumulated for a non-robust aggregate")
            agg = total.astype(out_dtype, copy=False)
            sens = c
        elif clipped is not None:
            agg = np.asarray(self.robust(clipped), dtype=out_dtype)
            sens = self.robust.sensitivity(c)
        else:
            agg = np.zeros(u.shape[1], dtype=out_dtype)
            sens = self.robust.sensitivity(c)
        sigma = self.sum_noise_multiplier * sens
        noisy = self._add_noise(agg, sigma, sens, plan.round_num, 1)
        update = noisy / self.expected_clients if self.robust is None else noisy

        next_c = c
        if self.adaptive is not None:
            centred = float(self.adaptive.centred_bits(seen).sum())
            noisy_count = float(
                self._add_noise(np.array([centred]), self.adaptive.count_stddev, 0.5, plan.round_num, 2)[0]
            )
            next_c = self.adaptive.update(noisy_count, self.expected_clients)
            self._clip_norm = next_c
        result = RoundResult(
            round_num=plan.round_num,
            update=update,
            sampled=int(plan.clients.size),
            answered=int(ids.size),
            clipped=n_clipped,
            clip_norm=c,
            next_clip_norm=next_c,
            noise_stddev=sigma,
            epsilon=self.ledger.epsilon_spent(),
            delta=self.ledger.delta,
        )
        self.history.append(result)
        return result

    def _check_deltas(self, deltas: Any, n: int) -> np.ndarray:
        if deltas is None or (n == 0 and np.asarray(deltas).size == 0):
            if self.num_params is None:
                raise UnsafeInput("no client answered and num_params is unknown: set server.num_params")
            return np.zeros((0, self.num_params), dtype=np.float32)
        u = np.asarray(deltas)
        if u.ndim != 2 or u.shape[0] != n:
            raise UnsafeInput(f"deltas must be a [answered={n}, params] matrix, got deltas.shape={u.shape}")
        if self.num_params is None:
            self.num_params = int(u.shape[1])
        elif u.shape[1] != self.num_params:
            raise UnsafeInput(f"deltas have {u.shape[1]} parameters, this run has {self.num_params}")
        if not np.issubdtype(u.dtype, np.floating):
            u = u.astype(np.float64)
        return u

    def _add_noise(
        self, x: np.ndarray, sigma: float, sensitivity: float, round_num: int, stream: int
    ) -> np.ndarray:
        from gaussdp.mechanism import GaussianMechanism

        # add_noise does not clip: the caller's bound (C for the clipped sum, 2R for a robust
        # aggregate, 1/2 for the centred count) sets the float-safe grid; the round's event was
        # charged with that bound (times 1 + GRID_SLACK) before this call.
        with warnings.catch_warnings():
            if self.seed is not None:
                warnings.simplefilter("ignore", NotPrivateWarning)  # warned once, at construction
            mech = GaussianMechanism(
                sigma=sigma,
                sensitivity=sensitivity,
                noise=self.noise,
                seed=_round_seed(self.seed, round_num, stream),
            )
            return np.asarray(mech.add_noise(x))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clip norm of adaptive clipping after a restart (the ledger restores the rest)."""
        super().load_state_dict(state)
        if self.adaptive is not None:
            self.adaptive.clip_norm = self._clip_norm

    def __repr__(self) -> str:
        return (
            f"DPFedAvg(num_clients={self.num_clients}, sample_rate={self.sample_rate}, "
            f"noise_multiplier={self.noise_multiplier}, clip_norm={self._clip_norm:.4g}, "
            f"rounds_done={self.rounds_done}, epsilon_spent={format_upper(self.epsilon())})"
        )
