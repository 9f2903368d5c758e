"""Partial work: a round's deadline and the batches each device trains by it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitlearn.planning.cost import RoundWork, client_seconds, trunk_seconds
from splitlearn.planning.deadline import (
    MAX_CANDIDATES,
    PartialChoice,
    deadline_choices,
    least_steps,
)
from splitlearn.planning.planners import SmartSplitPlanner
from splitlearn.planning.solve import candidate_options, choose_options, random_instance
from tests.helpers import client_state, cut_cost

TRUNK = 1e13


def test_a_round_is_a_line_in_its_batches_that_ends_at_the_cost_model() -> None:
    clients, cuts, trunk = random_instance(6, 4, seed=3)
    for client in clients:
        for cost in cuts:
            work = RoundWork.of(client, cost, trunk_flops_per_s=trunk)
            whole = client_seconds(client, cost)
            assert work.client_s(client.batches) == pytest.approx(whole, rel=1e-12)
            assert work.trunk_s(client.batches) == pytest.approx(
                trunk_seconds(client, cost, trunk_flops_per_s=trunk), rel=1e-12)
            # Half the batches is the cost model of a client with half the data.
            half = replace(client, samples=client.samples // 2, batches=client.batches // 2)
            assert work.client_s(client.batches // 2) == pytest.approx(
                client_seconds(half, cost), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), share=st.floats(0.0, 1.2))
def test_the_batches_within_a_deadline_are_the_most_that_end_by_it(seed: int,
                                                                    share: float) -> None:
    clients, cuts, trunk = random_instance(1, 3, seed=seed)
    work = RoundWork.of(clients[0], cuts[seed % 3], trunk_flops_per_s=trunk)
    deadline = share * work.client_s(work.batches)
    steps = work.steps_within(deadline)
    assert 0 <= steps <= work.batches
    assert steps == 0 or work.client_s(steps) <= deadline
    assert steps == work.batches or work.client_s(steps + 1) > deadline
    # Exactly at a batch's end, that batch is in.
    for k in range(work.batches + 1):
        assert work.steps_within(work.client_s(k)) >= k


def test_least_work_is_a_share_of_the_round_rounded_up_and_at_least_one_batch() -> None:
    assert [least_steps(8, f) for f in (0.01, 0.25, 0.26, 1.0)] == [1, 2, 3, 8]
    assert least_steps(3, 1 / 3) == 1  # no float rounding up past the share


def slow_reference(clients, whole, cuts, *, min_work, deadline):
    """Every device scans its batches for the most that end by the deadline."""
    by_cut = {c.cut: c for c in cuts}
    chosen = []
    for client, option in zip(clients, whole, strict=True):
        if option is None:
            chosen.append(None)
            continue
        work = RoundWork.of(client, by_cut[option.cut], trunk_flops_per_s=TRUNK,
                            recompute=option.recompute)
        fit = [k for k in range(work.batches + 1) if work.client_s(k) <= deadline]
        steps = max(max(fit, default=0), least_steps(work.batches, min_work))
        chosen.append(PartialChoice(option, steps, work.client_s(steps), work.trunk_s(steps)))
    return chosen


def rate_of(clients, chosen, *, shared_trunk=True) -> float:
    pairs = [(c.client_s, c.trunk_s) for c in chosen if c is not None]
    span = max(t for t, _ in pairs) + sum(w for _, w in pairs) if shared_trunk else max(
        t + w for t, w in pairs)
    return sum(cl.utility * c.steps / cl.batches
               for cl, c in zip(clients, chosen, strict=True) if c is not None) / span


@pytest.mark.parametrize("seed", range(24))
def test_no_deadline_on_a_fine_grid_trains_more_utility_per_second(seed: int) -> None:
    """Within MAX_CANDIDATES batch ends the chosen deadline is the best one: a scan of
    500 deadlines with the slow reference finds none better, nor is the whole-round
    plan better; every device keeps the solver's cut."""
    clients, cuts, _ = random_instance(1 + seed % 5, 1 + seed % 4, seed=seed)
    options, _ = candidate_options(clients, cuts, trunk_flops_per_s=TRUNK, allow_recompute=True)
    whole = choose_options(options, select=None, shared_trunk=True)
    min_work = (0.1, 0.25, 0.5, 1.0)[seed % 4]
    rate, chosen = deadline_choices(clients, whole, cuts, min_work=min_work,
                                    trunk_flops_per_s=TRUNK, shared_trunk=True)
    if not any(whole):
        assert chosen == [None] * len(clients)
        return
    assert sum(c.batches for c, o in zip(clients, whole, strict=True) if o) <= MAX_CANDIDATES
    assert rate == pytest.approx(rate_of(clients, chosen), rel=1e-12)
    for c, o, ch in zip(clients, whole, chosen, strict=True):
        assert (ch is None) == (o is None)
        assert ch is None or (ch.option == o and
                              least_steps(c.batches, min_work) <= ch.steps <= c.batches)
    whole_rate = rate_of(clients, [None if o is None else PartialChoice(o, c.batches, o.client_s,
                                                                        o.trunk_s)
                                   for c, o in zip(clients, whole, strict=True)])
    assert rate >= whole_rate * (1 - 1e-9)
    longest = max(o.client_s for o in whole if o is not None)
    for k in range(501):
        grid = slow_reference(clients, whole, cuts, min_work=min_work,
                              deadline=longest * k / 500)
        assert rate_of(clients, grid) <= rate * (1 + 1e-9)


