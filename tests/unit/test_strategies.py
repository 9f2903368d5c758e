"""Every protocol's strategy against reference maths: who is averaged, what is reported.

The strategies run on Flower's message API; here they get hand-built replies (and,
where a whole round matters, a scripted :class:`Grid`), so each rule is checked
without engines: failed, declined and late clients are never averaged, statuses
come from the reply's ``status`` record, sessions are granted and revoked per
round, sequential turns chain the weights, local loss trains only finished
clients' smashed data. The real engines run in tests/integration.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from torch import Tensor

from protocols import PROTOCOLS
from protocols.local_loss import LocalLossOptions
from protocols.sequential import SequentialOptions
from protocols.splitfed import SplitFedV2Options
from splitlearn.config import ModelConfig, RunSpec, decode_spec
from splitlearn.dataplane import TokenRegistry
from splitlearn.messages import ROUND_KEY, SMASHED_RECORD_KEY, SPEC_KEY, STATUS_KEY, state_to_record
from strategies.local_loss import LocalLossSplit
from strategies.reporting import (
    STATUSES,
    ReportingFedAvg,
    RoundOutcome,
    aggregate_split_metrics,
    client_row,
    reply_status,
)
from strategies.sequential import SequentialSplit, TurnByTurnGrid
from strategies.splitfed import DataPlaneAccess, SplitFed
from tests.helpers import ScriptedGrid, plain_spec

#: What a client may decline a round with (its reply's ``status`` record says which).
DECLINES = ("unavailable", "memory", "dropout", "refused", "budget", "privacy")
#: Flower's error code for a ClientApp that raised.
CLIENT_APP_RAISED = 2


pytestmark = pytest.mark.usefixtures("task_identity")


def request(node: int, message_type: str = "train.splitfed_v2") -> Message:
    return Message(content=RecordDict(), dst_node_id=node, message_type=message_type)


def weights(value: float | np.ndarray) -> dict[str, np.ndarray]:
    """Two arrays of a client side, all entries ``value`` (or the array given)."""
    base = np.asarray(value, dtype=np.float32)
    return {"0.weight": np.broadcast_to(base, (3, 2)).copy() if base.ndim == 0 else base,
            "0.bias": np.full(2, float(base.mean()) * 10.0, dtype=np.float32)}


def trained(node: int, arrays: dict[str, np.ndarray], examples: int, *,
            to: Message | None = None, virtual_s: float = 1.0, loss: float = 1.0) -> Message:
    """A finished client's reply (every finished reply has the same metric keys)."""
    content = RecordDict({
        "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        "metrics": MetricRecord({
            "num-examples": examples, "virtual-s": virtual_s, "train-loss": loss,
            "partition-id": node - 1,
        }),
    })
    return Message(content=content, reply_to=to or request(node))


def declined(node: int, status: str, *, to: Message | None = None) -> Message:
    """A client that declined the round: a status record, no arrays."""
    content = RecordDict({
        STATUS_KEY: ConfigRecord({"status": status, "reason": f"{status}: declined in a test"}),
        "metrics": MetricRecord({"partition-id": node - 1}),
    })
    return Message(content=content, reply_to=to or request(node))


def failed(node: int, reason: str = "RuntimeError: boom", *, to: Message | None = None) -> Message:
    """An error reply (a ClientApp that raised)."""
    return Message(Error(code=CLIENT_APP_RAISED, reason=reason), reply_to=to or request(node))


def value(arrays: ArrayRecord, key: str = "0.weight") -> np.ndarray:
    return arrays[key].numpy()


def fedavg(*pairs: tuple[dict[str, np.ndarray], int]) -> dict[str, np.ndarray]:
    """Reference: the examples-weighted average of each array."""
    return {
        key: np.average(np.stack([a[key] for a, _ in pairs]), axis=0,
                        weights=[n for _, n in pairs])
        for key in pairs[0][0]
    }


def assert_arrays(arrays: ArrayRecord, expected: dict[str, np.ndarray]) -> None:
    assert set(arrays) == set(expected)
    for key, want in expected.items():
        np.testing.assert_allclose(value(arrays, key), want, rtol=1e-6)


# --- strategies ---------------------------------------------------------------------


