"""Cut planners, chosen by name (``planner=uniform|greedy|dynsl|smartsplit|oracle``).

Every planner answers one question per round: given what is known of the
clients (:class:`~splitlearn.planning.cost.ClientState`) and what each cut
costs (:class:`~splitlearn.planning.cost.CutCost`), who trains at which cut,
with or without activation recomputation? Plans are scored with the same cost model
(:mod:`splitlearn.planning.cost`), so planners compare on predicted makespan.

* :class:`UniformPlanner`: one fixed cut for everyone (today's behaviour).
* :class:`GreedyPlanner`: each client its own fastest cut, ignoring that the
  shared trunk serialises clients (the usual per-client adaptive baseline).
* :class:`DynSLPlanner`: per-client cuts for the round played out at the trunk,
  re-planned every ``R`` rounds, moving clients only when the gain pays for the move.
* :class:`SmartSplitPlanner`: memory-aware device selection (data utility,
  staleness and speed) with exact cuts and recomputation.
* :class:`OraclePlanner`: exhaustive search (small fleets only).
* :class:`RotatePlanner`: a diagnostic that moves every client's cut each round.

All take a privacy floor (``min_cut``) and ``forbidden_cuts``
(:func:`privacy_floor`). Only :class:`DynSLPlanner` (its last plan) and
:class:`SmartSplitPlanner` (when each client was last selected) keep state.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any, Protocol

from splitlearn.planning.cost import (
    ClientState,
    CutCost,
    Plan,
    device_round,
    makespan,
    move_bytes,
)
from splitlearn.planning.deadline import PartialChoice, deadline_choices, plan_with_steps
from splitlearn.planning.queue import DeviceRound
from splitlearn.planning.search import EXACT_LIMIT, Choice, best_choice, scored
from splitlearn.planning.solve import (
    Option,
    TooManyAssignments,
    allowed_cuts,
    brute_force,
    candidate_options,
    choose_options,
    client_options,
    memory_reason,
    plan_from_choices,
    solve,
)

#: Relative slack for "does not raise the makespan" (sums differ by a few ulps).
_SPAN_RTOL = 1e-12


class Planner(Protocol):
    """What the server asks of a planner once per round."""

    def plan(
        self,
        server_round: int,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        *,
        trunk_flops_per_s: float,
    ) -> Plan:
        """Return this round's plan for ``clients`` over ``cuts``.

        Parameters
        ----------
        server_round : int
            The round being planned (1-based).
        clients : Sequence[ClientState]
            The sampled clients (distinct ids).
        cuts : Sequence[CutCost]
            The model's cuts.
        trunk_flops_per_s : float
            The trunk's training FLOP/s.
        """
        ...


def privacy_floor(cuts: Sequence[CutCost], max_leak: float) -> frozenset[int]:
    """Return the cuts whose measured ``leak`` exceeds ``max_leak`` (unmeasured ones pass)."""
    return frozenset(c.cut for c in cuts if c.leak is not None and c.leak > max_leak)


class FlooredPlanner:
    """What every planner shares: the privacy floor and the makespan model it solves for.

    Parameters
    ----------
    min_cut, forbidden_cuts
        The privacy floor: no cut below ``min_cut``, none in ``forbidden_cuts``.
    shared_trunk : bool
        One shared trunk (``max T + sum W``) or a trunk per client (``max (T + W)``).
    """

    def __init__(
        self,
        *,
        min_cut: int | None = None,
        forbidden_cuts: Collection[int] = frozenset(),
        shared_trunk: bool = True,
    ) -> None:
        self.min_cut = min_cut
        self.forbidden_cuts = frozenset(forbidden_cuts)
        self.shared_trunk = shared_trunk

    def options(
        self, clients: Sequence[ClientState], cuts: Sequence[CutCost], *,
        trunk_flops_per_s: float, allow_recompute: bool,
    ) -> tuple[list[list[Option]], dict[str, str]]:
        """Each client's feasible options above the floor, and why the others have none."""
        return candidate_options(
            clients, cuts, trunk_flops_per_s=trunk_flops_per_s,
            allow_recompute=allow_recompute, min_cut=self.min_cut,
            forbidden_cuts=self.forbidden_cuts,
        )


