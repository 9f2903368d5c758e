"""Scenarios end to end: device profiles, virtual clock, stragglers, memory declines.

Run by the shipped apps in this process (``run_in_process``): the scenarios' behaviour is
the ServerApp's and the ClientApp's; the engine has its own tests.
"""

from __future__ import annotations

import json

import pytest

from server.clock import device_rounds
from splitlearn.planning.queue import round_seconds
from tests.integration.test_simulation import read_clients, run_in_process


def device_seconds(row: dict[str, str], profile: dict, host_flops_per_s: float) -> float:
    """A client's virtual time recomputed from its profile and what it measured.

    Independent of the clock's code: the FLOPs it counted at the device's FLOP/s (its
    compute seconds rescaled by host / device FLOP/s where it counted none), the bytes
    over each link, one round trip per exchange (one per batch for SplitFed).
    """
    flops = float(row["flops"]) or float(row["compute_s"]) * host_flops_per_s
    compute = flops / profile["flops_per_s"]
    up = float(row["bytes_up"]) * 8 / (profile["uplink_mbps"] * 1e6)
    down = float(row["bytes_down"]) * 8 / (profile["downlink_mbps"] * 1e6)
    return compute + up + down + float(row["steps"]) * profile["rtt_s"]


def test_flaky_network_scenario_times_rounds_and_leaves_out_stragglers(tmp_path):
    run_dir = run_in_process(
        tmp_path, "+scenario=flaky_network", "num_clients=6", "strategy.num_rounds=2",
        "logger=none",
    )
    config = json.loads((run_dir / "config.json").read_text())
    deadline = config["failures"]["round_deadline_s"]
    profiles, host_flops = config["devices"]["profiles"], config["devices"]["host_flops_per_s"]
    rounds = {r["round"]: r for r in json.loads((run_dir / "metrics.json").read_text())}
    rows = read_clients(run_dir)
    assert {row["profile"] for row in rows} <= {"low_end_phone", "mid_range_phone",
                                                 "flagship_phone", "?"}
    timed = [row for row in rows if row["status"] in ("ok", "straggler")]
    assert timed, "some clients must have trained"
    for row in timed:
        assert float(row["flops"]) > 0  # emulated devices' compute is charged by its FLOPs
        expected = device_seconds(row, profiles[row["profile"]], host_flops)
        assert float(row["virtual_s"]) == pytest.approx(expected, rel=1e-6)
        # A client is a straggler exactly when its device would have missed the deadline.
        assert (row["status"] == "straggler") == (expected > deadline)
    assert any(row["status"] == "straggler" for row in rows), "low-end phones miss 5 s"
    for server_round in (1, 2):
        ok = [r for r in rows if int(r["round"]) == server_round and r["status"] == "ok"]
        if ok:
            # The counted clients' rounds played out at the shared trunk: at least the
            # slowest one's own, at most that plus every trunk step after it.
            slowest = max(float(r["virtual_s"]) for r in ok)
            metrics = rounds[server_round]
            played = round_seconds(device_rounds(ok, trunk_s=metrics["trunk_s"]))
            assert metrics["virtual_round_s"] == pytest.approx(played)
            assert slowest <= played <= slowest + metrics["trunk_s"] + 1e-9
            assert metrics["examples"] == sum(float(r["num_examples"]) for r in ok)
    assert rounds[2]["virtual_time_s"] > rounds[1]["virtual_time_s"] > 0
    for png in ("accuracy_time.png", "client_time.png"):
        assert (run_dir / png).read_bytes()[:4] == b"\x89PNG"


def test_memory_constrained_boards_decline_a_cut_they_cannot_hold(tmp_path):
    run_dir = run_in_process(
        tmp_path, "+scenario=memory_constrained", "num_clients=4", "strategy.num_rounds=2",
        "logger=none",
    )
    rows = read_clients(run_dir)
    boards = [row for row in rows if row["profile"] == "mcu_board"]
    assert boards and all(row["status"] in ("memory", "unavailable") for row in boards)
    assert any(row["status"] == "memory" and "needs" in row["reason"] for row in boards)
    others = [row for row in rows if row["profile"] in ("wearable", "low_end_phone")]
    assert any(row["status"] == "ok" for row in others)
