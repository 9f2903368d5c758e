"""The client loop of local-loss split learning (no Flower imports).

Han et al. 2021, "Accelerating Federated Learning with Split Learning on
Locally Generated Losses": per batch the client runs its bottom stages, scores
the activations with a small auxiliary head of its own, and steps bottom and
head on that local loss with its own SGD. The detached activations and the
labels ("smashed data") go to a :class:`~splitlearn.smashed_stream.SmashedSink`
without waiting: streamed one way to the trunk, or kept for the Flower reply
(bulk mode). The trunk trains on them on its own time; no gradient comes back.

Compute time counts the client's forward, backward and step (as in
:mod:`clients.train`); handing a batch to the sink is not compute, and the
final :meth:`~splitlearn.smashed_stream.SmashedSink.flush` (waiting for the
last acks) counts only towards wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from clients.train import RoundTally, TrainReport, epoch_loader, load_local_data
from splitlearn.aux_head import AUX_PREFIX, build_aux_head, split_client_state
from splitlearn.data import describe_dataset
from splitlearn.models import build_model
from splitlearn.smashed_stream import SmashedSink
from splitlearn.split import load_bottom_state, split
from splitlearn.task import SplitTask


def build_client_side(
    task: SplitTask, state: Mapping[str, torch.Tensor]
) -> tuple[nn.Module, nn.Module]:
    """Build the bottom stages and the auxiliary head and load ``state`` into them.

    Parameters
    ----------
    task : SplitTask
        Model, cut and ``aux_hidden``.
    state : Mapping[str, torch.Tensor]
        Stage entries (``"<stage index>.…"``) and head entries (``"aux.…"``).

    Returns
    -------
    tuple[nn.Module, nn.Module]
        ``(bottom, aux_head)``.
    """
    spec = describe_dataset(task.dataset, image_size=task.resize_to)
    model = build_model(
        task.model, in_channels=spec.in_channels, image_size=spec.image_size,
        num_classes=spec.num_classes, **task.model_kwargs(),
    )
    stages, aux = split_client_state(state)
    load_bottom_state(model, stages)
    bottom, _ = split(model, task.cut)
    head = build_aux_head(model.cut_shape(task.cut), spec.num_classes, hidden=task.aux_hidden)
    head.load_state_dict(aux, strict=True)
    return bottom, head


def train_local_loss(
    bottom: nn.Module,
    head: nn.Module,
    batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    sink: SmashedSink,
    *,
    epochs: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    on_step: Callable[[int], None] | None = None,
) -> TrainReport:
    """Train bottom and head on the local loss; hand every batch's smashed data to ``sink``.

    Parameters
    ----------
    bottom, head : nn.Module
        Client-side stages and auxiliary head; updated in place.
    batches : Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]
        Returns one epoch's (inputs, labels) batches each time it is called.
    sink : SmashedSink
        Receives ``(activations, labels)`` per batch: the activations the
        bottom produced for the batch (before its step), detached.
    epochs : int
        Passes over the data.
    lr, momentum, weight_decay : float
        SGD settings of the client's own optimiser (bottom and head together).
    on_step : Callable[[int], None], optional
        Called after every step with the step count; an exception aborts.

    Returns
    -------
    TrainReport
        Loss and accuracy are the auxiliary head's; bytes are the sink's.
    """
    params = [*bottom.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    bottom.train()
    head.train()
    tally = RoundTally()
    for _ in range(epochs):
        for inputs, labels in batches():
            if len(labels) == 0:
                continue
            t0 = time.perf_counter()
            activations = bottom(inputs)
            logits = head(activations)
            loss = nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tally.compute_s += time.perf_counter() - t0
            sink.send(activations.detach(), labels)
            steps = tally.add_batch(
                size=len(labels), loss=float(loss.detach()),
                correct=int((logits.detach().argmax(dim=1) == labels).sum()),
            )
            if on_step is not None:
                on_step(steps)
    sink.flush()
    return tally.report(bytes_up=sink.bytes_up, bytes_down=sink.bytes_down)


def run_local_loss_round(
    task: SplitTask,
    state: Mapping[str, torch.Tensor],
    sink: SmashedSink,
    *,
    partition_id: int,
    num_partitions: int,
    on_step: Callable[[int], None] | None = None,
) -> tuple[dict[str, torch.Tensor], TrainReport]:
    """One client's round: build bottom and head, train them, feed ``sink``.

    Returns
    -------
    tuple[dict[str, torch.Tensor], TrainReport]
        The updated client state (stage keys and ``"aux.…"`` keys) and the report.
    """
    torch.set_num_threads(task.torch_threads)
    bottom, head = build_client_side(task, state)
    data = load_local_data(task, partition_id=partition_id, num_partitions=num_partitions)
    loader = epoch_loader(data, task, partition_id)
    report = train_local_loss(
        bottom, head, lambda: loader, sink,
        epochs=task.local_epochs, lr=task.lr, momentum=task.momentum,
        weight_decay=task.weight_decay, on_step=on_step,
    )
    client_state = dict(bottom.state_dict())
    client_state |= {AUX_PREFIX + k: v for k, v in head.state_dict().items()}
    return client_state, report

