"""The node-indexed LinkState answers exactly as Flower's own, without scanning idle nodes,
and the engine's loop picks a stored message up without waiting out its tick."""

from __future__ import annotations

import threading
import time
from queue import Queue

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
from flwr.proto.task_pb2 import Task
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory, linkstate_factory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState, RunRecord
from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.node_index import (
    MIN_SWEEP_GAP_S,
    NodeIndexedLinkState,
    WakeOnStore,
    node_indexed_link_state,
)

ORIGINAL_LOOP = vce_api.add_messages_to_queue

NODES = 3


class Federation:
    """A LinkState set up as Flower's Simulation Engine sets it up, with its grid."""

    def __init__(self, num_nodes: int) -> None:
        factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                                   ObjectStoreFactory())
        self.node_ids = list(_register_nodes(num_nodes, factory))  # what the engine calls
        self.state = factory.state()
        run = Run.create_empty(run_id=generate_rand_int_from_bytes(RUN_ID_NUM_BYTES))
        run.primary_task_id = generate_rand_int_from_bytes(TASK_ID_NUM_BYTES)
        run.federation_id = NOOP_FEDERATION_ID
        self.state.run_ids[run.run_id] = RunRecord(run=run)
        self.state.task_store[run.primary_task_id] = Task(task_id=run.primary_task_id,
                                                          run_id=run.run_id)
        self.run = run
        self.grid = InMemoryGrid(state_factory=factory)
        self.grid.set_run(run)

    def push(self, node: int, tag: int, *, ttl: float | None = None) -> None:
        """Send node number ``node`` a message tagged ``tag``."""
        # Messages take their run from the task identity, as in the ServerApp.
        TaskIdentity.task_id, TaskIdentity.run_id = self.run.primary_task_id, self.run.run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        content = RecordDict({"tag": ConfigRecord({"tag": tag})})
        message = Message(content, dst_node_id=self.node_ids[node], message_type="train",
                          ttl=ttl)
        assert len(list(self.grid.push_messages([message]))) == 1

    def poll(self, node: int, limit: int | None) -> list[tuple[int, int]]:
        """What the engine's loop gets for node number ``node``: (node, tag) pairs."""
        messages = self.state.get_message_ins(node_id=self.node_ids[node], limit=limit)
        return [(self.node_ids.index(m.metadata.dst_node_id),
                 int(m.content["tag"]["tag"])) for m in messages]


def indexed_federation(num_nodes: int) -> Federation:
    with node_indexed_link_state():
        return Federation(num_nodes)


# Each federation sets the task identity; the fixture puts it back afterwards.
pytestmark = pytest.mark.usefixtures("task_identity")


def test_the_factory_builds_the_index_inside_the_block_only() -> None:
    assert isinstance(indexed_federation(2).state, NodeIndexedLinkState)
    assert linkstate_factory.InMemoryLinkState is InMemoryLinkState
    assert type(Federation(2).state) is InMemoryLinkState


def test_the_class_is_restored_when_the_run_fails() -> None:
    with pytest.raises(RuntimeError, match="engine died"), node_indexed_link_state():
        raise RuntimeError("engine died")
    assert linkstate_factory.InMemoryLinkState is InMemoryLinkState


operation = st.one_of(
    st.tuples(st.just("push"), st.integers(0, NODES - 1)),
    st.tuples(st.just("poll"), st.integers(0, NODES - 1), st.sampled_from([1, 2, None])),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(operation, max_size=30))
def test_every_poll_answers_as_flowers_own_state(operations: list[tuple]) -> None:
    """Random pushes and polls (dataplane 1, 2, all): the same messages, in the same order."""
    reference, indexed = Federation(NODES), indexed_federation(NODES)
    for tag, op in enumerate(operations):
        for federation in (reference, indexed):
            if op[0] == "push":
                federation.push(op[1], tag)
        if op[0] == "poll":
            assert indexed.poll(op[1], op[2]) == reference.poll(op[1], op[2])
    # Nothing is left behind: a final sweep delivers the same rest.
    for node in range(NODES):
        assert indexed.poll(node, None) == reference.poll(node, None)


