"""The privacy budget guard: exhausted clients stop being trained; epsilon per round."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)

from protocols.splitfed import SplitFedV2Options
from splitlearn.config import PrivacyConfig, RunSpec
from splitlearn.dataplane import TokenRegistry
from splitlearn.messages import ROUND_KEY, STATUS_KEY
from strategies.privacy import BUDGET_STATUS, PrivacyBudgetGuard
from strategies.reporting import RoundOutcome, aggregate_split_metrics
from strategies.splitfed import DataPlaneAccess, SplitFed
from tests.helpers import ScriptedGrid

SPEC = RunSpec(
    strategy=SplitFedV2Options(lr=0.05),
    privacy=PrivacyConfig(name="activation_gaussian", noise_multiplier=1.0, epsilon_max=10.0),
)


pytestmark = pytest.mark.usefixtures("task_identity")


def request(node: int) -> Message:
    return Message(content=RecordDict(), dst_node_id=node, message_type="train.splitfed_v2")


def trained(node: int, weights: np.ndarray, examples: int, epsilon: float, *,
            to: Message | None = None) -> Message:
    content = RecordDict({
        "arrays": ArrayRecord({"0.weight": Array(weights)}),
        "metrics": MetricRecord({"num-examples": examples, "epsilon": epsilon,
                                 "partition-id": node - 1}),
    })
    return Message(content=content, reply_to=to or request(node))


def out_of_budget(node: int, epsilon: float, *, to: Message | None = None) -> Message:
    content = RecordDict({
        STATUS_KEY: ConfigRecord({"status": BUDGET_STATUS, "reason": "privacy budget exhausted"}),
        "metrics": MetricRecord({"partition-id": node - 1, "epsilon": epsilon}),
    })
    return Message(content=content, reply_to=to or request(node))


class FakeTrunk:
    def __init__(self) -> None:
        self.finished: list[list[str]] = []

    def finish_round(self, finished) -> None:  # noqa: ANN001 - an iterable of node ids
        self.finished.append(list(finished))


def nodes_grid(nodes: list[int]) -> ScriptedGrid:
    return ScriptedGrid(nodes, lambda m: m)


def make_guard(outcomes: list[RoundOutcome] | None = None, **kwargs) -> PrivacyBudgetGuard:
    kwargs.setdefault("min_available_nodes", 1)
    kwargs.setdefault("min_train_nodes", 1)
    inner = SplitFed(
        protocol="splitfed_v2", spec=SPEC,
        dataplane=DataPlaneAccess(TokenRegistry(), "127.0.0.1:1", 60.0), trunk=FakeTrunk(),
        on_round=None if outcomes is None else outcomes.append, **kwargs,
    )
    return PrivacyBudgetGuard(inner)


def test_exhausted_clients_are_recorded_left_out_and_not_sampled_again():
    outcomes: list[RoundOutcome] = []
    guard = make_guard(outcomes)
    w = np.ones((2, 2), dtype=np.float32)
    arrays, metrics = guard.aggregate_train(1, [trained(1, w, 10, 3.0), out_of_budget(2, 9.5)])
    np.testing.assert_allclose(arrays["0.weight"].numpy(), w)
    assert metrics["clients-budget"] == 1 and metrics["num-examples"] == 10
    assert metrics["epsilon"] == 3.0  # of the clients that trained
    assert guard.exhausted == {2}
    # The wrapped strategy's report lists both clients, each with its epsilon, so the
    # reporter can take the least private client's, trained this round or not.
    [outcome] = outcomes
    rows = {row["node_id"]: row for row in outcome.rows}
    assert {n: r["status"] for n, r in rows.items()} == {"1": "ok", "2": BUDGET_STATUS}
    assert {n: r["epsilon"] for n, r in rows.items()} == {"1": 3.0, "2": 9.5}
    assert max(r["epsilon"] for r in outcome.rows) == 9.5
    messages = guard.configure_train(2, ArrayRecord(), ConfigRecord(), nodes_grid([1, 2, 3]))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 3]


def test_round_where_everyone_is_out_of_budget_keeps_the_weights():
    outcomes: list[RoundOutcome] = []
    guard = make_guard(outcomes)
    replies = [out_of_budget(1, 9.0), out_of_budget(2, 9.9)]
    assert guard.aggregate_train(3, replies) == (None, None)  # Strategy.start keeps the arrays
    assert outcomes[-1].metrics["clients_budget"] == 2
    assert outcomes[-1].metrics["num_examples"] == 0
    assert max(r["epsilon"] for r in outcomes[-1].rows) == 9.9
    assert guard.exhausted == {1, 2}
    assert guard.configure_train(4, ArrayRecord(), ConfigRecord(), nodes_grid([1, 2])) == []
    assert guard.aggregate_train(4, []) == (None, None)
    assert outcomes[-1].server_round == 4 and outcomes[-1].rows == []


def test_exhausted_clients_are_never_trained_again_through_flowers_loop():
    """Round 1: node 2 is out of budget. Round 2: 1 and 3 are too. Round 3: nobody trains."""
    out_after = {2: 1, 1: 2, 3: 2}  # node -> first round it declines

    def answer(message: Message) -> Message:
        node = message.metadata.dst_node_id
        server_round = int(message.content[ROUND_KEY]["server_round"])
        if server_round >= out_after[node]:
            return out_of_budget(node, 9.0 + node / 10, to=message)
        start = message.content["arrays"]["0.weight"].numpy()
        return trained(node, start + node, 10, float(server_round), to=message)

    grid = ScriptedGrid([1, 2, 3], answer)
    seen: dict[int, np.ndarray] = {}
    guard = make_guard(fraction_evaluate=1.0, min_evaluate_nodes=1)
    start = ArrayRecord({"0.weight": Array(np.zeros((2, 2), dtype=np.float32))})
    guard.start(grid=grid, initial_arrays=start, num_rounds=3,
                evaluate_fn=lambda r, a: seen.update({r: a["0.weight"].numpy()}))
    trained_nodes = [sorted(m.metadata.dst_node_id for m in call) for call in grid.calls]
    # Train messages per round; no federated evaluation (its calls are empty).
    assert trained_nodes == [[1, 2, 3], [], [1, 3], [], [], []]
    assert all(m.metadata.message_type.startswith("train.") for c in grid.calls for m in c)
    np.testing.assert_allclose(seen[1], np.full((2, 2), 2.0))  # mean of +1 and +3
    np.testing.assert_allclose(seen[2], seen[1])  # everyone out: weights kept
    np.testing.assert_allclose(seen[3], seen[1])  # nobody left to train
    assert guard.exhausted == {1, 2, 3}


def test_guard_sends_no_federated_evaluation():
    guard = make_guard(fraction_evaluate=1.0, min_evaluate_nodes=1)
    grid = nodes_grid([1, 2])
    # The wrapped strategy would evaluate, so the guard is what turns it off.
    assert len(list(guard.strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))) == 2
    assert list(guard.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid)) == []


def test_guard_has_no_attribute_passthrough():
    guard = make_guard()
    assert not hasattr(guard, "protocol") and guard.strategy.protocol == "splitfed_v2"


def test_round_epsilon_is_the_max_over_clients_not_the_average():
    records = [
        RecordDict({"m": MetricRecord({"num-examples": n, "epsilon": e})})
        for n, e in [(10, 1.0), (30, 4.0), (5, 2.5)]
    ]
    assert aggregate_split_metrics(records, "num-examples")["epsilon"] == 4.0
