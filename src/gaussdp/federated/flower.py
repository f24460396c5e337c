"""DP-FedAvg on Flower's Message API: a ``flwr.serverapp`` strategy and ``flwr.clientapp`` mods.

* :class:`DPFedAvgStrategy` is a ``flwr.serverapp.strategy.Strategy`` that drives a
  :class:`gaussdp.federated.DPFedAvg` server: it **checks** the budget (``would_exceed``: the run
  stops before a round that would not fit), **samples** the nodes with Poisson sampling from OS
  entropy, sends them the global model and the clip norm, and on their replies lets the server
  **clip** every update (the difference to the global model), **charge** the ledger durably, add the
  **noise** once to the sum and **release** it divided by the fixed ``qN``. A sampled node that does
  not answer, answers with an error or with a malformed update contributes zero and the round still
  counts (the dropout rule of :mod:`gaussdp.federated.server`). Adaptive clipping and the robust
  aggregators are the server's own.
* The ledger makes a run **resumable**: :meth:`DPFedAvgStrategy.start` continues after the last round
  the ledger holds, from the model checkpoint written after each round (``checkpoint=``). Killing the
  ServerApp and starting it again charges no round twice and loses none.
* Client side: Flower's own ``fixedclipping_mod`` / ``adaptiveclipping_mod`` clip the update to the
  ``clipping_norm`` this strategy sends (they compute the same clipped update as
  :func:`gaussdp.federated.clip_update`, so gaussdp has no mod of its own for it; the server clips
  again, so client-side clipping is welcome but never trusted). :func:`local_dp_mod` adds local DP
  with :class:`gaussdp.federated.LocalGaussian`, each client charged in its own ledger principal.

Compare Flower's ``DifferentialPrivacyServerSideFixedClipping`` (flwr 1.42): fixed-size uniform
sampling whose amplification its accountant does not take (``no-amplification`` is the only sampling
model it accepts), noise from ``np.random``; a round in which a node answers with an error is skipped,
and without its accountant a round with missing answers is averaged over the answers, i.e. divided
by their number (which the scale of the release then leaks).

Guarantee: client-level (epsilon, delta)-DP of the released global models under add/remove of one
node's whole data set (a node is a client), with Poisson sampling's amplification accounted; see
:mod:`gaussdp.federated.server`. Client-side evaluation metrics are not privatized: the example app
evaluates on the server's own held-out data.

Needs the ``federated`` extra (``pip install 'gaussdp[federated]'``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from gaussdp._format import format_exact, format_upper
from gaussdp.errors import BudgetExhausted, InvalidParameter, PrivacyError, UnsafeInput
from gaussdp.federated._tree import flatten, unflatten

try:
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        Error,
        Message,
        MessageType,
        MetricRecord,
        RecordDict,
    )
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import Result, Strategy
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, KEY_NORM_BIT
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gaussdp.federated.flower needs Flower: pip install 'gaussdp[federated]'") from exc

__all__ = [
    "KEY_CLIPPING_NORM",
    "KEY_NORM_BIT",
    "KEY_ROUND",
    "DPFTRLStrategy",
    "DPFedAvgStrategy",
    "load_checkpoint",
    "local_dp_mod",
    "save_checkpoint",
]

#: The round number in the train ConfigRecord (Flower's own strategies use the same key).
KEY_ROUND = "server-round"
# Flower's mods answer with this code when a precondition fails; ours do the same.
_MOD_FAILED_PRECONDITION = 6

log = logging.getLogger("gaussdp.federated.flower")


# -- checkpoints ---------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike[str], *, round_num: int, arrays: ArrayRecord, clip_norm: float
) -> None:
    """Write the global model after round ``round_num`` atomically (temporary file, fsync, rename).

    The ledger, not this file, is the source of truth for what was spent: the checkpoint only says
    which model the released rounds produced. It holds released (noised) values only.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    keys = list(arrays.keys())
    data: dict[str, Any] = {f"a{i}": a for i, a in enumerate(arrays.to_numpy_ndarrays())}
    meta = {"round": int(round_num), "clip_norm": float(clip_norm), "keys": keys}
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[int, ArrayRecord, float] | None:
    """``(round_num, arrays, clip_norm)`` from :func:`save_checkpoint`, or ``None`` if there is none."""
    p = Path(path)
    if not p.exists():
        return None
    with np.load(p, allow_pickle=False) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        arrays = [z[f"a{i}"] for i in range(len(meta["keys"]))]
    record = ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(meta["keys"], arrays, strict=True)})
    return int(meta["round"]), record, float(meta["clip_norm"])


