"""The Flower ClientApp: one training handler per protocol, and evaluation.

The ClientApp holds no model between messages: each ``train.split`` message
carries the client-side weights and a :class:`~splitlearn.task.SplitTask`
(cut, training settings, trunk address, session token); the client builds its
bottom layers, opens one data-plane session to the trunk, trains, and replies
with the updated client-side weights and its metrics. The training itself is in
:mod:`clients.train`, which does not import Flower.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from clients.device import (
    ClientUnavailable,
    DeviceFailure,
    DevicePlan,
    EmulatedSession,
    InjectedDropout,
    MemoryBudgetExceeded,
    check_memory,
    plan_round,
    virtual_time,
)
from clients.local_loss import run_local_loss_round
from clients.train import (
    TrainReport,
    build_bottom,
    evaluate_bottom,
    load_local_data,
    run_split_round,
)
from clients.ushaped import (
    EXCHANGES_PER_BATCH,
    EmulatedUShapedSession,
    build_head_tail,
    check_ushaped_memory,
    evaluate_ushaped,
    run_ushaped_round,
)
from clients.whole import run_whole_round
from splitlearn.planning.devices import DeviceProfile
from splitlearn.privacy import PrivacyAccountant, PrivacyBudgetExhausted
from splitlearn.privacy.budget import EPSILON_METRIC
from splitlearn.smashed_stream import SMASHED_RECORD_KEY, GrpcSmashedStream, SmashedBuffer
from splitlearn.task import STATUS_KEY, SplitTask
from splitlearn.transport import GrpcTrunkSession
from splitlearn.wire import record_to_state, state_to_record

app = ClientApp()

#: ``context.state`` key of this node's privacy accountant history.
ACCOUNTANT_STATE_KEY = "privacy-accountant"


def _partition(context: Context) -> dict[str, int]:
    # The SuperNode's node config says which share of the data this node holds.
    return {
        "partition_id": int(context.node_config["partition-id"]),
        "num_partitions": int(context.node_config["num-partitions"]),
    }


def _dropout_hook(fail_after_steps: int, session: GrpcTrunkSession):  # noqa: ANN202
    def on_step(step: int) -> None:
        if 0 <= fail_after_steps <= step:
            session.abort()  # the device vanishes: no clean stream close
            raise InjectedDropout(f"vanished after {step} steps")

    return on_step


def _load_accountant(context: Context) -> PrivacyAccountant:
    # context.state persists per node across rounds, so epsilon keeps adding up.
    record = context.state.config_records.get(ACCOUNTANT_STATE_KEY)
    return PrivacyAccountant() if record is None else PrivacyAccountant.from_lists(record)


def _save_accountant(context: Context, accountant: PrivacyAccountant) -> None:
    context.state[ACCOUNTANT_STATE_KEY] = ConfigRecord(accountant.to_lists())


def _open_session(task: SplitTask) -> GrpcTrunkSession:
    return GrpcTrunkSession(task.trunk_address, task.token, max_frame_bytes=task.max_frame_bytes)


@dataclass(frozen=True)
class _Round:
    """What every training handler knows once the device agreed to train."""

    task: SplitTask
    partition: dict[str, int]
    plan: DevicePlan
    memory: int

    @property
    def partition_id(self) -> int:
        return self.partition["partition_id"]


MemoryCheck = Callable[[SplitTask, DeviceProfile | None], int]


def _begin(msg: Message, context: Context, memory_of: MemoryCheck) -> _Round | Message:
    """Read the task and draw the device's round; a declining device's reply instead."""
    task = SplitTask.from_config(msg.content["config"])
    partition = _partition(context)
    plan = plan_round(task, **partition)
    try:
        if not plan.available:
            raise ClientUnavailable(f"device not reachable in round {task.server_round}")
        memory = memory_of(task, plan.profile)
    except (ClientUnavailable, MemoryBudgetExceeded) as declined:
        return _decline(msg, declined, partition["partition_id"])
    return _Round(task, partition, plan, memory)


def _reply(
    msg: Message, rnd: _Round, state: dict, report: TrainReport, *, exchanges: int
) -> Message:
    """Build the reply every protocol sends: client-side weights and the standard metrics."""
    task = rnd.task
    vtime = virtual_time(
        compute_s=report.compute_s, bytes_up=report.bytes_up, bytes_down=report.bytes_down,
        exchanges=exchanges, profile=rnd.plan.profile, host_flops_per_s=task.host_flops_per_s,
    )
    metrics = MetricRecord({
        "partition-id": rnd.partition_id,
        "virtual-s": vtime.total_s,
        "virtual-compute-s": vtime.compute_s,
        "virtual-upload-s": vtime.upload_s,
        "virtual-download-s": vtime.download_s,
        "virtual-latency-s": vtime.latency_s,
        "memory-bytes": rnd.memory,
        "num-examples": report.examples,
        "steps": report.steps,
        "train-loss": report.loss,
        "train-accuracy": report.accuracy,
        "compute-s": report.compute_s,
        "train-s": report.wall_s,
        "bytes-up": report.bytes_up,
        "bytes-down": report.bytes_down,
        "cut": task.cut,
    })
    content = RecordDict({"arrays": state_to_record(state), "metrics": metrics})
    return Message(content=content, reply_to=msg)


def _decline(msg: Message, reason: DeviceFailure, partition_id: int) -> Message:
    # A device that cannot take part says so instead of failing: no traceback,
    # and the server still learns which partition (and so which profile) it was.
    content = RecordDict({
        STATUS_KEY: ConfigRecord({"status": reason.kind, "reason": str(reason)}),
        "metrics": MetricRecord({"partition-id": partition_id}),
    })
    return Message(content=content, reply_to=msg)


@app.train("split")
def train_split(msg: Message, context: Context) -> Message:
    """Train the client-side layers for one round against the shared trunk."""
    rnd = _begin(msg, context, check_memory)
    if isinstance(rnd, Message):
        return rnd
    task, plan = rnd.task, rnd.plan
    session = _open_session(task)
    paced = session
    if task.emulate and plan.profile is not None:
        paced = EmulatedSession(session, plan.profile, host_flops_per_s=task.host_flops_per_s)
    accountant = _load_accountant(context)
    try:
        state, report = run_split_round(
            task,
            record_to_state(msg.content["arrays"]),
            paced,
            on_step=_dropout_hook(plan.fail_after_steps, session),
            accountant=accountant,
            **rnd.partition,
        )
    except PrivacyBudgetExhausted as spent:
        declined = _decline(msg, spent, rnd.partition_id)  # type: ignore[arg-type]
        declined.content["metrics"][EPSILON_METRIC] = spent.epsilon_spent
        return declined
    except InjectedDropout as gone:
        # Its stream is already cut. Replying (rather than raising) keeps the
        # context.state update, so the frames it sent stay charged to its budget.
        return _decline(msg, gone, rnd.partition_id)
    finally:
        paced.close()
        _save_accountant(context, accountant)
    reply = _reply(msg, rnd, state, report, exchanges=report.steps)
    if task.privacy != "none":
        reply.content["metrics"][EPSILON_METRIC] = accountant.epsilon(task.privacy_delta)
    return reply


@app.train("whole")
def train_whole(msg: Message, context: Context) -> Message:
    """FedAvg baseline: train the whole model on the device, no trunk."""
    rnd = _begin(msg, context, partial(check_memory, whole=True))
    if isinstance(rnd, Message):
        return rnd
    arrays = record_to_state(msg.content["arrays"])
    state, report = run_whole_round(rnd.task, arrays, **rnd.partition)
    if rnd.plan.fail_after_steps >= 0:
        raise InjectedDropout("vanished before uploading its weights")
    # One download and one upload of the weights: one round trip.
    return _reply(msg, rnd, state, report, exchanges=1)


@app.train("local_loss")
def train_local_loss(msg: Message, context: Context) -> Message:
    """Local-loss round: train against the aux head; stream (or ship) the smashed data."""
    rnd = _begin(msg, context, check_memory)
    if isinstance(rnd, Message):
        return rnd
    task, plan = rnd.task, rnd.plan
    sink: SmashedBuffer | GrpcSmashedStream = SmashedBuffer() if task.bulk else GrpcSmashedStream(
        task.trunk_address, task.token, max_frame_bytes=task.max_frame_bytes
    )
    try:
        state, report = run_local_loss_round(
            task, record_to_state(msg.content["arrays"]), sink,
            on_step=_dropout_hook(plan.fail_after_steps, sink), **rnd.partition,
        )
    finally:
        sink.close()
    # Streaming is one way: frames follow each other without waiting, so the link's
    # latency is paid once per round (the last ack), not per batch. Bulk data rides
    # the Flower reply: no data-plane exchange at all (its bytes still count as up).
    reply = _reply(msg, rnd, state, report, exchanges=0 if task.bulk else 1)
    if task.emulate and plan.profile is not None:
        virtual_s = float(reply.content["metrics"]["virtual-s"])
        time.sleep(max(virtual_s - report.wall_s, 0.0))  # no per-batch pacing: no waits
    if isinstance(sink, SmashedBuffer):
        reply.content[SMASHED_RECORD_KEY] = state_to_record(sink.to_arrays())
    return reply


@app.train("ushaped")
def train_ushaped_split(msg: Message, context: Context) -> Message:
    """U-shaped round: head, tail and loss on the device; labels never leave it."""
    rnd = _begin(msg, context, check_ushaped_memory)
    if isinstance(rnd, Message):
        return rnd
    task, plan = rnd.task, rnd.plan
    session = _open_session(task)
    paced: GrpcTrunkSession | EmulatedUShapedSession = session
    if task.emulate and plan.profile is not None:
        paced = EmulatedUShapedSession(
            session, plan.profile, host_flops_per_s=task.host_flops_per_s
        )
    try:
        state, report = run_ushaped_round(
            task, record_to_state(msg.content["arrays"]), paced,
            on_step=_dropout_hook(plan.fail_after_steps, session), **rnd.partition,
        )
    finally:
        paced.close()
    return _reply(msg, rnd, state, report, exchanges=EXCHANGES_PER_BATCH * report.steps)


@app.evaluate("ushaped")
def evaluate_ushaped_split(msg: Message, context: Context) -> Message:
    """Evaluate head + trunk + tail on local data; the loss is computed on the device."""
    task = SplitTask.from_config(msg.content["config"])
    torch.set_num_threads(task.torch_threads)
    head, tail = build_head_tail(task, record_to_state(msg.content["arrays"]))
    data = load_local_data(task, **_partition(context))
    session = _open_session(task)
    try:
        loss, accuracy, examples = evaluate_ushaped(
            head, tail, DataLoader(data, batch_size=task.batch_size), session
        )
    finally:
        session.close()
    metrics = MetricRecord({"num-examples": examples, "eval-loss": loss, "eval-accuracy": accuracy})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate bottom + trunk on this client's local data (no update)."""
    task = SplitTask.from_config(msg.content["config"])
    torch.set_num_threads(task.torch_threads)
    bottom = build_bottom(task, record_to_state(msg.content["arrays"]))
    data = load_local_data(task, **_partition(context))
    session = _open_session(task)
    try:
        loss, accuracy, examples = evaluate_bottom(
            bottom, DataLoader(data, batch_size=task.batch_size), session
        )
    finally:
        session.close()
    metrics = MetricRecord({"num-examples": examples, "eval-loss": loss, "eval-accuracy": accuracy})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
