"""End to end: ``strategy=ushaped`` through the shipped apps (2 rounds, 3 clients).

In process (the same strategy, ClientApp, trunk and run folder, without the engine's
start-up): the engine's own path is the other protocols' and has its own tests.
"""

from __future__ import annotations

import json

from tests.integration.test_simulation import read_clients, run_in_process


def test_ushaped_two_rounds_three_clients(tmp_path):
    run_dir = run_in_process(
        tmp_path, "strategy=ushaped", "strategy.num_rounds=2", "num_clients=3", "logger=none"
    )
    config = json.loads((run_dir / "config.json").read_text())
    assert config["strategy"]["name"] == "ushaped"
    rounds = json.loads((run_dir / "metrics.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1, 2]
    # The centralised test loads head + tail from the FedAvg'd arrays into the trunk's model.
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    for r in rounds[1:]:
        assert r["examples"] == 1437 * config["strategy"]["local_epochs"]
        assert r["failed_clients"] == 0 and r["bytes_up"] > 0 and r["bytes_down"] > 0
        assert r["trunk_s"] > 0  # the trunk trained its middle stages
    rows = read_clients(run_dir)
    assert len(rows) == 6 and {row["status"] for row in rows} == {"ok"}
    for row in rows:  # the device computes the loss: it reports it itself
        assert 0 < float(row["train_loss"]) and 0 <= float(row["train_accuracy"]) <= 1
