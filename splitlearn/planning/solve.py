"""Exact makespan minimisation over per-client cuts (pure Python).

Every client ``i`` has options ``o = (cut, recompute)``; an option is
feasible when its training memory fits the client's budget
(:func:`~splitlearn.planning.cost.fits`), its cut is at least ``min_cut`` and
not in ``forbidden_cuts``, and (unless ``allow_recompute``) it does not
recompute activations. Each option costs the client ``T_io`` seconds
(:func:`~splitlearn.planning.cost.client_seconds`) and the trunk ``W_io``
seconds (:func:`~splitlearn.planning.cost.trunk_seconds`). A round lasts

* ``max_i T_i + sum_i W_i`` with one shared trunk (it serialises its steps), or
* ``max_i (T_i + W_i)`` with a trunk per client (``shared_trunk=False``).

Algorithm, shared trunk
    Sweep a threshold ``tau`` over the distinct ``T_io`` in increasing order.
    Under ``tau`` every client independently takes its option with
    ``T_io <= tau`` of least ``W_io`` (``w_i(tau)``), and the sweep scores
    ``tau + sum_i w_i(tau)`` (with ``select=m``: ``tau`` plus the ``m`` smallest
    ``w_i(tau)``, once at least ``m`` clients have an option under ``tau``).
    The least score is the optimum. Every score is at least the makespan of
    the assignment it describes (its largest ``T`` is at most ``tau``), hence
    at least the optimum; and if an optimal assignment has largest client time
    ``tau*`` (one of the swept values), then under ``tau*`` each of its options
    is available, so each ``w_i(tau*)`` is at most that option's ``W`` and the
    score at ``tau*`` is at most the optimum. The plan is rebuilt at the
    smallest best ``tau`` and its makespan computed from the chosen options.

    Options enter the sweep once each, in order of ``T``; a client's least
    ``W`` only falls. Without selection the sum is updated per option, so the
    sweep costs ``O(nK log(nK))`` for ``n`` clients with ``K`` options each
    (the sort). With ``select=m`` the ``m`` smallest ``w_i`` are kept as a set
    with a lazy max-heap: a member that falls stays a member; an outsider that
    falls below the set's largest member swaps with it. That is ``O(log n)``
    per option, ``O(nK log(nK))`` in all.

Algorithm, a trunk per client
    The objective no longer couples clients: each client takes its option of
    least ``T + W``, and with ``select=m`` the ``m`` clients with the smallest
    such minimum take part. ``O(nK + n log n)``.

Ties (deterministic)
    Among options of equal ``W`` (or ``T + W``) a client prefers no
    recomputation, then its ``current_cut``, then the smaller cut; among
    clients of equal ``W`` the selection prefers smaller ``T``, then input
    order; among thresholds of equal score (to 1e-12 relative, the rounding
    of the running sums) the smallest wins.

:func:`brute_force` enumerates every assignment (and every subset of ``m``
clients) and is the reference the tests hold :func:`solve` to.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from splitlearn.planning.cost import (
    TRAIN_TO_FORWARD_FLOPS,
    Assignment,
    ClientState,
    CutCost,
    Plan,
    client_seconds,
    fits,
    makespan,
    needed_memory,
    trunk_seconds,
)

#: The most assignments :func:`brute_force` agrees to enumerate.
BRUTE_FORCE_LIMIT = 2_000_000

#: Relative slack when comparing sweep scores: running sums drift by a few ulps.
_SCORE_RTOL = 1e-12

NOT_SELECTED = "not selected"


class TooManyAssignments(ValueError):
    """:func:`brute_force` refuses: the instance has too many assignments to enumerate."""


@dataclass(frozen=True)
class Option:
    """One feasible way for a client to train: a cut, recomputation or not, and its times.

    Parameters
    ----------
    cut : int
        Stages ``[0, cut)`` on the client.
    recompute : bool
        Whether the client recomputes its activations in the backward.
    client_s : float
        Predicted client seconds ``T`` (compute and transfers).
    trunk_s : float
        Predicted trunk seconds ``W`` for this client.
    """

    cut: int
    recompute: bool
    client_s: float
    trunk_s: float


def allowed_cuts(
    cuts: Sequence[CutCost], *, min_cut: int | None = None, forbidden_cuts: Collection[int] = ()
) -> list[CutCost]:
    """Return the cuts at or above ``min_cut`` and not forbidden.

    Raises
    ------
    ValueError
        If ``cuts`` is empty, names a cut twice, or no cut is left.
    """
    if not cuts:
        raise ValueError("no cuts to plan over (cuts is empty)")
    names = [c.cut for c in cuts]
    if len(set(names)) != len(names):
        raise ValueError(f"cuts must be distinct, got {names}")
    kept = [
        c for c in cuts if (min_cut is None or c.cut >= min_cut) and c.cut not in forbidden_cuts
    ]
    if not kept:
        raise ValueError(
            f"no cut allowed: cuts {names}, min_cut={min_cut}, "
            f"forbidden_cuts={sorted(forbidden_cuts)}"
        )
    return kept


def client_options(
    client: ClientState,
    cuts: Sequence[CutCost],
    *,
    trunk_flops_per_s: float,
    allow_recompute: bool = True,
) -> list[Option]:
    """Return the client's feasible options, most preferred first.

    Preference (used to break ties): no recomputation, then the client's
    ``current_cut``, then the smaller cut. ``cuts`` should already be the
    allowed ones (:func:`allowed_cuts`).
    """
    modes = (False, True) if allow_recompute else (False,)
    options = [
        Option(
            cut=cost.cut,
            recompute=recompute,
            client_s=client_seconds(client, cost, recompute=recompute),
            trunk_s=trunk_seconds(client, cost, trunk_flops_per_s=trunk_flops_per_s),
        )
        for cost in cuts
        for recompute in modes
        if fits(client, cost, recompute=recompute)
    ]
    return sorted(options, key=lambda o: (o.recompute, o.cut != client.current_cut, o.cut))


def memory_reason(client: ClientState, cuts: Sequence[CutCost], *, allow_recompute: bool) -> str:
    """Explain why no allowed cut fits ``client``: the least memory any needs vs its budget."""
    needs = [(needed_memory(client, cost), cost.cut, False) for cost in cuts]
    if allow_recompute:
        needs += [(needed_memory(client, cost, recompute=True), cost.cut, True)
                  for cost in cuts]
    need, cut, recompute = min(needs)
    how = " with recomputation" if recompute else ""
    return (
        f"no cut fits its memory: needs at least {need:,} bytes (cut {cut}{how}), "
        f"budget {client.memory_bytes:,.0f} bytes"
    )


def plan_from_choices(
    clients: Sequence[ClientState],
    chosen: Sequence[Option | None],
    excluded: dict[str, str],
    *,
    shared_trunk: bool,
) -> Plan:
    """Assemble a :class:`Plan` from one chosen option (or None) per client.

    Clients with None that are not already in ``excluded`` are marked
    "not selected"; the makespan is computed from the chosen options.
    """
    reasons = dict(excluded)
    assignments = []
    pairs = []
    for client, option in zip(clients, chosen, strict=True):
        if option is None:
            reasons.setdefault(client.client, NOT_SELECTED)
            continue
        assignments.append(Assignment(client.client, option.cut, option.recompute,
                                      client_s=option.client_s, trunk_s=option.trunk_s))
        pairs.append((option.client_s, option.trunk_s))
    ordered = {c.client: reasons[c.client] for c in clients if c.client in reasons}
    return Plan(tuple(assignments), makespan(pairs, shared_trunk=shared_trunk), ordered)


def solve(
    clients: Sequence[ClientState],
    cuts: Sequence[CutCost],
    *,
    trunk_flops_per_s: float,
    select: int | None = None,
    allow_recompute: bool = True,
    min_cut: int | None = None,
    forbidden_cuts: Collection[int] = frozenset(),
    shared_trunk: bool = True,
) -> Plan:
    """Return a plan of least predicted makespan (exact; see the module docstring).

    Parameters
    ----------
    clients : Sequence[ClientState]
        The candidates (distinct ids).
    cuts : Sequence[CutCost]
        The model's cuts (distinct).
    trunk_flops_per_s : float
        The trunk's training FLOP/s.
    select : int | None
        None: every client with a feasible option takes part. ``m``: exactly
        ``min(m, #feasible)`` clients take part, chosen with the cuts.
    allow_recompute : bool
        Whether clients may recompute activations in the backward (to fit memory).
    min_cut : int | None
        The smallest cut allowed (a privacy floor), or None.
    forbidden_cuts : Collection[int]
        Cuts never assigned (e.g. from :func:`~splitlearn.planning.planners.privacy_floor`).
    shared_trunk : bool
        One trunk serialising all clients (True) or one trunk per client.

    Returns
    -------
    Plan
        Assignments in input order; excluded clients with the least memory
        they would need, or "not selected".

    Raises
    ------
    ValueError
        On duplicate ids or cuts, no allowed cut, a non-positive trunk speed
        or a negative ``select``.
    """
    options, excluded = candidate_options(
        clients,
        cuts,
        trunk_flops_per_s=trunk_flops_per_s,
        select=select,
        allow_recompute=allow_recompute,
        min_cut=min_cut,
        forbidden_cuts=forbidden_cuts,
    )
    chosen = choose_options(options, select=select, shared_trunk=shared_trunk)
    return plan_from_choices(clients, chosen, excluded, shared_trunk=shared_trunk)


def candidate_options(
    clients: Sequence[ClientState],
    cuts: Sequence[CutCost],
    *,
    trunk_flops_per_s: float,
    select: int | None = None,
    allow_recompute: bool = True,
    min_cut: int | None = None,
    forbidden_cuts: Collection[int] = frozenset(),
) -> tuple[list[list[Option]], dict[str, str]]:
    """Validate an instance; return each client's options and the memory exclusions."""
    if not trunk_flops_per_s > 0:
        raise ValueError(f"trunk_flops_per_s must be > 0, got {trunk_flops_per_s}")
    if select is not None and select < 0:
        raise ValueError(f"select must be None or >= 0, got {select}")
    ids = [c.client for c in clients]
    if len(set(ids)) != len(ids):
        raise ValueError(f"client ids must be distinct, got {ids}")
    allowed = allowed_cuts(cuts, min_cut=min_cut, forbidden_cuts=forbidden_cuts)
    options = [
        client_options(
            c, allowed, trunk_flops_per_s=trunk_flops_per_s, allow_recompute=allow_recompute
        )
        for c in clients
    ]
    excluded = {
        c.client: memory_reason(c, allowed, allow_recompute=allow_recompute)
        for c, opts in zip(clients, options, strict=True)
        if not opts
    }
    return options, excluded


def choose_options(
    options: Sequence[Sequence[Option]], *, select: int | None, shared_trunk: bool = True
) -> list[Option | None]:
    """Pick one option per client (None: not taking part) minimising the makespan.

    ``options[i]`` lists client ``i``'s feasible options, most preferred
    first; a client with none never takes part. Exact; see the module docstring.
    """
    feasible = sum(1 for opts in options if opts)
    need = feasible if select is None else min(select, feasible)
    if need == 0:
        return [None] * len(options)
    if not shared_trunk:
        return _choose_per_client_trunk(options, need)
    tau = _best_threshold(options, need, selecting=select is not None)
    return _choices_under(options, tau, need)


def _choose_per_client_trunk(options: Sequence[Sequence[Option]], need: int) -> list[Option | None]:
    """Each client's least ``T + W``; the ``need`` clients with the smallest minima take part."""
    best = [min(opts, key=lambda o: o.client_s + o.trunk_s) if opts else None for opts in options]
    ranked = sorted((o.client_s + o.trunk_s, i) for i, o in enumerate(best) if o is not None)
    keep = {i for _, i in ranked[:need]}
    return [o if i in keep else None for i, o in enumerate(best)]


def _best_threshold(options: Sequence[Sequence[Option]], need: int, *, selecting: bool) -> float:
    """Sweep ``tau`` over the client times; return the smallest ``tau`` of least score."""
    events = sorted((o.client_s, o.trunk_s, i) for i, opts in enumerate(options) for o in opts)
    track = _SmallestSum(len(options), need) if selecting else _FullSum(len(options), need)
    scores: list[tuple[float, float]] = []
    start = 0
    while start < len(events):
        tau = events[start][0]
        stop = start
        # All options with the same T enter before tau is scored.
        while stop < len(events) and events[stop][0] == tau:
            _, w, i = events[stop]
            track.offer(i, w)
            stop += 1
        if track.ready():
            scores.append((tau, tau + track.total))
        start = stop
    least = min(score for _, score in scores)
    slack = _SCORE_RTOL * abs(least)
    return next(tau for tau, score in scores if score <= least + slack)


def _choices_under(
    options: Sequence[Sequence[Option]], tau: float, need: int
) -> list[Option | None]:
    """Each client's least-``W`` option with ``T <= tau``; keep the ``need`` smallest ``W``."""
    best: list[Option | None] = []
    for opts in options:
        under = [o for o in opts if o.client_s <= tau]
        # min() keeps the first of equal W: the options are in preference order.
        best.append(min(under, key=lambda o: o.trunk_s) if under else None)
    ranked = sorted((o.trunk_s, o.client_s, i) for i, o in enumerate(best) if o is not None)
    keep = {i for *_, i in ranked[:need]}
    return [o if i in keep else None for i, o in enumerate(best)]


class _FullSum:
    """Sum of every client's least ``W`` so far; ready once all ``need`` clients have one."""

    def __init__(self, n: int, need: int) -> None:
        self.best = [math.inf] * n
        self.count = 0
        self.need = need
        self.total = 0.0

    def offer(self, i: int, w: float) -> None:
        old = self.best[i]
        if w >= old:
            return
        self.best[i] = w
        if old == math.inf:
            self.count += 1
            self.total += w
        else:
            self.total += w - old

    def ready(self) -> bool:
        return self.count >= self.need


class _SmallestSum:
    """Sum of the ``need`` smallest per-client least ``W`` (a set plus a lazy max-heap)."""

    def __init__(self, n: int, need: int) -> None:
        self.best = [math.inf] * n
        self.member = [False] * n
        self.size = 0
        self.need = need
        self.total = 0.0
        self.heap: list[tuple[float, int]] = []  # (-w, client); stale entries skipped

    def offer(self, i: int, w: float) -> None:
        old = self.best[i]
        if w >= old:
            return
        self.best[i] = w
        if self.member[i]:
            # A member that falls is still among the smallest.
            self.total += w - old
            heapq.heappush(self.heap, (-w, i))
        elif self.size < self.need:
            self._admit(i, w)
        else:
            top_w, top = self._largest_member()
            if w < top_w:
                heapq.heappop(self.heap)
                self.member[top] = False
                self.size -= 1
                self.total -= top_w
                self._admit(i, w)

    def _admit(self, i: int, w: float) -> None:
        self.member[i] = True
        self.size += 1
        self.total += w
        heapq.heappush(self.heap, (-w, i))

    def _largest_member(self) -> tuple[float, int]:
        while True:
            neg_w, j = self.heap[0]
            if self.member[j] and self.best[j] == -neg_w:
                return -neg_w, j
            heapq.heappop(self.heap)

    def ready(self) -> bool:
        return self.size >= self.need


def brute_force(
    clients: Sequence[ClientState],
    cuts: Sequence[CutCost],
    *,
    trunk_flops_per_s: float,
    select: int | None = None,
    allow_recompute: bool = True,
    min_cut: int | None = None,
    forbidden_cuts: Collection[int] = frozenset(),
    shared_trunk: bool = True,
) -> Plan:
    """Return a least-makespan plan by enumerating every assignment (the reference).

    Same parameters and result as :func:`solve`. Every subset of
    ``min(select, #feasible)`` clients is tried when ``select`` is set.
    Among equal makespans the first in enumeration order wins (options in
    preference order, subsets in input order).

    Raises
    ------
    ValueError
        As :func:`solve`.
    TooManyAssignments
        A ValueError: more than ``BRUTE_FORCE_LIMIT`` assignments to try.
    """
    options, excluded = candidate_options(
        clients,
        cuts,
        trunk_flops_per_s=trunk_flops_per_s,
        select=select,
        allow_recompute=allow_recompute,
        min_cut=min_cut,
        forbidden_cuts=forbidden_cuts,
    )
    feasible = [i for i, opts in enumerate(options) if opts]
    size = len(feasible) if select is None else min(select, len(feasible))
    total = count_assignments([len(options[i]) for i in feasible], size)
    if total > BRUTE_FORCE_LIMIT:
        raise TooManyAssignments(
            f"brute force would try {total:,} assignments (> {BRUTE_FORCE_LIMIT:,}); "
            "use solve() for fleets this large"
        )
    best_span = math.inf
    best: tuple[tuple[int, ...], tuple[Option, ...]] = ((), ())
    for subset in itertools.combinations(feasible, size):
        for combo in itertools.product(*(options[i] for i in subset)):
            span = makespan(((o.client_s, o.trunk_s) for o in combo), shared_trunk=shared_trunk)
            if span < best_span:
                best_span, best = span, (subset, combo)
    chosen: list[Option | None] = [None] * len(clients)
    for i, option in zip(*best, strict=True):
        chosen[i] = option
    return plan_from_choices(clients, chosen, excluded, shared_trunk=shared_trunk)


def count_assignments(option_counts: Sequence[int], size: int) -> int:
    """Count the ways to pick ``size`` clients and one option each.

    The elementary symmetric polynomial of degree ``size`` of the counts.
    """
    ways = [1] + [0] * size
    for k in option_counts:
        for j in range(size, 0, -1):
            ways[j] += ways[j - 1] * k
    return ways[size]


def random_instance(
    num_clients: int, num_cuts: int, *, seed: int
) -> tuple[list[ClientState], list[CutCost], float]:
    """Build a seeded random fleet and model: ``(clients, cuts, trunk_flops_per_s)``.

    Deeper cuts put more FLOPs, weights and memory on the client; activations
    shrink with depth, unevenly. Budgets leave some cuts out of reach for some
    clients, and some only with recomputation.
    """
    rng = random.Random(seed)
    total_flops = 3e9
    cuts = []
    for c in range(1, num_cuts + 1):
        share = c / (num_cuts + 1)
        client_flops = total_flops * share
        memory = int(50e6 + 400e6 * share * rng.uniform(0.8, 1.2))
        cuts.append(
            CutCost(
                cut=c,
                client_flops_per_sample=client_flops,
                recompute_flops_per_sample=client_flops / TRAIN_TO_FORWARD_FLOPS,
                server_flops_per_sample=total_flops - client_flops,
                smashed_bytes_per_sample=int(200e3 * (1 - share) * rng.uniform(0.5, 1.5)) + 1,
                client_param_bytes=int(40e6 * share**2),
                memory_bytes=memory,
                recompute_memory_bytes=int(memory * rng.uniform(0.4, 0.8)),
            )
        )
    clients = [
        ClientState(
            client=f"c{i}",
            flops_per_s=10 ** rng.uniform(9, 11.5),
            uplink_bytes_per_s=10 ** rng.uniform(5, 7.5),
            downlink_bytes_per_s=10 ** rng.uniform(5.5, 8),
            rtt_s=rng.uniform(0.005, 0.2),
            memory_bytes=rng.uniform(40e6, 600e6),
            samples=rng.choice([64, 128, 256, 512]),
            batches=rng.choice([2, 4, 8]),
            utility=rng.uniform(0.1, 1.0),
            current_cut=rng.choice([None, *range(1, num_cuts + 1)]),
        )
        for i in range(num_clients)
    ]
    return clients, cuts, 1e13


def time_planner(num_clients: int = 1000, num_cuts: int = 20, seed: int = 0) -> float:
    """Seconds to solve a random instance (:func:`random_instance`) twice.

    Once with every feasible client and once selecting a tenth of them, both
    with recomputation allowed and a shared trunk; the sum is returned (a
    benchmark's figure, never asserted on in tests).
    """
    clients, cuts, trunk = random_instance(num_clients, num_cuts, seed=seed)
    start = time.perf_counter()
    solve(clients, cuts, trunk_flops_per_s=trunk)
    solve(clients, cuts, trunk_flops_per_s=trunk, select=max(1, num_clients // 10))
    return time.perf_counter() - start