# -- the strategy -------------------------------------------------------------------------------------


class DPFedAvgStrategy(Strategy):
    """A ``flwr.serverapp`` strategy running DP-FedAvg through a :class:`gaussdp.federated.DPFedAvg`.

    Every answering node weighs the same (the fixed denominator ``qN``): the ``num-examples`` a node
    reports is ignored, since weighting by it would let one client's weight, hence the sensitivity,
    grow without bound. The population is fixed: ``server.num_clients`` must equal the number of
    nodes the Grid reports (the strategy waits up to ``wait_timeout`` seconds for them to connect),
    or the sampling rate ``q`` the accounting uses would be wrong. Client ``i`` of the server is the
    node with the ``i``-th smallest node id in that round.

    Args:
        server: the gaussdp server (its ledger and ``run_id`` are the run's privacy state).
        server_lr: global += server_lr * released update.
        checkpoint: a file for the model after each round; :meth:`start` resumes from it.
        wait_timeout: seconds to wait for ``server.num_clients`` nodes before each round.
        arrayrecord_key, configrecord_key: the record names in the train messages (Flower's).

    Raises:
        TypeError: ``server`` is not a :class:`~gaussdp.federated.DPFedAvg`.
    """

    def __init__(
        self,
        server: Any,
        *,
        server_lr: float = 1.0,
        checkpoint: str | os.PathLike[str] | None = None,
        wait_timeout: float = 600.0,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
    ) -> None:
        from gaussdp.federated.mf import BandedMFServer
        from gaussdp.federated.server import DPFedAvg

        if not isinstance(server, DPFedAvg | BandedMFServer):
            raise TypeError(
                "server must be a gaussdp.federated.DPFedAvg or gaussdp.federated.mf.BandedMFServer, "
                f"got {type(server).__name__}"
            )
        self.server = server
        self.server_lr = float(server_lr)
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.wait_timeout = float(wait_timeout)
        self.report_every = 10.0  # seconds between the "waiting for nodes" messages
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.rounds: list[Any] = []  # the server's RoundResult of each round this object ran
        self.stopped: str | None = None  # why start() stopped early (the budget), if it did
        self._plan: Any = None
        self._ids: dict[int, int] = {}
        self._global: np.ndarray | None = None
        self._keys: list[str] = []
        self._spec: Any = None

    def __repr__(self) -> str:
        return f"DPFedAvgStrategy({self.server!r})"

    def summary(self) -> None:
        """Log the DP settings and the privacy spent so far (the ledger's figure)."""
        s = self.server
        log.info(
            "DP-FedAvg (gaussdp): N=%d clients, q=%s, noise multiplier z=%s, clip norm C=%.4g, "
            "rounds done=%d, epsilon spent=%s at delta=%s",
            s.num_clients,
            format_exact(s.sample_rate),
            format_exact(s.noise_multiplier),
            s.clip_norm,
            s.rounds_done,
            format_upper(s.epsilon()),
            format_exact(s.ledger.delta),
        )

    # -- the global model ---------------------------------------------------------------------------
    def _set_global(self, arrays: ArrayRecord) -> None:
        self._keys = list(arrays.keys())
        self._global, self._spec = flatten(arrays.to_numpy_ndarrays(), "arrays")
        self.server.num_params = int(self._global.size)

    @property
    def arrays(self) -> ArrayRecord:
        """The current global model (the strategy, not Flower's copy, is the source of truth)."""
        if self._global is None:
            raise InvalidParameter("no global model yet: call configure_train or start first")
        parts = unflatten(self._global, self._spec)
        return ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(self._keys, parts, strict=True)})

    # -- train ----------------------------------------------------------------------------------------
    def _population(self, grid: Grid) -> list[int]:
        n = self.server.num_clients
        start = time.monotonic()
        deadline = start + self.wait_timeout
        reported = -math.inf
        while True:
            nodes = sorted(int(i) for i in grid.get_node_ids())
            if len(nodes) >= n or time.monotonic() >= deadline:
                break
            if time.monotonic() - reported >= self.report_every:
                # say what the run waits for (a restarted SuperLink has no nodes until they reconnect)
                reported = time.monotonic()
                log.warning(
                    "waiting for %d SuperNodes to connect to the SuperLink: %d connected; giving up in "
                    "%.0f s (wait_timeout=%g)",
                    n,
                    len(nodes),
                    max(0.0, deadline - reported),
                    self.wait_timeout,
                )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if len(nodes) != n:
            raise InvalidParameter(
                f"the server was built for num_clients={n} but the Grid has {len(nodes)} nodes: the "
                "sampling rate q of the accounting would be wrong"
            )
        return nodes

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Check the budget (``BudgetExhausted`` stops the run), Poisson-sample, send the model and C.

        Raises:
            BudgetExhausted: the round would exceed the budget; nothing was sampled or sent.
            PrivacyError: ``server_round`` is not the ledger's next round.
            InvalidParameter: the Grid's population is not ``server.num_clients``.
        """
        if self._plan is not None:
            raise PrivacyError(f"round {self._plan.round_num} was configured but never aggregated")
        self._set_global(arrays)
        nodes = self._population(grid)
        plan = self.server.begin_round()  # would_exceed check, then Poisson sampling (OS entropy)
        if plan.round_num != server_round:
            raise PrivacyError(
                f"Flower asks for round {server_round} but the ledger's next round of this run is "
                f"{plan.round_num}: use DPFedAvgStrategy.start, which resumes from the ledger"
            )
        self._plan = plan
        self._ids = {nodes[i]: i for i in plan.clients.tolist()}
        cfg = ConfigRecord(dict(config))
        cfg[KEY_CLIPPING_NORM] = float(plan.clip_norm)
        cfg[KEY_ROUND] = int(plan.round_num)
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg})
        log.info(
            "round %d: %d of %d nodes sampled (q=%g)",
            plan.round_num,
            plan.clients.size,
            len(nodes),
            self.server.sample_rate,
        )
        return [
            Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            for node in sorted(self._ids)
        ]

    def _delta(self, reply: Message) -> tuple[np.ndarray, float | None] | str:
        """The reply's update and reported norm, or why it counts as a dropout."""
        if self._global is None or self._plan is None:
            raise RuntimeError("a reply arrived before configure_train planned its round")
        if reply.has_error():
            return f"error: {reply.error.reason}"
        records = list(reply.content.array_records.values())
        if len(records) != 1:
            return f"{len(records)} ArrayRecords instead of 1"
        rec = records[0]
        if list(rec.keys()) != self._keys:
            return "its arrays do not match the global model's keys"
        try:
            vec, _ = flatten(rec.to_numpy_ndarrays(), "arrays")
        except (UnsafeInput, TypeError, ValueError) as exc:
            return f"unreadable arrays ({exc})"
        if vec.size != self._global.size or not np.isfinite(vec).all():
            return "wrong size or non-finite values"
        norm: float | None = None
        for metrics in reply.content.metric_records.values():
            if KEY_NORM_BIT in metrics:
                # Flower's adaptiveclipping_mod reports whether it had to clip (norm > C) instead
                # of the norm: any value above C (resp. at most C) gives the server the same bit.
                norm = 2.0 * self._plan.clip_norm if bool(metrics[KEY_NORM_BIT]) else 0.0
        return vec.astype(self._global.dtype, copy=False) - self._global, norm

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Deltas to the global model; the server clips, charges, noises once, divides by ``qN``.

        A sampled node without a usable reply is a dropout (zero contribution, round counted).

        Raises:
            UnsafeInput: a reply from a node that was not sampled, or two replies from one node.
            BudgetExhausted: the ledger refused the charge (nothing released).
        """
        plan = self._plan
        if plan is None or plan.round_num != server_round:
            raise PrivacyError(f"round {server_round} was not configured by this strategy")
        if self._global is None:
            raise RuntimeError(f"round {server_round} has no global model (start() sets it)")
        rows: list[tuple[int, np.ndarray, float | None]] = []
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if node == SUPERLINK_NODE_ID and reply.has_error():
                # The SuperLink answers for a node it holds unavailable (e.g. after a SuperLink
                # restart, until the node's next heartbeat): that node is a dropout, whichever it is.
                log.warning(
                    "round %d: the SuperLink answered for a node: %s", server_round, reply.error.reason
                )
                continue
            if node not in self._ids:
                raise UnsafeInput(
                    f"round {server_round}: a reply from node {node}, which was not sampled: refused"
                )
            got = self._delta(reply)
            if isinstance(got, str):
                log.warning("round %d: node %d counts as a dropout: %s", server_round, node, got)
                continue
            rows.append((self._ids[node], got[0], got[1]))
        rows.sort(key=lambda r: r[0])  # arrival order is not deterministic
        ids = np.asarray([r[0] for r in rows], dtype=np.int64)
        deltas = np.stack([r[1] for r in rows]) if rows else None
        norms = [r[2] for r in rows]
        reported = np.asarray(norms, dtype=np.float64) if rows and all(n is not None for n in norms) else None
        self._plan = None
        res = self.server.finish_round(plan, deltas, ids, norms=reported)  # clip, charge, noise
        self._global = self._global + (self.server_lr * res.update).astype(self._global.dtype, copy=False)
        self.rounds.append(res)
        metrics = MetricRecord(
            {
                "epsilon": float(res.epsilon),
                "delta": float(res.delta),
                "clip-norm": float(res.clip_norm),
                "sampled": int(res.sampled),
                "answered": int(res.answered),
            }
        )
        log.info(
            "round %d released: %d/%d answered, epsilon=%s at delta=%s",
            res.round_num,
            res.answered,
            res.sampled,
            format_upper(res.epsilon),
            format_exact(res.delta),
        )
        return self.arrays, metrics

    # -- evaluate: on the server's own data (client-side metrics would not be private) ----------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: client metrics are not privatized (evaluate with ``evaluate_fn``)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    # -- the run ------------------------------------------------------------------------------------------
    def _resume(self, initial_arrays: ArrayRecord) -> ArrayRecord:
        done = self.server.rounds_done
        saved = load_checkpoint(self.checkpoint) if self.checkpoint is not None else None
        if done == 0:
            return initial_arrays
        if saved is None:
            raise PrivacyError(
                f"the ledger holds {done} rounds of {self.server.ledger.principal!r} but there is no "
                f"checkpoint{f' at {self.checkpoint}' if self.checkpoint else ''} to continue from: give "
                "the checkpoint of that run, or a new run_id to start a new run"
            )
        r, arrays, clip_norm = saved
        if r == done:
            log.info("resuming after round %d (ledger and checkpoint agree)", r)
        elif r == done - 1:
            # Charged, then stopped before the model was saved: the charge stands (it is spent), the
            # release is lost; never redo round `done` (a second release would not be covered).
            log.warning(
                "round %d was charged but its model was not saved before the stop: it stays spent; "
                "continuing from the model of round %d",
                done,
                r,
            )
        else:
            raise PrivacyError(
                f"the checkpoint holds round {r} but the ledger holds {done} rounds of "
                f"{self.server.ledger.principal!r}: they belong to different runs"
            )
        self.server.load_state_dict({"clip_norm": clip_norm})
        return arrays

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run the rounds ``rounds_done + 1 .. num_rounds`` of this run (the ledger says where it is).

        ``num_rounds`` is the run's total; a restarted ServerApp continues where the ledger and the
        checkpoint stopped. The run ends early, with :attr:`stopped` set, before a round that would
        exceed the budget. ``evaluate_fn(round, arrays)`` evaluates on the server's own data.
        """
        result = Result()
        arrays = self._resume(initial_arrays)
        first = self.server.rounds_done + 1
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        if evaluate_fn is not None and first == 1:
            res0 = evaluate_fn(0, arrays)
            if res0 is not None:
                result.evaluate_metrics_serverapp[0] = res0
        for rnd in range(first, int(num_rounds) + 1):
            try:
                messages = list(self.configure_train(rnd, arrays, ConfigRecord(dict(train_config)), grid))
            except BudgetExhausted as exc:
                self.stopped = str(exc)
                log.warning("%s", exc)
                break
            replies = grid.send_and_receive(messages, timeout=timeout) if messages else []
            new_arrays, metrics = self.aggregate_train(rnd, replies)
            if new_arrays is None or metrics is None:
                raise RuntimeError(f"round {rnd}: aggregate_train returned no model")
            arrays = new_arrays
            if self.checkpoint is not None:
                save_checkpoint(
                    self.checkpoint, round_num=rnd, arrays=arrays, clip_norm=self.server.clip_norm
                )
            result.arrays = arrays
            result.train_metrics_clientapp[rnd] = metrics
            if evaluate_fn is not None:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
        result.arrays = arrays
        return result