class FakeTrunk:
    """The protocol's trunk side, recording what the strategy asks of it."""

    def __init__(self, refuse: Callable[[str, Tensor], bool] | None = None) -> None:
        self.finished: list[list[str]] = []
        self.bulk: list[tuple[str, int, torch.Tensor, torch.Tensor]] = []
        self.refuse = refuse

    def finish_round(self, finished) -> None:  # noqa: ANN001 - an iterable of node ids
        self.finished.append(list(finished))

    def train_bulk(self, client: str, cut: int, activations: Tensor, labels: Tensor, *,
                   server_round: int) -> None:
        if self.refuse is not None and self.refuse(client, activations):
            raise ValueError("refused in a test")
        self.bulk.append((client, cut, activations, labels))



def dataplane() -> DataPlaneAccess:
    return DataPlaneAccess(TokenRegistry(), "127.0.0.1:1", 60.0)


def split_strategy(cls: type[SplitFed] = SplitFed, *, protocol: str = "splitfed_v2",
                   spec: RunSpec | None = None, trunk: FakeTrunk | None = None,
                   **kwargs) -> SplitFed:
    kwargs.setdefault("min_available_nodes", 1)
    kwargs.setdefault("min_train_nodes", 1)
    return cls(protocol=protocol, spec=spec or plain_spec(0.05), dataplane=dataplane(),
               trunk=trunk or FakeTrunk(), **kwargs)


def protocol_strategy(name: str, outcomes: list[RoundOutcome], **kwargs) -> ReportingFedAvg:
    """The registered protocol's strategy, built the way the ServerApp builds it."""
    protocol = PROTOCOLS[name]
    kwargs |= {"protocol": name, "spec": RunSpec(strategy=protocol.options()),
               "on_round": outcomes.append, "min_available_nodes": 1, "min_train_nodes": 1}
    if protocol.trunk is not None:
        kwargs |= {"dataplane": dataplane(), "trunk": FakeTrunk()}
    return protocol.strategy(**kwargs)


def sent(message: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in message.content["arrays"].items()}


def start_arrays() -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in weights(0.0).items()})


# --- averaging ----------------------------------------------------------------------


def test_failed_clients_are_not_aggregated():
    outcomes: list[RoundOutcome] = []
    strategy = split_strategy(on_round=outcomes.append)
    rng = np.random.default_rng(0)
    w = [weights(rng.normal(size=(3, 2)).astype(np.float32)) for _ in range(4)]
    replies = [trained(1, w[0], 10, loss=1.0), failed(2, ""), trained(3, w[2], 30, loss=2.0),
               failed(4, "[memory] would not fit")]
    arrays, metrics = strategy.aggregate_train(4, replies)
    assert_arrays(arrays, fedavg((w[0], 10), (w[2], 30)))
    assert metrics["failed-clients"] == 2 and metrics["num-examples"] == 40
    assert metrics["clients-failed"] == 2 and metrics["clients-memory"] == 0
    assert metrics["train-loss"] == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)
    [outcome] = outcomes
    assert {row["node_id"]: row["status"] for row in outcome.rows} == {
        "1": "ok", "2": "failed", "3": "ok", "4": "failed"}


def test_a_round_with_only_failures_returns_nothing_to_replace_the_weights():
    outcomes: list[RoundOutcome] = []
    strategy = split_strategy(on_round=outcomes.append)
    replies = [failed(1), declined(2, "dropout"), failed(3, "[memory] oom")]
    assert strategy.aggregate_train(1, replies) == (None, None)
    [outcome] = outcomes  # still reported
    assert outcome.metrics["failed_clients"] == 3 and outcome.metrics["num_examples"] == 0
    assert outcome.metrics["clients_dropout"] == 1 and outcome.metrics["clients_failed"] == 2


