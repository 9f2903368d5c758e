"""The planner benchmark's bookkeeping: time to target, equal-time accuracy, reductions."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from benchmarks.planner import (
    RunResult,
    accuracy_after,
    at_budget,
    round_cuts,
    rounds_to_target,
    summarise,
    time_to_target,
)


def run(method: str, curve: list[tuple[float, float]], *, seed: int = 0,
        scenario: str = "s") -> RunResult:
    history = [{"round": r, "virtual_time_s": t, "test_accuracy": a}
               for r, (t, a) in enumerate(curve)]
    return RunResult(scenario, seed, method, time_to_target(history, 0.9), curve[-1][0],
                     curve[-1][1], max(a for _, a in curve), 0.0, tuple(curve),
                     rounds=len(curve) - 1, rounds_to_target=rounds_to_target(history, 0.9))


def test_time_to_target_is_the_end_of_the_first_round_at_target() -> None:
    history = [{"round": 0, "virtual_time_s": 0.0, "test_accuracy": 0.95},  # before training
               {"round": 1, "virtual_time_s": 3.0, "test_accuracy": 0.5},
               {"round": 2, "virtual_time_s": 7.0, "test_accuracy": 0.91}]
    assert time_to_target(history, 0.9) == 7.0
    assert time_to_target(history, 0.99) == math.inf
    assert rounds_to_target(history, 0.9) == 2.0
    assert rounds_to_target(history, 0.99) == math.inf


def test_accuracy_at_budget_averages_the_last_evaluations_by_then() -> None:
    result = run("p", [(0, 0.1), (1, 0.5), (2, 0.7), (3, 0.8), (4, 0.9), (5, 1.0)])
    assert at_budget(result, 4.0).accuracy_at_budget == pytest.approx((0.7 + 0.8 + 0.9) / 3)
    assert at_budget(result, 1.5).accuracy_at_budget == pytest.approx(0.5)  # one round by then
    assert at_budget(result, 0.5).accuracy_at_budget == 0.0  # no round finished
    assert accuracy_after(result, 2) == 0.7 and accuracy_after(result, 99) == 1.0


def test_summary_reductions_and_accuracy_gaps() -> None:
    uniform = {"cut=1": [(0, 0.1), (10, 0.5), (20, 0.92)],
               "cut=2": [(0, 0.1), (5, 0.91), (10, 0.95)]}
    planners = {"greedy": [(0, 0.1), (6, 0.95), (12, 0.96)],
                "smartsplit": [(0, 0.1), (3, 0.8), (4, 0.93), (7, 0.94), (10, 0.96)]}
    results = [at_budget(run(m, c), 10.0) for m, c in (uniform | planners).items()]
    results[-1] = replace(results[-1], plan_errors=((1, 0.2), (2, -0.1)))
    whole = summarise(results, cuts=[1, 2])
    json.dumps(whole)  # the summary is written as JSON
    summary = whole["s"]
    errors = summary["plan_error"]  # only the planner that planned has them
    assert list(errors) == ["smartsplit"] and errors["smartsplit"]["rounds"] == 2
    assert errors["smartsplit"]["median_abs"] == pytest.approx(0.15)
    assert errors["smartsplit"]["median_signed"] == pytest.approx(0.05)
    assert math.isnan(errors["smartsplit"]["worst_abs_measured"])  # both rounds use the prior
    assert summary["reduction_vs_best_uniform_by_planner"] == {
        "greedy": pytest.approx(1 - 6 / 5), "smartsplit": pytest.approx(1 - 4 / 5)}
    assert summary["best_uniform"] == "cut=2" and summary["worst_uniform"] == "cut=1"
    assert summary["best_planner"] == "smartsplit"
    assert summary["reduction_vs_best_uniform"] == pytest.approx(1 - 4 / 5)
    assert summary["reduction_vs_worst_uniform"] == pytest.approx(1 - 4 / 20)
    assert summary["reduction_vs_greedy"] == pytest.approx(1 - 4 / 6)
    # At equal time (10 s): the mean of the last three evaluations after training began.
    assert summary["accuracy_gap_vs_best_uniform"] == pytest.approx(
        (0.93 + 0.94 + 0.96) / 3 - (0.91 + 0.95) / 2)
    assert summary["accuracy_gap_at_equal_rounds"] == pytest.approx(0.96 - 0.95)
    # Rounds to 90%: cut 1 in 2, cut 2 in 1; the deepest cut's over the shallowest's - 1.
    assert summary["rounds_to_target"]["cut=1"] == 2 and summary["rounds_to_target"]["cut=2"] == 1
    assert summary["implied_learning_penalty"] == pytest.approx(1 / 2 - 1)


def test_the_implied_learning_penalty_averages_seeds_and_needs_both_cuts_at_target() -> None:
    from benchmarks.planner import implied_learning_penalty

    shallow = [run("cut=1", [(0, 0.1)] + [(r, 0.5) for r in range(1, n)] + [(n, 0.95)], seed=s)
               for s, n in enumerate((4, 6))]
    deep = [run("cut=3", [(0, 0.1)] + [(r, 0.5) for r in range(1, n)] + [(n, 0.95)], seed=s)
            for s, n in enumerate((6, 9))]
    middle = [run("cut=2", [(0, 0.1), (1, 0.95)])]
    assert implied_learning_penalty([*shallow, *deep, *middle], [1, 2, 3]) == pytest.approx(
        7.5 / 5 - 1)
    never = run("cut=3", [(0, 0.1), (1, 0.5)], seed=2)
    assert implied_learning_penalty([*shallow, *deep, never], [1, 3]) is None
    assert implied_learning_penalty(shallow, [1, 3]) is None


def test_the_plan_errors_are_summed_up_over_runs_and_apart_from_the_prior_rounds() -> None:
    from dataclasses import replace

    from benchmarks.planner import plan_error_summary

    first = replace(run("dynsl", [(0, 0.1), (1, 0.5)]),
                    plan_errors=((1, -0.5), (2, 0.3), (3, 0.02), (4, -0.04)))
    second = replace(run("dynsl", [(0, 0.1), (1, 0.5)], seed=1), plan_errors=((3, 0.1),))
    summary = plan_error_summary([first, second])
    assert summary["median_abs"] == pytest.approx(0.1)  # of 0.5, 0.3, 0.02, 0.04, 0.1
    assert summary["worst_abs"] == pytest.approx(0.5)
    assert summary["worst_abs_measured"] == pytest.approx(0.1)  # rounds 3 and later
    assert summary["median_signed"] == pytest.approx(0.02) and summary["rounds"] == 5
    assert plan_error_summary([run("cut=2", [(0, 0.1)])]) == {}  # a uniform cut plans nothing


def clock_run(folder, seconds: dict[str, float]):  # noqa: ANN001, ANN201
    """A run folder whose one round had each device (partition id) take ``seconds``."""
    import csv
    import json

    folder.mkdir()
    rows = [{"round": 1, "status": "ok", "node_id": 10 + i, "client": device, "steps": 1,
             "num_examples": 8, "virtual_s": s, "virtual_compute_s": s}
            for i, (device, s) in enumerate(seconds.items())]
    rows.append({"round": 1, "status": "dropout", "node_id": 99, "client": "gone"})
    with open(folder / "clients.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (folder / "metrics.json").write_text(json.dumps([{"round": 0}, {"round": 1, "trunk_s": 0}]))
    return folder


def test_the_clock_oracle_mixes_the_cuts_each_device_is_fastest_at(tmp_path) -> None:
    from benchmarks.clock_oracle import oracle

    # a is fast at cut 1, b at cut 2: any uniform cut waits 9 s for one of them, the
    # mix 3 s; a planner's run that got one device right waited 6 s.
    found = oracle({1: clock_run(tmp_path / "c1", {"a": 3.0, "b": 9.0}),
                    2: clock_run(tmp_path / "c2", {"a": 9.0, "b": 3.0})},
                   {"dynsl": clock_run(tmp_path / "d", {"a": 3.0, "b": 6.0})})
    assert found["cut=1_s"] == found["cut=2_s"] == pytest.approx(9.0)
    assert found["oracle_s"] == pytest.approx(3.0) and found["dynsl_s"] == pytest.approx(6.0)
    assert found["oracle_gain_vs_best_uniform"] == pytest.approx(2 / 3)
    assert found["dynsl_gain_vs_best_uniform"] == pytest.approx(1 / 3)


def test_each_rounds_plan_reads_as_a_cut_or_a_status_per_device_in_partition_order(
        tmp_path) -> None:
    rows = ["round,partition_id,status,cut",
            "1,1,ok,4", "1,0,ok,1", "1,2,unavailable,",
            "2,0,memory,", "2,2,ok,3"]  # partition 1 has no row in round 2
    path = tmp_path / "clients.csv"
    path.write_text("\n".join(rows) + "\n")
    assert round_cuts(path) == ("14u", "m-3")