class UniformPlanner:
    """Every client at one cut without recomputation; those it does not fit are excluded.

    Parameters
    ----------
    cut : int
        The cut for everyone.
    min_cut, forbidden_cuts
        The privacy floor; ``cut`` must respect it.
    shared_trunk : bool
        How the makespan is predicted.
    """

    def __init__(
        self,
        cut: int,
        *,
        min_cut: int | None = None,
        forbidden_cuts: Collection[int] = frozenset(),
        shared_trunk: bool = True,
    ) -> None:
        if cut in forbidden_cuts or (min_cut is not None and cut < min_cut):
            raise ValueError(
                f"uniform cut {cut} breaks the privacy floor "
                f"(min_cut={min_cut}, forbidden_cuts={sorted(forbidden_cuts)})"
            )
        self.cut = cut
        self.shared_trunk = shared_trunk

    def plan(
        self,
        server_round: int,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        *,
        trunk_flops_per_s: float,
    ) -> Plan:
        """Put every client that fits at ``self.cut`` (see :class:`Planner`)."""
        only = [c for c in cuts if c.cut == self.cut]
        if not only:
            raise ValueError(f"uniform cut {self.cut} is not one of {[c.cut for c in cuts]}")
        return solve(
            clients,
            only,
            trunk_flops_per_s=trunk_flops_per_s,
            allow_recompute=False,
            shared_trunk=self.shared_trunk,
        )


class GreedyPlanner(FlooredPlanner):
    """Each client the feasible cut of least ``T_i + W_i``, as if it had the trunk alone.

    No recomputation. The plan's makespan is still predicted with the shared
    trunk (when ``shared_trunk``), which is what the greedy choice ignores.
    """

    def plan(
        self,
        server_round: int,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        *,
        trunk_flops_per_s: float,
    ) -> Plan:
        """Give each client its own fastest cut (see :class:`Planner`)."""
        options, excluded = self.options(
            clients, cuts, trunk_flops_per_s=trunk_flops_per_s, allow_recompute=False
        )
        # min() keeps the first of equal times: options come in preference order.
        chosen = [
            min(opts, key=lambda o: o.client_s + o.trunk_s) if opts else None for opts in options
        ]
        return plan_from_choices(clients, chosen, excluded, shared_trunk=self.shared_trunk)


