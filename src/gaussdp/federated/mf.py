"""Server-side DP-FTRL with a banded matrix-factorisation strategy: no client sampling, cyclic rounds.

One round of :class:`BandedMFServer` (Kairouz et al. 2021's DP-FTRL with the banded strategies of
Choquette-Choo et al. 2023, the way production federated models are trained):

1. **check** that charging the round keeps the run within its budget;
2. the round's **clients** are a fixed block of the population: client ``i`` (the ``i``-th smallest
   node id) takes part in the rounds ``r`` with ``(r - 1) mod R == i // m`` (``m`` clients per round,
   ``R = ceil(N / m)`` rounds per epoch of rounds), so each client takes part at most once per epoch,
   ``R`` rounds apart -- no sampling, no amplification claimed;
3. the clients that answer send their model deltas; the server **clips** each to ``C``;
4. **charge** the round to the run's ledger principal, once (idempotency key per round): the
   Gaussian that brings the run's charge up to the accounting's
   :func:`gaussdp.accounting.banded_matrix_factorization_event` of the rounds so far (a prefix of the
   strategy ``C``; at least a negligible ``mu^2 = 1e-20`` so that every round has its row);
5. **noise** the sum with ``y_r = (C^{-1} z)_r``, ``z_r ~ N(0, (z C)^2 I)`` from OS entropy, through a
   buffer of ``bands - 1`` noise vectors (:class:`gaussdp.mf.BandedNoise`), and **release** it
   divided by the fixed ``m``.

Guarantee: client-level (epsilon, delta)-DP of the released updates under zero-out of one client
(its updates replaced by zero, the dropout a server cannot tell from absence; the relation of
DP-FTRL, Kairouz et al. 2021, Section 2) for the fixed population. The released sequence is a
post-processing of ``C x + Z``; adaptively chosen updates do not change its privacy (Denisov et
al. 2022, Theorem 2.1).

**Restarts.** The noise buffer is secret and is never written to disk: a server that restarts (a
new process continuing the run from the ledger) starts a new buffer. The noise of the rounds after
the restart is then ``C_2^{-1} z`` for the trailing block ``C_2`` of ``C``: the whole run releases
``C' x + Z`` for the block-diagonal ``C'`` obtained from ``C`` by zeroing the entries that link the
two parts. With participations at least ``bands`` rounds apart, the sensitivity is the largest sum
of ``k`` squared column norms, and ``C'``'s columns are no longer than ``C``'s: the charges for ``C``
cover it (the restart costs accuracy, never privacy). A server continuing a run checks that the
ledger's charges are its own plan's for the rounds done, and refuses otherwise (changed parameters
would be another strategy, which these charges do not cover).

References:
    Kairouz, McMahan, Song, Thakkar, Thakurta & Xu 2021, "Practical and Private (Deep) Learning
    without Sampling or Shuffling", ICML (DP-FTRL).
    Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, "(Amplified) Banded Matrix
    Factorizations", NeurIPS (banded strategies, b-min-separated participation).
    Denisov, McMahan, Rush, Smith & Thakurta 2022, "Improved Differential Privacy for SGD via Optimal
    Private Linear Operators on Adaptive Streams", NeurIPS, Theorem 2.1.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from gaussdp._format import format_upper
from gaussdp._validate import check_counts, check_positive
from gaussdp.errors import InvalidParameter, NotPrivateWarning, PrivacyError, UnsafeInput
from gaussdp.federated.rounds import RoundLedger
from gaussdp.federated.server import RoundPlan, RoundResult, RoundServer
from gaussdp.mf import BandedMFPlan, BandedNoise

__all__ = ["BandedMFServer"]

_MIN_MU2 = 1e-20  # the floor of a round's charge: a row per round, no visible change of epsilon


class BandedMFServer(RoundServer):
    """DP-FTRL / banded-MF server with client-level accounting in a :class:`gaussdp.budget.Ledger`.

    Args:
        num_clients: N, the fixed population.
        clients_per_round: m; ``R = ceil(N / m)`` rounds make one epoch (every client once).
        num_rounds: the rounds of the whole run (the strategy is optimised for them).
        bands: the bands of the strategy, at most ``R``.
        noise_multiplier: z; the noise ``z_r`` on each round's clipped sum has stddev ``z C``.
        clip_norm: C.
        ledger, run_id, epsilon, delta, accountant: as :class:`gaussdp.federated.DPFedAvg`.
        noise: ``"secure"`` (default: CSPRNG keystream) or ``"fast"`` (PCG64 from OS entropy).
        seed: reproducible noise for experiments; **not private**.

    Raises:
        InvalidParameter: a parameter out of range, named (``bands`` above the rounds per epoch).
    """

    def __init__(
        self,
        *,
        num_clients: int,
        clients_per_round: int,
        num_rounds: int,
        bands: int,
        noise_multiplier: float,
        clip_norm: float,
        ledger: Any,
        epsilon: float,
        delta: float,
        run_id: str = "dp-ftrl",
        accountant: str = "pld",
        noise: str = "secure",
        seed: int | None = None,
    ) -> None:
        check_counts(
            num_clients=num_clients, clients_per_round=clients_per_round, num_rounds=num_rounds, bands=bands
        )
        if clients_per_round > num_clients:
            raise InvalidParameter(
                f"clients_per_round must be <= num_clients, got clients_per_round={clients_per_round}, "
                f"num_clients={num_clients}"
            )
        self.num_clients = num_clients
        self.clients_per_round = clients_per_round
        self.rounds_per_epoch = -(-num_clients // clients_per_round)
        if bands > self.rounds_per_epoch:
            raise InvalidParameter(
                f"bands must be <= the rounds per epoch (ceil(num_clients / clients_per_round) = "
                f"{self.rounds_per_epoch}), got bands={bands}: a client's rounds must be >= bands apart"
            )
        self.plan = BandedMFPlan(
            steps=num_rounds,
            bands=min(bands, num_rounds),
            min_separation=self.rounds_per_epoch,
            max_participations=-(-num_rounds // self.rounds_per_epoch),
        )
        self.num_rounds = num_rounds
        self.noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        self._clip_norm = check_positive("clip_norm", clip_norm)
        if noise not in ("secure", "fast"):
            raise InvalidParameter(f"noise must be 'secure' or 'fast', got noise={noise!r}")
        self.noise: Any = noise  # "secure" or "fast" (checked above)
        self.seed = seed
        if seed is not None:
            warnings.warn(
                "BandedMFServer(seed=...) makes the noise reproducible: not private",
                NotPrivateWarning,
                stacklevel=2,
            )
        self.ledger = RoundLedger(ledger, run_id, epsilon=epsilon, delta=delta, accountant=accountant)
        self.expected_clients = float(clients_per_round)  # the fixed denominator
        self.sample_rate = 1.0  # no sampling (reported by the Flower strategy's summary)
        self.history: list[RoundResult] = []
        self.num_params: int | None = None
        self._noise = BandedNoise(self.plan.coefficients)
        self._source: Any = None
        self._resumed_checked = False

    # -- accounting ------------------------------------------------------------------------------
    def _charged_mu2(self) -> float:
        from gaussdp.accounting import GaussianEvent

        total = 0.0
        for event, count in self.ledger.ledger.events(self.ledger.principal):
            if not isinstance(event, GaussianEvent):
                raise PrivacyError(f"the run's ledger principal holds a {type(event).__name__}: not this run")
            total += count / event.noise_multiplier**2
        return total

    def round_event(self, round_num: int) -> Any:
        """The Gaussian charged for round ``round_num``: what the prefix up to it needs beyond the charges."""
        from gaussdp.accounting import GaussianEvent
        from gaussdp.accounting.events import NOISE_MULTIPLIER_MAX

        if not 1 <= round_num <= self.num_rounds:
            raise InvalidParameter(
                f"round {round_num} is outside the planned run of num_rounds={self.num_rounds} rounds"
            )
        need = 1.0 / self.plan.event(self.noise_multiplier, upto=round_num).noise_multiplier ** 2
        inc = max((need - self._charged_mu2()) * (1.0 + 2.0**-50), _MIN_MU2)
        nm = 1.0 / math.sqrt(inc)
        for _ in range(2):  # rounded down over the sqrt and the division
            nm = math.nextafter(nm, 0.0)
        return GaussianEvent(min(nm, NOISE_MULTIPLIER_MAX))  # smaller: more charged, never less

    def _check_resumed(self, done: int) -> None:
        """A server continuing a run must be the run's: what the ledger holds is this plan's charge."""
        need = 1.0 / self.plan.event(self.noise_multiplier, upto=done).noise_multiplier ** 2
        charged = self._charged_mu2()
        if not need * (1 - 1e-9) <= charged <= need * (1 + 1e-9) + done * 2 * _MIN_MU2:
            raise PrivacyError(
                f"the ledger holds {done} rounds of {self.ledger.principal!r} charged mu^2={charged:.6g}, "
                f"but this server's plan charges mu^2={need:.6g} for them: it is not the same run "
                "(num_clients, clients_per_round, num_rounds, bands and noise_multiplier must not change); "
                "use a new run_id"
            )
        self._resumed_checked = True

    def clients_of_round(self, round_num: int) -> np.ndarray:
        """The client indices of round ``round_num`` (fixed; each client once per epoch of rounds)."""
        block = (round_num - 1) % self.rounds_per_epoch
        lo = block * self.clients_per_round
        return np.arange(lo, min(lo + self.clients_per_round, self.num_clients))

    # -- one round -------------------------------------------------------------------------------
    def begin_round(self) -> RoundPlan:
        """Check the budget for the next round and name its clients.

        Raises:
            BudgetExhausted: the round would exceed the budget; nothing was charged or released.
            InvalidParameter: the run has done all its planned rounds.
        """
        round_num = self.rounds_done + 1
        if round_num > 1 and not self._resumed_checked:
            self._check_resumed(round_num - 1)
        self.ledger.check_round(round_num, self.round_event(round_num))
        return RoundPlan(
            round_num=round_num, clients=self.clients_of_round(round_num), clip_norm=self._clip_norm
        )

    def finish_round(
        self, plan: RoundPlan, deltas: Any, answered: Any, *, norms: np.ndarray | None = None
    ) -> RoundResult:
        """Clip, charge, add the correlated noise, release the round's average update.

        Raises:
            UnsafeInput: NaN/Inf or wrong shapes; an id not of this round; a client twice.
            BudgetExhausted: the ledger refused the charge (nothing released).
        """
        from gaussdp.clipping import clipped_sum

        if plan.round_num != self.rounds_done + 1:
            raise PrivacyError(
                f"round {plan.round_num} is not the next round of this run (next is {self.rounds_done + 1})"
            )
        ids = np.asarray(answered, dtype=np.int64).reshape(-1)
        chosen = set(plan.clients.tolist())
        stray = [int(i) for i in ids if int(i) not in chosen]
        if stray:
            raise UnsafeInput(
                f"clients {stray[:5]} answered round {plan.round_num} without being its clients: each "
                "client takes part once per epoch of rounds; refused, nothing released"
            )
        if len(set(ids.tolist())) != ids.size:
            raise UnsafeInput(f"a client answered twice in round {plan.round_num}: answered={ids.tolist()}")
        if deltas is None or ids.size == 0:
            if self.num_params is None:
                raise UnsafeInput("no client answered and num_params is unknown: set server.num_params")
            u = np.zeros((0, self.num_params))
        else:
            u = np.asarray(deltas, dtype=np.float64)
            if u.ndim != 2 or u.shape[0] != ids.size:
                raise UnsafeInput(f"deltas must be a [answered={ids.size}, params] matrix, got {u.shape}")
            if self.num_params is None:
                self.num_params = int(u.shape[1])
            elif u.shape[1] != self.num_params:
                raise UnsafeInput(f"deltas have {u.shape[1]} parameters, this run has {self.num_params}")
        c = plan.clip_norm
        total, seen = clipped_sum(u, c)
        event = self.round_event(plan.round_num)
        self.ledger.charge_round(plan.round_num, event)  # durable, before anything is released
        std = self.noise_multiplier * c
        fresh = self._standard_normal(total.size) * std
        noisy = total + self._noise.next("update", fresh)
        result = RoundResult(
            round_num=plan.round_num,
            update=noisy / self.expected_clients,
            sampled=int(plan.clients.size),
            answered=int(ids.size),
            clipped=int(np.count_nonzero(seen > c)),
            clip_norm=c,
            next_clip_norm=c,
            noise_stddev=std,
            epsilon=self.ledger.epsilon_spent(),
            delta=self.ledger.delta,
        )
        self.history.append(result)
        return result

    def _standard_normal(self, n: int) -> np.ndarray:
        from gaussdp.noise import noise_source

        if self._source is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NotPrivateWarning)  # warned once, at construction
                self._source = noise_source(self.noise) if self.seed is None else noise_source(seed=self.seed)
        return np.asarray(self._source.standard_normal(n))

    def __repr__(self) -> str:
        return (
            f"BandedMFServer(num_clients={self.num_clients}, clients_per_round={self.clients_per_round}, "
            f"bands={self.plan.bands}, noise_multiplier={self.noise_multiplier}, "
            f"rounds_done={self.rounds_done}, epsilon_spent={format_upper(self.epsilon())})"
        )