def test_a_round_with_only_failures_keeps_the_previous_weights_through_flowers_loop():
    def answer(message: Message) -> Message:
        server_round = int(message.content[ROUND_KEY]["server_round"])
        node = message.metadata.dst_node_id
        if server_round == 2:  # everyone fails in round 2
            return failed(node, to=message)
        return trained(node, {k: v + node for k, v in sent(message).items()}, 10 * node,
                       to=message)

    grid = ScriptedGrid([1, 2, 3], answer)
    seen: dict[int, dict[str, np.ndarray]] = {}
    strategy = split_strategy(fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=start_arrays(), num_rounds=3,
                   evaluate_fn=lambda r, a: seen.update({r: {k: v.numpy() for k, v in a.items()}}))
    start = weights(0.0)
    round1 = fedavg(*((({k: v + n for k, v in start.items()}), 10 * n) for n in (1, 2, 3)))
    round3 = fedavg(*((({k: v + n for k, v in round1.items()}), 10 * n) for n in (1, 2, 3)))
    for server_round, want in [(0, start), (1, round1), (2, round1), (3, round3)]:
        for key in want:
            np.testing.assert_allclose(seen[server_round][key], want[key], rtol=1e-6)
    assert not np.allclose(round1["0.weight"], start["0.weight"])  # round 1 did train


def test_split_metrics_sum_counts_and_average_rates():
    rows = [  # num-examples, bytes-up, steps, accuracy, loss, virtual-s, epsilon
        (10, 100, 1, 0.5, 2.0, 4.0, 1.0),
        (30, 300, 3, 0.9, 1.0, 2.0, 3.0),
        (60, 50, 6, 0.6, 0.5, 7.0, 2.0),
    ]
    records = [
        RecordDict({"m": MetricRecord({
            "num-examples": n, "bytes-up": b, "steps": s, "train-accuracy": a, "train-loss": lo,
            "virtual-s": v, "epsilon": e, "partition-id": i, "cut": 1,
        })})
        for i, (n, b, s, a, lo, v, e) in enumerate(rows)
    ]
    out = aggregate_split_metrics(records, "num-examples")
    assert out["num-examples"] == 100 and out["bytes-up"] == 450 and out["steps"] == 10
    # (10 * 0.5 + 30 * 0.9 + 60 * 0.6) / 100 = (5 + 27 + 36) / 100
    assert out["train-accuracy"] == pytest.approx(0.68)
    # (10 * 2.0 + 30 * 1.0 + 60 * 0.5) / 100 = (20 + 30 + 30) / 100
    assert out["train-loss"] == pytest.approx(0.80)
    assert out["virtual-s"] == 7.0 and out["epsilon"] == 3.0  # the worst client's
    assert out["clients"] == 3
    assert "partition-id" not in out and "cut" not in out  # per-client labels


# --- statuses -----------------------------------------------------------------------


@pytest.mark.parametrize("status", DECLINES)
def test_a_decline_status_comes_from_the_status_record(status):
    reply = declined(7, status)
    assert reply_status(reply, deadline_s=None) == status
    assert reply_status(reply, deadline_s=0.0) == status
    row = client_row(reply, status)
    assert row["status"] == status and row["reason"] == f"{status}: declined in a test"
    assert row["partition_id"] == 6 and row["client"] == "6"


@pytest.mark.parametrize("reason", [
    "[memory] out of memory at cut 1",
    "[dropout] vanished",
    "Traceback (most recent call last):\nInjectedDropout: [dropout] vanished after 2 steps",
    "budget",
    "unavailable",
    "",
])
def test_an_error_reply_is_failed_whatever_its_text(reason):
    reply = failed(9, reason)
    assert reply_status(reply, deadline_s=None) == "failed"
    assert reply_status(reply, deadline_s=5.0) == "failed"
    assert client_row(reply, "failed")["status"] == "failed"


