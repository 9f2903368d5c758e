"""The one client loop: data -> protocol step -> metrics (no Flower imports).

Every protocol's round runs through :func:`train_round`: batches from the privacy
option (plain, or Poisson-sampled for DP-SGD), the protocol's step per batch, and
the shared hooks: the privacy option's release and optimiser, the dropout hook,
device pacing. Compute time is the batch's wall time minus what the channel spent
waiting for the trunk, so the virtual clock can rescale it for a slower device.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from clients.device import DeviceDeadline, Pacer
from clients.steps.base import ClientStep
from splitlearn.config import RunSpec
from splitlearn.dataplane import TrunkChannel
from splitlearn.optim import base_lr
from splitlearn.planning.clock import ClientMeasurement
from splitlearn.privacy import ClientPrivacy


@dataclass(frozen=True)
class TrainReport:
    """What one client did in one round.

    Parameters
    ----------
    examples : int
        Samples trained on (summed over epochs).
    steps : int
        Optimiser steps (batches).
    loss, accuracy : float
        Mean training loss and accuracy (as the protocol scores them).
    compute_s : float
        Seconds of the device's own compute (not waiting for the trunk).
    wall_s : float
        Seconds from the first batch to the end of the round.
    bytes_up, bytes_down : int
        Bytes sent and received for training (data plane, or weights/smashed data
        carried in Flower messages where the protocol has no data plane).
    exchanges : int
        Round trips with the server (each pays the link's latency).
    wait_s : float
        Seconds spent waiting for the trunk's replies (the trunk's time, not the device's).
    flops : float | None
        FLOPs of the device's own compute, where they were counted (None: not counted).
    """

    examples: int
    steps: int
    loss: float
    accuracy: float
    compute_s: float
    wall_s: float
    bytes_up: int
    bytes_down: int
    exchanges: int
    wait_s: float = 0.0
    flops: float | None = None

    @property
    def measurement(self) -> ClientMeasurement:
        """What the virtual clock needs."""
        return ClientMeasurement(self.compute_s, self.bytes_up, self.bytes_down, self.exchanges,
                                 flops=self.flops)


@dataclass
class RoundTally:
    """Running totals of one client round."""

    steps: int = 0
    empty: int = 0  # noise-only steps: nothing was sent for them
    examples: int = 0
    correct: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    flops: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add_batch(self, *, size: int, correct: int, loss: float, compute_s: float) -> int:
        """Count one batch (``loss`` is its mean); return the step count."""
        self.steps += 1
        self.examples += size
        self.correct += correct
        self.loss_sum += loss * size
        self.compute_s += compute_s
        return self.steps


def epoch_loader(data: TensorDataset, spec: RunSpec, *, server_round: int, partition_id: int,
                 generator: torch.Generator | None = None) -> DataLoader:
    """Shuffled batches whose order is a function of (seed, round, partition).

    With ``generator`` (a client secret) the order is that generator's instead:
    a server that knows the task's seed could otherwise tell which rows of two
    noised releases come from the same example, and average their noise away.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(
            spec.seed * 1_000_003 + server_round * 1_009 + partition_id
        )
    return DataLoader(data, batch_size=spec.strategy.batch_size, shuffle=True, generator=generator)


class _Traffic:
    """Bytes and waits of a round, with or without a channel."""

    def __init__(self, step: ClientStep, channel: TrunkChannel | None) -> None:
        self.step, self.channel = step, channel

    @property
    def wait_s(self) -> float:
        return self.channel.wait_s if self.channel else 0.0

    @property
    def up(self) -> int:
        return (self.channel.bytes_up if self.channel else 0) + self.step.extra_bytes_up

    @property
    def down(self) -> int:
        return (self.channel.bytes_down if self.channel else 0) + self.step.extra_bytes_down


def _capped(privacy: ClientPrivacy, *, epochs: int, max_steps: int | None
            ) -> Iterator[tuple[Tensor, ...]]:
    """Yield ``epochs`` passes of the privacy option's batches, stopping after ``max_steps``."""
    batches = itertools.chain.from_iterable(privacy.batches() for _ in range(epochs))
    return itertools.islice(batches, max_steps)


def train_round(
    step: ClientStep,
    channel: TrunkChannel | None,
    privacy: ClientPrivacy,
    *,
    epochs: int,
    on_step: Callable[[int], None] | None = None,
    pacer: Pacer | None = None,
    max_steps: int | None = None,
    deadline: DeviceDeadline | None = None,
    count_flops: bool = False,
) -> TrainReport:
    """Train the step's modules for ``epochs`` passes; return the round's report.

    Parameters
    ----------
    step : ClientStep
        The protocol's per-batch work (its modules are updated in place).
    channel : TrunkChannel | None
        The round's data-plane session, or None for protocols without one.
    privacy : ClientPrivacy
        Batches, release and optimiser of the privacy option (``none`` included).
    epochs : int
        Passes over the local data.
    on_step : Callable[[int], None], optional
        Called with the step count after every step; an exception aborts the round.
    pacer : Pacer, optional
        Makes each batch take as long as the emulated device would.
    max_steps : int, optional
        Stop after this many steps (partial work: what the planner predicts fits).
    deadline : DeviceDeadline, optional
        Stop before a batch that would end after the round's deadline on the device's
        own clock (partial work, kept by the device).
    count_flops : bool, optional
        Count the FLOPs of the first batch's device-side compute (its training step,
        whatever the protocol runs there) and charge every batch at that many per
        example (:attr:`TrainReport.flops`): an emulated device's compute on the
        virtual clock. A step torch does not run (another runtime) counts none.
    """
    train = step.spec.strategy
    optimizer = privacy.make_optimizer(
        step.trained(), lr=base_lr(train, "device"), momentum=train.momentum,
        weight_decay=train.weight_decay, optimizer=train.optimizer,
    )
    step.release = privacy.release
    step.trained().train()
    traffic, tally = _Traffic(step, channel), RoundTally()
    per_example: float | None = None  # counted FLOPs per example of a batch (count_flops)
    for inputs, labels, *ids in _capped(privacy, epochs=epochs, max_steps=max_steps):
        if deadline is not None and deadline.reached(tally.steps):
            break
        if len(labels) == 0:  # DP-SGD: a noise-only step hides that the batch was empty
            optimizer.zero_grad(set_to_none=True)
            optimizer.step()
            tally.steps += 1
            tally.empty += 1
            if on_step is not None:
                on_step(tally.steps)
            continue
        started, waited = time.perf_counter(), traffic.wait_s
        up, down = traffic.up, traffic.down
        step.batch_ids = ids[0] if ids else None  # the data's third tensor, when it has one
        counter = FlopCounterMode(display=False) if count_flops and per_example is None else None
        with counter or nullcontext():
            loss, correct = step.train_batch(inputs, labels, channel, optimizer)
        if counter is not None:
            per_example = counter.get_total_flops() / len(labels)
        wall = time.perf_counter() - started
        compute = wall - (traffic.wait_s - waited)
        steps = tally.add_batch(size=len(labels), correct=correct, loss=loss, compute_s=compute)
        flops = per_example * len(labels) if per_example else None
        tally.flops += flops or 0.0
        work = ClientMeasurement(compute, traffic.up - up, traffic.down - down,
                                 step.exchanges_per_batch, flops=flops)
        if pacer is not None:  # the trunk's time is the trunk's: pace the device's own part
            pacer.after_batch(work, wall_s=compute)
        if deadline is not None:
            deadline.after_batch(work, wall_s=wall)
        if on_step is not None:
            on_step(steps)
    step.finish(channel)
    return TrainReport(
        examples=tally.examples, steps=tally.steps,
        loss=tally.loss_sum / max(tally.examples, 1),
        accuracy=tally.correct / max(tally.examples, 1), compute_s=tally.compute_s,
        wall_s=time.perf_counter() - tally.started, bytes_up=traffic.up, bytes_down=traffic.down,
        exchanges=(tally.steps - tally.empty) * step.exchanges_per_batch
        + step.extra_exchanges(), wait_s=traffic.wait_s,
        flops=tally.flops if per_example else None,
    )


@torch.no_grad()
def evaluate_round(
    step: ClientStep, channel: TrunkChannel | None, loader: DataLoader
) -> tuple[float, float, int]:
    """Evaluate the step's pipeline on local data; return mean loss, accuracy, examples."""
    step.trained().eval()
    examples = correct = 0
    loss_sum = 0.0
    for inputs, labels, *_ in loader:  # a third tensor, the examples' ids, is not needed
        loss, hits = step.evaluate_batch(inputs, labels, channel)
        examples += len(labels)
        correct += hits
        loss_sum += loss * len(labels)
    return loss_sum / max(examples, 1), correct / max(examples, 1), examples
