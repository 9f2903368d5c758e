"""The round time budget's bookkeeping: the parts add up to the round, clients share cores."""

from __future__ import annotations

import pytest

from benchmarks.cli import parse_arguments
from benchmarks.rounds import PARTS, not_learning, round_budget, round_walls, steady_median


def history() -> list[dict]:
    # Round 1 pays for start-up; rounds 2 and 3 are steady.
    walls = [0.1, 8.0, 9.0, 10.2]
    return [{"round": r, "wall_s": w, "round_train_s": 0.8 + 0.1 * r, "evaluate_s": 0.05,
             "trunk_s": 0.5} for r, w in enumerate(walls)]


def client(server_round: int, *, handler: float = 0.3, status: str = "ok") -> dict:
    return {"round": str(server_round), "status": status, "handler_s": str(handler),
            "setup_s": "0.05", "train_s": "0.2", "compute_s": "0.04"}


def test_the_parts_add_up_to_the_round_and_clients_share_the_cores() -> None:
    clients = [client(r) for r in (1, 2, 3) for _ in range(4)]
    budget = round_budget(history(), clients, parallel=2)
    assert budget["round_s"] == pytest.approx((1.0 + 1.2) / 2)  # rounds 2 and 3
    assert sum(budget[key] for key, _ in PARTS) == pytest.approx(budget["round_s"])
    # Four clients two at a time: each client-second is half a round-second.
    assert budget["client_setup_s"] == pytest.approx(4 * 0.05 / 2)
    assert budget["trunk_wait_s"] == pytest.approx(4 * (0.2 - 0.04) / 2)
    assert budget["flower_dispatch_s"] == pytest.approx((1.0 + 1.1) / 2 - 4 * 0.3 / 2)
    assert budget["trunk_busy_s"] == 0.5
    one_at_a_time = round_budget(history(), clients, parallel=1)
    assert one_at_a_time["client_setup_s"] == pytest.approx(2 * budget["client_setup_s"])


def test_failed_clients_spend_no_budget() -> None:
    clients = [client(2), client(2, handler=99.0, status="failed"), client(3)]
    budget = round_budget(history(), clients, parallel=1)
    assert budget["client_wrapup_s"] == pytest.approx(0.3 - 0.05 - 0.2)


def test_walls_are_differences_of_the_run_clock_and_round_1_is_left_out() -> None:
    assert round_walls(history()) == pytest.approx({1: 7.9, 2: 1.0, 3: 1.2})
    assert steady_median(history()) == pytest.approx(1.1)


def test_a_run_without_steady_rounds_cannot_be_budgeted() -> None:
    with pytest.raises(ValueError, match="no round >= 2"):
        round_budget(history()[:2], [client(1)], parallel=1)
    with pytest.raises(ValueError, match="parallel"):
        round_budget(history(), [client(2)], parallel=0)


@pytest.mark.parametrize("argv", [
    ["rounds", "--repeats", "1", "dataplane.trunk_workers=2", "logger=none"],
    ["rounds", "dataplane.trunk_workers=2", "--repeats", "1", "logger=none"],
    ["rounds", "dataplane.trunk_workers=2", "logger=none", "--repeats", "1"],
])
def test_overrides_and_options_are_read_in_any_order(argv) -> None:
    args = parse_arguments(argv)
    assert (args.name, args.repeats) == ("rounds", 1)
    assert args.overrides == ["dataplane.trunk_workers=2", "logger=none"]


def test_the_defences_summary_pairs_each_job_on_against_off() -> None:
    from benchmarks.defences import BOOKS, summarise

    def row(job: str, setting: str, accuracy: float, round_s: float) -> dict:
        return {"job": job, "defences": setting, "accuracy": accuracy, "round_s": round_s,
                **dict.fromkeys(BOOKS, 0)}

    rows = [row("default", "on", 0.97, 1.2), row("default", "off", 0.98, 1.0),
            row("default", "on", 0.95, 1.4), row("default", "off", 0.96, 1.1),
            row("heterogeneous", "on", 0.90, 2.0), row("heterogeneous", "off", 0.90, 2.0)]
    summary = summarise(rows)
    assert summary["default"]["on"]["accuracy"] == pytest.approx(0.96)  # the median of two
    assert summary["default"]["cost"]["accuracy_points"] == pytest.approx(1.0)
    assert summary["default"]["cost"]["round_time_ratio"] == pytest.approx(1.3 / 1.05)
    assert summary["heterogeneous"]["cost"] == {"accuracy_points": 0.0, "round_time_ratio": 1.0}


def test_rounds_of_a_job_that_did_not_learn_are_not_a_figure():
    assert not_learning([0.97, 0.98], 0.5) is None
    assert not_learning([0.97, 0.12], 0.5) == "final test accuracy 0.1200 is below the floor 0.5"
    assert not_learning([], 0.5) is not None  # no run, no figure
