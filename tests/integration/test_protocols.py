"""Each protocol end to end (2 rounds, 3 clients), and SplitFed v1 against FedAvg.

Run by the shipped apps in this process (``run_in_process``): what is tested is the
protocols; the engine has its own tests (test_simulation, test_adaptive_splits, ...).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_simulation import read_clients, run_in_process

SMALL = ("strategy.num_rounds=2", "num_clients=3", "logger=none")


def rounds_of(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.parametrize(
    "overrides",
    [("strategy=sequential",), ("strategy=splitfed_v2", "strategy.batch_concurrent=true")],
    ids=["sequential", "splitfed_v2-batched"],
)
def test_protocol_trains_every_client(tmp_path, overrides):
    run_dir = run_in_process(tmp_path, *overrides, *SMALL)
    rounds = rounds_of(run_dir)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.1
    rows = read_clients(run_dir)
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok"}


def test_splitfed_v1_is_fedavg_of_the_whole_model(tmp_path):
    """Per-client trunk copies merged by samples == FedAvg of the joined model.

    With one trunk copy per client, each client trains bottom+copy exactly as it
    would train the whole model, and both sides are averaged with the same
    weights, so SplitFed v1 must match Flower's FedAvg baseline round by round.
    """
    v1 = rounds_of(run_in_process(tmp_path / "v1", "strategy=splitfed_v1", *SMALL))
    fedavg_dir = run_in_process(tmp_path / "fedavg", "strategy=fedavg", *SMALL)
    fedavg = rounds_of(fedavg_dir)
    for a, b in zip(v1, fedavg, strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-4, abs=1e-5)
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-9)
    # FedAvg moves weights, not smashed data: bytes are the model, once each way.
    rows = [r for r in read_clients(fedavg_dir) if r["round"] == "1"]
    assert all(int(float(r["bytes_up"])) == int(float(r["bytes_down"])) for r in rows)