def test_every_status_is_counted_and_reported():
    outcomes: list[RoundOutcome] = []
    strategy = split_strategy(on_round=outcomes.append, round_deadline_s=5.0)
    replies = [trained(1, weights(1.0), 10), trained(2, weights(2.0), 10, virtual_s=6.0),
               *(declined(3 + i, s) for i, s in enumerate(DECLINES)),
               failed(9, "[budget] [memory] [dropout]")]
    _, metrics = strategy.aggregate_train(1, replies)
    for status in STATUSES[1:]:
        # A lost client is one asked that never replied (none was asked here).
        assert metrics[f"clients-{status}"] == (status != "lost"), status
    assert metrics["failed-clients"] == len(replies) - 1


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_a_client_that_never_replies_is_lost_and_nothing_of_it_is_aggregated(name):
    def answer(message: Message) -> Message | None:
        node = message.metadata.dst_node_id
        if node == 2 and message.metadata.message_type.startswith("train."):
            return None  # vanished: Flower's grid returns without its reply
        return trained(node, weights(float(node)), 10 * node, to=message)

    outcomes: list[RoundOutcome] = []
    strategy = protocol_strategy(name, outcomes, fraction_evaluate=0.0)
    result = strategy.start(grid=ScriptedGrid([1, 2, 3], answer),
                            initial_arrays=start_arrays(), num_rounds=1)
    [outcome] = outcomes
    rows = {int(r["node_id"]): r for r in outcome.rows}
    assert rows[2]["status"] == "lost" and "round_timeout_s" in rows[2]["reason"]
    assert rows[1]["status"] == rows[3]["status"] == "ok"
    assert outcome.metrics["clients_lost"] == 1 and outcome.metrics["failed_clients"] == 1
    assert outcome.metrics["num_examples"] == 40
    if name == "sequential":  # the last finished turn (turns go in Flower's sampling order)
        last = [int(r["node_id"]) for r in outcome.rows if r["status"] == "ok"][-1]
        assert_arrays(result.arrays, weights(float(last)))
    else:
        assert_arrays(result.arrays, fedavg((weights(1.0), 10), (weights(3.0), 30)))


