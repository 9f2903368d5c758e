"""The planners' behaviour on crafted fleets, the privacy floor and the monitor's arithmetic."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from splitlearn.planning.cost import (
    ClientState,
    CutCost,
    client_seconds,
    device_round,
    fits,
    predicted_round_s,
)
from splitlearn.planning.monitor import ClientMonitor
from splitlearn.planning.planners import (
    PLANNERS,
    DynSLPlanner,
    GreedyPlanner,
    OraclePlanner,
    RotatePlanner,
    SmartSplitPlanner,
    UniformPlanner,
    make_planner,
    privacy_floor,
)
from splitlearn.planning.queue import round_seconds
from splitlearn.planning.solve import random_instance, solve
from tests.helpers import client_state, cut_cost


def cuts_of(plan) -> dict[str, int]:
    return {a.client: a.cut for a in plan.assignments}


# --- uniform -------------------------------------------------------------------


def test_uniform_puts_everyone_at_its_cut_and_excludes_what_does_not_fit() -> None:
    cuts = [cut_cost(c, client_flops=c, server_flops=5 - c, memory=100 * c) for c in (1, 2, 3)]
    clients = [client_state("big", memory=1000), client_state("small", memory=150)]
    plan = UniformPlanner(2).plan(1, clients, cuts, trunk_flops_per_s=1.0)
    assert cuts_of(plan) == {"big": 2}
    assert not plan.assignments[0].recompute
    assert "needs at least 200 bytes" in plan.excluded["small"]
    assert "budget 150 bytes" in plan.excluded["small"]


def test_uniform_refuses_a_forbidden_or_unknown_cut() -> None:
    with pytest.raises(ValueError, match="privacy floor"):
        UniformPlanner(1, forbidden_cuts={1})
    with pytest.raises(ValueError, match="privacy floor"):
        UniformPlanner(1, min_cut=2)
    cuts = [cut_cost(1, client_flops=1, server_flops=1)]
    with pytest.raises(ValueError, match=r"uniform cut 4 is not one of \[1\]"):
        UniformPlanner(4).plan(1, [client_state("a")], cuts, trunk_flops_per_s=1.0)


# --- greedy --------------------------------------------------------------------

# Alone, cut 1 is faster (1 + 2 < 4 + 0.5); four clients on one trunk make cut 2 better.
SERIALISING_CUTS = [
    cut_cost(1, client_flops=1, server_flops=2),
    cut_cost(2, client_flops=4, server_flops=0.5),
]


def test_greedy_ignores_that_the_trunk_serialises() -> None:
    clients = [client_state(f"c{i}") for i in range(4)]
    greedy = GreedyPlanner().plan(1, clients, SERIALISING_CUTS, trunk_flops_per_s=1.0)
    exact = solve(clients, SERIALISING_CUTS, trunk_flops_per_s=1.0, allow_recompute=False)
    assert set(cuts_of(greedy).values()) == {1}
    assert greedy.makespan_s == pytest.approx(1 + 4 * 2)
    assert exact.makespan_s == pytest.approx(4 + 4 * 0.5)


def test_greedy_never_recomputes() -> None:
    cuts = [cut_cost(1, client_flops=1, server_flops=1, memory=100, recompute_memory=10)]
    plan = GreedyPlanner().plan(1, [client_state("a", memory=50)], cuts, trunk_flops_per_s=1.0)
    assert plan.assignments == () and "memory" in plan.excluded["a"]


# --- DynSL ---------------------------------------------------------------------


def moving_cuts(*, shallow_trunk: float, deep_trunk: float, deep_params: int) -> list[CutCost]:
    """Cut 1 keeps the trunk busy; cut 2 relieves it but moves ``deep_params`` bytes."""
    return [
        cut_cost(1, client_flops=1, server_flops=shallow_trunk),
        cut_cost(2, client_flops=2, server_flops=deep_trunk, params=deep_params),
    ]


def test_dynsl_moves_when_the_gain_over_r_rounds_pays_for_the_move() -> None:
    # Kept: 1 + 9 = 10 s. New: 2 + 2 x 2.5 (weights) + 1 = 8 s. Moving costs 2.5 s.
    cuts = moving_cuts(shallow_trunk=9, deep_trunk=1, deep_params=5)
    client = [client_state("a", link=2.0, current_cut=1)]
    # Over 1 round the 2 s gain does not clear 1.1 x 2.5 s; over 10 rounds it does.
    once = DynSLPlanner(every=1, hysteresis=0.1).plan(1, client, cuts, trunk_flops_per_s=1.0)
    often = DynSLPlanner(every=10, hysteresis=0.1).plan(1, client, cuts, trunk_flops_per_s=1.0)
    assert cuts_of(once) == {"a": 1} and once.makespan_s == pytest.approx(10)
    assert cuts_of(often) == {"a": 2} and often.makespan_s == pytest.approx(8)


def test_dynsl_does_not_move_for_a_tiny_gain() -> None:
    # Kept: 1 + 3 = 4 s; new: 2 + 1.99 + 0.002 = 3.992 s. Cheap to move, but under h x 4 s.
    cuts = moving_cuts(shallow_trunk=3, deep_trunk=1.99, deep_params=1)
    client = [client_state("a", link=1000.0, current_cut=1)]
    planner = DynSLPlanner(every=1, hysteresis=0.1)
    assert cuts_of(planner.plan(1, client, cuts, trunk_flops_per_s=1.0)) == {"a": 1}
    bold = DynSLPlanner(every=1, hysteresis=0.0)
    assert cuts_of(bold.plan(1, client, cuts, trunk_flops_per_s=1.0)) == {"a": 2}


def test_dynsl_keeps_cuts_between_replans() -> None:
    planner = DynSLPlanner(every=3, hysteresis=0.0)
    deep = moving_cuts(shallow_trunk=9, deep_trunk=1, deep_params=0)
    shallow = moving_cuts(shallow_trunk=1, deep_trunk=9, deep_params=0)
    clients = [client_state("a")]
    assert cuts_of(planner.plan(1, clients, deep, trunk_flops_per_s=1.0)) == {"a": 2}
    # Cut 1 is now far better, but rounds 2 and 3 are not re-plan rounds.
    for server_round in (2, 3):
        assert cuts_of(planner.plan(server_round, clients, shallow, trunk_flops_per_s=1.0)) == {
            "a": 2
        }
    assert cuts_of(planner.plan(4, clients, shallow, trunk_flops_per_s=1.0)) == {"a": 1}


def test_dynsl_places_new_and_no_longer_fitting_clients_between_replans() -> None:
    planner = DynSLPlanner(every=5)
    cuts = [
        cut_cost(1, client_flops=1, server_flops=9, memory=10),
        cut_cost(2, client_flops=2, server_flops=1, memory=100),
    ]
    assert cuts_of(planner.plan(1, [client_state("a")], cuts, trunk_flops_per_s=1.0)) == {"a": 2}
    shrunk = [client_state("a", memory=50), client_state("b")]
    assert cuts_of(planner.plan(2, shrunk, cuts, trunk_flops_per_s=1.0)) == {"a": 1, "b": 2}


def test_dynsl_places_a_client_again_once_it_is_measured() -> None:
    # Round 1 knows only the prior (fast compute: cut 2); measured, the device computes
    # slowly and cut 1 is far better. Round 2 is no re-plan round, yet the guess goes.
    planner = DynSLPlanner(every=5)
    cuts = [cut_cost(1, client_flops=1, server_flops=1), cut_cost(2, client_flops=4,
                                                                  server_flops=0.1)]
    guess = replace(client_state("a", flops=100.0), measured=False)
    assert cuts_of(planner.plan(1, [guess], cuts, trunk_flops_per_s=1.0)) == {"a": 2}
    slow = client_state("a", flops=0.5)
    assert cuts_of(planner.plan(2, [slow], cuts, trunk_flops_per_s=1.0)) == {"a": 1}
    # Measured, it keeps its cut between re-plans again, whatever it measures.
    fast = client_state("a", flops=100.0)
    assert cuts_of(planner.plan(3, [fast], cuts, trunk_flops_per_s=1.0)) == {"a": 1}


def test_dynsl_reverts_moves_that_do_not_shorten_the_round() -> None:
    # A trunk per client. Both gain alone from cut 2 ("slow": 10 -> 3.5 s, "fast":
    # 2.4 -> 1.6 s), but "fast" stays under the round's 3.5 s either way: put back.
    cuts = [
        cut_cost(1, client_flops=4, server_flops=2),
        cut_cost(2, client_flops=1, server_flops=1.5),
    ]
    clients = [
        client_state("slow", flops=0.5, current_cut=1),
        client_state("fast", flops=10, current_cut=1),
    ]
    planner = DynSLPlanner(every=1, hysteresis=0.0, shared_trunk=False)
    plan = planner.plan(1, clients, cuts, trunk_flops_per_s=1.0)
    assert cuts_of(plan) == {"slow": 2, "fast": 1}
    assert plan.makespan_s == pytest.approx(3.5)


def played_round(plan, clients, cuts, trunk: float) -> float:  # noqa: ANN001
    return predicted_round_s(plan, {c.client: c for c in clients}, {c.cut: c for c in cuts},
                             trunk_flops_per_s=trunk)


@pytest.mark.parametrize("seed", range(4))
def test_dynsl_plans_the_played_out_round_exactly_on_a_small_fleet(seed: int) -> None:
    clients, cuts, trunk = random_instance(4, 4, seed=seed)
    fresh = [replace(c, current_cut=None) for c in clients]
    planner = DynSLPlanner(every=1)
    plan = planner.plan(1, fresh, cuts, trunk_flops_per_s=trunk)
    assert planner.last_gap == 0.0  # every combination tried
    # Against every combination of the cuts that fit, played out the same way.
    by_cut = {c.cut: c for c in cuts}
    options = [[c.cut for c in cuts if fits(client, c)] for client in fresh]
    best = min(
        round_seconds([device_round(client, by_cut[cut], trunk_flops_per_s=trunk)
                       for client, cut in zip(fresh, combo, strict=True)])
        for combo in itertools.product(*options))
    assert played_round(plan, fresh, cuts, trunk) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("penalty", [0.3, 2.0])
def test_dynsl_weighs_each_round_by_what_its_cuts_teach(seed: int, penalty: float) -> None:
    clients, cuts, trunk = random_instance(4, 4, seed=seed)
    fresh = [replace(c, current_cut=None) for c in clients]
    planner = DynSLPlanner(every=1, learning_penalty=penalty)
    plan = planner.plan(1, fresh, cuts, trunk_flops_per_s=trunk)
    # The reference: every combination's played-out round times 1 + p x its depth, the
    # samples-weighted share of the way from the lightest device side to the heaviest.
    by_cut = {c.cut: c for c in cuts}
    low = min(c.client_param_bytes for c in cuts)
    high = max(c.client_param_bytes for c in cuts)
    samples = sum(c.samples for c in fresh)

    def score(combo) -> float:  # noqa: ANN001
        played = round_seconds([device_round(client, by_cut[cut], trunk_flops_per_s=trunk)
                                for client, cut in zip(fresh, combo, strict=True)])
        depth = sum(c.samples * (by_cut[cut].client_param_bytes - low) / (high - low)
                    for c, cut in zip(fresh, combo, strict=True)) / samples
        return played * (1 + penalty * depth)

    options = [[c.cut for c in cuts if fits(client, c)] for client in fresh]
    scores = {combo: score(combo) for combo in itertools.product(*options)}
    chosen = tuple(plan.cut_of(c.client) for c in fresh)
    assert score(chosen) == pytest.approx(min(scores.values()), rel=1e-12)
    # Without the penalty the plan is the fastest round's, which teaches no better.
    fastest = DynSLPlanner(every=1).plan(1, fresh, cuts, trunk_flops_per_s=trunk)
    fast = tuple(fastest.cut_of(c.client) for c in fresh)
    assert played_round(fastest, fresh, cuts, trunk) <= played_round(plan, fresh, cuts, trunk) * (
        1 + 1e-12)
    assert score(chosen) <= score(fast) * (1 + 1e-12)


def test_dynsl_gives_a_device_its_shallower_cut_when_deep_rounds_learn_less() -> None:
    # Cut 2 is 1 s faster (9 s against 10 s) but holds all the device-side weights.
    cuts = [cut_cost(1, client_flops=1, server_flops=9),
            cut_cost(2, client_flops=8, server_flops=1, params=1)]
    client = [client_state("a", link=1e9)]
    assert cuts_of(DynSLPlanner(every=1).plan(1, client, cuts, trunk_flops_per_s=1.0)) == {"a": 2}
    # At p = 0.2 the deep round counts 9 x 1.2 = 10.8 s: cut 1's 10 s wins.
    learning = DynSLPlanner(every=1, learning_penalty=0.2)
    assert cuts_of(learning.plan(1, client, cuts, trunk_flops_per_s=1.0)) == {"a": 1}
    # At p = 0.1 it counts 9.9 s: cut 2 still wins.
    slight = DynSLPlanner(every=1, learning_penalty=0.1)
    assert cuts_of(slight.plan(1, client, cuts, trunk_flops_per_s=1.0)) == {"a": 2}


def test_dynsl_can_start_a_device_at_its_smallest_cut_until_it_is_measured() -> None:
    # The prior guesses a fast device (cut 2); started at its smallest cut, it trains at
    # cut 1 until measured, and then takes the cut its measurement plans.
    cuts = [cut_cost(1, client_flops=1, server_flops=9), cut_cost(2, client_flops=2,
                                                                  server_flops=1)]
    guess = replace(client_state("a", flops=100.0), measured=False)
    planned = DynSLPlanner(every=5)
    assert cuts_of(planned.plan(1, [guess], cuts, trunk_flops_per_s=1.0)) == {"a": 2}
    smallest = DynSLPlanner(every=5, start="smallest")
    assert cuts_of(smallest.plan(1, [guess], cuts, trunk_flops_per_s=1.0)) == {"a": 1}
    assert cuts_of(smallest.plan(2, [guess], cuts, trunk_flops_per_s=1.0)) == {"a": 1}
    measured = client_state("a", flops=100.0)
    assert cuts_of(smallest.plan(3, [measured], cuts, trunk_flops_per_s=1.0)) == {"a": 2}
    # Its smallest cut that fits: with cut 1 forbidden, cut 2.
    floored = DynSLPlanner(every=5, start="smallest", forbidden_cuts={1})
    assert cuts_of(floored.plan(1, [guess], cuts, trunk_flops_per_s=1.0)) == {"a": 2}


def test_dynsl_gives_a_device_placed_by_a_guess_the_measured_devices_deadline() -> None:
    # "known" was measured (its own round at cut 1: 2 s of compute + 2 x 1 s of weights);
    # "new" is the prior's guess: it trains until then, at least one batch, on its clock.
    cuts = [cut_cost(1, client_flops=2, server_flops=1, params=1)]
    known = client_state("known")
    new = replace(client_state("new", flops=100.0), measured=False)
    plan = DynSLPlanner(every=5).plan(1, [known, new], cuts, trunk_flops_per_s=1.0)
    by_client = {a.client: a for a in plan.assignments}
    assert by_client["known"].deadline_s is None
    assert by_client["known"].client_s == pytest.approx(4.0)
    assert by_client["new"].deadline_s == pytest.approx(4.0)
    assert by_client["new"].least_work == 0.0  # one batch at least (clients.app.least_steps)
    # With nobody measured, the slowest guess's own predicted time.
    alone = DynSLPlanner(every=5).plan(1, [new, replace(new, client="other", flops_per_s=1.0)],
                                       cuts, trunk_flops_per_s=1.0)
    assert [a.deadline_s for a in alone.assignments] == pytest.approx([4.0, 4.0])
    # Once measured, no deadline.
    later = DynSLPlanner(every=5).plan(2, [known, replace(new, measured=True)], cuts,
                                       trunk_flops_per_s=1.0)
    assert {a.deadline_s for a in later.assignments} == {None}


def test_dynsl_refuses_a_bad_penalty_or_start() -> None:
    with pytest.raises(ValueError, match="learning_penalty"):
        DynSLPlanner(learning_penalty=-0.1)
    with pytest.raises(ValueError, match="learning_penalty"):
        DynSLPlanner(learning_penalty=math.inf)
    with pytest.raises(ValueError, match="start"):
        DynSLPlanner(start="largest")


def test_dynsl_beats_the_makespan_solver_and_every_uniform_cut_on_a_large_fleet() -> None:
    clients, cuts, trunk = random_instance(30, 6, seed=2)
    fresh = [replace(c, current_cut=None) for c in clients]
    planner = DynSLPlanner(every=1)
    plan = planner.plan(1, fresh, cuts, trunk_flops_per_s=trunk)
    mine = played_round(plan, fresh, cuts, trunk)
    solver = solve(fresh, cuts, trunk_flops_per_s=trunk, allow_recompute=False)
    assert mine <= played_round(solver, fresh, cuts, trunk) * (1 + 1e-12)
    for cut in cuts:
        uniform = UniformPlanner(cut.cut).plan(1, fresh, cuts, trunk_flops_per_s=trunk)
        if len(uniform.assignments) == len(plan.assignments):  # the cut fits everyone
            assert mine <= played_round(uniform, fresh, cuts, trunk) * (1 + 1e-12)
    # Too many combinations to try: the plan states how far from the optimum it can be.
    assert 0 <= planner.last_gap < 1


# --- SmartSplit ----------------------------------------------------------------


def test_smartsplit_selects_m_of_the_clients() -> None:
    cuts = [cut_cost(1, client_flops=1, server_flops=1)]
    clients = [client_state(f"c{i}", flops=1 + i) for i in range(10)]
    plan = SmartSplitPlanner(select_fraction=0.3).plan(
        1, clients, cuts, trunk_flops_per_s=1.0
    )
    assert len(plan.assignments) == 3
    assert len(plan.excluded) == 7
    assert all(r.startswith("not selected") for r in plan.excluded.values())


def test_smartsplit_random_selection_draws_m_feasible_devices_per_round() -> None:
    cuts = [cut_cost(1, client_flops=1, server_flops=1, memory=100)]
    clients = [client_state(f"c{i}", flops=1 + i) for i in range(10)]
    clients.append(client_state("too-small", memory=10))
    planner = SmartSplitPlanner(select_fraction=0.3, selection="random", seed=7)
    picks = [frozenset(cuts_of(planner.plan(r, clients, cuts, trunk_flops_per_s=1.0)))
             for r in range(1, 6)]
    assert all(len(p) == 3 and "too-small" not in p for p in picks)
    assert len(set(picks)) > 1  # a fresh draw each round ...
    again = SmartSplitPlanner(select_fraction=0.3, selection="random", seed=7)
    assert cuts_of(again.plan(1, clients, cuts, trunk_flops_per_s=1.0)) == dict.fromkeys(
        picks[0], 1)  # ... repeatable by its seed
    with pytest.raises(ValueError, match="selection"):
        SmartSplitPlanner(selection="best")


def test_smartsplit_recomputes_to_fit_a_small_budget_only() -> None:
    cuts = [
        cut_cost(
            1,
            client_flops=1,
            server_flops=4,
            memory=100,
            recompute_memory=40,
            recompute_flops=0.5,
        ),
        cut_cost(
            2, client_flops=2, server_flops=2, memory=200, recompute_memory=80, recompute_flops=1
        ),
    ]
    clients = [
        client_state("tight", memory=50),
        client_state("roomy", memory=1000),
        client_state("tiny", memory=30),
    ]
    plan = SmartSplitPlanner(select_fraction=1.0).plan(
        1, clients, cuts, trunk_flops_per_s=1.0
    )
    by_client = {a.client: (a.cut, a.recompute) for a in plan.assignments}
    assert by_client == {"tight": (1, True), "roomy": (2, False)}
    assert "needs at least 40 bytes (cut 1 with recomputation)" in plan.excluded["tiny"]


def test_smartsplit_without_recompute_asks_no_device_to_recompute() -> None:
    # planner.recompute=false: the device that fits only recomputed is left out, the
    # one that fits cut 2 recomputed (faster) trains at cut 1 as it is.
    cuts = [
        cut_cost(1, client_flops=1, server_flops=10, memory=50),
        cut_cost(
            2, client_flops=2, server_flops=1, memory=200, recompute_memory=30, recompute_flops=1
        ),
    ]
    clients = [client_state("a", memory=100), client_state("tight", memory=40)]
    plan = SmartSplitPlanner(select_fraction=1.0, allow_recompute=False).plan(
        1, clients, cuts, trunk_flops_per_s=1.0
    )
    assert [(a.client, a.cut, a.recompute) for a in plan.assignments] == [("a", 1, False)]
    assert "tight" in plan.excluded


def test_smartsplit_recomputes_when_it_unlocks_a_faster_cut() -> None:
    # Cut 1 fits plainly; cut 2 fits only recomputed, and relieves the trunk.
    cuts = [
        cut_cost(1, client_flops=1, server_flops=10, memory=50),
        cut_cost(
            2, client_flops=2, server_flops=1, memory=200, recompute_memory=80, recompute_flops=1
        ),
    ]
    plan = SmartSplitPlanner(select_fraction=1.0).plan(
        1, [client_state("a", memory=100)], cuts, trunk_flops_per_s=1.0
    )
    assert [(a.cut, a.recompute) for a in plan.assignments] == [(2, True)]


def test_smartsplit_explores_every_device_once_fastest_first() -> None:
    cuts = [cut_cost(1, client_flops=1, server_flops=1)]
    clients = [client_state(f"c{i}", flops=10 - i) for i in range(6)]
    planner = SmartSplitPlanner(select_fraction=0.5)
    first = cuts_of(planner.plan(1, clients, cuts, trunk_flops_per_s=1.0))
    second = cuts_of(planner.plan(2, clients, cuts, trunk_flops_per_s=1.0))
    assert set(first) == {"c0", "c1", "c2"}
    assert set(second) == {"c3", "c4", "c5"}  # the unexplored ones, however slow


def test_smartsplit_prefers_useful_devices_and_penalises_stragglers() -> None:
    cuts = [cut_cost(1, client_flops=1, server_flops=1)]
    clients = [
        client_state("fast-dull", flops=1, utility=0.1),  # 1 s
        client_state("slow-rich", flops=0.25, utility=0.9),  # 4 s
        client_state("fast-dull-2", flops=1, utility=0.2),  # 1 s
        client_state("mid-rich", flops=0.8, utility=0.8),  # 1.25 s
    ]

    def second_round(penalty: float) -> set[str]:
        planner = SmartSplitPlanner(select_fraction=0.5, exploration=0.0,
                                    straggler_penalty=penalty)
        planner.last_selected = dict.fromkeys([c.client for c in clients], 1)  # all explored
        return set(cuts_of(planner.plan(2, clients, cuts, trunk_flops_per_s=1.0)))

    assert second_round(0.0) == {"slow-rich", "mid-rich"}  # utility alone
    # Oort's penalty against the deadline (the 2nd fastest time, 1 s): slow-rich scores
    # (0.9 / 0.9) x (1/4)^2 = 0.06, mid-rich (0.8 / 0.9) x 0.8^2 = 0.57, fast-dull-2 0.22.
    assert second_round(2.0) == {"fast-dull-2", "mid-rich"}


def test_smartsplit_brings_back_devices_left_out_longest() -> None:
    cuts = [cut_cost(1, client_flops=1, server_flops=1)]
    clients = [client_state(f"c{i}") for i in range(9)]  # alike: only staleness differs
    planner = SmartSplitPlanner(select_fraction=1 / 3)
    picks = [set(cuts_of(planner.plan(r, clients, cuts, trunk_flops_per_s=1.0)))
             for r in range(1, 10)]
    assert all(len(p) == 3 for p in picks)
    # Three rounds explore; then the least recently selected come back, in turn.
    assert picks[3:6] == picks[0:3] and picks[6:9] == picks[0:3]


def test_smartsplit_chooses_how_many_train_by_utility_per_second() -> None:
    """Between the fewest and the most, the selection with the most utility per predicted
    second of round trains: a slow half of the fleet is left out when waiting for it costs
    more than its data brings; a fleet of alike devices all trains."""
    cuts = [cut_cost(1, client_flops=1, server_flops=0)]
    fast = [client_state(f"fast{i}", flops=1.0) for i in range(4)]  # 1 s each
    slow = [client_state(f"slow{i}", flops=0.1) for i in range(4)]  # 10 s each

    def trained(clients: list, **options: float) -> set[str]:
        planner = SmartSplitPlanner(exploration=0.0, **options)
        planner.last_selected = dict.fromkeys([c.client for c in clients], 1)  # all explored
        return set(cuts_of(planner.plan(2, clients, cuts, trunk_flops_per_s=1.0)))

    # 4 fast: utility 4 in 1 s; all 8: utility 8 in 10 s.
    assert trained(fast + slow, select_fraction=1.0, min_select_fraction=0.25) == {
        c.client for c in fast}
    assert len(trained(fast + slow, select_fraction=1.0)) == 8  # the size is fixed without
    alike = [client_state(f"c{i}") for i in range(8)]
    assert len(trained(alike, select_fraction=1.0, min_select_fraction=0.25)) == 8
    # A slow device rich enough in utility is worth waiting for.
    rich = [*fast, client_state("slow-rich", flops=0.1, utility=100.0)]
    assert "slow-rich" in trained(rich, select_fraction=1.0, min_select_fraction=0.2)
    assert SmartSplitPlanner(select_fraction=0.8, min_select_fraction=0.2).selection_sizes(
        100) == [20, 29, 37, 46, 54, 63, 71, 80]  # at most 8 sizes, evenly spread
    with pytest.raises(ValueError, match="min_select_fraction"):
        SmartSplitPlanner(select_fraction=0.5, min_select_fraction=0.6)


def test_smartsplit_validates_its_options() -> None:
    with pytest.raises(ValueError, match="select_fraction"):
        SmartSplitPlanner(select_fraction=0)
    with pytest.raises(ValueError, match="exploration"):
        SmartSplitPlanner(exploration=-0.1)
    with pytest.raises(ValueError, match="straggler_penalty"):
        SmartSplitPlanner(straggler_penalty=-1)


# --- oracle --------------------------------------------------------------------


def test_oracle_matches_the_solver_on_a_small_fleet() -> None:
    clients, cuts, trunk = random_instance(4, 4, seed=5)
    oracle = OraclePlanner().plan(1, clients, cuts, trunk_flops_per_s=trunk)
    exact = solve(clients, cuts, trunk_flops_per_s=trunk)
    assert oracle.makespan_s == pytest.approx(exact.makespan_s, rel=1e-9)


def test_oracle_refuses_a_large_fleet_clearly() -> None:
    clients, cuts, trunk = random_instance(40, 10, seed=1)
    with pytest.raises(ValueError, match="planner 'oracle' cannot plan 40 clients x 10 cuts"):
        OraclePlanner().plan(1, clients, cuts, trunk_flops_per_s=trunk)


# --- rotate --------------------------------------------------------------------


def test_rotate_moves_every_client_each_round() -> None:
    cuts = [cut_cost(c, client_flops=c, server_flops=3 - c, memory=100 * c) for c in (2, 1)]
    clients = [client_state("0"), client_state("1"), client_state("7", memory=150)]
    planner = RotatePlanner()
    first = planner.plan(1, clients, cuts, trunk_flops_per_s=1.0)
    second = planner.plan(2, clients, cuts, trunk_flops_per_s=1.0)
    # Ranks by id 0, 1, 2 take the cuts [1, 2] in turn; "7" does not fit cut 2.
    assert cuts_of(first) == {"0": 2, "1": 1}
    assert "needs at least 200 bytes" in first.excluded["7"]
    assert cuts_of(second) == {"0": 1, "1": 2, "7": 1}


# --- privacy floor -------------------------------------------------------------


def test_privacy_floor_forbids_measured_leaky_cuts_only() -> None:
    cuts = [
        cut_cost(1, client_flops=1, server_flops=1, leak=0.9),
        cut_cost(2, client_flops=2, server_flops=1, leak=0.6),
        cut_cost(3, client_flops=3, server_flops=1, leak=None),
        cut_cost(4, client_flops=4, server_flops=1, leak=0.2),
    ]
    assert privacy_floor(cuts, max_leak=0.5) == frozenset({1, 2})


@pytest.mark.parametrize("name", sorted(set(PLANNERS) - {"uniform"}))
def test_every_planner_respects_forbidden_cuts(name: str) -> None:
    cuts = [cut_cost(c, client_flops=c, server_flops=10 - c, leak=1.0 - c / 10) for c in (1, 2, 3)]
    forbidden = privacy_floor(cuts, max_leak=0.75)
    assert forbidden == frozenset({1, 2})
    planner = make_planner(name, forbidden_cuts=forbidden)
    clients = [client_state(f"c{i}", flops=1 + i) for i in range(4)]
    plan = planner.plan(1, clients, cuts, trunk_flops_per_s=1.0)
    assert plan.assignments and {a.cut for a in plan.assignments} == {3}


# --- make_planner --------------------------------------------------------------


def test_make_planner_builds_each_planner_by_name() -> None:
    assert isinstance(make_planner("uniform", cut=2), UniformPlanner)
    assert isinstance(make_planner("greedy"), GreedyPlanner)
    assert isinstance(make_planner("dynsl", every=3, hysteresis=0.2), DynSLPlanner)
    assert isinstance(make_planner("smartsplit", select_fraction=0.5), SmartSplitPlanner)
    assert isinstance(make_planner("oracle"), OraclePlanner)
    assert isinstance(make_planner("rotate"), RotatePlanner)


def test_make_planner_errors_name_what_is_accepted() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown planner 'best'; accepted: \['dynsl', 'greedy', 'oracle', 'rotate', ",
    ):
        make_planner("best")
    with pytest.raises(ValueError, match=r"takes no options \['evry'\]; accepted: \['every'"):
        make_planner("dynsl", evry=3)
    with pytest.raises(ValueError, match=r"planner 'uniform' needs options \['cut'\]"):
        make_planner("uniform")


# --- monitor -------------------------------------------------------------------

ROUND = {
    "flops": 4e9,
    "compute_s": 2.0,
    "bytes_up": 1e6,
    "upload_s": 1.0,
    "bytes_down": 4e6,
    "download_s": 2.0,
    "exchanges": 10,
    "latency_s": 0.5,
    "memory_bytes": 1e9,
    "samples": 64,
    "batches": 4,
}

PRIOR = ClientState(
    client="template",
    flops_per_s=1.0,
    uplink_bytes_per_s=1.0,
    downlink_bytes_per_s=1.0,
    rtt_s=1.0,
    memory_bytes=1.0,
    samples=1,
    batches=1,
)


def test_monitor_turns_one_round_into_rates() -> None:
    monitor = ClientMonitor()
    monitor.observe("a", **ROUND, cut=3)
    state = monitor.state("a", PRIOR)
    assert state == replace(
        PRIOR,
        client="a",
        flops_per_s=2e9,
        uplink_bytes_per_s=1e6,
        downlink_bytes_per_s=2e6,
        rtt_s=0.05,
        memory_bytes=1e9,
        samples=64,
        batches=4,
        current_cut=3,
        flops_per_s_at=((3, 2e9),),
    )


def test_monitor_keeps_a_rate_per_cut_and_moves_them_all_when_the_device_changes() -> None:
    # Measured at cut 1 (2 GFLOP/s), then at cut 4, whose layers run 3x as efficiently.
    monitor = ClientMonitor(alpha=0.5, jump=2.0)
    monitor.observe("a", **ROUND, cut=1)
    monitor.observe("a", **(ROUND | {"compute_s": ROUND["compute_s"] / 3}), cut=4)
    state = monitor.state("a", PRIOR)
    assert state.rate_at(1) == pytest.approx(2e9) and state.rate_at(4) == pytest.approx(6e9)
    assert state.rate_at(2) == pytest.approx(2e9)  # never trained there: its speed
    # At cut 4 again, 20% faster: the ratio there is smoothed; cut 1 keeps its own rate.
    monitor.observe("a", **(ROUND | {"compute_s": ROUND["compute_s"] / 3.6}), cut=4)
    state = monitor.state("a", PRIOR)
    assert state.rate_at(4) == pytest.approx(0.5 * 7.2e9 + 0.5 * 6e9)
    assert state.rate_at(1) == pytest.approx(2e9)
    # Throttled 4x at cut 4: the device changed, and every cut's rate moves with it.
    before = state.rate_at(4)
    monitor.observe("a", **(ROUND | {"compute_s": ROUND["compute_s"] * 4 / 3}), cut=4)
    state = monitor.state("a", PRIOR)
    assert state.rate_at(4) == pytest.approx(1.5e9)
    assert state.rate_at(1) == pytest.approx(2e9 * 1.5e9 / before)
    # The cost model charges each cut at its own rate.
    cost = cut_cost(4, client_flops=3e9, server_flops=1.0)
    assert client_seconds(replace(state, uplink_bytes_per_s=1e30, downlink_bytes_per_s=1e30,
                                  rtt_s=0.0), cost) == pytest.approx(64 * 3e9 / 1.5e9)


def test_monitor_smooths_exponentially_and_skips_zero_durations() -> None:
    monitor = ClientMonitor(alpha=0.25)
    monitor.observe("a", **ROUND)
    monitor.observe("a", **(ROUND | {"compute_s": 1.0, "upload_s": 0.0, "latency_s": None}))
    state = monitor.state("a", PRIOR)
    assert state.flops_per_s == pytest.approx(0.25 * 4e9 + 0.75 * 2e9)
    assert state.uplink_bytes_per_s == pytest.approx(1e6)  # the zero-second upload taught nothing
    assert state.rtt_s == pytest.approx(0.05)


def test_monitor_takes_a_rate_that_jumped_as_it_is() -> None:
    # A link that lost Wi-Fi for cellular: the next plan has the new link, not an average.
    monitor = ClientMonitor(alpha=0.25, jump=2.0)
    monitor.observe("a", **ROUND)  # 1 MB/s up
    monitor.observe("a", **(ROUND | {"upload_s": 4.0}))  # 4x slower: replaces the estimate
    assert monitor.state("a", PRIOR).uplink_bytes_per_s == pytest.approx(ROUND["bytes_up"] / 4)
    monitor.observe("a", **(ROUND | {"upload_s": 6.0}))  # within 2x: smoothed
    assert monitor.state("a", PRIOR).uplink_bytes_per_s == pytest.approx(
        0.25 * ROUND["bytes_up"] / 6 + 0.75 * ROUND["bytes_up"] / 4)
    with pytest.raises(ValueError, match="jump"):
        ClientMonitor(jump=1.0)


def test_monitor_keeps_the_prior_for_what_was_never_measured() -> None:
    monitor = ClientMonitor()
    monitor.observe_memory("declined", 5e8)
    assert monitor.state("declined", PRIOR) == replace(PRIOR, client="declined", memory_bytes=5e8)
    assert monitor.state("unknown", PRIOR) == replace(PRIOR, client="unknown")


def test_monitor_memory_is_the_latest_report_not_an_average() -> None:
    monitor = ClientMonitor(alpha=0.5)
    monitor.observe("a", **ROUND)
    monitor.observe_memory("a", 2e8)
    assert monitor.state("a", PRIOR).memory_bytes == 2e8


def test_monitor_utility_is_coverage_times_relative_samples_and_loss() -> None:
    monitor = ClientMonitor(alpha=1.0)
    monitor.observe("a", **ROUND, loss=3.0, label_coverage=0.5)
    monitor.observe("b", **ROUND, loss=1.0)
    monitor.observe("c", **ROUND, label_coverage=0.4)
    monitor.observe("d", **(ROUND | {"samples": 256}))
    mean_samples = (3 * 64 + 256) / 4
    assert monitor.utility("a") == pytest.approx(0.5 * 64 / mean_samples * 3.0 / 2.0)
    assert monitor.utility("b") == pytest.approx(64 / mean_samples * 1.0 / 2.0)
    assert monitor.utility("c") == pytest.approx(0.4 * 64 / mean_samples)
    assert monitor.utility("d") == pytest.approx(256 / mean_samples)
    assert monitor.utility("never-seen") == 1.0
    assert monitor.state("a", PRIOR).utility == monitor.utility("a")


def test_monitor_rejects_a_bad_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        ClientMonitor(alpha=0.0)


def test_the_cut_costs_follow_the_data_planes_encoding() -> None:
    """int8 up, bfloat16 down: the planner charges those bytes, and a slow link then takes
    the shallow cut whose big activations it could not afford at float32."""
    from splitlearn.planning.cost import client_seconds, with_compression

    shallow = cut_cost(1, client_flops=1.0, server_flops=9.0, smashed=4 * 1000)
    deep = cut_cost(2, client_flops=2000.0, server_flops=0.0, smashed=4 * 10)
    encoded = [with_compression(c, uplink="int8", downlink="bfloat16") for c in (shallow, deep)]
    assert encoded[0].smashed_bytes_per_sample == 1000 + 4
    assert encoded[0].gradient_bytes_per_sample == 2 * 1000
    device = client_state("phone", flops=1.0, link=2.0)
    assert client_seconds(device, encoded[0]) == pytest.approx(1.0 + (1004 + 2000) / 2.0)
    assert client_seconds(device, shallow) == pytest.approx(1.0 + 8000 / 2.0)
    plain = solve([device], [shallow, deep], trunk_flops_per_s=1e9)
    compressed = solve([device], encoded, trunk_flops_per_s=1e9)
    assert plain.cut_of("phone") == 2 and compressed.cut_of("phone") == 1


def test_error_feedbacks_references_count_in_a_cuts_memory() -> None:
    """Uplink error feedback keeps a float32 row per example on the device: a device whose
    batch fits at the shallow cut, but not with a reference per example of its big
    activations, is given the deep cut; unknown example counts charge nothing."""
    from splitlearn.planning.cost import fits, with_compression

    shallow = cut_cost(1, client_flops=1.0, server_flops=9.0, smashed=4 * 1000, memory=100)
    deep = cut_cost(2, client_flops=5000.0, server_flops=8.0, smashed=4 * 10, memory=200)
    costs = [with_compression(c, uplink="topk", downlink="topk", error_feedback=True)
             for c in (shallow, deep)]
    assert [c.reference_bytes_per_example for c in costs] == [4000, 40]
    assert with_compression(shallow, uplink="none", downlink="topk",
                            error_feedback=True).reference_bytes_per_example == 0
    # U-shaped: a lossy downlink's features (64 values a row here) are references too.
    assert [with_compression(shallow, uplink=up, downlink=down, error_feedback=True,
                             feature_entries=64).reference_bytes_per_example
            for up, down in (("topk", "topk"), ("none", "topk"), ("topk", "none"))] == [
        4000 + 256, 256, 4000]
    device = replace(client_state("phone", memory=100 + 4000 * 50 - 1), examples=50)
    assert not fits(device, costs[0]) and fits(device, costs[1])
    assert fits(replace(device, examples=0), costs[0])  # examples unknown: not charged
    assert solve([device], costs, trunk_flops_per_s=1e9).cut_of("phone") == 2
    assert solve([replace(device, examples=0)], costs, trunk_flops_per_s=1e9).cut_of("phone") == 1


def test_samples_kept_past_their_batch_count_in_a_cuts_memory() -> None:
    """Local loss keeps sent batches (a float32 row and an int64 label each): its window
    with uplink error feedback, at most a round's samples; all of them in bulk mode."""
    import math

    from splitlearn.planning.cost import needed_memory, with_compression, with_kept_samples

    shallow = cut_cost(1, client_flops=1.0, server_flops=9.0, smashed=4 * 1000, memory=100)
    device = replace(client_state("phone"), examples=50, samples=100)
    windowed = with_compression(with_kept_samples(shallow, 64), uplink="topk", downlink="none",
                                error_feedback=True)
    assert needed_memory(device, windowed) == 100 + 4000 * 50 + 4008 * 64
    assert needed_memory(replace(device, samples=20), windowed) == 100 + 4000 * 50 + 4008 * 20
    bulk = with_kept_samples(shallow, math.inf)
    assert needed_memory(device, bulk) == 100 + 4008 * 100
    assert needed_memory(device, shallow) == 100  # nothing kept


def test_the_trunks_cost_is_fitted_per_batch_and_per_flop_and_never_negative() -> None:
    from splitlearn.planning.monitor import fit_trunk

    def took(batches: float, flops: float) -> tuple[float, float, float]:
        return batches, flops, batches * 2e-3 + flops / 5e9

    # Steps at three cuts and two rounds: both parts come back.
    batch_s, flops_per_s = fit_trunk([took(1, 3e8), took(1, 1e8), took(1, 1e5),
                                      took(80, 1e10), took(80, 1e7)])
    assert batch_s == pytest.approx(2e-3) and flops_per_s == pytest.approx(5e9)
    # Where FLOPs explain nothing (a round costs what its batches cost), they cost nothing.
    assert fit_trunk([(1, 1e8, 0.01), (1, 1e9, 0.01), (2, 1e9, 0.02)]) == (
        pytest.approx(0.01), math.inf)
    # Where the joint fit would make the per-batch cost negative, FLOPs alone.
    batch_s, flops_per_s = fit_trunk([(1, 1e9, 0.1), (1, 2e9, 0.25)])
    assert batch_s == 0.0 and flops_per_s > 0
    with pytest.raises(ValueError, match="no observation"):
        fit_trunk([(3, 1e9, 0.0)])
