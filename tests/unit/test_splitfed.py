"""SplitFed aggregation, tasks and tokens, against plain reference maths."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from server.trunk_service import TokenRegistry
from splitlearn.task import SplitTask
from strategies.splitfed import SplitFed, aggregate_split_metrics

TASK = SplitTask(
    server_round=0, cut=1, model="cnn", model_options="{}", dataset="digits", dataset_path="",
    test_fraction=0.2, image_size=0, partitioner="iid", alpha=0.5, shards_per_partition=2,
    seed=0, local_epochs=1, batch_size=32, lr=0.05, momentum=0.9, weight_decay=0.0,
    trunk_address="127.0.0.1:1", token="", max_frame_bytes=1 << 20,
)


@pytest.fixture(autouse=True)
def run_identity(monkeypatch):
    # Flower messages need a run id; the engines set it, tests set it here.
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)


def reply(node: int, weights: np.ndarray, examples: int, **metrics) -> Message:
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.split")
    content = RecordDict({
        "arrays": ArrayRecord({"0.weight": Array(weights)}),
        "metrics": MetricRecord({"num-examples": examples, **metrics}),
    })
    return Message(content=content, reply_to=request)


def failed(node: int) -> Message:
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.split")
    return Message(Error(code=0, reason="injected dropout after 2 steps"), reply_to=request)


def make_strategy(revoked: list[int]) -> SplitFed:
    return SplitFed(
        task=TASK, issue_token=lambda c, k, r: f"{c}-{r}", revoke_round=revoked.append,
    )


def test_failed_client_is_not_aggregated():
    revoked: list[int] = []
    strategy = make_strategy(revoked)
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(3)]
    replies = [reply(1, ws[0], 10, **{"train-loss": 1.0}), failed(2),
               reply(3, ws[2], 30, **{"train-loss": 2.0})]
    strategy._round_started = time.perf_counter()
    arrays, metrics = strategy.aggregate_train(4, replies)
    expected = np.average(np.stack([ws[0], ws[2]]), axis=0, weights=[10, 30])
    np.testing.assert_allclose(arrays["0.weight"].numpy(), expected, rtol=1e-6)
    assert metrics["failed-clients"] == 1 and metrics["num-examples"] == 40
    assert metrics["train-loss"] == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)
    assert revoked == [4]
    statuses = {row["node_id"]: row["status"] for row in strategy.client_rows[4]}
    assert statuses == {"1": "ok", "2": "failed", "3": "ok"}


def test_round_with_only_failures_keeps_the_previous_weights():
    strategy = make_strategy([])
    strategy._round_started = time.perf_counter()
    arrays, metrics = strategy.aggregate_train(1, [failed(1), failed(2)])
    assert arrays is None and metrics is None  # Strategy.start keeps the old arrays


def test_split_metrics_sum_counts_and_average_rates():
    records = [
        RecordDict({"m": MetricRecord({"num-examples": n, "bytes-up": b, "train-accuracy": a})})
        for n, b, a in [(10, 100, 0.5), (30, 300, 0.9)]
    ]
    out = aggregate_split_metrics(records, "num-examples")
    assert out["num-examples"] == 40 and out["bytes-up"] == 400
    assert out["train-accuracy"] == pytest.approx(np.average([0.5, 0.9], weights=[10, 30]))
    assert out["clients"] == 2


def test_task_round_trips_through_a_config_record():
    task = replace(TASK, server_round=3, token="abc", dropout_rate=0.5, emulate=1)
    assert SplitTask.from_config(task.to_config()) == task


def test_task_with_missing_or_mistyped_key_is_rejected_by_name():
    config = TASK.to_config()
    del config["batch-size"]
    with pytest.raises(ValueError, match="'batch-size'"):
        SplitTask.from_config(config)
    with pytest.raises(ValueError, match="'cut' has str"):
        SplitTask.from_config(TASK.to_config() | {"cut": "1"})


def test_tokens_are_unique_checked_and_revoked_by_round():
    tokens = TokenRegistry()
    a = tokens.issue(client="1", cut=1, server_round=1, ttl_s=60)
    b = tokens.issue(client="2", cut=2, server_round=2, ttl_s=60)
    assert a != b and tokens.lookup(a).client == "1" and tokens.lookup(b).cut == 2
    assert tokens.lookup("forged") is None and tokens.lookup(None) is None
    tokens.revoke_round(1)
    assert tokens.lookup(a) is None and tokens.lookup(b) is not None


def test_tokens_expire():
    tokens = TokenRegistry()
    t = tokens.issue(client="1", cut=1, server_round=1, ttl_s=-1)
    assert tokens.lookup(t) is None


def declined(node: int, status: str) -> Message:
    from flwr.app import ConfigRecord

    from splitlearn.task import STATUS_KEY

    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.split")
    content = RecordDict({
        STATUS_KEY: ConfigRecord({"status": status, "reason": f"[{status}] test"}),
        "metrics": MetricRecord({"partition-id": node}),
    })
    return Message(content=content, reply_to=request)


def test_stragglers_declines_and_dropouts_are_recorded_and_left_out():
    strategy = SplitFed(task=TASK, issue_token=lambda c, k, r: "t", revoke_round=lambda r: None,
                        round_deadline_s=5.0)
    w = [np.full((3, 2), v, dtype=np.float32) for v in (1.0, 2.0, 3.0)]
    replies = [
        reply(1, w[0], 10, **{"virtual-s": 4.0}),
        reply(2, w[1], 10, **{"virtual-s": 9.0}),  # past the 5 s deadline
        reply(3, w[2], 10, **{"virtual-s": 1.0}),
        declined(4, "unavailable"),
        declined(5, "memory"),
        failed(6),
    ]
    strategy._round_started = time.perf_counter()
    arrays, metrics = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["0.weight"].numpy(), np.full((3, 2), 2.0))  # mean(1, 3)
    assert metrics["failed-clients"] == 4
    assert metrics["clients-straggler"] == 1 and metrics["clients-unavailable"] == 1
    assert metrics["clients-memory"] == 1 and metrics["clients-dropout"] == 0
    assert metrics["virtual-s"] == 4.0  # the slowest client that counted
    rows = {row["node_id"]: row for row in strategy.client_rows[1]}
    assert rows["2"]["status"] == "straggler" and rows["4"]["status"] == "unavailable"
    assert rows["5"]["reason"] == "[memory] test" and rows["6"]["status"] == "failed"


def test_tagged_client_errors_are_classified():
    from flwr.app import Error

    from strategies.failures import reply_status

    request = Message(content=RecordDict(), dst_node_id=9, message_type="train.split")
    error = Message(Error(code=0, reason="Traceback ...\nInjectedDropout: [dropout] vanished"),
                    reply_to=request)
    assert reply_status(error, deadline_s=None) == "dropout"


class ScriptedGrid:
    """A stand-in grid for the strategy's own logic: each node 'trains' by adding
    its node id to every array and reports 10 examples (the real engines are
    exercised in tests/integration/test_protocols.py)."""

    def __init__(self, nodes):
        self.nodes = nodes
        self.received = []  # (node, value of "0.weight" it was sent)

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            sent = message.content["arrays"]["0.weight"].numpy()
            self.received.append((node, float(sent.ravel()[0])))
            replies.append(reply(node, sent + node, 10))
        return replies


def test_sequential_passes_weights_from_each_client_to_the_next():
    from strategies.sequential import SequentialSplit

    grid = ScriptedGrid([1, 2, 3])
    strategy = SequentialSplit(
        task=TASK, issue_token=lambda c, k, r: "t", revoke_round=lambda r: None,
        min_available_nodes=3, min_train_nodes=3,
    )
    from flwr.app import ConfigRecord

    start = ArrayRecord({"0.weight": Array(np.zeros((2, 2), dtype=np.float32))})
    first = list(strategy.configure_train(1, start, ConfigRecord(), grid))
    assert len(first) == 1  # one turn at a time
    replies = grid.send_and_receive(first)
    arrays, metrics = strategy.aggregate_train(1, replies)
    order = [node for node, _ in grid.received]
    # Each turn starts from what the previous client finished with ...
    assert [value for _, value in grid.received] == [0.0, order[0], order[0] + order[1]]
    # ... and the round's result is the last client's weights, not an average.
    np.testing.assert_allclose(arrays["0.weight"].numpy(), np.full((2, 2), 6.0))
    assert metrics["num-examples"] == 30 and sorted(order) == [1, 2, 3]


def every_protocol():
    from strategies.fedavg import FedAvgBaseline
    from strategies.local_loss import LocalLossSplit
    from strategies.sequential import SequentialSplit
    from strategies.ushaped import UShapedSplit

    common = {"issue_token": lambda c, k, r: "t", "revoke_round": lambda r: None,
              "round_deadline_s": 5.0}
    return {
        "splitfed": lambda: SplitFed(task=TASK, **common),
        "sequential": lambda: SequentialSplit(task=TASK, **common),
        "fedavg": lambda: FedAvgBaseline(task=TASK, **common),
        "ushaped": lambda: UShapedSplit(task=replace(TASK, tail_cut=3), **common),
        "local_loss": lambda: LocalLossSplit(task=TASK, **common),
    }


@pytest.mark.parametrize("name", sorted(every_protocol()))
def test_every_protocol_leaves_out_failed_declined_and_late_clients(name):
    strategy = every_protocol()[name]()
    if name == "sequential":  # its remaining turns are none: all replies are in
        strategy._grid, strategy._waiting = ScriptedGrid([]), []
    w = [np.full((3, 2), v, dtype=np.float32) for v in (1.0, 5.0, 3.0)]
    replies = [
        reply(1, w[0], 10, **{"virtual-s": 1.0}),
        reply(2, w[1], 10, **{"virtual-s": 9.0}),  # straggler past 5 s
        reply(3, w[2], 10, **{"virtual-s": 2.0}),
        declined(4, "unavailable"), declined(5, "dropout"), failed(6),
    ]
    strategy._round_started = time.perf_counter()
    arrays, metrics = strategy.aggregate_train(1, replies)
    expected = 3.0 if name == "sequential" else 2.0  # last finished turn vs mean(1, 3)
    np.testing.assert_allclose(arrays["0.weight"].numpy(), np.full((3, 2), expected))
    assert metrics["num-examples"] == 20 and metrics["failed-clients"] == 4
    assert metrics["clients-straggler"] == 1 and metrics["clients-dropout"] == 1
    statuses = sorted(row["status"] for row in strategy.client_rows[1])
    assert statuses == ["dropout", "failed", "ok", "ok", "straggler", "unavailable"]