def test_stragglers_past_the_round_deadline_are_left_out():
    outcomes: list[RoundOutcome] = []
    strategy = split_strategy(on_round=outcomes.append, round_deadline_s=5.0)
    w = [weights(v) for v in (1.0, 2.0, 3.0, 4.0)]
    replies = [
        trained(1, w[0], 10, virtual_s=4.0),
        trained(2, w[1], 20, virtual_s=9.0),  # past the 5 s deadline
        trained(3, w[2], 30, virtual_s=1.0),
        trained(4, w[3], 40, virtual_s=5.0),  # on the deadline: in time
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert_arrays(arrays, fedavg((w[0], 10), (w[2], 30), (w[3], 40)))
    assert metrics["clients-straggler"] == 1 and metrics["failed-clients"] == 1
    assert metrics["num-examples"] == 80
    assert metrics["virtual-s"] == 5.0  # the slowest client that counted
    statuses = {row["node_id"]: row["status"] for row in outcomes[0].rows}
    assert statuses == {"1": "ok", "2": "straggler", "3": "ok", "4": "ok"}


def test_without_a_deadline_no_client_is_a_straggler():
    strategy = split_strategy(round_deadline_s=None)
    w = [weights(v) for v in (1.0, 2.0)]
    arrays, metrics = strategy.aggregate_train(
        1, [trained(1, w[0], 10, virtual_s=1e6), trained(2, w[1], 30, virtual_s=1.0)])
    assert_arrays(arrays, fedavg((w[0], 10), (w[1], 30)))
    assert metrics["clients-straggler"] == 0


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_every_protocol_leaves_out_failed_declined_and_late_clients(name):
    outcomes: list[RoundOutcome] = []
    strategy = protocol_strategy(name, outcomes, round_deadline_s=5.0)
    w = {node: weights(float(node)) for node in range(1, 5)}
    replies = [
        trained(1, w[1], 10, virtual_s=1.0),
        trained(2, w[2], 20, virtual_s=9.0),  # straggler past 5 s
        trained(3, w[3], 30, virtual_s=2.0),
        trained(4, w[4], 40, virtual_s=3.0),
        *(declined(5 + i, s) for i, s in enumerate(DECLINES)),
        failed(20), failed(21, "[memory] text is not a status"),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    if name == "sequential":  # the last finished turn, not an average
        assert_arrays(arrays, w[4])
    else:
        assert_arrays(arrays, fedavg((w[1], 10), (w[3], 30), (w[4], 40)))
    assert metrics["num-examples"] == 80
    assert metrics["failed-clients"] == 1 + len(DECLINES) + 2  # straggler, declines, errors
    assert metrics["clients-straggler"] == 1 and metrics["clients-failed"] == 2
    assert all(metrics[f"clients-{s}"] == 1 for s in DECLINES)
    [outcome] = outcomes
    assert sorted(row["status"] for row in outcome.rows) == sorted(
        ["ok", "straggler", "ok", "ok", *DECLINES, "failed", "failed"])
    if PROTOCOLS[name].trunk is not None:  # the trunk settles only the finished clients
        assert [sorted(f) for f in strategy.trunk.finished] == [["1", "3", "4"]]


def test_on_round_receives_one_outcome_per_round_with_a_row_per_sampled_client():
    def answer(message: Message) -> Message:
        node = message.metadata.dst_node_id
        if node == 2:
            return failed(node, to=message)
        if node == 4:
            return declined(node, "unavailable", to=message)
        return trained(node, sent(message), 10, to=message, virtual_s=float(node))

    outcomes: list[RoundOutcome] = []
    grid = ScriptedGrid([1, 2, 3, 4], answer)
    strategy = split_strategy(on_round=outcomes.append, fraction_train=0.5, min_train_nodes=2,
                              fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=start_arrays(), num_rounds=2)
    assert [o.server_round for o in outcomes] == [1, 2]
    for outcome, messages in zip(outcomes, grid.train_calls(), strict=True):
        sampled = sorted(str(m.metadata.dst_node_id) for m in messages)
        assert len(sampled) == 2
        assert sorted(row["node_id"] for row in outcome.rows) == sampled
        for row in outcome.rows:
            node = int(row["node_id"])
            assert row["status"] == {2: "failed", 4: "unavailable"}.get(node, "ok")
            if row["status"] == "ok":
                assert row["virtual_s"] == float(node) and row["partition_id"] == node - 1
        finished = [int(r["node_id"]) for r in outcome.rows if r["status"] == "ok"]
        assert outcome.metrics["num_examples"] == 10 * len(finished)
        assert outcome.metrics["failed_clients"] == 2 - len(finished)
        assert outcome.parallel


# --- SplitFed sessions --------------------------------------------------------------


def test_splitfed_grants_a_session_per_client_and_revokes_the_round():
    spec = RunSpec(strategy=SplitFedV2Options(lr=0.1), model=ModelConfig(cut=2))
    trunk = FakeTrunk()
    strategy = split_strategy(spec=spec, trunk=trunk)
    tokens = strategy.dataplane.tokens
    grid = ScriptedGrid([1, 2, 3], lambda m: m)
    messages = list(strategy.configure_train(3, start_arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3]
    issued = []
    for message in messages:
        assert message.metadata.message_type == "train.splitfed_v2"
        data = message.content[ROUND_KEY]
        assert data["trunk_address"] == "127.0.0.1:1"
        assert data["server_round"] == 3 and data["cut"] == 2
        grant = tokens.lookup(str(data["token"]))
        assert grant is not None
        assert (grant.client, grant.protocol, grant.cut, grant.server_round) == (
            str(message.metadata.dst_node_id), "splitfed_v2", 2, 3)
        # The client decodes the run spec the message carries with the protocol's schema.
        text = str(message.content["config"][SPEC_KEY])
        assert decode_spec(text, strategy=SplitFedV2Options) == spec
        issued.append(str(data["token"]))
    assert len(set(issued)) == 3
    later = tokens.issue(client="1", protocol="splitfed_v2", cut=2, server_round=4, ttl_s=60)

    first, second, third = messages
    replies = [trained(first.metadata.dst_node_id, weights(1.0), 10, to=first),
               failed(second.metadata.dst_node_id, to=second),
               trained(third.metadata.dst_node_id, weights(3.0), 10, to=third)]
    strategy.aggregate_train(3, replies)
    assert all(tokens.lookup(t) is None for t in issued)
    assert tokens.lookup(later) is not None  # the next round's sessions stay open
    finished = sorted(str(m.metadata.dst_node_id) for m in (first, third))
    assert [sorted(f) for f in trunk.finished] == [finished]


def test_splitfed_revokes_the_evaluation_sessions():
    strategy = split_strategy(fraction_evaluate=1.0, min_evaluate_nodes=1)
    messages = list(strategy.configure_evaluate(
        2, start_arrays(), ConfigRecord(), ScriptedGrid([1, 2], lambda m: m)))
    assert [m.metadata.message_type for m in messages] == ["evaluate.splitfed_v2"] * 2
    tokens = [str(m.content[ROUND_KEY]["token"]) for m in messages]
    assert all(strategy.dataplane.tokens.lookup(t) is not None for t in tokens)
    strategy.aggregate_evaluate(2, [])
    assert all(strategy.dataplane.tokens.lookup(t) is None for t in tokens)


def test_tokens_are_unique_checked_and_revoked_by_round():
    tokens = TokenRegistry()
    a = tokens.issue(client="1", protocol="splitfed_v2", cut=1, server_round=1, ttl_s=60)
    b = tokens.issue(client="2", protocol="ushaped", cut=2, server_round=2, ttl_s=60)
    assert a != b
    assert tokens.lookup(a).client == "1" and tokens.lookup(b).cut == 2
    assert tokens.lookup(b).protocol == "ushaped"
    assert tokens.lookup("forged") is None and tokens.lookup(None) is None
    revoked: list[list[str]] = []
    tokens.on_revoke(revoked.append)
    tokens.revoke_round(1)
    assert tokens.lookup(a) is None and tokens.lookup(b) is not None
    assert revoked == [[a]]


def test_tokens_expire():
    tokens = TokenRegistry()
    t = tokens.issue(client="1", protocol="splitfed_v2", cut=1, server_round=1, ttl_s=-1)
    assert tokens.lookup(t) is None


# --- sequential ---------------------------------------------------------------------


def sequential_grid(nodes: list[int], *, fails: set[int] = frozenset(),
                    late: set[int] = frozenset(), poisons: set[int] = frozenset()
                    ) -> ScriptedGrid:
    """Each node adds its id to every array; ``fails`` error out, ``late`` are stragglers,
    ``poisons`` send NaN weights back."""

    def answer(message: Message) -> Message:
        node = message.metadata.dst_node_id
        if not message.metadata.message_type.startswith("train."):
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}),
                           reply_to=message)
        if node in fails:
            return failed(node, to=message)
        if node in poisons:
            return trained(node, {k: v * np.nan for k, v in sent(message).items()}, 10,
                           to=message)
        return trained(node, {k: v + node for k, v in sent(message).items()}, 10, to=message,
                       virtual_s=9.0 if node in late else 1.0)

    return ScriptedGrid(nodes, answer)


