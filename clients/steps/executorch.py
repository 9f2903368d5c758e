"""The split step with the device's stages trained by ExecuTorch's runtime (``devices.runtime``).

With ``devices.runtime=executorch`` the device of a protocol whose device step is the split
step (its capabilities list the ``executorch`` runtime) trains its stages through the
exported ExecuTorch program (:class:`clients.executorch_program.ExecuTorchBottom`): the
``.pte`` a device without Python
PyTorch runs. The programs (one per batch shape) are exported once per process and kept
(:data:`clients.executorch_program.PROGRAMS`, keyed by the model's architecture and settings,
the cut and the batch shape): each round borrows them, writes the weights it received into
them, steps them with a fresh ExecuTorch SGD at the run's lr, momentum and weight decay (no
momentum carries across rounds, as the eager optimiser is made per round), and ends by
loading the trained weights back into the model, so the reply carries them, and giving the
programs back. Evaluation stays eager PyTorch (no update, the same function).

What the program does not do is refused rather than trained eagerly
(:func:`splitlearn.runtimes.executorch_refusal`, at composition and again on the device):
other device steps, privacy that clips, noises or regularises what the device computes,
activation recomputation, and stages holding buffers (BatchNorm's running statistics,
which the program does not update).

``peak-memory-bytes`` is the largest memory plan of the round's programs (the arena
ExecuTorch's runtime allocates to run one, weights and gradients included where the plan
holds them), not :class:`clients.memory.MemoryMeter`'s count: the meter watches PyTorch's
autograd, which this step does not use. Export time, where a round has to export (the
process's first round for the architecture, or concurrent rounds wanting the same program),
counts as the device's compute in the batch that needs the program.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clients.device import DeviceFailure
from clients.executorch_program import ExecuTorchBottom
from clients.steps.base import ClientStep
from clients.steps.split import SplitStep
from protocols import Protocol, runtime_refusal
from splitlearn.config import RunSpec
from splitlearn.dataplane import TrunkChannel
from splitlearn.models import SplittableModel
from splitlearn.optim import base_lr, is_light
from splitlearn.runtimes import (
    EXECUTORCH_KEY,
    RECOMPUTE_REFUSAL,
    bottom_refusal,
    executorch_refusal,
)


def model_settings(spec: RunSpec) -> str:
    """Return the run's settings that build the model (part of the programs' cache key)."""
    model, dataset = spec.model, spec.dataset
    options = sorted((str(k), repr(v)) for k, v in dict(model.options).items())
    return repr((model.name, model._target_, options, dataset.name, dataset.image_size))


def client_step_type(protocol: Protocol, spec: RunSpec, *, recompute: bool
                     ) -> type[ClientStep]:
    """Return the step that trains this round's device side under ``spec.devices.runtime``.

    ExecuTorch's program is the split step's device side: it serves every protocol whose
    capabilities list the ``executorch`` runtime.

    Raises
    ------
    DeviceFailure
        The ExecuTorch runtime cannot honour the round (the reason names the option).
    """
    if spec.devices.runtime == "eager":
        return protocol.client
    refusal = (runtime_refusal(protocol, spec.devices.runtime)
               or executorch_refusal(spec.privacy, recompute=recompute))
    if refusal is not None:
        raise DeviceFailure(refusal)
    return ExecuTorchSplitStep


class ExecuTorchSplitStep(SplitStep):
    """The split step whose device stages ExecuTorch's runtime trains (see the module docstring).

    Raises
    ------
    DeviceFailure
        On stages the program cannot train (:func:`bottom_refusal`).
    """

    def __init__(
        self, model: SplittableModel, spec: RunSpec, *, cut: int, recompute: bool = False
    ) -> None:
        if recompute:
            raise DeviceFailure(RECOMPUTE_REFUSAL)
        super().__init__(model, spec, cut=cut)
        refusal = bottom_refusal(self.bottom)
        if refusal is not None:
            raise DeviceFailure(refusal)
        train = spec.strategy
        if not is_light(train.optimizer):
            raise DeviceFailure(f"{EXECUTORCH_KEY}: the exported program steps plain SGD, not "
                                f"strategy.optimizer._target_={train.optimizer._target_} with "
                                f"options {sorted(train.optimizer.options)}")
        self.device = ExecuTorchBottom(model, self.cut, lr=base_lr(train, "device"),
                                       momentum=train.momentum,
                                       weight_decay=train.weight_decay,
                                       config=model_settings(spec))

    def train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Train on one batch through the program (the PyTorch ``optimizer`` is not used)."""
        # No MemoryMeter: it watches PyTorch's autograd; the peak is the runtime's plan.
        result = self._train_batch(inputs, labels, channel, optimizer)
        self.peak_memory_bytes = self.device.planned_bytes
        return result

    def _train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Run the program's forward, exchange, run its backward and step ExecuTorch's SGD."""
        assert channel is not None
        activations = self.device.activations(inputs)
        grad, loss, correct = channel.forward(activations, labels, example_ids=self.batch_ids)
        self.device.train(inputs, grad)
        return loss, correct

    def finish(self, channel: TrunkChannel | None) -> None:
        """Load the program's trained weights into the model (the reply carries them).

        Then give the programs back for the next round.
        """
        super().finish(channel)
        self.device.load_into(self.bottom)
        self.device.release()