def test_a_node_with_several_pending_stays_pending_until_drained() -> None:
    federation = indexed_federation(3)
    for tag in range(3):
        federation.push(1, tag)
    assert [federation.poll(1, 1) for _ in range(4)] == [[(1, 0)], [(1, 1)], [(1, 2)], []]
    assert federation.state.nodes_with_pending == set()
    federation.push(1, 3)  # a later round's message for the same node
    assert federation.poll(1, 1) == [(1, 3)]


def test_an_expired_message_is_dropped_as_flower_drops_it() -> None:
    reference, indexed = Federation(2), indexed_federation(2)
    for federation in (reference, indexed):
        federation.push(0, 0, ttl=0.05)
        federation.push(1, 1)
    time.sleep(0.1)
    for node in (0, 1):
        assert indexed.poll(node, None) == reference.poll(node, None)
    assert indexed.state.num_message_ins() == reference.state.num_message_ins() == 1


def test_a_sweep_over_many_idle_nodes_does_not_scan_the_store(monkeypatch) -> None:
    """10 pending of 2,000 registered: Flower's sweep scans 2,000 x 10, the index 10."""
    indexed = indexed_federation(2000)
    for node in range(10):
        indexed.push(node, node)
    scans = 0
    original = InMemoryLinkState.get_message_ins

    def counting(self: InMemoryLinkState, *args: object, **kwargs: object) -> list[Message]:
        nonlocal scans
        scans += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InMemoryLinkState, "get_message_ins", counting)
    delivered = [m for node in range(2000) for m in indexed.poll(node, 1)]
    assert sorted(delivered) == [(n, n) for n in range(10)]
    assert scans == 10


def test_a_stored_message_ends_the_loops_wait_early() -> None:
    federation = indexed_federation(2)
    waker = WakeOnStore(threading.Event(), federation.state)
    threading.Timer(0.05, federation.push, args=(1, 0)).start()
    started = time.perf_counter()
    assert waker.wait(5.0) is False  # not stopping
    assert time.perf_counter() - started < 2.0  # a plain wait takes the whole 5 s
    assert not federation.state.stored.is_set()  # cleared for the next wait


def test_sweeps_keep_the_least_gap_and_a_stop_still_ends_the_wait() -> None:
    federation = indexed_federation(2)
    stop = threading.Event()
    waker = WakeOnStore(stop, federation.state)
    federation.push(0, 0)  # already stored: the wait still keeps the gap
    started = time.perf_counter()
    waker.wait(1.0)
    assert time.perf_counter() - started >= MIN_SWEEP_GAP_S * 0.9
    stop.set()
    started = time.perf_counter()
    assert waker.wait(5.0) is True and waker.is_set()
    assert time.perf_counter() - started < 1.0


class SlowTicks(threading.Event):
    """A stop event whose waits last 100 times what they ask: Flower's 0.1 s tick is 10 s."""

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(None if timeout is None else 100 * timeout)


def test_the_engines_own_loop_hands_over_a_message_well_within_its_tick() -> None:
    """Flower's loop sweeps every 0.1 s: a message stored 10 ms after a sweep waited ~90 ms.

    The loop's tick is stretched to 10 s here (and the least gap between sweeps to 0.5 s),
    so that a hand-over at the tick and a prompt one differ by far more than any load on
    the machine can blur: no speed is asserted.
    """
    with node_indexed_link_state():
        federation = Federation(3)
        mapping = {node_id: i for i, node_id in enumerate(federation.node_ids)}
        queue: Queue[Message] = Queue()
        stop = SlowTicks()
        loop = threading.Thread(target=vce_api.add_messages_to_queue,
                                args=(federation.state, queue, mapping, stop))
        loop.start()
    latencies = []
    try:
        for tag in range(5):
            time.sleep(0.01)  # the loop has just swept (it delivered the last message)
            pushed = time.perf_counter()
            federation.push(tag % 3, tag)
            assert int(queue.get(timeout=30).content["tag"]["tag"]) == tag
            latencies.append(time.perf_counter() - pushed)
    finally:
        stop.set()
        loop.join(30)
    assert max(latencies) < 5.0, latencies  # at the tick: 10 s
    assert vce_api.add_messages_to_queue is ORIGINAL_LOOP  # restored after the block
