"""The exact cut solver against exhaustive search, its constraints, ties and errors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitlearn.planning.cost import (
    ClientState,
    CutCost,
    Plan,
    client_seconds,
    fits,
    makespan,
    trunk_seconds,
)
from splitlearn.planning.solve import (
    BRUTE_FORCE_LIMIT,
    NOT_SELECTED,
    TooManyAssignments,
    brute_force,
    count_assignments,
    random_instance,
    solve,
)
from tests.helpers import client_state, cut_cost

REPO = Path(__file__).resolve().parents[2]

#: Worst-case assignments per generated instance, so brute force stays fast.
MAX_COMBOS = 50_000


@st.composite
def instances(draw: st.DrawFn) -> dict:
    """A random planning problem: clients, cuts and the solver's switches."""
    num_clients = draw(st.integers(1, 6))
    allow_recompute = draw(st.booleans())
    per_cut = 2 if allow_recompute else 1
    # The largest cut count whose worst case brute force still enumerates quickly.
    max_cuts = max(1, min(6, int(MAX_COMBOS ** (1 / num_clients) / per_cut)))
    num_cuts = draw(st.integers(1, max_cuts))
    # Small integers make exact ties (and so tie-breaking) common.
    small = st.integers(1, 8).map(float)
    memories = st.integers(10, 100)
    cuts = []
    for c in range(1, num_cuts + 1):
        memory = draw(memories)
        cuts.append(
            CutCost(
                cut=c,
                client_flops_per_sample=draw(small),
                recompute_flops_per_sample=draw(st.integers(0, 3).map(float)),
                server_flops_per_sample=draw(small),
                smashed_bytes_per_sample=draw(st.integers(0, 4)),
                client_param_bytes=draw(st.integers(0, 4)),
                memory_bytes=memory,
                recompute_memory_bytes=draw(st.integers(5, memory)),
            )
        )
    clients = [
        ClientState(
            client=f"c{i}",
            flops_per_s=draw(st.sampled_from([0.5, 1.0, 2.0, 3.7])),
            uplink_bytes_per_s=draw(st.sampled_from([1.0, 4.0, 10.0])),
            downlink_bytes_per_s=draw(st.sampled_from([2.0, 8.0, 20.0])),
            rtt_s=draw(st.sampled_from([0.0, 0.1, 0.5])),
            memory_bytes=draw(st.integers(0, 110)),
            samples=draw(st.integers(1, 4)),
            batches=draw(st.integers(1, 2)),
            current_cut=draw(st.none() | st.integers(1, num_cuts)),
        )
        for i in range(num_clients)
    ]
    # Keep at least one cut allowed: an empty set is a configuration error (tested below).
    min_cut = draw(st.none() | st.integers(1, num_cuts))
    floor = min_cut or 1
    forbidden = draw(st.frozensets(st.integers(floor, num_cuts), max_size=num_cuts - floor))
    return {
        "clients": clients,
        "cuts": cuts,
        "trunk_flops_per_s": draw(st.sampled_from([0.5, 1.0, 4.0])),
        "select": draw(st.none() | st.integers(0, num_clients + 1)),
        "allow_recompute": allow_recompute,
        "min_cut": min_cut,
        "forbidden_cuts": forbidden,
        "shared_trunk": draw(st.booleans()),
    }


def predicted_makespan(plan: Plan, instance: dict) -> float:
    """The plan's makespan recomputed from its assignments with the cost model."""
    by_cut = {c.cut: c for c in instance["cuts"]}
    by_id = {c.client: c for c in instance["clients"]}
    pairs = [
        (
            client_seconds(by_id[a.client], by_cut[a.cut], recompute=a.recompute),
            trunk_seconds(
                by_id[a.client], by_cut[a.cut], trunk_flops_per_s=instance["trunk_flops_per_s"]
            ),
        )
        for a in plan.assignments
    ]
    return makespan(pairs, shared_trunk=instance["shared_trunk"])


