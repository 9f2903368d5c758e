"""The FedAvg baseline's client loop: the whole model trained on the device.

No data plane: the device downloads every stage, trains locally and uploads
every stage. Its "bytes" are the weights themselves, which is what split
learning is compared against. No Flower imports.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn

from clients.train import RoundTally, TrainReport, epoch_loader, load_local_data
from splitlearn.data import describe_dataset
from splitlearn.models import SplittableModel, build_model
from splitlearn.split import load_bottom_state
from splitlearn.task import SplitTask


def build_whole_model(task: SplitTask, state: Mapping[str, torch.Tensor]) -> SplittableModel:
    """Build the model for ``task`` and load every stage from ``state``."""
    spec = describe_dataset(task.dataset, image_size=task.resize_to)
    model = build_model(
        task.model, in_channels=spec.in_channels, image_size=spec.image_size,
        num_classes=spec.num_classes, **task.model_kwargs(),
    )
    load_bottom_state(model, state)
    return model


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors in a state dict (what a weight transfer costs)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def run_whole_round(
    task: SplitTask,
    state: Mapping[str, torch.Tensor],
    *,
    partition_id: int,
    num_partitions: int,
) -> tuple[dict[str, torch.Tensor], TrainReport]:
    """Train the whole model locally for ``task.local_epochs``; return stages and report."""
    torch.set_num_threads(task.torch_threads)
    model = build_whole_model(task, state)
    loader = epoch_loader(
        load_local_data(task, partition_id=partition_id, num_partitions=num_partitions),
        task, partition_id,
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=task.lr, momentum=task.momentum, weight_decay=task.weight_decay
    )
    model.train()
    tally = RoundTally()
    for _ in range(task.local_epochs):
        for inputs, labels in loader:
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tally.add_batch(
                size=len(labels), loss=float(loss.detach()),
                correct=int((logits.detach().argmax(dim=1) == labels).sum()),
            )
    tally.compute_s = time.perf_counter() - tally.started  # all of it is local compute
    new_state = model.stages.state_dict()
    return new_state, tally.report(bytes_up=state_bytes(new_state), bytes_down=state_bytes(state))
