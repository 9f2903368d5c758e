"""End to end: the local_loss protocol through the shipped apps in process, every mode.

The engines add nothing local loss does not share with the other protocols (they are
tested with those); its trunk side over real gRPC is tests/unit/test_local_loss.py's."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_simulation import read_clients, run_in_process

#: Each mode's overrides beyond the protocol's.
MODES = {"streaming": [], "bulk": ["strategy.bulk=true"],
         "top-k with error feedback": ["compression=topk_feedback"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_local_loss_two_rounds_three_clients(tmp_path, mode):
    overrides = ["strategy=local_loss", "strategy.num_rounds=2", "num_clients=3", "logger=none",
                 *MODES[mode]]
    run_dir = run_in_process(tmp_path, *overrides)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["strategy"]["name"] == "local_loss"
    rounds = json.loads((run_dir / "metrics.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1, 2]
    # Both halves learned: the averaged bottom joined with the asynchronously trained trunk.
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    rows = read_clients(run_dir)
    reasons = [(row["round"], row["status"], row.get("reason")) for row in rows]
    for r in rounds[1:]:
        assert r["examples"] == 1437 * config["strategy"]["local_epochs"], reasons
        assert r["failed_clients"] == 0 and r["bytes_up"] > 0
        assert r["trunk_s"] > 0  # the trunk trained on the round's smashed data
        # Streaming gets one small ack per batch; bulk gets nothing before the reply.
        # Besides the weights (in the Flower messages), only acks come back: no gradients.
        data_plane_down = r["bytes_down"] - r["weights_bytes_down"]
        data_plane_up = r["bytes_up"] - r["weights_bytes_up"]
        assert (data_plane_down > 0) == (mode != "bulk")
        assert data_plane_down < data_plane_up / (100 if mode == "streaming" else 10)
        # Dense smashed data: 8 KiB a sample at cut 1 (float32); a tenth of it in top-k.
        assert (data_plane_up < 1024 * r["examples"]) == (mode == "top-k with error feedback")
    assert len(rows) == 6 and {row["status"] for row in rows} == {"ok"}
    if mode == "top-k with error feedback":  # each device's references carried on, in step
        assert [row["feedback_restarts"] for row in rows] == ["0"] * 6
        epochs = config["strategy"]["local_epochs"]
        assert [int(row["feedback_carried"]) for row in rows] == [
            0 if row["round"] == "1" else int(row["num_examples"]) // epochs for row in rows]