def sequential(**kwargs) -> SequentialSplit:
    return split_strategy(SequentialSplit, protocol="sequential",
                          spec=RunSpec(strategy=SequentialOptions()), **kwargs)


def test_turn_by_turn_grid_sends_one_message_at_a_time_from_the_last_finished_weights():
    grid = sequential_grid([1, 2, 3, 4, 5], fails={2}, late={4})
    strategy = sequential(round_deadline_s=5.0)
    turns = strategy.wrap_grid(grid)
    assert isinstance(turns, TurnByTurnGrid)
    messages = list(strategy.configure_train(1, start_arrays(), ConfigRecord(), turns))
    replies = list(turns.send_and_receive(messages))
    assert [len(call) for call in grid.calls] == [1] * 5  # one turn at a time
    order = [call[0].metadata.dst_node_id for call in grid.calls]
    assert sorted(order) == [1, 2, 3, 4, 5]
    # Reference: each turn starts from what the last *finished* client ended with.
    expected = 0.0
    for call, node in zip(grid.calls, order, strict=True):
        np.testing.assert_allclose(sent(call[0])["0.weight"], np.full((3, 2), expected))
        if node not in {2, 4}:  # failed and late turns pass nothing on
            expected += node
    # Apart from the weights, each turn's message is the one the strategy configured.
    for original, delivered in zip(messages, (c[0] for c in grid.calls), strict=True):
        assert delivered.metadata.dst_node_id == original.metadata.dst_node_id
        assert delivered.metadata.message_type == "train.sequential"
        assert dict(delivered.content[ROUND_KEY]) == dict(original.content[ROUND_KEY])
    calls = len(grid.calls)
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert len(grid.calls) == calls  # aggregation does no I/O
    np.testing.assert_allclose(value(arrays), np.full((3, 2), expected))  # 1 + 3 + 5
    assert expected == 9.0
    assert metrics["num-examples"] == 30 and metrics["failed-clients"] == 2