class DPFTRLStrategy(DPFedAvgStrategy):
    """DP-FTRL / banded-MF on Flower: a :class:`DPFedAvgStrategy` driving a
    :class:`gaussdp.federated.mf.BandedMFServer` (no client sampling; each node once per epoch of
    rounds, the noise correlated across rounds through the strategy).

    The same Message API flow, ledger, checkpoints and resumption as :class:`DPFedAvgStrategy`: the
    rounds' clients are the server's fixed blocks of the nodes (the ``i``-th smallest node id is
    client ``i``), and the population must stay ``server.num_clients``. Guarantee: client-level, under
    zero-out of one node's updates (see :mod:`gaussdp.federated.mf`).

    Raises:
        TypeError: ``server`` is not a :class:`~gaussdp.federated.mf.BandedMFServer`.
    """

    def __init__(self, server: Any, **kwargs: Any) -> None:
        from gaussdp.federated.mf import BandedMFServer

        if not isinstance(server, BandedMFServer):
            raise TypeError(
                f"server must be a gaussdp.federated.mf.BandedMFServer, got {type(server).__name__}"
            )
        super().__init__(server, **kwargs)

    def __repr__(self) -> str:
        return f"DPFTRLStrategy({self.server!r})"


# -- client mods ---------------------------------------------------------------------------------------