def can_fit(client: ClientState, instance: dict) -> bool:
    modes = (False, True) if instance["allow_recompute"] else (False,)
    return any(
        fits(client, c, recompute=m)
        for c in instance["cuts"]
        for m in modes
        if (instance["min_cut"] is None or c.cut >= instance["min_cut"])
        and c.cut not in instance["forbidden_cuts"]
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_solve_matches_brute_force(instance: dict) -> None:
    exact = solve(**instance)
    reference = brute_force(**instance)
    assert math.isclose(exact.makespan_s, reference.makespan_s, rel_tol=1e-9, abs_tol=1e-12)
    assert len(exact.assignments) == len(reference.assignments)
    # Who cannot fit is fixed; who is not selected may differ where two choices tie.
    assert unfit(exact) == unfit(reference)
    assert len(exact.excluded) == len(reference.excluded)


def unfit(plan) -> set[str]:
    return {c for c, reason in plan.excluded.items() if reason != NOT_SELECTED}


@settings(max_examples=100, deadline=None)
@given(instances())
def test_plan_respects_memory_floor_and_selection(instance: dict) -> None:
    plan = solve(**instance)
    by_cut = {c.cut: c for c in instance["cuts"]}
    by_id = {c.client: c for c in instance["clients"]}
    for a in plan.assignments:
        assert fits(by_id[a.client], by_cut[a.cut], recompute=a.recompute)
        assert instance["min_cut"] is None or a.cut >= instance["min_cut"]
        assert a.cut not in instance["forbidden_cuts"]
        assert instance["allow_recompute"] or not a.recompute
    assert math.isclose(plan.makespan_s, predicted_makespan(plan, instance), rel_tol=1e-12)

    feasible = [c.client for c in instance["clients"] if can_fit(c, instance)]
    taking_part = {a.client for a in plan.assignments}
    expected = (
        len(feasible) if instance["select"] is None else min(instance["select"], len(feasible))
    )
    assert len(taking_part) == expected
    assert taking_part <= set(feasible)
    for client in instance["clients"]:
        if client.client in taking_part:
            assert client.client not in plan.excluded
        elif client.client in feasible:
            assert plan.excluded[client.client] == "not selected"
        else:
            reason = plan.excluded[client.client]
            assert "memory" in reason and f"budget {client.memory_bytes:,.0f} bytes" in reason
    assert solve(**instance) == plan  # deterministic


def test_memory_reason_names_the_least_memory_needed() -> None:
    cuts = [
        cut_cost(1, client_flops=1, server_flops=1, memory=300, recompute_memory=120),
        cut_cost(2, client_flops=1, server_flops=1, memory=200, recompute_memory=150),
    ]
    clients = [client_state("small", memory=100)]
    plain = solve(clients, cuts, trunk_flops_per_s=1.0, allow_recompute=False)
    assert plain.excluded["small"] == (
        "no cut fits its memory: needs at least 200 bytes (cut 2), budget 100 bytes"
    )
    recomputed = solve(clients, cuts, trunk_flops_per_s=1.0)
    assert "needs at least 120 bytes (cut 1 with recomputation)" in recomputed.excluded["small"]


def test_recomputation_is_used_only_when_it_is_the_way_to_fit() -> None:
    cuts = [
        cut_cost(
            1, client_flops=1, server_flops=5, memory=100, recompute_memory=40, recompute_flops=1
        )
    ]
    tight = solve([client_state("a", memory=50)], cuts, trunk_flops_per_s=1.0)
    roomy = solve([client_state("a", memory=500)], cuts, trunk_flops_per_s=1.0)
    assert tight.assignments[0].recompute and not roomy.assignments[0].recompute
    assert tight.makespan_s == pytest.approx(2 + 5)
    assert roomy.makespan_s == pytest.approx(1 + 5)


def test_ties_prefer_no_recomputation_then_current_cut_then_smaller_cut() -> None:
    # Identical costs everywhere, and recomputation costs nothing: all ties.
    cuts = [cut_cost(c, client_flops=1, server_flops=1, memory=10) for c in (1, 2, 3)]
    plan = solve(
        [client_state("new"), client_state("held", current_cut=3)], cuts, trunk_flops_per_s=1.0
    )
    assert {a.client: (a.cut, a.recompute) for a in plan.assignments} == {
        "new": (1, False),
        "held": (3, False),
    }


def test_shared_trunk_trades_client_time_for_trunk_time() -> None:
    # Per client, cut 1 is faster alone (1 + 2 < 4 + 0.5), but four clients share the trunk.
    cuts = [
        cut_cost(1, client_flops=1, server_flops=2),
        cut_cost(2, client_flops=4, server_flops=0.5),
    ]
    clients = [client_state(f"c{i}") for i in range(4)]
    shared = solve(clients, cuts, trunk_flops_per_s=1.0)
    apart = solve(clients, cuts, trunk_flops_per_s=1.0, shared_trunk=False)
    assert {a.cut for a in shared.assignments} == {2} and shared.makespan_s == pytest.approx(6)
    assert {a.cut for a in apart.assignments} == {1} and apart.makespan_s == pytest.approx(3)


def test_select_keeps_the_clients_that_make_the_round_shortest() -> None:
    cuts = [cut_cost(1, client_flops=1, server_flops=1)]
    clients = [client_state("slow", flops=0.1), client_state("fast", flops=10), client_state("mid")]
    plan = solve(clients, cuts, trunk_flops_per_s=1.0, select=2)
    assert {a.client for a in plan.assignments} == {"fast", "mid"}
    assert plan.excluded == {"slow": "not selected"}
    assert solve(clients, cuts, trunk_flops_per_s=1.0, select=0).assignments == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cuts": []}, "cuts is empty"),
        ({"forbidden_cuts": frozenset({1, 2})}, "no cut allowed"),
        ({"min_cut": 3}, "no cut allowed"),
        ({"select": -1}, "select must be"),
        ({"trunk_flops_per_s": 0.0}, "trunk_flops_per_s"),
        ({"clients": [client_state("a"), client_state("a")]}, "distinct"),
    ],
)
def test_invalid_instances_are_refused(kwargs: dict, message: str) -> None:
    instance = {
        "clients": [client_state("a")],
        "cuts": [cut_cost(c, client_flops=1, server_flops=1) for c in (1, 2)],
        "trunk_flops_per_s": 1.0,
    } | kwargs
    with pytest.raises(ValueError, match=message):
        solve(**instance)