def test_a_turn_that_sends_back_bad_weights_is_not_handed_to_the_next_client():
    grid = sequential_grid([1, 2, 3], poisons={2})
    strategy = sequential()
    turns = strategy.wrap_grid(grid)
    messages = list(strategy.configure_train(1, start_arrays(), ConfigRecord(), turns))
    replies = list(turns.send_and_receive(messages))
    for call in grid.calls:  # whoever came after client 2 started from finite weights
        assert np.isfinite(sent(call[0])["0.weight"]).all(), call[0].metadata.dst_node_id
    arrays, metrics = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(value(arrays), np.full((3, 2), 4.0))  # 1 + 3: 2's is dropped
    assert metrics["clients-refused"] == 1


def test_turn_by_turn_grid_passes_evaluation_through_untouched():
    grid = sequential_grid([1, 2, 3])
    strategy = sequential(fraction_evaluate=1.0, min_evaluate_nodes=1)
    turns = strategy.wrap_grid(grid)
    messages = list(strategy.configure_evaluate(1, start_arrays(), ConfigRecord(), turns))
    assert len(messages) == 3
    replies = list(turns.send_and_receive(messages))
    assert len(grid.calls) == 1 and all(a is b for a, b in zip(grid.calls[0], messages,
                                                                strict=True))
    assert len(replies) == 3


