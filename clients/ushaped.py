"""The client-side loop of U-shaped split learning (no Flower imports).

The device keeps the head (stages ``[0, cut)``), the tail (stages
``[tail_cut, num_stages)``) and the loss, so labels never leave it
(Vepakomma et al. 2018, "Split learning for health", U-shaped configuration).
Per batch, two exchanges with the trunk:

1. run the head, send the activations at the cut, receive the trunk's features
   at the tail cut;
2. run the tail and the loss, backpropagate to the features, send d loss /
   d features, receive the gradient at the cut and finish the head's backward.

Head and tail step together with one SGD optimiser. Compute time counts only
the device's own work (head, tail, loss, backward, step), not the waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from clients.device import EmulatedSession, MemoryBudgetExceeded
from clients.train import RoundTally, TrainReport, epoch_loader, load_local_data
from splitlearn.calibration import client_train_memory_bytes
from splitlearn.data import describe_dataset
from splitlearn.models import SplittableModel, build_model
from splitlearn.planning.devices import DeviceProfile
from splitlearn.split import load_bottom_state, resolve_tail_cut, split_u, ushaped_state
from splitlearn.task import SplitTask
from splitlearn.transport import UShapedSession

#: Data-plane round trips per training batch (features out, gradient back).
EXCHANGES_PER_BATCH = 2


def train_ushaped(
    head: nn.Module,
    tail: nn.Module,
    batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    session: UShapedSession,
    *,
    epochs: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    on_step: Callable[[int], None] | None = None,
) -> TrainReport:
    """Train the device's head and tail for ``epochs`` passes over ``batches()``.

    Parameters
    ----------
    head, tail : nn.Module
        The device's first and last stages; updated in place.
    batches : Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]
        Returns one epoch's (inputs, labels) batches each time it is called.
    session : UShapedSession
        Open data-plane session of a U-shaped grant.
    epochs : int
        Passes over the data.
    lr, momentum, weight_decay : float
        SGD settings (match the trunk's for whole-model-equivalent updates).
    on_step : Callable[[int], None], optional
        Called after every completed step with the step count; an exception it
        raises aborts training.

    Returns
    -------
    TrainReport
        Counts, the device's own loss and accuracy, timings and bytes.
    """
    params = [*head.parameters(), *tail.parameters()]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    head.train()
    tail.train()
    tally = RoundTally()
    for _ in range(epochs):
        for inputs, labels in batches():
            t0 = time.perf_counter()
            activations = head(inputs)
            t1 = time.perf_counter()
            features = session.forward_features(activations.detach()).requires_grad_(True)
            t2 = time.perf_counter()
            logits = tail(features)
            loss = nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # tail gradients, and d loss / d features for the trunk
            t3 = time.perf_counter()
            assert features.grad is not None
            grad_at_cut = session.backward_features(features.grad)
            t4 = time.perf_counter()
            activations.backward(grad_at_cut)
            optimizer.step()
            tally.compute_s += (t1 - t0) + (t3 - t2) + (time.perf_counter() - t4)
            steps = tally.add_batch(
                size=len(labels), loss=float(loss.detach()),
                correct=int((logits.detach().argmax(dim=1) == labels).sum()),
            )
            if on_step is not None:
                on_step(steps)
    return tally.report(bytes_up=session.bytes_up, bytes_down=session.bytes_down)


@torch.no_grad()
def evaluate_ushaped(
    head: nn.Module,
    tail: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    session: UShapedSession,
) -> tuple[float, float, int]:
    """Evaluate head + trunk + tail on local data; the loss is computed on the device.

    Returns
    -------
    tuple[float, float, int]
        Mean loss, accuracy and number of examples.
    """
    head.eval()
    tail.eval()
    examples = correct = 0
    loss_sum = 0.0
    for inputs, labels in batches:
        logits = tail(session.evaluate_features(head(inputs)))
        loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(dim=1) == labels).sum())
        examples += len(labels)
    return loss_sum / max(examples, 1), correct / max(examples, 1), examples


def build_client_model(task: SplitTask, state: Mapping[str, torch.Tensor]) -> SplittableModel:
    """Build the model for ``task`` and load the client-side stages the server sent."""
    spec = describe_dataset(task.dataset, image_size=task.resize_to)
    model = build_model(
        task.model,
        in_channels=spec.in_channels,
        image_size=spec.image_size,
        num_classes=spec.num_classes,
        **task.model_kwargs(),
    )
    load_bottom_state(model, state)
    return model


def build_head_tail(
    task: SplitTask, state: Mapping[str, torch.Tensor]
) -> tuple[nn.Sequential, nn.Sequential]:
    """Build the device's head and tail for ``task`` with the server's weights loaded."""
    model = build_client_model(task, state)
    head, _, tail = split_u(model, task.cut, task.tail_cut)
    return head, tail


def ushaped_memory_bytes(
    model: SplittableModel, cut: int, tail_cut: int, *, batch_size: int
) -> int:
    """Estimated training memory of head plus tail for one batch, in bytes.

    As :func:`splitlearn.calibration.client_train_memory_bytes` for the head,
    plus the tail's saved activations, parameters, gradients and momentum.
    """
    tail = model.stage_costs()[resolve_tail_cut(model, cut, tail_cut):]
    tail_bytes = sum(c.train_memory_bytes_per_sample for c in tail) * batch_size
    tail_bytes += 3 * 4 * sum(c.params for c in tail)
    return client_train_memory_bytes(model, cut, batch_size=batch_size) + tail_bytes


def check_ushaped_memory(task: SplitTask, profile: DeviceProfile | None) -> int:
    """Estimated head + tail training bytes; raise if the profile cannot hold them."""
    model = build_client_model(task, {})
    needed = ushaped_memory_bytes(model, task.cut, task.tail_cut, batch_size=task.batch_size)
    if profile is not None and needed > profile.memory_bytes:
        raise MemoryBudgetExceeded(
            f"U-shaped cuts {task.cut}/{task.tail_cut} at batch {task.batch_size} need "
            f"{needed / 2**20:.1f} MiB; {profile.name} has {profile.memory_bytes / 2**20:.1f} MiB"
        )
    return needed


class EmulatedUShapedSession(EmulatedSession):
    """A U-shaped session that takes as long as the device would (both exchanges paced)."""

    def forward_features(self, activations: torch.Tensor) -> torch.Tensor:
        """Send activations, paced like the device; return the features."""
        return self._pace(lambda a, _: self.inner.forward_features(a), activations, None)

    def backward_features(self, grad: torch.Tensor) -> torch.Tensor:
        """Send the features' gradient, paced like the device; return the cut gradient."""
        return self._pace(lambda g, _: self.inner.backward_features(g), grad, None)

    def evaluate_features(self, activations: torch.Tensor) -> torch.Tensor:
        """Evaluate one batch, paced like the device."""
        return self._pace(lambda a, _: self.inner.evaluate_features(a), activations, None)


def run_ushaped_round(
    task: SplitTask,
    state: Mapping[str, torch.Tensor],
    session: UShapedSession,
    *,
    partition_id: int,
    num_partitions: int,
    on_step: Callable[[int], None] | None = None,
) -> tuple[dict[str, torch.Tensor], TrainReport]:
    """One client's U-shaped round: build head and tail, train them against the trunk.

    Returns
    -------
    tuple[dict[str, torch.Tensor], TrainReport]
        The updated head and tail state (keys ``"<stage index>.<name>"``) and
        the report.
    """
    torch.set_num_threads(task.torch_threads)
    model = build_client_model(task, state)
    tail_cut = resolve_tail_cut(model, task.cut, task.tail_cut)
    head, _, tail = split_u(model, task.cut, tail_cut)  # modules shared with ``model``
    data = load_local_data(task, partition_id=partition_id, num_partitions=num_partitions)
    loader = epoch_loader(data, task, partition_id)
    report = train_ushaped(
        head, tail, lambda: loader, session,
        epochs=task.local_epochs, lr=task.lr, momentum=task.momentum,
        weight_decay=task.weight_decay, on_step=on_step,
    )
    return ushaped_state(model, task.cut, tail_cut), report