def _mod_error(msg: Message, reason: str) -> Message:
    log.error("%s", reason)
    return Message(Error(code=_MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def local_dp_mod(
    local: Any, *, client_id: Callable[[Context], Any] | None = None
) -> Callable[[Message, Context, Callable[[Message, Context], Message]], Message]:
    """A ``ClientApp`` mod: local DP with ``local`` (:class:`gaussdp.federated.LocalGaussian`).

    The update (the reply's arrays minus the global arrays received) is clipped, the client is
    charged in its own principal ``client/<id>`` (keyed by the server's round, so a retried round
    is never charged or released twice), and only then is the noisy update sent. A client whose
    budget is spent answers with an error and sends nothing. Flower's ``LocalDpMod`` instead
    calibrates with sensitivity ``C`` (the replacement relation needs ``2C``, see
    :mod:`gaussdp.federated.client`) and charges no ledger.

    Args:
        local: the client's :class:`~gaussdp.federated.LocalGaussian`, or a function without
            arguments that builds it, called once in the process that runs the ClientApp. Pass the
            function with Flower's simulation runtime: Ray pickles the ClientApp and its mods, and a
            ledger (an open database) must be opened where it is used, not copied.
        client_id: ``client_id(context)``, the client's stable identity (default: the
            ``partition-id`` of the node config when set, else the node id).
    """
    from gaussdp.federated.client import LocalGaussian

    if not isinstance(local, LocalGaussian) and not callable(local):
        raise TypeError(
            f"local must be a gaussdp.federated.LocalGaussian or a function returning one, got "
            f"{type(local).__name__}"
        )
    built: list[LocalGaussian] = [local] if isinstance(local, LocalGaussian) else []

    def mechanism() -> LocalGaussian:
        if not built:
            made = local()
            if not isinstance(made, LocalGaussian):
                raise TypeError(f"local() must return a LocalGaussian, got {type(made).__name__}")
            built.append(made)
        return built[0]

    def ident(ctxt: Context) -> Any:
        if client_id is not None:
            return client_id(ctxt)
        return ctxt.node_config.get("partition-id", ctxt.node_id)

    def mod(msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, ctxt)
        sent = list(msg.content.array_records.values())
        configs = list(msg.content.config_records.values())
        if len(sent) != 1 or len(configs) != 1:
            return _mod_error(msg, "local_dp_mod expects one ArrayRecord and one ConfigRecord")
        round_num = configs[0].get(KEY_ROUND)
        out = call_next(msg, ctxt)
        if out.has_error():
            return out
        replies = list(out.content.array_records.items())
        if len(replies) != 1 or list(replies[0][1].keys()) != list(sent[0].keys()):
            return _mod_error(msg, "local_dp_mod: the reply must hold one ArrayRecord with the sent keys")
        name, rec = replies[0]
        global_arrays = sent[0].to_numpy_ndarrays()
        try:
            noisy = mechanism().privatize(
                rec.to_numpy_ndarrays(),
                global_arrays,
                client_id=ident(ctxt),
                round_num=int(round_num) if round_num is not None else None,  # type: ignore[arg-type]
            )
        except PrivacyError as exc:  # budget spent, round replayed, NaN/Inf: nothing leaves
            return _mod_error(msg, f"local_dp_mod: {exc}")
        out.content.array_records[name] = ArrayRecord(
            {
                k: Array(np.asarray(g + d, dtype=g.dtype))
                for k, g, d in zip(rec.keys(), global_arrays, noisy, strict=True)
            }
        )
        return out

    return mod