def test_sequential_round_result_is_the_last_finished_clients_weights():
    outcomes: list[RoundOutcome] = []
    strategy = sequential(on_round=outcomes.append, round_deadline_s=5.0)
    replies = [trained(1, weights(1.0), 10), trained(2, weights(2.0), 50),
               trained(3, weights(3.0), 10, virtual_s=6.0), failed(4)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert_arrays(arrays, weights(2.0))  # not an average, not the straggler's
    assert metrics["num-examples"] == 60
    assert not outcomes[0].parallel  # their times add up
    assert strategy.aggregate_train(2, [failed(1), declined(2, "memory")]) == (None, None)


def test_sequential_rounds_through_flowers_loop_chain_every_turn():
    grid = sequential_grid([1, 2, 3])
    seen: dict[int, float] = {}
    strategy = sequential(fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=start_arrays(), num_rounds=2,
                   evaluate_fn=lambda r, a: seen.update({r: float(value(a)[0, 0])}))
    assert seen == {0: 0.0, 1: 6.0, 2: 12.0}


# --- local loss, bulk ---------------------------------------------------------------


def smashed(node: int, batches: int) -> ArrayRecord:
    """``batches`` batches of 2 + b rows; batch b of node n is all ``100 n + b``."""
    sizes = [2 + b for b in range(batches)]
    acts = torch.cat([torch.full((n, 4), 100.0 * node + b) for b, n in enumerate(sizes)])
    labels = torch.cat([torch.full((n,), b, dtype=torch.int64) for b, n in enumerate(sizes)])
    return state_to_record({"activations": acts, "labels": labels,
                            "batch-sizes": torch.tensor(sizes, dtype=torch.int64)})


def bulk_replies(order: list[int]) -> list[Message]:
    """Nodes 1, 2, 4 finish; 3 is a straggler, 5 fails, 6 declines (each with smashed data
    where it could have any); 7 finishes having kept no batch (no smashed record)."""
    made = {7: trained(7, weights(7.0), 70)}
    for node in (1, 2, 3, 4):
        reply = trained(node, weights(float(node)), 10 * node, virtual_s=9.0 if node == 3 else 1.0)
        reply.content[SMASHED_RECORD_KEY] = smashed(node, batches=node)
        made[node] = reply
    made[5] = failed(5, "[memory] not a status")
    made[6] = declined(6, "refused")
    return [made[n] for n in order]


def bulk_strategy(seed: int = 0, *, trunk: FakeTrunk | None = None) -> LocalLossSplit:
    spec = RunSpec(seed=seed, strategy=LocalLossOptions(bulk=True), model=ModelConfig(cut=1))
    return split_strategy(LocalLossSplit, protocol="local_loss", spec=spec, trunk=trunk,
                          round_deadline_s=5.0)


def trained_batches(strategy: LocalLossSplit) -> tuple[list[str], list[float]]:
    bulk = strategy.trunk.bulk
    assert all(cut == 1 for _, cut, _, _ in bulk)
    return [client for client, *_ in bulk], [float(acts.sum()) for _, _, acts, _ in bulk]


def test_bulk_smashed_data_is_taken_out_before_fedavg_and_only_finished_clients_train():
    strategy = bulk_strategy()
    arrays, metrics = strategy.aggregate_train(1, bulk_replies([1, 2, 3, 4, 5, 6, 7]))
    assert_arrays(arrays, fedavg(*((weights(float(n)), 10 * n) for n in (1, 2, 4, 7))))
    assert metrics["num-examples"] == 140
    clients, sums = trained_batches(strategy)
    # Every batch of the finished clients 1, 2, 4, once; none of the straggler's.
    expected = sorted((str(n), 4.0 * (2 + b) * (100 * n + b)) for n in (1, 2, 4)
                      for b in range(n))
    assert sorted(zip(clients, sums, strict=True)) == expected
    for client, _, acts, labels in strategy.trunk.bulk:  # batches kept whole, labels paired
        batch = int(acts[0, 0].item()) - 100 * int(client)
        assert len(acts) == len(labels) == 2 + batch and labels.tolist() == [batch] * len(acts)
    assert strategy.bulk_batches[1] == {"trained": 7, "refused": 0}
    assert [sorted(f) for f in strategy.trunk.finished] == [["1", "2", "4", "7"]]


def test_bulk_order_depends_on_seed_and_round_not_on_reply_order():
    def run(seed: int, server_round: int, order: list[int]) -> tuple[list[str], list[float]]:
        strategy = bulk_strategy(seed)
        strategy.aggregate_train(server_round, bulk_replies(order))
        return trained_batches(strategy)

    clients, sums = run(0, 1, [1, 2, 3, 4, 5, 6, 7])
    again_clients, again_sums = run(0, 1, [6, 4, 7, 5, 2, 3, 1])
    assert again_clients == clients and again_sums == pytest.approx(sums)
    for other in (run(0, 2, [1, 2, 3, 4, 5, 6]), run(1, 1, [1, 2, 3, 4, 5, 6])):
        assert sorted(other[1]) == pytest.approx(sorted(sums))  # the same batches ...
        assert other[1] != pytest.approx(sums)  # ... in another order


def test_bulk_refused_batches_are_counted_and_the_rest_still_train():
    trunk = FakeTrunk(refuse=lambda client, acts: client == "2")
    strategy = bulk_strategy(trunk=trunk)
    strategy.aggregate_train(1, bulk_replies([1, 2, 4]))
    assert strategy.bulk_batches[1] == {"trained": 5, "refused": 2}
    assert sorted(set(trained_batches(strategy)[0])) == ["1", "4"]


def test_streaming_local_loss_trains_nothing_from_replies():
    trunk = FakeTrunk()
    spec = RunSpec(strategy=LocalLossOptions(bulk=False))
    strategy = split_strategy(LocalLossSplit, protocol="local_loss", spec=spec, trunk=trunk)
    replies = [trained(1, weights(1.0), 10), trained(2, weights(3.0), 30)]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert_arrays(arrays, fedavg((weights(1.0), 10), (weights(3.0), 30)))
    assert trunk.bulk == [] and [sorted(f) for f in trunk.finished] == [["1", "2"]]


def test_the_superlinks_error_for_a_vanished_node_makes_that_node_lost():
    def answer(message: Message) -> Message:
        node = message.metadata.dst_node_id
        if node != 2:
            return trained(node, weights(float(node)), 10, to=message)
        # What the SuperLink sends for a node that stopped its heartbeats: an error reply
        # from the SuperLink's own id (1 here is a node of ours too: 9 stands for it).
        error = Message(Error(code=0, reason="Error: Node Unavailable"), reply_to=message)
        error.metadata.__dict__["_src_node_id"] = 9
        error.metadata.__dict__["_reply_to_message_id"] = message.metadata.message_id
        return error

    outcomes: list[RoundOutcome] = []
    strategy = split_strategy(on_round=outcomes.append, fraction_evaluate=0.0)
    strategy.start(grid=ScriptedGrid([1, 2, 3], answer), initial_arrays=start_arrays(),
                   num_rounds=1)
    rows = {int(r["node_id"]): r for r in outcomes[0].rows}
    assert sorted(rows) == [1, 2, 3]  # no row for the SuperLink's id
    assert rows[2]["status"] == "lost" and "Node Unavailable" in rows[2]["reason"]
    assert outcomes[0].metrics["clients_lost"] == 1
