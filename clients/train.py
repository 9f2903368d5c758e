"""The client-side training loop of split learning (no Flower imports).

Per batch: run the bottom layers, send the activations at the cut over a
:class:`~splitlearn.transport.TrunkSession`, receive the gradient at the cut,
finish the backward pass and step the client optimiser. Compute time counts
only the client's own forward/backward/step, not the wait for the trunk, so a
virtual clock can rescale it for a slower device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from splitlearn.aux_head import without_aux
from splitlearn.data import describe_dataset, load_client_data
from splitlearn.models import build_model
from splitlearn.privacy import PrivacyAccountant, PrivacySettings, make_client_privacy
from splitlearn.split import load_bottom_state, split
from splitlearn.task import SplitTask
from splitlearn.transport import TrunkSession


@dataclass(frozen=True)
class TrainReport:
    """What one client did in one round.

    Parameters
    ----------
    examples : int
        Samples processed (summed over epochs).
    steps : int
        Batches exchanged with the trunk.
    loss : float
        Mean training loss reported by the trunk.
    accuracy : float
        Training accuracy reported by the trunk.
    compute_s : float
        Seconds of client-side compute (forward, backward, optimiser step).
    wall_s : float
        Seconds from first batch to last, including waiting for the trunk.
    bytes_up : int
        Data-plane bytes sent.
    bytes_down : int
        Data-plane bytes received.
    """

    examples: int
    steps: int
    loss: float
    accuracy: float
    compute_s: float
    wall_s: float
    bytes_up: int
    bytes_down: int


@dataclass
class RoundTally:
    """Running totals of one client round; every client loop reports through one."""

    steps: int = 0
    examples: int = 0
    correct: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add_batch(self, *, size: int, correct: int, loss: float) -> int:
        """Count one trained batch (``loss`` is its mean); return the step count."""
        self.steps += 1
        self.examples += size
        self.correct += correct
        self.loss_sum += loss * size
        return self.steps

    def report(self, *, bytes_up: int, bytes_down: int) -> TrainReport:
        """Freeze the totals into a :class:`TrainReport` (wall time ends now)."""
        return TrainReport(
            examples=self.examples,
            steps=self.steps,
            loss=self.loss_sum / max(self.examples, 1),
            accuracy=self.correct / max(self.examples, 1),
            compute_s=self.compute_s,
            wall_s=time.perf_counter() - self.started,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
        )


def train_bottom(
    bottom: nn.Module,
    batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    session: TrunkSession,
    *,
    epochs: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    on_step: Callable[[int], None] | None = None,
    release: Callable[[torch.Tensor], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainReport:
    """Train the client-side layers for ``epochs`` passes over ``batches()``.

    Parameters
    ----------
    bottom : nn.Module
        Client-side stages; updated in place.
    batches : Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]
        Returns one epoch's (inputs, labels) batches each time it is called.
    session : TrunkSession
        Open data-plane session.
    epochs : int
        Passes over the data.
    lr, momentum, weight_decay : float
        SGD settings (match the trunk's for whole-model-equivalent updates).
    on_step : Callable[[int], None], optional
        Called after every completed step with the step count (fault injection,
        progress); an exception it raises aborts training.
    release : Callable[[torch.Tensor], torch.Tensor], optional
        Applied to the activations before they are sent (privacy: clip and
        noise); differentiable, the backward pass runs through it.
    optimizer : torch.optim.Optimizer, optional
        Replaces the SGD built from ``lr``, ``momentum``, ``weight_decay``
        (privacy: Opacus's DP optimiser). An empty batch (Poisson sampling)
        sends nothing but still steps it.

    Returns
    -------
    TrainReport
        Counts, losses and timings for the round.
    """
    if optimizer is None:
        optimizer = torch.optim.SGD(
            bottom.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay
        )
    bottom.train()
    tally = RoundTally()
    for _ in range(epochs):
        for inputs, labels in batches():
            if len(labels) == 0:  # DP-SGD: a noise-only step hides that the batch was empty
                optimizer.zero_grad(set_to_none=True)
                optimizer.step()
                tally.steps += 1
                continue
            t0 = time.perf_counter()
            activations = bottom(inputs)
            if release is not None:
                activations = release(activations)
            t1 = time.perf_counter()
            reply = session.exchange(activations.detach(), labels)
            t2 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            activations.backward(reply.grad)
            optimizer.step()
            tally.compute_s += (t1 - t0) + (time.perf_counter() - t2)
            steps = tally.add_batch(size=len(labels), correct=reply.correct, loss=reply.loss)
            if on_step is not None:
                on_step(steps)
    return tally.report(bytes_up=session.bytes_up, bytes_down=session.bytes_down)


@torch.no_grad()
def evaluate_bottom(
    bottom: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    session: TrunkSession,
) -> tuple[float, float, int]:
    """Evaluate bottom + trunk on local data through the data plane.

    Returns
    -------
    tuple[float, float, int]
        Mean loss, accuracy and number of examples.
    """
    bottom.eval()
    examples = correct = 0
    loss_sum = 0.0
    for inputs, labels in batches:
        reply = session.evaluate(bottom(inputs), labels)
        examples += len(labels)
        correct += reply.correct
        loss_sum += reply.loss * len(labels)
    return loss_sum / max(examples, 1), correct / max(examples, 1), examples


def build_bottom(task: SplitTask, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """Build the client-side stages for ``task`` and load the server's weights."""
    spec = describe_dataset(task.dataset, image_size=task.resize_to)
    model = build_model(
        task.model,
        in_channels=spec.in_channels,
        image_size=spec.image_size,
        num_classes=spec.num_classes,
        **task.model_kwargs(),
    )
    load_bottom_state(model, without_aux(state))  # a local-loss aux head is not evaluated
    bottom, _ = split(model, task.cut)
    return bottom


def load_local_data(task: SplitTask, *, partition_id: int, num_partitions: int) -> TensorDataset:
    """Load this client's partition as ``task`` describes it."""
    return load_client_data(
        dataset=task.dataset,
        partition_id=partition_id,
        num_partitions=num_partitions,
        partitioner=task.partitioner,
        seed=task.seed,
        alpha=task.alpha,
        shards_per_partition=task.shards_per_partition,
        path=task.dataset_path or None,
        test_fraction=task.test_fraction,
        image_size=task.resize_to,
    )


def epoch_loader(data: TensorDataset, task: SplitTask, partition_id: int) -> DataLoader:
    """Shuffled batches whose order is a function of (seed, round, partition)."""
    generator = torch.Generator().manual_seed(
        task.seed * 1_000_003 + task.server_round * 1_009 + partition_id
    )
    return DataLoader(data, batch_size=task.batch_size, shuffle=True, generator=generator)


def run_split_round(
    task: SplitTask,
    state: Mapping[str, torch.Tensor],
    session: TrunkSession,
    *,
    partition_id: int,
    num_partitions: int,
    on_step: Callable[[int], None] | None = None,
    accountant: PrivacyAccountant | None = None,
) -> tuple[dict[str, torch.Tensor], TrainReport]:
    """One client's round: build the bottom, train it against the trunk.

    With a privacy option on (``task.privacy``), the whole round's privacy cost
    is charged to ``accountant`` before anything is sent, so a round that fails
    half-way is paid for too.

    Returns
    -------
    tuple[dict[str, torch.Tensor], TrainReport]
        The updated client-side state dict (bottom keys) and the report.

    Raises
    ------
    PrivacyBudgetExhausted
        If the round would take the client's epsilon past its budget; nothing
        was sent and ``accountant`` is unchanged.
    """
    torch.set_num_threads(task.torch_threads)
    bottom = build_bottom(task, state)
    data = load_local_data(task, partition_id=partition_id, num_partitions=num_partitions)
    loader = epoch_loader(data, task, partition_id)
    privacy = make_client_privacy(PrivacySettings.from_task(task), loader)
    if privacy.settings.accounted:
        if accountant is None:
            raise ValueError(f"privacy={task.privacy} needs a PrivacyAccountant to charge")
        accountant.spend(
            privacy.round_steps(epochs=task.local_epochs),
            delta=privacy.settings.delta, epsilon_max=privacy.settings.epsilon_max,
        )
    try:
        report = train_bottom(
            bottom,
            privacy.batches(),
            session,
            epochs=task.local_epochs,
            lr=task.lr,
            momentum=task.momentum,
            weight_decay=task.weight_decay,
            on_step=on_step,
            release=privacy.release,
            optimizer=privacy.make_optimizer(
                bottom, lr=task.lr, momentum=task.momentum, weight_decay=task.weight_decay
            ),
        )
    finally:
        privacy.close()
    return bottom.state_dict(), report