class DynSLPlanner(FlooredPlanner):
    """DynSL: per-client cuts re-planned every R rounds for the round as it is played out.

    On re-plan rounds (1, 1 + R, 1 + 2R, ...) the planner picks each client's cut (no
    selection, no recomputation) for the least round played out at the trunk
    (:mod:`splitlearn.planning.queue`: the devices' work overlapping the trunk's queue,
    where a slow device's work can move to a trunk that would wait for it anyway), exactly
    for small fleets and otherwise by descent to a stated bound
    (:func:`~splitlearn.planning.search.best_choice`), and compares with keeping the
    current cuts:

    * gain = (kept round - new round) x R rounds;
    * cost = sum over moved clients of ``move_bytes`` / its slower link + one RTT.

    A round is weighed by what it teaches as well as by its length, with
    ``learning_penalty`` p: a device at a deeper cut trains more of the model on its own
    (skewed) data, averaged FedAvg-style, and such rounds learn less, so the target takes
    more of them. The planner minimises the round times ``1 + p x d``, where ``d`` is the
    plan's share of the way from the shallowest allowed cut to the deepest, by the
    device-side weights each device holds, weighted by its samples: with every device
    at the deepest cut the target takes ``1 + p`` times the rounds it takes at the
    shallowest (p = 0: the round alone). Rounds above stand for this score.

    The new plan is taken when ``gain > (1 + h) cost`` and ``gain > h x kept
    round``; then each moved client (costliest move first) is put back when that
    does not raise the new plan's score. Between re-plans clients keep their
    cuts. A client's current cut is the one this planner last gave it, else its
    ``current_cut``. A client without one, or whose cut no longer fits or is no
    longer allowed, gets the best cut given the others' kept cuts; such forced moves
    count in neither plan's cost. So does a client whose cut was given before it was
    measured (the prior's guess), once it has been. :attr:`last_gap` is how far above
    the optimum the last fresh plan's round can be (0: solved exactly).

    Parameters
    ----------
    every : int
        Rounds between re-plans, R >= 1.
    hysteresis : float
        h >= 0: the margin a re-plan must clear.
    learning_penalty : float
        p >= 0: rounds to a target with every device at the deepest allowed cut over
        those at the shallowest, minus 1 (``python -m benchmarks planner`` reports it
        for a scenario: ``implied_learning_penalty``).
    start : str
        Where a client not measured yet trains: the cut planned for the prior's guess
        of it (``"planned"``) or its smallest allowed cut (``"smallest"``). Either way
        it keeps the measured clients' deadline (:func:`with_guess_deadlines`).
    min_cut, forbidden_cuts
        The privacy floor.
    shared_trunk : bool
        One trunk for every client, or one each.
    exact_limit : int
        The most combinations of cuts tried one by one (more: descent).
    """

    def __init__(
        self,
        every: int = 5,
        hysteresis: float = 0.1,
        *,
        learning_penalty: float = 0.0,
        start: str = "planned",
        min_cut: int | None = None,
        forbidden_cuts: Collection[int] = frozenset(),
        shared_trunk: bool = True,
        exact_limit: int = EXACT_LIMIT,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 round, got {every}")
        if hysteresis < 0:
            raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")
        if not learning_penalty >= 0 or not math.isfinite(learning_penalty):
            raise ValueError(f"learning_penalty must be finite and >= 0, got {learning_penalty}")
        self.every = every
        self.hysteresis = hysteresis
        if start not in ("planned", "smallest"):
            raise ValueError(f"start must be 'planned' or 'smallest', got {start!r}")
        self.learning_penalty = learning_penalty
        self.start = start
        self.exact_limit = exact_limit
        super().__init__(min_cut=min_cut, forbidden_cuts=forbidden_cuts, shared_trunk=shared_trunk)
        # The planner's memory: the cut it last gave each client, and the clients it gave
        # one before they were measured (the prior's guess: placed again once measured).
        self.cuts: dict[str, int] = {}
        self.guessed: set[str] = set()
        self.last_gap = 0.0
        self._penalties: dict[int, list[float]] = {}  # this plan's, by client index

    def is_replan_round(self, server_round: int) -> bool:
        """Whether ``server_round`` re-plans (rounds 1, 1 + R, ...)."""
        return (server_round - 1) % self.every == 0

    def plan(
        self,
        server_round: int,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        *,
        trunk_flops_per_s: float,
    ) -> Plan:
        """Keep cuts, or re-plan when this round is a re-plan round (see :class:`Planner`)."""
        options, excluded = self.options(
            clients, cuts, trunk_flops_per_s=trunk_flops_per_s, allow_recompute=False
        )
        if self.start == "smallest":  # not measured yet: its smallest cut until it is
            options = [opts if c.measured or not opts else [min(opts, key=lambda o: o.cut)]
                       for c, opts in zip(clients, options, strict=True)]
        taking = [i for i, opts in enumerate(options) if opts]
        by_cut = {c.cut: c for c in cuts}
        rounds = {i: [device_round(clients[i], by_cut[o.cut], trunk_flops_per_s=trunk_flops_per_s,
                                   trunk=0 if self.shared_trunk else clients[i].client)
                      for o in options[i]] for i in taking}
        self._penalties = self._learning_penalties(clients, options, taking, cuts)
        current = {i: self._kept_index(clients[i], options[i]) for i in taking}
        for i in taking:  # placed by a guess before it was measured: placed again now
            if clients[i].measured and clients[i].client in self.guessed:
                current[i] = None
        self.guessed -= {c.client for c in clients if c.measured}
        pinned = [[rounds[i][current[i]]] if current[i] is not None else rounds[i]
                  for i in taking]
        kept = best_choice(pinned, exact_limit=self.exact_limit, penalties=[
            [self._penalties[i][current[i]]] if current[i] is not None else self._penalties[i]
            for i in taking])
        chosen = {i: current[i] if current[i] is not None else kept.picks[n]
                  for n, i in enumerate(taking)}
        if taking and self.is_replan_round(server_round):
            fresh = self._fresh(options, rounds, taking, cuts)
            self.last_gap = fresh.gap
            picks = dict(zip(taking, fresh.picks, strict=True))
            if self._worth_moving(clients, cuts, options, current, kept.score, picks, rounds):
                chosen = self._revert_needless_moves(clients, cuts, options, current, picks,
                                                     rounds)
        plan = plan_from_choices(
            clients, [options[i][chosen[i]] if i in chosen else None
                      for i in range(len(clients))],
            excluded, shared_trunk=self.shared_trunk)
        self.cuts.update((a.client, a.cut) for a in plan.assignments)
        self.guessed |= {c.client for c in clients if not c.measured}
        return with_guess_deadlines(plan, {c.client for c in clients if not c.measured})

    def _fresh(self, options: Sequence[Sequence[Option]], rounds: dict[int, list[DeviceRound]],
               taking: Sequence[int], cuts: Sequence[CutCost]) -> Choice:
        """Return the best cuts for the played-out round (descent starts where it is likely)."""
        solver = choose_options([options[i] for i in taking], select=None,
                                shared_trunk=self.shared_trunk)
        starts = [[options[i].index(o) if o is not None else 0
                   for i, o in zip(taking, solver, strict=True)]]
        for cut in sorted({c.cut for c in cuts}):  # every uniform cut, where it is feasible
            starts.append([next((k for k, o in enumerate(options[i]) if o.cut == cut), 0)
                           for i in taking])
        return best_choice([rounds[i] for i in taking], starts=starts,
                           exact_limit=self.exact_limit,
                           penalties=[self._penalties[i] for i in taking])

    def _learning_penalties(self, clients: Sequence[ClientState],
                            options: Sequence[Sequence[Option]], taking: Sequence[int],
                            cuts: Sequence[CutCost]) -> dict[int, list[float]]:
        """Each taking client's option's share of ``p x d`` (see the class docstring)."""
        weights = {c.cut: c.client_param_bytes for c in cuts}
        low, high = min(weights.values(), default=0), max(weights.values(), default=0)
        samples = sum(clients[i].samples for i in taking)
        if self.learning_penalty == 0 or high <= low or samples <= 0:
            return {i: [0.0] * len(options[i]) for i in taking}
        return {i: [self.learning_penalty * clients[i].samples / samples
                    * (weights[o.cut] - low) / (high - low) for o in options[i]]
                for i in taking}

    def _kept_index(self, client: ClientState, options: Sequence[Option]) -> int | None:
        """Find the current cut among the feasible options (None: new, or it no longer fits)."""
        cut = self.cuts.get(client.client, client.current_cut)
        return next((k for k, o in enumerate(options) if o.cut == cut), None)

    def _round(self, picks: dict[int, int], rounds: dict[int, list[DeviceRound]]) -> float:
        """Return the score of ``picks``: the round played out, times 1 + their penalties."""
        order = sorted(picks)
        return scored([rounds[i] for i in order], [picks[i] for i in order],
                      [self._penalties[i] for i in order])

    def _moves(self, clients: Sequence[ClientState], cuts: Sequence[CutCost],
               options: Sequence[Sequence[Option]], current: dict[int, int | None],
               picks: dict[int, int]) -> list[tuple[float, int]]:
        """Return what each client ``picks`` moves from its current cut costs, with its index."""
        return [(_move_seconds(clients[i], cuts, options[i][old].cut, options[i][k].cut), i)
                for i, k in picks.items()
                if (old := current[i]) is not None and options[i][k].cut != options[i][old].cut]

    def _worth_moving(
        self,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        options: Sequence[Sequence[Option]],
        current: dict[int, int | None],
        kept_s: float,
        picks: dict[int, int],
        rounds: dict[int, list[DeviceRound]],
    ) -> bool:
        """Whether the fresh plan's gain over R rounds pays for its moves, with margin h."""
        gain = (kept_s - self._round(picks, rounds)) * self.every
        cost = sum(seconds for seconds, _ in self._moves(clients, cuts, options, current, picks))
        h = self.hysteresis
        return gain > (1 + h) * cost and gain > h * kept_s

    def _revert_needless_moves(
        self,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        options: Sequence[Sequence[Option]],
        current: dict[int, int | None],
        picks: dict[int, int],
        rounds: dict[int, list[DeviceRound]],
    ) -> dict[int, int]:
        """Put moved clients back (costliest move first) where the round does not lengthen."""
        chosen = dict(picks)
        limit = self._round(picks, rounds) * (1 + _SPAN_RTOL)
        for _, i in sorted(self._moves(clients, cuts, options, current, picks), reverse=True):
            trial = chosen | {i: current[i]}
            if self._round(trial, rounds) <= limit:  # type: ignore[arg-type]
                chosen = trial  # type: ignore[assignment]
        return chosen


def with_guess_deadlines(plan: Plan, unmeasured: Collection[str]) -> Plan:
    """Return ``plan`` with a deadline for each device it placed by the prior's guess.

    Such a device may be far slower than the guess (a microcontroller board planned as
    a phone), and one round of it at a cut that does not suit it can last several of the
    others'. So it trains until the slowest measured device's predicted own time (the
    prior's, when none is measured), on its own clock, and at least one batch (partial
    work, :class:`clients.device.DeviceDeadline`): its round still measures it.
    """
    guessed = [a for a in plan.assignments if a.client in unmeasured]
    if not guessed:
        return plan
    known = [a.client_s for a in plan.assignments if a.client not in unmeasured]
    deadline = max(known or [a.client_s for a in guessed])
    return replace(plan, assignments=tuple(
        replace(a, deadline_s=deadline, least_work=0.0) if a.client in unmeasured else a
        for a in plan.assignments))


def _move_seconds(client: ClientState, cuts: Sequence[CutCost], old: int, new: int) -> float:
    """Seconds a cut move costs: the stages that change sides over the slower link, one RTT."""
    link = min(client.uplink_bytes_per_s, client.downlink_bytes_per_s)
    return move_bytes(cuts, old, new) / link + client.rtt_s


#: Selection sizes SmartSplit tries per round, at most (``min_select_fraction``).
_SIZE_GRID = 8


class SmartSplitPlanner(FlooredPlanner):
    """SmartSplit: memory-aware device selection, exact cuts with recomputation.

    Per round: (a) devices that fit no cut even with recomputation are
    excluded; (b) of the rest, the ``m = max(1, round(select_fraction x n))``
    of highest score train, where (after Oort, Lai et al., OSDI 2021)::

        score_i = (utility_i / max utility + exploration x sqrt(ln r / last_i))
                  x min(1, deadline / t_i) ** straggler_penalty

    ``utility`` is the client's statistical utility (the monitor's data
    utility), ``last_i`` the round it was last selected (never selected:
    first in line, fastest first), ``t_i`` its fastest predicted time at any
    cut it fits and ``deadline`` the m-th smallest of those (the round m
    devices could make); ties go to the faster device, then input order;
    (c) the selected devices' cuts and recomputation are solved exactly
    (recomputation costs FLOPs, so the solver takes it only to fit
    or to reach a faster cut).

    Without the staleness bonus the same fast devices would train every round
    and, under label skew, the model would learn their labels only; without
    the penalty a straggler would set every round's length.

    With ``min_select_fraction`` the number of devices is chosen each round
    too: for ``m`` on an even grid from ``min_select_fraction x n`` to
    ``select_fraction x n`` (at most 8 sizes), the top ``m`` are planned and
    the size whose devices bring the most statistical utility per predicted
    second of round (``sum utility / makespan``, the progress-per-time trade
    Oort's utility and deadline stand for) trains. When slow devices are most
    of the fleet, waiting for more of them costs more than their data brings;
    when the fleet is fast, more devices take part.

    With ``min_work`` (partial work) the round also gets a deadline: each selected
    device trains the batches that end by it, at least ``min_work`` of its round,
    and the deadline is the one of most utility trained per predicted second
    (:mod:`splitlearn.planning.deadline`). A slow device then trains part of its
    round instead of setting the round's length, and its data still takes part.

    Parameters
    ----------
    select_fraction : float
        Share of the given clients that train, in (0, 1] (the most, with
        ``min_select_fraction``).
    min_select_fraction : float | None
        If given, in (0, select_fraction]: the fewest; the size in between is
        chosen per round (above). None: always ``select_fraction``.
    exploration : float
        Weight of the staleness bonus, >= 0 (Oort's 0.1).
    straggler_penalty : float
        Exponent of the slow-device penalty, >= 0 (Oort's 2; 0: none).
    min_work : float | None
        If given, in (0, 1]: partial work, the least share of its round a selected
        device trains. None: every selected device trains its whole round.
    selection : str
        ``"utility"`` as above, or ``"random"``: ``m`` feasible devices drawn
        at random each round (seeded by ``seed`` and the round), their cuts
        and recomputation still solved exactly: the baseline that shows what
        the scoring buys.
    seed : int
        Seed of the random selection.
    allow_recompute : bool
        Whether a device may be asked to recompute its activations (to fit, or to
        reach a faster cut); ``planner.recompute``. Without it, (a) excludes every
        device that fits no cut as it is.
    min_cut, forbidden_cuts
        The privacy floor.
    shared_trunk : bool
        The makespan model solved for.
    """

    def __init__(
        self,
        select_fraction: float = 0.5,
        exploration: float = 0.1,
        straggler_penalty: float = 2.0,
        *,
        min_select_fraction: float | None = None,
        min_work: float | None = None,
        selection: str = "utility",
        seed: int = 0,
        allow_recompute: bool = True,
        min_cut: int | None = None,
        forbidden_cuts: Collection[int] = frozenset(),
        shared_trunk: bool = True,
    ) -> None:
        if not 0 < select_fraction <= 1:
            raise ValueError(f"select_fraction must lie in (0, 1], got {select_fraction}")
        if min_select_fraction is not None and not 0 < min_select_fraction <= select_fraction:
            raise ValueError(f"min_select_fraction must lie in (0, select_fraction="
                             f"{select_fraction}], got {min_select_fraction}")
        self.min_select_fraction = min_select_fraction
        if min_work is not None and not 0 < min_work <= 1:
            raise ValueError(f"min_work must lie in (0, 1], got {min_work}")
        self.min_work = min_work
        if exploration < 0:
            raise ValueError(f"exploration must be >= 0, got {exploration}")
        if straggler_penalty < 0:
            raise ValueError(f"straggler_penalty must be >= 0, got {straggler_penalty}")
        if selection not in ("utility", "random"):
            raise ValueError(f"selection must be 'utility' or 'random', got {selection!r}")
        self.selection = selection
        self.seed = seed
        self.allow_recompute = allow_recompute
        self.select_fraction = select_fraction
        self.exploration = exploration
        self.straggler_penalty = straggler_penalty
        super().__init__(min_cut=min_cut, forbidden_cuts=forbidden_cuts, shared_trunk=shared_trunk)
        # The planner's memory: the round each client was last selected.
        self.last_selected: dict[str, int] = {}

    def selection_size(self, num_clients: int) -> int:
        """``m``: how many of ``num_clients`` given clients train (at least one)."""
        return max(1, round(self.select_fraction * num_clients))

    def selection_sizes(self, num_clients: int) -> list[int]:
        """Return the sizes tried: ``selection_size``, or a grid down to the fewest."""
        most = self.selection_size(num_clients)
        if self.min_select_fraction is None:
            return [most]
        fewest = max(1, round(self.min_select_fraction * num_clients))
        steps = min(_SIZE_GRID - 1, most - fewest)
        return sorted({fewest + round(k * (most - fewest) / steps) for k in range(steps + 1)}
                      if steps > 0 else {most})

    def plan(
        self,
        server_round: int,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        *,
        trunk_flops_per_s: float,
    ) -> Plan:
        """Select the ``m`` best-scored devices and solve their cuts (see :class:`Planner`)."""
        options, excluded = self.options(
            clients, cuts, trunk_flops_per_s=trunk_flops_per_s,
            allow_recompute=self.allow_recompute,
        )
        feasible = [i for i, opts in enumerate(options) if opts]
        best: tuple[float, set[int], list[Option | None], list[PartialChoice | None] | None]
        best = (-math.inf, set(), [None] * len(clients), None)
        for m in self.selection_sizes(len(clients)):
            selected = self._select(server_round, clients, options, feasible, m)
            in_pool = [opts if i in selected else [] for i, opts in enumerate(options)]
            chosen = choose_options(in_pool, select=None, shared_trunk=self.shared_trunk)
            partial = None
            if self.min_work is None:
                rate = _utility_rate(clients, chosen, shared_trunk=self.shared_trunk)
            else:
                rate, partial = deadline_choices(
                    clients, chosen, cuts, min_work=self.min_work,
                    trunk_flops_per_s=trunk_flops_per_s, shared_trunk=self.shared_trunk)
            if rate > best[0]:
                best = (rate, selected, chosen, partial)
        _, selected, chosen, partial = best
        for i in feasible:
            if i not in selected:
                excluded[clients[i].client] = f"not selected ({self.selection} selection)"
        plan = (plan_from_choices(clients, chosen, excluded, shared_trunk=self.shared_trunk)
                if partial is None else
                plan_with_steps(clients, partial, excluded, shared_trunk=self.shared_trunk,
                                min_work=self.min_work or 1.0))
        self.last_selected.update((a.client, server_round) for a in plan.assignments)
        return plan

    def _select(self, server_round: int, clients: Sequence[ClientState],
                options: Sequence[Sequence[Option]], feasible: Sequence[int], m: int) -> set[int]:
        """Pick ``m`` devices: the best scored, or drawn at random among the feasible."""
        if self.selection == "random":
            rng = random.Random(f"{self.seed}/{server_round}")
            return set(rng.sample(list(feasible), min(m, len(feasible))))
        return set(self.ranked(server_round, clients, options, m)[:m])

    def ranked(
        self, server_round: int, clients: Sequence[ClientState],
        options: Sequence[Sequence[Option]], m: int,
    ) -> list[int]:
        """Return the feasible clients' indices, best score first, for ``m`` to be selected."""
        fastest = {i: min(o.client_s for o in opts) for i, opts in enumerate(options) if opts}
        if not fastest:
            return []
        deadline = sorted(fastest.values())[min(m, len(fastest)) - 1]
        top = max(clients[i].utility for i in fastest)

        def score(i: int) -> float:
            last = self.last_selected.get(clients[i].client)
            if last is None:
                return math.inf  # never tried: explore first
            utility = clients[i].utility / top if top > 0 else 0.0
            stale = math.sqrt(math.log(server_round) / last) if server_round > 1 else 0.0
            slow = min(1.0, deadline / fastest[i]) if fastest[i] > 0 else 1.0
            return (utility + self.exploration * stale) * slow**self.straggler_penalty

        return sorted(fastest, key=lambda i: (-score(i), fastest[i], i))


def _utility_rate(clients: Sequence[ClientState], chosen: Sequence[Option | None], *,
                  shared_trunk: bool) -> float:
    """Statistical utility of the chosen devices per predicted second of their round."""
    pairs = [(o.client_s, o.trunk_s) for o in chosen if o is not None]
    utility = sum(c.utility for c, o in zip(clients, chosen, strict=True) if o is not None)
    span = makespan(pairs, shared_trunk=shared_trunk)
    return utility / span if span > 0 else utility


class OraclePlanner(FlooredPlanner):
    """Exhaustive search over every assignment (no selection): small fleets only.

    Parameters
    ----------
    allow_recompute : bool
        Whether clients may recompute activations.
    min_cut, forbidden_cuts
        The privacy floor.
    shared_trunk : bool
        The makespan model searched.
    """

    def __init__(
        self,
        *,
        allow_recompute: bool = True,
        min_cut: int | None = None,
        forbidden_cuts: Collection[int] = frozenset(),
        shared_trunk: bool = True,
    ) -> None:
        self.allow_recompute = allow_recompute
        super().__init__(min_cut=min_cut, forbidden_cuts=forbidden_cuts, shared_trunk=shared_trunk)

    def plan(
        self,
        server_round: int,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        *,
        trunk_flops_per_s: float,
    ) -> Plan:
        """Try every assignment (see :class:`Planner`); ValueError when there are too many."""
        try:
            return brute_force(
                clients,
                cuts,
                trunk_flops_per_s=trunk_flops_per_s,
                allow_recompute=self.allow_recompute,
                min_cut=self.min_cut,
                forbidden_cuts=self.forbidden_cuts,
                shared_trunk=self.shared_trunk,
            )
        except TooManyAssignments as err:
            raise ValueError(
                f"planner 'oracle' cannot plan {len(clients)} clients x {len(cuts)} cuts: {err}"
            ) from err


class RotatePlanner(FlooredPlanner):
    """Diagnostic: client ``k`` takes ``cuts[(k + round) % len(cuts)]``, no recomputation.

    Cuts then differ within a round and move every round, which exercises the
    per-client machinery; it is not meant to be fast. ``k`` is the client's
    rank by id (numerically for Flower node ids), so ``len(cuts)`` clients get
    ``len(cuts)`` different cuts. ``cuts`` are the allowed ones in increasing
    order; a client its cut does not fit is excluded.
    """

    def plan(
        self,
        server_round: int,
        clients: Sequence[ClientState],
        cuts: Sequence[CutCost],
        *,
        trunk_flops_per_s: float,
    ) -> Plan:
        """Give each client the next cut in turn (see :class:`Planner`)."""
        allowed = sorted(
            allowed_cuts(cuts, min_cut=self.min_cut, forbidden_cuts=self.forbidden_cuts),
            key=lambda c: c.cut,
        )
        chosen: list[Option | None] = []
        excluded: dict[str, str] = {}
        rank = {c.client: k for k, c in enumerate(sorted(clients, key=_id_order))}
        for client in clients:
            turn = [allowed[(rank[client.client] + server_round) % len(allowed)]]
            opts = client_options(
                client, turn, trunk_flops_per_s=trunk_flops_per_s, allow_recompute=False
            )
            if not opts:
                excluded[client.client] = memory_reason(client, turn, allow_recompute=False)
            chosen.append(opts[0] if opts else None)
        return plan_from_choices(clients, chosen, excluded, shared_trunk=self.shared_trunk)


PLANNERS: dict[str, type] = {
    "uniform": UniformPlanner,
    "greedy": GreedyPlanner,
    "dynsl": DynSLPlanner,
    "smartsplit": SmartSplitPlanner,
    "oracle": OraclePlanner,
    "rotate": RotatePlanner,
}


def make_planner(name: str, **options: Any) -> Planner:
    """Build the planner called ``name`` with its constructor's ``options``.

    Raises
    ------
    ValueError
        If ``name`` is not one of :data:`PLANNERS`, an option is not one the
        planner takes, or a required one is missing (the message lists them).
    """
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; accepted: {sorted(PLANNERS)}")
    cls = PLANNERS[name]
    parameters = inspect.signature(cls).parameters
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        raise ValueError(
            f"planner {name!r} takes no options {unknown}; accepted: {list(parameters)}"
        )
    missing = [
        p for p, spec in parameters.items() if spec.default is spec.empty and p not in options
    ]
    if missing:
        raise ValueError(f"planner {name!r} needs options {missing}")
    planner: Planner = cls(**options)
    return planner


def _id_order(client: ClientState) -> tuple[int, int | str]:
    """Sort key of client ids: integers (Flower node ids) numerically, then the rest."""
    text = client.client
    return (0, int(text)) if text.lstrip("-").isdigit() else (1, text)
