"""The privacy budget guard: exhausted clients stop being trained; epsilon per round."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from splitlearn.privacy.budget import BUDGET_STATUS
from splitlearn.task import STATUS_KEY, SplitTask
from strategies.privacy import PrivacyBudgetGuard
from strategies.splitfed import SplitFed, aggregate_split_metrics

TASK = SplitTask(
    server_round=0, cut=1, model="cnn", model_options="{}", dataset="digits", dataset_path="",
    test_fraction=0.2, image_size=0, partitioner="iid", alpha=0.5, shards_per_partition=2,
    seed=0, local_epochs=1, batch_size=32, lr=0.05, momentum=0.9, weight_decay=0.0,
    trunk_address="127.0.0.1:1", token="", max_frame_bytes=1 << 20,
    privacy="activation_gaussian", privacy_noise_multiplier=1.0, privacy_epsilon_max=10.0,
)


@pytest.fixture(autouse=True)
def run_identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)


def trained(node: int, weights: np.ndarray, examples: int, epsilon: float) -> Message:
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.split")
    content = RecordDict({
        "arrays": ArrayRecord({"0.weight": Array(weights)}),
        "metrics": MetricRecord({"num-examples": examples, "epsilon": epsilon}),
    })
    return Message(content=content, reply_to=request)


def out_of_budget(node: int, epsilon: float) -> Message:
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.split")
    content = RecordDict({
        STATUS_KEY: ConfigRecord({"status": BUDGET_STATUS, "reason": "privacy budget exhausted"}),
        "metrics": MetricRecord({"partition-id": node, "epsilon": epsilon}),
    })
    return Message(content=content, reply_to=request)


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def make_guard(**kwargs) -> PrivacyBudgetGuard:
    inner = SplitFed(task=TASK, issue_token=lambda c, k, r: f"{c}-{r}",
                     revoke_round=lambda r: None, **kwargs)
    inner._round_started = time.perf_counter()
    return PrivacyBudgetGuard(inner)


def test_exhausted_clients_are_recorded_left_out_and_not_sampled_again():
    guard = make_guard(min_available_nodes=1, min_train_nodes=1)
    w = np.ones((2, 2), dtype=np.float32)
    arrays, metrics = guard.aggregate_train(1, [trained(1, w, 10, 3.0), out_of_budget(2, 9.5)])
    np.testing.assert_allclose(arrays["0.weight"].numpy(), w)
    assert metrics["epsilon"] == 9.5  # the least private client, trained this round or not
    assert metrics["clients-budget"] == 1 and metrics["num-examples"] == 10
    # The wrapped strategy's rows (read through the guard) list both clients.
    statuses = {row["node_id"]: row["status"] for row in guard.client_rows[1]}
    assert statuses == {"1": "ok", "2": BUDGET_STATUS}
    messages = guard.configure_train(2, ArrayRecord(), ConfigRecord(), FakeGrid([1, 2, 3]))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 3]


def test_round_where_everyone_is_out_of_budget_keeps_the_weights():
    guard = make_guard()
    arrays, metrics = guard.aggregate_train(3, [out_of_budget(1, 9.0), out_of_budget(2, 9.9)])
    assert arrays is None  # Strategy.start keeps the previous arrays
    assert metrics["epsilon"] == 9.9 and metrics["clients-budget"] == 2
    assert guard.train_metrics[3] is metrics  # where the round reporter reads them
    assert set(guard.exhausted) == {1, 2}
    assert guard.configure_train(4, ArrayRecord(), ConfigRecord(), FakeGrid([1, 2])) == []
    arrays, metrics = guard.aggregate_train(4, [])
    assert arrays is None and metrics["clients-budget"] == 2 and metrics["epsilon"] == 9.9


def test_guard_sends_no_federated_evaluation():
    guard = make_guard(fraction_evaluate=1.0, min_evaluate_nodes=1, min_available_nodes=1)
    assert list(guard.configure_evaluate(1, ArrayRecord(), ConfigRecord(), FakeGrid([1]))) == []


def test_round_epsilon_is_the_max_over_clients_not_the_average():
    records = [
        RecordDict({"m": MetricRecord({"num-examples": n, "epsilon": e})})
        for n, e in [(10, 1.0), (30, 4.0), (5, 2.5)]
    ]
    assert aggregate_split_metrics(records, "num-examples")["epsilon"] == 4.0
