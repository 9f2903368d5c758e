"""The Flower ClientApp: ``train.split`` and ``evaluate`` handlers.

The ClientApp holds no model between messages: each ``train.split`` message
carries the client-side weights, the cut and a :class:`~splitlearn.task.SplitTask`;
the client builds its bottom layers, opens one data-plane session to the trunk,
trains, and replies with the updated client-side weights and its metrics.
"""

from __future__ import annotations

import logging

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clients.train import TrainReport, evaluate_bottom, train_bottom
from splitlearn.data import describe_dataset, load_client_data
from splitlearn.models import build_model
from splitlearn.split import load_bottom_state, split
from splitlearn.task import SplitTask
from splitlearn.transport import GrpcTrunkSession
from splitlearn.wire import record_to_state, state_to_record

log = logging.getLogger(__name__)

app = ClientApp()


class InjectedDropout(RuntimeError):
    """Raised to make a client vanish mid-round (failure injection)."""


def build_bottom(task: SplitTask, arrays: object) -> nn.Module:
    """Build the client-side stages for ``task`` and load the server's weights."""
    spec = describe_dataset(task.dataset)
    model = build_model(
        task.model,
        in_channels=spec.in_channels,
        image_size=spec.image_size,
        num_classes=spec.num_classes,
        **task.model_kwargs(),
    )
    load_bottom_state(model, record_to_state(arrays))
    bottom, _ = split(model, task.cut)
    return bottom


def load_local_data(task: SplitTask, context: Context) -> TensorDataset:
    """Load this node's partition (ids come from the SuperNode's node config)."""
    return load_client_data(
        dataset=task.dataset,
        partition_id=int(context.node_config["partition-id"]),
        num_partitions=int(context.node_config["num-partitions"]),
        partitioner=task.partitioner,
        seed=task.seed,
        alpha=task.alpha,
        shards_per_partition=task.shards_per_partition,
        path=task.dataset_path or None,
        test_fraction=task.test_fraction,
    )


def _epoch_loader(data: TensorDataset, task: SplitTask, partition_id: int) -> DataLoader:
    # Batch order is a function of (seed, round, partition): reruns are reproducible.
    generator = torch.Generator().manual_seed(
        task.seed * 1_000_003 + task.server_round * 1_009 + partition_id
    )
    return DataLoader(data, batch_size=task.batch_size, shuffle=True, generator=generator)


def _dropout_hook(task: SplitTask, session: GrpcTrunkSession):  # noqa: ANN202
    def on_step(step: int) -> None:
        if 0 <= task.fail_after_steps <= step:
            session.abort()  # the device vanishes: no clean stream close
            raise InjectedDropout(f"injected dropout after {step} steps")

    return on_step


def _report_metrics(report: TrainReport, task: SplitTask) -> MetricRecord:
    return MetricRecord(
        {
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


@app.train("split")
def train_split(msg: Message, context: Context) -> Message:
    """Train the client-side layers for one round against the shared trunk."""
    task = SplitTask.from_config(msg.content["config"])
    torch.set_num_threads(task.torch_threads)
    bottom = build_bottom(task, msg.content["arrays"])
    data = load_local_data(task, context)
    loader = _epoch_loader(data, task, int(context.node_config["partition-id"]))
    session = GrpcTrunkSession(task.trunk_address, task.token, max_frame_bytes=task.max_frame_bytes)
    try:
        report = train_bottom(
            bottom,
            lambda: loader,
            session,
            epochs=task.local_epochs,
            lr=task.lr,
            momentum=task.momentum,
            weight_decay=task.weight_decay,
            on_step=_dropout_hook(task, session),
        )
    finally:
        session.close()
    content = RecordDict(
        {"arrays": state_to_record(bottom.state_dict()), "metrics": _report_metrics(report, task)}
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate bottom + trunk on this client's local data (no update)."""
    task = SplitTask.from_config(msg.content["config"])
    torch.set_num_threads(task.torch_threads)
    bottom = build_bottom(task, msg.content["arrays"])
    data = load_local_data(task, context)
    session = GrpcTrunkSession(task.trunk_address, task.token, max_frame_bytes=task.max_frame_bytes)
    try:
        loss, accuracy, examples = evaluate_bottom(
            bottom, DataLoader(data, batch_size=task.batch_size), session
        )
    finally:
        session.close()
    metrics = MetricRecord({"num-examples": examples, "eval-loss": loss, "eval-accuracy": accuracy})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
