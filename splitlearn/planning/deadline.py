"""Partial work: a deadline for the round, and the batches each device trains by it (pure Python).

Waiting for every selected device to finish its whole round lets the slowest set
the round's length. With partial work the round has a deadline ``tau`` on the
devices' own time, and device ``i`` trains ``k_i`` of its ``B_i`` batches at the
cut (with or without recomputation) the makespan solver gave it for a whole round:

* its round is a line, ``T(k) = weights + k x per batch`` and
  ``W(k) = k x trunk per batch`` (:class:`~splitlearn.planning.cost.RoundWork`),
  and it trains the most batches that end by ``tau``;
* but at least ``ceil(min_work x B_i)``: below that a device is not worth its
  weights' transfer, so a deadline too short for it is extended for it (it then
  sets the round's length);
* the round lasts ``max_i T_i(k_i) + sum_i W_i(k_i)`` with a shared trunk,
  ``max_i (T_i(k_i) + W_i(k_i))`` with a trunk per client, as every plan's.

The cut stays the solver's: a shallower cut can fit more of a device's batches
by a deadline only by moving its work to the trunk, which the trunk then queues
for everyone (measured: an option of more batches at cut 1 cost the shared trunk
93 s where cut 4 cost it 0.04 s).

``tau`` is chosen to maximise the utility trained per predicted second,
``sum_i u_i x k_i / B_i / makespan`` (a device's statistical utility grows with
the samples it trains, so the share of its round it trains scales it). Between
two consecutive ends of some device's batch no device's batches change, so the
best deadline is one of those ends, ``T_i(k)`` for ``k`` from the least work to
``B_i``: with at most :data:`MAX_CANDIDATES` of them every one is tried (exact
over deadlines), with more an evenly spaced subset by rank; ties go to the longer
deadline (more work per round), so whole rounds win when nothing is gained.
``O(C x n)`` for ``C`` candidates and ``n`` devices.

The family is "every device does what it can by the deadline"; it is not the
optimum over every choice of batches per device (with a shared trunk, a
device whose trunk work is dear per unit of utility could be better stopped
early).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from splitlearn.planning.cost import ClientState, CutCost, Plan, RoundWork, makespan
from splitlearn.planning.solve import Option, plan_from_choices

#: The most deadlines tried per round (and selection size).
MAX_CANDIDATES = 256


@dataclass(frozen=True)
class PartialChoice:
    """One device's part in a deadline-bounded round."""

    option: Option
    steps: int
    client_s: float
    trunk_s: float


def least_steps(batches: int, min_work: float) -> int:
    """Return the fewest batches a device trains in a round: ``ceil(min_work x batches)``, >= 1."""
    return max(1, min(batches, math.ceil(min_work * batches - 1e-9)))


def deadline_choices(
    clients: Sequence[ClientState],
    whole: Sequence[Option | None],
    cuts: Sequence[CutCost],
    *,
    min_work: float,
    trunk_flops_per_s: float,
    shared_trunk: bool,
) -> tuple[float, list[PartialChoice | None]]:
    """Choose the round's deadline and the batches of each taking-part device.

    Parameters
    ----------
    clients : Sequence[ClientState]
        The round's candidates.
    whole : Sequence[Option | None]
        The solver's option for each training a whole round (None: it does not
        take part).
    cuts : Sequence[CutCost]
        The cuts the options name.
    min_work : float
        In (0, 1]: the least share of its round a taking-part device trains.
    trunk_flops_per_s : float
        The trunk's speed.
    shared_trunk : bool
        The makespan model.

    Returns
    -------
    tuple[float, list[PartialChoice | None]]
        The utility per predicted second of the best deadline, and its choices.
    """
    by_cut = {c.cut: c for c in cuts}
    lines = [None if o is None else (o, RoundWork.of(
        client, by_cut[o.cut], trunk_flops_per_s=trunk_flops_per_s, recompute=o.recompute))
        for client, o in zip(clients, whole, strict=True)]
    best: tuple[float, float, list[PartialChoice | None]] = (-math.inf, -math.inf, [])
    for tau in _candidates(lines, min_work):
        chosen = [None if line is None else _by_deadline(*line, tau, min_work) for line in lines]
        rate = _rate(clients, chosen, shared_trunk=shared_trunk)
        if rate > best[0] * (1 + 1e-12) or (rate >= best[0] * (1 - 1e-12) and tau > best[1]):
            best = (rate, tau, chosen)
    if not best[2]:  # nobody takes part
        return 0.0, [None] * len(clients)
    return best[0], best[2]


def _candidates(lines: Sequence[tuple[Option, RoundWork] | None], min_work: float
                ) -> list[float]:
    """Return the deadlines worth trying: the end of every batch, at most MAX_CANDIDATES."""
    times = sorted({w.client_s(k) for line in lines if line is not None for w in line[1:]
                    for k in range(least_steps(w.batches, min_work), w.batches + 1)})
    if len(times) <= MAX_CANDIDATES:
        return times
    picks = {round(k * (len(times) - 1) / (MAX_CANDIDATES - 1)) for k in range(MAX_CANDIDATES)}
    return [times[i] for i in sorted(picks)]


def _by_deadline(option: Option, work: RoundWork, tau: float, min_work: float
                 ) -> PartialChoice:
    """Return the device's batches by ``tau`` (at least the least work) and their times."""
    steps = max(work.steps_within(tau), least_steps(work.batches, min_work))
    return PartialChoice(option, steps, work.client_s(steps), work.trunk_s(steps))


def _rate(clients: Sequence[ClientState], chosen: Sequence[PartialChoice | None], *,
          shared_trunk: bool) -> float:
    """Return the utility trained per predicted second: ``sum u x k / B / makespan``."""
    pairs = [(c.client_s, c.trunk_s) for c in chosen if c is not None]
    trained = sum(client.utility * c.steps / max(client.batches, 1)
                  for client, c in zip(clients, chosen, strict=True) if c is not None)
    span = makespan(pairs, shared_trunk=shared_trunk)
    return trained / span if span > 0 else trained


def plan_with_steps(clients: Sequence[ClientState], chosen: Sequence[PartialChoice | None],
                    excluded: dict[str, str], *, shared_trunk: bool, min_work: float) -> Plan:
    """Assemble the round's :class:`Plan`; a device short of its whole round gets ``steps``.

    Every taking-part device gets the round's deadline (``deadline_s``): the plan's
    steps come from estimates, and the device keeps the deadline by its own clock
    (:class:`clients.device.DeviceDeadline`), so one slower than estimated does not
    stretch the round, and one faster trains more of its round by the same time.
    """
    as_options = [None if c is None else replace(c.option, client_s=c.client_s, trunk_s=c.trunk_s)
                  for c in chosen]
    plan = plan_from_choices(clients, as_options, excluded, shared_trunk=shared_trunk)
    short = {client.client: c.steps for client, c in zip(clients, chosen, strict=True)
             if c is not None and c.steps < client.batches}
    # Every device keeps the round's deadline on its own clock: the latest predicted end
    # (the deadline, or a device's least work past it, which the round waits for anyway).
    deadline = max((c.client_s for c in chosen if c is not None), default=0.0)
    return replace(plan, assignments=tuple(
        replace(a, steps=short.get(a.client), deadline_s=deadline, least_work=min_work)
        for a in plan.assignments))
