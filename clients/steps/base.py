"""What every protocol's client step provides to the one client loop (:mod:`clients.loop`).

A step owns the modules the device trains for its protocol (a bottom, a head and a
tail, a bottom and an auxiliary head, the whole model) and does one batch with
them: forward, exchange with the trunk over a channel when the protocol has one,
backward, optimiser step. Everything else a round needs (data, declines, privacy,
dropout, device emulation, byte and time accounting) is the loop's, written once.

Two things every step gets from this base: with ``recompute=True`` the device's
stages run under per-stage activation recomputation (:mod:`clients.recompute`;
subclasses run them through :meth:`ClientStep.run_stages`), and the first
:attr:`ClientStep.measured_batches` training batches of a round are measured with
:class:`clients.memory.MemoryMeter` into :attr:`ClientStep.peak_memory_bytes`.
Subclasses implement :meth:`ClientStep._train_batch`; the loop calls
:meth:`ClientStep.train_batch`, which adds the measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from clients.memory import MemoryMeter
from clients.recompute import run_stages
from splitlearn.calibration import client_train_memory_bytes
from splitlearn.config import CompressionConfig, RunSpec, StrategyConfig
from splitlearn.dataplane import TrunkChannel
from splitlearn.models import SplittableModel
from splitlearn.models.lean import mask_cut_relu
from splitlearn.stages import bottom_state, load_bottom_state, split


class ClientStep:
    """A protocol's work on the device; this base is the split bottom without an exchange.

    Parameters
    ----------
    model : SplittableModel
        The network; the step's modules are views of its stages (no copies).
    spec : RunSpec
        The run's settings (protocol options in ``spec.strategy``).
    cut : int
        This client's cut: stages ``[0, cut)`` are the device's.
    recompute : bool, optional
        Train the device's stages with per-stage activation recomputation: less
        memory (see :meth:`memory_bytes`) for one more forward of compute. A step
        that frees its sent output (:attr:`frees_sent_output`) also replaces the
        ReLU that ends the cut's stage in ``model`` by a
        :class:`~splitlearn.models.lean.MaskReLU` (the same function).
    """

    #: Data-plane round trips per training batch (the virtual clock charges an RTT each).
    exchanges_per_batch: ClassVar[int] = 1
    #: Whether the trunk's gradient at the cut comes back (local loss only sends).
    receives_gradient: ClassVar[bool] = True
    #: Whether the step talks to the trunk over a data-plane channel.
    needs_channel: ClassVar[bool] = True
    #: Training batches per round whose memory is measured (the first ones): every
    #: batch holds as much, and the meter's hooks cost time on each batch it watches.
    measured_batches: ClassVar[int] = 3
    #: Whether the step drops the output at the cut once it is sent, before the backward
    #: (it keeps only a :class:`~clients.cut_gradient.GradientRoot` to start the backward
    #: from): with recomputation, the last stage is then recomputed too, with a
    #: :class:`~splitlearn.models.lean.MaskReLU` at the cut.
    frees_sent_output: ClassVar[bool] = False

    def __init__(
        self, model: SplittableModel, spec: RunSpec, *, cut: int, recompute: bool = False
    ) -> None:
        self.model = model
        self.spec = spec
        self.cut = model.check_cut(cut)
        self.recompute = recompute
        if recompute and self.frees_sent_output:
            mask_cut_relu(model, self.cut)
        self.bottom, _ = split(model, self.cut)
        #: Most bytes one measured training batch held (see :mod:`clients.memory`); 0 before.
        self.peak_memory_bytes = 0
        self._batches_measured = 0
        self._meter: MemoryMeter | None = None
        #: What the device sends instead of raw activations (privacy sets it).
        self.release: Callable[[Tensor], Tensor] = _as_is
        #: The examples of the batch being trained, by index in the device's data (the loop
        #: sets them when the data carries them: with error feedback); else None.
        self.batch_ids: Tensor | None = None
        #: Bytes this round moved outside the data plane (e.g. in the Flower reply).
        self.extra_bytes_up = 0
        self.extra_bytes_down = 0

    @classmethod
    def initial_state(
        cls, model: SplittableModel, spec: RunSpec, *, cuts: Sequence[int]
    ) -> dict[str, Tensor]:
        """Return the global arrays of round 1 when clients may hold any of ``cuts``.

        By default what a client at the deepest cut holds: every stage a client
        may be sent.
        """
        return cls(model, spec, cut=max(cuts)).state()

    def trained(self) -> nn.Module:
        """Return the modules the device trains (their parameters go to the optimiser)."""
        return self.bottom

    def state(self) -> dict[str, Tensor]:
        """Return the client-side arrays sent back (keys ``"<stage index>.…"``)."""
        return bottom_state(self.model, self.cut)

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Load the arrays the server sent (validated before anything is copied)."""
        load_bottom_state(self.model, state)

    def memory_bytes(self, batch_size: int) -> int:
        """Estimated training memory of the device's modules for one batch (recomputed if set)."""
        return client_train_memory_bytes(
            self.model, self.cut, batch_size=batch_size, recompute=self.recompute,
            frees_output=self.frees_sent_output,
        )

    @classmethod
    def kept_samples_cap(cls, options: StrategyConfig, compression: CompressionConfig) -> float:
        """Most samples of a round whose activations the step keeps past their batch.

        0 here: a batch's activations go with it. (Local loss keeps what it sent until
        the trunk's ack or the Flower reply; ``math.inf``: all of a round's.)
        """
        return 0

    def kept_bytes(self, examples: int, compression: CompressionConfig) -> int:
        """Bytes the step keeps besides one batch's training memory, for ``examples`` examples.

        With uplink error feedback a float32 reference per example at the cut, and the
        samples of :meth:`kept_samples_cap` (at most a round's): a float32 row and an int64
        label each.
        """
        row = 4 * torch.Size(self.model.cut_shape(self.cut)).numel()
        kept = min(self.kept_samples_cap(self.spec.strategy, compression),
                   examples * self.spec.strategy.local_epochs)
        return row * examples * compression.uplink_feedback + (row + 8) * int(kept)

    def train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Train on one batch; return its mean loss and correctly classified rows.

        The round's first :attr:`measured_batches` batches are measured, raising
        :attr:`peak_memory_bytes` to the most any of them held.
        """
        if self._batches_measured >= self.measured_batches:
            return self._train_batch(inputs, labels, channel, optimizer)
        self._batches_measured += 1
        meter = self._meter = MemoryMeter(self.trained(), optimizer)
        if channel is not None:
            channel = cast(TrunkChannel, _UnmeteredCalls(channel, meter))
        try:
            with meter:
                result = self._train_batch(inputs, labels, channel, optimizer)
        finally:
            self._meter = None
        self.peak_memory_bytes = max(self.peak_memory_bytes, meter.peak_bytes)
        return result

    def _train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Do the protocol's work on one training batch (what subclasses implement)."""
        raise NotImplementedError

    def run_stages(self, stages: Iterable[nn.Module], inputs: Tensor) -> Tensor:
        """Run the device's ``stages`` for training: recomputed when asked, output measured.

        Parameters
        ----------
        stages : Iterable[nn.Module]
            Consecutive stages the device trains (e.g. :attr:`bottom`).
        inputs : Tensor
            The first stage's input.

        Returns
        -------
        Tensor
            The last stage's output, which the step holds until it is sent (the
            meter counts it while it lives).
        """
        meter = self._meter
        observe = nullcontext if meter is None else meter.observing
        out = run_stages(stages, inputs, recompute=self.recompute,
                         recompute_output=self.frees_sent_output, recompute_context=observe)
        if meter is not None:
            meter.watch(out)
        return out

    @torch.no_grad()
    def evaluate_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None
    ) -> tuple[float, int]:
        """Evaluate one batch without an update; return its mean loss and hits."""
        raise NotImplementedError

    def finish(self, channel: TrunkChannel | None) -> None:
        """End of the round's training (e.g. wait for acks)."""

    def extra_exchanges(self) -> int:
        """Round trips besides ``exchanges_per_batch`` per batch (e.g. a final flush)."""
        return 0

    def reply_arrays(self) -> dict[str, dict[str, Tensor]]:
        """Further ArrayRecords for the reply, by key (bulk smashed data)."""
        return {}


class _UnmeteredCalls:
    """A channel whose methods run with the meter paused: the trunk's tensors are not the device's.

    With an in-process transport (tests, ``experiments.local``) the trunk trains in
    this thread, where the meter's saved-tensor hooks would see its activations.
    """

    def __init__(self, channel: TrunkChannel, meter: MemoryMeter) -> None:
        self._channel = channel
        self._meter = meter

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._channel, name)
        if not callable(value):
            return value

        def unmetered(*args: Any, **kwargs: Any) -> Any:
            with self._meter.paused():
                return value(*args, **kwargs)

        return unmetered


def _as_is(activations: Tensor) -> Tensor:
    return activations


def hits(logits: Tensor, labels: Tensor) -> int:
    """Rows whose arg-max is the label."""
    return int((logits.detach().argmax(dim=1) == labels).sum())
