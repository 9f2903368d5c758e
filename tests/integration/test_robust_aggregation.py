"""Robust aggregation through the shipped strategy, ClientApp and trunk: one device's reply
weights scaled x1000 wreck the unbounded weighted mean; the bound on updates (the default),
the median and Krum keep the honest accuracy."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

import pytest
from flwr.app import Array, ArrayRecord, Message

from experiments.local import LocalGrid, run_local
from protocols import compose_config

#: The lying device (node ids are 1..num_clients) and what it multiplies its weights by.
ATTACKER, SCALE = 1, 1000.0
#: 5 devices: Krum with f = 1 needs n > 2f + 2.
BASE = ["num_clients=5", "strategy.num_rounds=2", "strategy.lr=0.1", "logger=none",
        "aggregation.num_malicious=1"]


class ScalingGrid(LocalGrid):
    """A grid on which the attacker's training replies come back with every float scaled."""

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Deliver as the LocalGrid does, then scale the attacker's reply weights."""
        replies = list(super().send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if (reply.metadata.src_node_id == ATTACKER and not reply.has_error()
                    and reply.metadata.message_type.startswith("train.")
                    and "arrays" in reply.content.array_records):
                arrays = reply.content.array_records["arrays"]
                reply.content["arrays"] = ArrayRecord({
                    k: Array(v.numpy() * SCALE if v.numpy().dtype.kind == "f" else v.numpy())
                    for k, v in arrays.items()})
        return replies


def run(tmp_path: Path, *overrides: str, attacked: bool) -> tuple[list[dict], list[dict]]:
    """Run the default protocol (SplitFed v2, cut 1) for 2 rounds; its rounds and client rows."""
    cfg = compose_config([*BASE, *overrides])
    cfg.run_dir = str(tmp_path)
    run_local(cfg, concurrency=1, grid_type=ScalingGrid if attacked else LocalGrid)
    with open(tmp_path / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    return json.loads((tmp_path / "metrics.json").read_text()), rows


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> float:
    rounds, _ = run(tmp_path_factory.mktemp("honest"), attacked=False)
    assert rounds[-1]["test_accuracy"] > 0.8, "two rounds of this run learn digits"
    return rounds[-1]["test_accuracy"]


def test_one_scaled_device_wrecks_the_unbounded_weighted_mean(tmp_path, honest):
    """Round 1 averages the x1000 copy in, and the joined model does not recover from it."""
    rounds, _ = run(tmp_path, "aggregation.max_update_ratio=0", attacked=True)
    assert rounds[2]["test_accuracy"] < honest - 0.15
    assert "robust_held" not in rounds[-1]  # no robust rule: nothing reported of one
    assert "updates_shortened" not in rounds[-1]


def test_the_bound_on_updates_keeps_the_honest_accuracy(tmp_path, honest):
    """The default: the x1000 copy's update is shortened to 4x the median, every round."""
    rounds, rows = run(tmp_path, attacked=True)
    assert [r["status"] for r in rows] == ["ok"] * 10
    assert rounds[-1]["test_accuracy"] > honest - 0.05
    assert all(r["updates_shortened"] >= 1 for r in rounds[1:])
    assert all(int(r["update_shortened"]) > 0 for r in rows if r["node_id"] == str(ATTACKER))


@pytest.mark.parametrize("method", ["median", "krum"])
def test_a_robust_rule_keeps_the_honest_accuracy(tmp_path, honest, method):
    # Without the bound on updates, so that the rule alone keeps the liar out.
    rounds, rows = run(tmp_path, f"aggregation.robust={method}", "aggregation.max_update_ratio=0",
                       attacked=True)
    assert [r["status"] for r in rows] == ["ok"] * 10  # nobody refused: the liar did not count
    assert rounds[-1]["test_accuracy"] > honest - 0.05
    assert all(r["robust_held"] == 0 for r in rounds[1:])  # five devices: the rule applied
    if method == "krum":  # one copy kept: the liar is among the four left out, every round
        assert all(r["robust_left_out"] == 4 for r in rounds[1:])
        assert {r["robust_left_out"] for r in rows if r["node_id"] == str(ATTACKER)} == {"1"}