def test_a_straggler_trains_part_of_its_round_instead_of_setting_its_length() -> None:
    """Four fast devices (1 s a round) and one ten times slower, 10 batches each: with
    partial work the slow one trains what ends with the others and the round is 1 s
    long, not 10; it still takes part. At min_work=1 every round is whole again."""
    cuts = [cut_cost(1, client_flops=10, server_flops=0)]
    fast = [replace(client_state(f"fast{i}", flops=100.0), samples=10, batches=10)
            for i in range(4)]
    slow = replace(client_state("slow", flops=10.0), samples=10, batches=10)

    def plan(**options: float):
        planner = SmartSplitPlanner(select_fraction=1.0, exploration=0.0, straggler_penalty=0.0,
                                    **options)
        return planner.plan(1, [*fast, slow], cuts, trunk_flops_per_s=1e9)

    whole, partial = plan(), plan(min_work=0.1)
    assert whole.makespan_s == pytest.approx(10.0)
    assert all(a.steps is None for a in whole.assignments)
    steps = {a.client: a.steps for a in partial.assignments}
    assert steps == {"fast0": None, "fast1": None, "fast2": None, "fast3": None, "slow": 1}
    assert partial.makespan_s == pytest.approx(1.0)
    # Every device keeps the round's deadline itself (the latest predicted end, 1 s here).
    assert [a.deadline_s for a in partial.assignments] == [pytest.approx(1.0)] * 5
    assert [a.least_work for a in partial.assignments] == [0.1] * 5
    assert all(a.deadline_s is None for a in whole.assignments)
    # 4 + 0.1 units of utility in 1 s against 5 in 10 s.
    assert all(a.steps is None for a in plan(min_work=1.0).assignments)
    with pytest.raises(ValueError, match="min_work"):
        SmartSplitPlanner(min_work=0.0)
    with pytest.raises(ValueError, match="min_work"):
        SmartSplitPlanner(min_work=1.5)


def test_alike_devices_with_weights_to_move_train_whole_rounds() -> None:
    """Five alike devices, 1 s of weights and 10 batches of 1 s each: a shorter deadline
    cuts every device's work but not the weights' time, so whole rounds train the most
    per second (5 / 11 s against, e.g., 2.5 / 6 s at half the batches)."""
    cuts = [cut_cost(1, client_flops=1, server_flops=0, params=1)]
    alike = [replace(client_state(f"c{i}", link=2.0), samples=10, batches=10) for i in range(5)]
    planner = SmartSplitPlanner(select_fraction=1.0, exploration=0.0, min_work=0.1)
    plan = planner.plan(1, alike, cuts, trunk_flops_per_s=1e9)
    assert [a.steps for a in plan.assignments] == [None] * 5
    assert plan.makespan_s == pytest.approx(11.0)