def test_brute_force_refuses_large_instances() -> None:
    clients, cuts, trunk = random_instance(40, 10, seed=1)
    with pytest.raises(TooManyAssignments, match="use solve"):
        brute_force(clients, cuts, trunk_flops_per_s=trunk)


def test_count_assignments() -> None:
    assert count_assignments([2, 3, 4], 3) == 24
    assert count_assignments([2, 3, 4], 2) == 2 * 3 + 2 * 4 + 3 * 4
    assert count_assignments([2, 3], 0) == 1
    assert count_assignments([10] * 7, 7) > BRUTE_FORCE_LIMIT


def test_random_instance_is_seeded_and_solvable() -> None:
    clients, cuts, trunk = random_instance(50, 8, seed=3)
    assert (clients, cuts) == random_instance(50, 8, seed=3)[:2]
    plan = solve(clients, cuts, trunk_flops_per_s=trunk, select=10)
    assert len(plan.assignments) == 10


def test_planning_imports_without_torch_or_flwr() -> None:
    code = """
import importlib, pkgutil, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "flwr"}:
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Block())
import splitlearn.planning as planning
names = sorted(m.name for m in pkgutil.iter_modules(planning.__path__))
for name in names:
    importlib.import_module(f"splitlearn.planning.{name}")
print(",".join(names))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert {"cost", "solve", "planners", "monitor"} <= set(done.stdout.strip().split(","))
