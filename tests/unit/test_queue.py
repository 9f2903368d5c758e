"""A round played out at the trunk (splitlearn.planning.queue); the clock's rows (server.clock)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.clock import device_rounds
from splitlearn.planning.cost import client_seconds, device_round, predicted_round_s, trunk_seconds
from splitlearn.planning.queue import (
    DeviceRound,
    bounds,
    dealt,
    own,
    round_seconds,
    sequential_round_seconds,
)
from splitlearn.planning.search import best_choice, played, scored
from splitlearn.planning.solve import random_instance, solve


def reference_round(devices: list[DeviceRound]) -> float:
    """The same round, one batch at a time by scanning for the earliest arrival (no heap)."""
    free: dict = {}
    ready = [d.before_s + d.up_s for d in devices]
    left = [d.batches for d in devices]
    end = [d.before_s + d.after_s for d in devices]
    while any(left):
        i = min((k for k in range(len(devices)) if left[k]), key=lambda k: (ready[k], k))
        d = devices[i]
        done = max(ready[i], free.get(d.trunk, 0.0)) + d.trunk_s
        free[d.trunk] = done
        left[i] -= 1
        on = done if d.waits else ready[i]
        ready[i] = on + d.down_s + d.up_s
        end[i] = max(on + d.down_s + d.after_s, done)
    return max(end, default=0.0)


def test_two_devices_on_one_trunk_take_turns():
    # Both ask at t=1; A (listed first) is served 1-2, B 2-3; A asks again at 4 and is
    # served 4-5 (done at 6), B asks at 5, is served 5-6 and is done at 7.
    alike = DeviceRound(2, before_s=0.0, up_s=1.0, trunk_s=1.0, down_s=1.0, after_s=0.0)
    assert round_seconds([alike, alike]) == 7.0
    assert bounds([alike, alike]) == (6.0, 8.0)  # alone 6; own 4 + trunk 4
    # Each with a trunk of its own: no turns.
    mine = [DeviceRound(2, 0.0, 1.0, 1.0, 1.0, 0.0, trunk=k) for k in "ab"]
    assert round_seconds(mine) == 6.0
    assert sequential_round_seconds([alike, alike]) == 12.0
    # A device that does not wait for the answer (local loss) sends at 1, 3 and 5; the
    # trunk, 2 s a batch, is done at 7, after the device (6 + its weights, 0).
    sender = DeviceRound(3, before_s=0.0, up_s=1.0, trunk_s=2.0, down_s=1.0, after_s=0.0,
                         waits=False)
    assert round_seconds([sender]) == sender.alone_s == 7.0 and sender.own_s == 6.0


def test_the_trunk_works_while_a_slow_device_computes():
    # A slow device's compute hides a fast one's trunk steps: the round is the slow
    # device's alone, where max T + sum W would add every trunk step to it.
    slow = DeviceRound(3, before_s=1.0, up_s=5.0, trunk_s=0.5, down_s=5.0, after_s=1.0)
    fast = DeviceRound(3, before_s=0.1, up_s=0.1, trunk_s=1.0, down_s=0.1, after_s=0.1)
    assert round_seconds([slow, fast]) == slow.alone_s
    assert round_seconds([slow, fast]) < max(slow.own_s, fast.own_s) + 3 * 0.5 + 3 * 1.0


seconds = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)
device = st.builds(DeviceRound, st.integers(0, 6), seconds, seconds, seconds, seconds, seconds,
                   st.integers(0, 2), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(device, max_size=8))
def test_a_round_lies_within_its_bounds_and_equals_the_scan(devices):
    played = round_seconds(devices)
    lower, upper = bounds(devices)
    assert lower - 1e-9 <= played <= upper + 1e-9
    assert played == pytest.approx(reference_round(devices), abs=1e-9)
    alone = [replace(d, trunk=i) for i, d in enumerate(devices)]
    assert round_seconds(alone) == pytest.approx(max((d.alone_s for d in devices), default=0.0))


def row(node: int, *, steps: int = 4, examples: int = 32, cut: int = 1, **seconds: float) -> dict:
    parts = {"virtual_compute_s": 3.0, "virtual_upload_s": 2.0, "virtual_download_s": 1.0,
             "virtual_latency_s": 0.4} | seconds
    return {"status": "ok", "node_id": str(node), "steps": steps, "num_examples": examples,
            "cut": cut, "virtual_s": sum(parts.values()), "bytes_up": 1000,
            "weights_bytes_up": 250, "bytes_down": 1000, "weights_bytes_down": 500} | parts


def test_the_clock_keeps_each_devices_seconds_and_shares_the_trunks_by_work():
    rows = [row(9, examples=96, cut=2), row(3), {"status": "failed", "node_id": "5"},
            row(4, steps=0)]
    played = device_rounds(rows, trunk_s=10.0, trunk_flops={1: 2.0, 2: 1.0})
    assert len(played) == 3  # the failed device is not played; node order: 3, 4, 9
    three, four, nine = played
    assert three.own_s == pytest.approx(rows[1]["virtual_s"])
    assert nine.own_s == pytest.approx(rows[0]["virtual_s"])
    # Its weights' share of the links comes before and after its batches.
    assert three.before_s == pytest.approx(0.5) and three.after_s == pytest.approx(0.5)
    # 32 examples x 2 FLOPs and 96 x 1 share 10 s (the weights-only device none of it).
    assert three.batches * three.trunk_s == pytest.approx(4.0)
    assert nine.batches * nine.trunk_s == pytest.approx(6.0)
    assert four.batches == 0 and four.before_s == pytest.approx(rows[3]["virtual_s"])
    # Trunk workers are dealt in node order; SplitFed v1's trunks are each device's own.
    assert [d.trunk for d in device_rounds(rows, trunk_s=1.0, trunk_of=dealt(2))] == [0, 1, 0]
    assert [d.trunk for d in device_rounds(rows, trunk_s=1.0, trunk_of=own)] == ["3", "4", "9"]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 10_000), st.booleans())
def test_a_predicted_device_round_has_the_cost_models_parts(clients, cuts, seed, recompute):
    fleet, table, trunk_flops = random_instance(clients, cuts, seed=seed)
    plan = solve(fleet, table, trunk_flops_per_s=trunk_flops, allow_recompute=False)
    by_cut = {c.cut: c for c in table}
    for client in fleet:
        for cost in table:
            played = device_round(client, cost, trunk_flops_per_s=trunk_flops,
                                  recompute=recompute)
            assert played.own_s == pytest.approx(client_seconds(client, cost,
                                                                recompute=recompute))
            assert played.batches * played.trunk_s == pytest.approx(
                trunk_seconds(client, cost, trunk_flops_per_s=trunk_flops))
    # Played out, the plan's round lies between its slowest device's own time and the
    # planners' makespan (which adds every trunk step after it); a trunk per device is
    # no slower than one shared.
    states = {c.client: c for c in fleet}
    predicted = predicted_round_s(plan, states, by_cut, trunk_flops_per_s=trunk_flops)
    assert plan.slowest_client_s * (1 - 1e-9) <= predicted <= plan.makespan_s * (1 + 1e-9)
    assert predicted_round_s(plan, states, by_cut, trunk_flops_per_s=trunk_flops,
                             trunk_of=own) <= predicted * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(device, min_size=1, max_size=3), min_size=1, max_size=4))
def test_the_best_choice_is_the_best_combination_and_its_bound_holds(options):
    every = [played(options, p) for p in itertools.product(*(range(len(d)) for d in options))]
    exact = best_choice(options)
    assert exact.exact and exact.gap == 0.0
    assert exact.round_s == pytest.approx(min(every))
    assert exact.bound_s <= min(every) + 1e-9  # a lower bound of the optimum
    # With too many combinations to try: descent from each start, no worse than any.
    starts = [[len(d) - 1 for d in options]]
    descended = best_choice(options, starts=starts, exact_limit=0)
    assert not descended.exact
    assert min(every) - 1e-9 <= descended.round_s <= played(options, starts[0]) + 1e-9
    assert descended.round_s <= played(options, [0] * len(options)) + 1e-9
    assert descended.bound_s * (1 + descended.gap) == pytest.approx(descended.round_s) or (
        descended.gap == 0.0)
    # Past the descent limit the starts are compared as they are.
    compared = best_choice(options, starts=starts, exact_limit=0, descent_limit=0)
    assert compared.round_s == pytest.approx(
        min(played(options, starts[0]), played(options, [0] * len(options))))
    with pytest.raises(ValueError, match="at least one option"):
        best_choice([*options, []])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(device, st.floats(0.0, 2.0)), min_size=1, max_size=3),
                min_size=1, max_size=4))
def test_with_penalties_the_best_choice_minimises_the_round_times_one_plus_them(devices):
    options = [[d for d, _ in dev] for dev in devices]
    penalties = [[p for _, p in dev] for dev in devices]
    combos = list(itertools.product(*(range(len(d)) for d in options)))
    # The reference: the round of each combination, times 1 + its options' shares.
    every = {c: played(options, c) * (1 + sum(penalties[i][k] for i, k in enumerate(c)))
             for c in combos}
    exact = best_choice(options, penalties=penalties)
    assert exact.exact and exact.score == pytest.approx(min(every.values()))
    assert exact.round_s == pytest.approx(played(options, exact.picks))
    assert exact.bound_s <= min(every.values()) + 1e-9
    descended = best_choice(options, penalties=penalties, exact_limit=0)
    assert min(every.values()) - 1e-9 <= descended.score <= every[(0,) * len(options)] + 1e-9
    assert descended.bound_s <= min(every.values()) + 1e-9
    assert descended.score == pytest.approx(scored(options, descended.picks, penalties))
    # Zero penalties are the round alone.
    zero = best_choice(options, penalties=[[0.0] * len(d) for d in options])
    assert zero.score == pytest.approx(best_choice(options).round_s)
    with pytest.raises(ValueError, match="penalties need"):
        best_choice(options, penalties=[[-1.0] * len(d) for d in options])
    with pytest.raises(ValueError, match="penalties need"):
        best_choice(options, penalties=[[0.0] for _ in options[:-1]] + [[]])
