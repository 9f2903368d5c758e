"""Adaptive splits on the server: measurements in, each round's clients and cuts out.

The planner (:mod:`splitlearn.planning`) is pure arithmetic; this is what feeds
it. After every training round each reply's metrics (compute, bytes and the
virtual seconds they took, memory budget, loss, label coverage) are smoothed
into a :class:`~splitlearn.planning.cost.ClientState` per node, and the trunk's
speed is measured from its busy time. Before the next round the planner gets
the sampled nodes' states and the model's cut table and says who trains, at
which cut, and whether it recomputes its activations. A node never measured yet
is planned as a prior device (``planner.prior_*``: a median phone on a median
mobile link), so no device figure is needed up front: real devices and emulated
ones are planned the same way.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

from flwr.app import Message

from splitlearn.config import PlannerConfig
from splitlearn.planning.cost import Assignment, ClientState, CutCost, Plan, predicted_rounds
from splitlearn.planning.devices import MBIT
from splitlearn.planning.monitor import ClientMonitor, fit_trunk
from splitlearn.planning.planners import Planner, make_planner, privacy_floor
from splitlearn.planning.queue import DeviceRound, TrunkOf, round_seconds, shared
from strategies.reporting import reply_metrics

log = logging.getLogger(__name__)

#: What an unmeasured memory budget is taken to be: no limit.
UNLIMITED = float("inf")
#: Rounds of trunk work the trunk's cost is fitted to (with the steps measured before).
TRUNK_ROUNDS = 8
#: Rounds whose plans are kept: a round's report reads its plan once the round has ended
#: (older ones would only grow the checkpoint, a plan per round of a long run).
KEPT_PLANS = 4
#: Batches per epoch an unmeasured client is assumed to hold (a nominal figure: its data
#: size is its own; the first reply measures it).
PRIOR_BATCHES_PER_EPOCH = 8


def prior_state(cfg: PlannerConfig, *, batch_size: int, epochs: int) -> ClientState:
    """Return what the planner assumes of a device it has not measured (``planner.prior_*``)."""
    batches = PRIOR_BATCHES_PER_EPOCH * epochs
    return ClientState(
        "prior", flops_per_s=cfg.prior_flops_per_s,
        uplink_bytes_per_s=cfg.prior_uplink_mbps * MBIT,
        downlink_bytes_per_s=cfg.prior_downlink_mbps * MBIT, rtt_s=cfg.prior_rtt_s,
        memory_bytes=UNLIMITED, samples=batches * batch_size, batches=batches, measured=False,
    )


def build_planner(cfg: PlannerConfig, cuts: Sequence[CutCost], *, shared_trunk: bool,
                  seed: int = 0) -> Planner:
    """Build the configured planner, with the privacy floor from the measured leak table."""
    floor = privacy_floor(cuts, cfg.max_leak) if cfg.max_leak is not None else frozenset()
    common: dict[str, Any] = {"forbidden_cuts": floor, "shared_trunk": shared_trunk}
    options: dict[str, dict[str, Any]] = {
        "greedy": {},
        "dynsl": {"every": cfg.every, "hysteresis": cfg.hysteresis,
                  "learning_penalty": cfg.learning_penalty, "start": cfg.start},
        "smartsplit": {"select_fraction": cfg.select_fraction,
                       "min_select_fraction": cfg.min_select_fraction,
                       "min_work": cfg.min_work,
                       "exploration": cfg.exploration,
                       "straggler_penalty": cfg.straggler_penalty, "selection": cfg.selection,
                       "seed": seed, "allow_recompute": cfg.recompute},
        "oracle": {"allow_recompute": cfg.recompute},
        "rotate": {},
    }
    return make_planner(cfg.name, **options[cfg.name], **common)


class CutPlanning:
    """Plans each round from what the previous rounds measured.

    Parameters
    ----------
    planner : Planner
        Decides the round.
    costs : Sequence[CutCost]
        The cuts a client may get, with their costs at the run's batch size.
    prior : ClientState
        What a node nobody has measured yet is taken to be (its memory is
        unknown, so unlimited: a device that cannot fit its cut declines and
        reports its budget, which the next plan follows).
    trunk_busy_s : Callable[[], float]
        The trunk's busy seconds so far (its speed is measured from them).
    trunk_steps : Sequence[tuple[float, float, float]]
        ``(batches, FLOPs, seconds)`` of trunk steps measured before the run (one per
        cut): with the rounds' trunk work and busy time, what the trunk's cost
        (seconds per batch and FLOP/s, :func:`~splitlearn.planning.monitor.fit_trunk`)
        is fitted to.
    smoothing : float
        Weight of the newest measurement in the running estimates.
    trunk_of : TrunkOf
        Which trunk serves each device (how the round is predicted).
    """

    def __init__(
        self, *, planner: Planner, costs: Sequence[CutCost], prior: ClientState,
        trunk_busy_s: Callable[[], float], trunk_steps: Sequence[tuple[float, float, float]],
        smoothing: float = 0.5, trunk_of: TrunkOf = shared,
    ) -> None:
        self.planner = planner
        self.trunk_of = trunk_of
        self.costs = {c.cut: c for c in costs}
        self.prior = prior
        self.trunk_busy_s = trunk_busy_s
        self.trunk_steps = list(trunk_steps)
        #: The last rounds' trunk work and busy time, (batches, FLOPs, seconds).
        self.trunk_rounds: deque[tuple[float, float, float]] = deque(maxlen=TRUNK_ROUNDS)
        self.trunk_flops_per_s = math.inf
        self._fit_trunk()
        self.monitor = ClientMonitor(alpha=smoothing)
        self.plans: dict[int, Plan] = {}  # by server round, the last KEPT_PLANS, for the reports
        # Each round's predicted device rounds, to predict the round of those that finished.
        self._played: dict[int, dict[str, DeviceRound]] = {}
        self._planned_rounds = 0
        self._busy_seen = trunk_busy_s()
        self._given: dict[str, int] = {}  # the cut the planner last gave each client

    def checkpoint(self) -> dict[str, Any]:
        """Return the planner and what it has learnt (plain Python objects: picklable)."""
        return {"planner": self.planner, "monitor": self.monitor, "plans": dict(self.plans),
                "planned_rounds": self._planned_rounds, "given": dict(self._given),
                "trunk_steps": list(self.trunk_steps), "trunk_rounds": list(self.trunk_rounds)}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`checkpoint`'s state; the trunk's books are restored already."""
        self.planner, self.monitor = saved["planner"], saved["monitor"]
        self.plans, self._given = dict(saved["plans"]), dict(saved["given"])
        self._planned_rounds = saved["planned_rounds"]
        self.trunk_steps = list(saved["trunk_steps"])
        self.trunk_rounds.clear()
        self.trunk_rounds.extend(saved["trunk_rounds"])
        self._fit_trunk()
        self._busy_seen = self.trunk_busy_s()

    @property
    def max_cut(self) -> int:
        """The deepest cut a client may get (the global arrays hold the stages below it)."""
        return max(self.costs)

    def assign(self, server_round: int, nodes: Sequence[int]) -> dict[int, Assignment]:
        """Ask the planner who of ``nodes`` trains, at which cut, recomputing or not."""
        self._planned_rounds += 1  # DynSL counts its re-plans from the first plan
        states = [self.state(str(n)) for n in nodes]
        plan = self.planner.plan(
            self._planned_rounds, states, list(self.costs.values()),
            trunk_flops_per_s=self.trunk_flops_per_s,
        )
        played = predicted_rounds(plan, {s.client: s for s in states}, self.costs,
                                  trunk_flops_per_s=self.trunk_flops_per_s,
                                  trunk_of=self.trunk_of)
        plan = replace(plan, round_s=round_seconds(list(played.values())))
        self.plans[server_round] = plan
        self._played[server_round] = played
        for old in [r for r in self.plans if r <= server_round - KEPT_PLANS]:
            self.plans.pop(old)  # what the reports and the predictions still read
            self._played.pop(old, None)
        if plan.excluded:
            log.info("round %d: planner left out %s", server_round, plan.excluded)
        self._given |= {a.client: a.cut for a in plan.assignments}
        by_client = {a.client: a for a in plan.assignments}
        return {n: by_client[str(n)] for n in nodes if str(n) in by_client}

    def predicted_round_s(self, server_round: int, finished: Collection[str]) -> float | None:
        """Return the round planned for ``server_round`` played out by ``finished`` alone.

        The cost model's prediction of what the clock charges (it plays out the devices
        that finished): a device that dropped out or was unavailable is not what the
        model predicts. None: the round was not planned here.
        """
        played = self._played.get(server_round)
        if played is None:
            return None
        return round_seconds([r for client, r in played.items() if client in finished])

    def state(self, client: str) -> ClientState:
        """Return the planner's view of ``client``: what was measured, over the prior.

        Its current cut is the one the planner last gave it (None before its
        first plan), which is what moving away from costs.
        """
        state = self.monitor.state(client, self.prior)
        return replace(state, current_cut=self._given.get(client))

    def observe(self, server_round: int,
                replies: Sequence[tuple[Message, str, Assignment]]) -> None:
        """Fold the round's replies into the estimates; measure the trunk's speed.

        Each reply comes with its status (as the strategy judged it) and the
        assignment it was given: the cut is the server's, not what the client
        claims. A reply whose metrics cannot be read is left out, with a warning.
        """
        work = (0.0, 0.0)
        for reply, status, assigned in replies:
            if reply.has_error():
                continue
            try:
                batches, flops = self._observe_one(reply, status, assigned)
                work = (work[0] + batches, work[1] + flops)
            except (KeyError, TypeError, ValueError) as err:
                log.warning("round %d: client %s's metrics not used for planning: %r",
                            server_round, reply.metadata.src_node_id, err)
        self._measure_trunk(*work)

    def _observe_one(self, reply: Message, status: str, assigned: Assignment
                     ) -> tuple[float, float]:
        """Fold one reply in; return the trunk batches and FLOPs it caused."""
        metrics = reply_metrics(reply)
        client = str(reply.metadata.src_node_id)
        if status == "memory" and "memory-budget" in metrics:
            self.monitor.observe_memory(client, float(metrics["memory-budget"]),
                                        examples=int(metrics.get("examples-held", 0)))
        if status not in ("ok", "straggler"):
            return 0.0, 0.0
        return self._observe_trained(client, metrics, assigned)

    def _observe_trained(self, client: str, metrics: Any, assigned: Assignment
                         ) -> tuple[float, float]:
        """Fold one trained client's metrics in; return the trunk batches and FLOPs."""
        cost = self.costs[assigned.cut]
        samples = int(metrics["num-examples"])
        recompute = cost.recompute_flops_per_sample if assigned.recompute else 0.0
        self.monitor.observe(
            client, flops=samples * (cost.client_flops_per_sample + recompute),
            compute_s=_positive(metrics.get("virtual-compute-s")),
            bytes_up=float(metrics["bytes-up"]),
            upload_s=_positive(metrics.get("virtual-upload-s")),
            bytes_down=float(metrics["bytes-down"]),
            download_s=_positive(metrics.get("virtual-download-s")),
            exchanges=int(metrics["steps"]) * cost.exchanges_per_batch,
            latency_s=_positive(metrics.get("virtual-latency-s")),
            memory_bytes=_positive(metrics.get("memory-budget")),
            # Its whole round's workload (partial work trains less of it).
            samples=int(metrics.get("round-examples", samples)),
            batches=int(metrics.get("round-steps", metrics["steps"])),
            loss=float(metrics["train-loss"]),
            label_coverage=float(metrics.get("label-coverage", 1.0)), cut=cost.cut,
            examples=int(metrics.get("examples-held", 0)),
        )
        return float(metrics["steps"]), samples * cost.server_flops_per_sample

    def _measure_trunk(self, batches: float, flops: float) -> None:
        busy = self.trunk_busy_s()
        seconds, self._busy_seen = busy - self._busy_seen, busy
        if batches > 0 and seconds > 0:
            self.trunk_rounds.append((batches, flops, seconds))
            self._fit_trunk()

    def _fit_trunk(self) -> None:
        """Refit the trunk's seconds per batch and FLOP/s; every cut's cost follows."""
        observations = [*self.trunk_steps, *self.trunk_rounds]
        if not any(seconds > 0 for *_, seconds in observations):
            return  # nothing measured: FLOPs cost nothing, as the prior has it
        batch_s, self.trunk_flops_per_s = fit_trunk(observations)
        self.costs = {cut: replace(cost, trunk_batch_s=batch_s)
                      for cut, cost in self.costs.items()}


def _positive(value: Any) -> float | None:
    """Return a measured duration or amount, or None when there is none (0: not measured)."""
    return float(value) if value is not None and float(value) > 0 else None
