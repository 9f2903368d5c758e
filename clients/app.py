"""The Flower ClientApp: ``train.split`` and ``evaluate`` handlers.

The ClientApp holds no model between messages: each ``train.split`` message
carries the client-side weights and a :class:`~splitlearn.task.SplitTask`
(cut, training settings, trunk address, session token); the client builds its
bottom layers, opens one data-plane session to the trunk, trains, and replies
with the updated client-side weights and its metrics. The training itself is in
:mod:`clients.train`, which does not import Flower.
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from clients.train import (
    TrainReport,
    build_bottom,
    evaluate_bottom,
    load_local_data,
    run_split_round,
)
from splitlearn.task import SplitTask
from splitlearn.transport import GrpcTrunkSession
from splitlearn.wire import record_to_state, state_to_record

app = ClientApp()


class InjectedDropout(RuntimeError):
    """Raised to make a client vanish mid-round (failure injection)."""


def _partition(context: Context) -> dict[str, int]:
    # The SuperNode's node config says which share of the data this node holds.
    return {
        "partition_id": int(context.node_config["partition-id"]),
        "num_partitions": int(context.node_config["num-partitions"]),
    }


def _dropout_hook(task: SplitTask, session: GrpcTrunkSession):  # noqa: ANN202
    def on_step(step: int) -> None:
        if 0 <= task.fail_after_steps <= step:
            session.abort()  # the device vanishes: no clean stream close
            raise InjectedDropout(f"injected dropout after {step} steps")

    return on_step


def _report_metrics(report: TrainReport, task: SplitTask, partition_id: int) -> MetricRecord:
    return MetricRecord(
        {
            "partition-id": partition_id,
            "num-examples": report.examples,
            "steps": report.steps,
            "train-loss": report.loss,
            "train-accuracy": report.accuracy,
            "compute-s": report.compute_s,
            "train-s": report.wall_s,
            "bytes-up": report.bytes_up,
            "bytes-down": report.bytes_down,
            "cut": task.cut,
        }
    )


def _open_session(task: SplitTask) -> GrpcTrunkSession:
    return GrpcTrunkSession(task.trunk_address, task.token, max_frame_bytes=task.max_frame_bytes)


@app.train("split")
def train_split(msg: Message, context: Context) -> Message:
    """Train the client-side layers for one round against the shared trunk."""
    task = SplitTask.from_config(msg.content["config"])
    partition = _partition(context)
    session = _open_session(task)
    try:
        state, report = run_split_round(
            task,
            record_to_state(msg.content["arrays"]),
            session,
            on_step=_dropout_hook(task, session),
            **partition,
        )
    finally:
        session.close()
    metrics = _report_metrics(report, task, partition["partition_id"])
    content = RecordDict({"arrays": state_to_record(state), "metrics": metrics})
    return Message(content=content, reply_to=msg)


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
