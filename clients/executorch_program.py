"""The client's training step as an ExecuTorch program: what a device without Python PyTorch runs.

:func:`export_client_step` exports the stages ``[0, cut)`` as one training method of an
ExecuTorch program (the ``.pte`` bytes an Android or iOS app loads): given a batch and the
gradient the trunk returned for the activations at the cut, it returns those activations
and the gradients of the client's weights. The loss it differentiates is the surrogate
``<output, gradient>``, whose weight gradients are exactly the vector-Jacobian product the
split step needs; ExecuTorch's training export turns it into a joint forward-backward graph.

ExecuTorch 1.5.1's portable ``max_pool2d_with_indices_backward`` kernel accumulates into its
output without zeroing it first, and memory planning hands it a reused buffer: the stray
values in its result are the pooled maxima of the forward output it reuses, so a bottom with
``MaxPool2d`` got wrong gradients (the joint graph itself, run by PyTorch, is exact). The
program computes that op instead as zeros plus ``scatter_add`` of the gradient at the
indices, which the runtime gets right.

:class:`ExecuTorchClientStep` runs the program through ExecuTorch's runtime with ExecuTorch's
own SGD. The program has the batch's shape. Per batch it runs once with a zero gradient to
get the activations (nothing is stepped), then, with the trunk's gradient, again and steps:
one extra forward per batch, as activation recomputation costs.

:class:`ExecuTorchBottom` is what the ClientApp uses (``devices.runtime=executorch``, see
:mod:`clients.steps.executorch`): a program per batch shape (a smaller last batch gets its
own), one set of weights and one SGD shared by them.

:data:`PROGRAMS` keeps the programs across rounds, as a phone app keeps the ``.pte`` it
loaded: a round borrows each program it needs (keyed by :class:`ProgramKey`: what fixes the
graph), overwrites all of its weights with the ones the round received and gives it back
at the end. A program is lent to one round at a time, so concurrent rounds in one process
(``experiments.local`` runs ClientApps as threads) never share a program's memory.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from splitlearn.models import SplittableModel
from splitlearn.stages import split

#: The program's method.
METHOD = "forward"
#: Idle programs the process keeps (each holds its ``.pte`` and the runtime's memory plan).
CACHE_CAPACITY = 8
#: What the export wrapper (:class:`_SurrogateStep`) puts before the stages' parameter names.
PREFIX = "bottom."


class _SurrogateStep(nn.Module):
    """Forward to the cut; the loss ``<output, gradient>`` (its weight gradients: the VJP)."""

    def __init__(self, bottom: nn.Module) -> None:
        super().__init__()
        self.bottom = bottom

    def forward(self, x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        out = self.bottom(x)
        return (out * grad_out).sum(), out.detach()


def _max_pool_backward(grad: Tensor, x: Tensor, kernel: Any, stride: Any, padding: Any,
                       dilation: Any, ceil_mode: bool, indices: Tensor) -> Tensor:
    """``max_pool2d_with_indices_backward`` as zeros + scatter-add (indices index each plane)."""
    n, c = x.shape[:2]
    flat = torch.zeros(n, c, x.shape[-2] * x.shape[-1], dtype=grad.dtype)
    return flat.scatter_add(2, indices.reshape(n, c, -1), grad.reshape(n, c, -1)).reshape(x.shape)


@dataclass(frozen=True)
class ExportedStep:
    """An exported client step: the program and the shapes it was exported for."""

    program: bytes  # the ExecuTorch program (.pte)
    input_shape: tuple[int, ...]  # a batch of inputs
    output_shape: tuple[int, ...]  # the activations at the cut (and their gradient)
    planned_bytes: int = 0  # the method's memory-planned tensors: the arena the runtime allocates


def export_client_step(model: SplittableModel, cut: int, *, batch_size: int) -> ExportedStep:
    """Export the stages ``[0, cut)`` of ``model`` (its current weights) as a training program.

    Parameters
    ----------
    model : SplittableModel
        The network; not modified.
    cut : int
        Stages ``[0, cut)`` are the device's.
    batch_size : int
        Rows per batch (the program's shapes are static).

    Returns
    -------
    ExportedStep
        The ExecuTorch program (``.pte`` bytes) and its shapes.
    """
    from executorch.exir import to_edge
    from torch.export.experimental import _export_forward_backward

    bottom, _ = split(copy.deepcopy(model), cut)
    x = torch.zeros(batch_size, *model.input_shape)
    grad_out = torch.zeros(batch_size, *model.cut_shape(cut))
    exported = torch.export.export(_SurrogateStep(bottom), (x, grad_out), strict=False)
    joint = _export_forward_backward(exported).run_decompositions(
        {torch.ops.aten.max_pool2d_with_indices_backward.default: _max_pool_backward})
    program = to_edge(joint).to_executorch()
    method = next(p for p in program.executorch_program.execution_plan if p.name == METHOD)
    return ExportedStep(program.buffer, tuple(x.shape), tuple(grad_out.shape),
                        planned_bytes=sum(method.non_const_buffer_sizes))


class ExecuTorchClientStep:
    """The device's side of split training, run by ExecuTorch's runtime.

    Parameters
    ----------
    step : ExportedStep
        What :func:`export_client_step` returned.
    lr, momentum, weight_decay : float
        SGD settings (ExecuTorch's SGD, as the device's optimiser).
    """

    def __init__(self, step: ExportedStep, *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        from executorch.extension.training import (
            _load_for_executorch_for_training_from_buffer,
            get_sgd_optimizer,
        )

        self.step = step  # the module reads from its buffer: it must outlive the module
        self._module = _load_for_executorch_for_training_from_buffer(step.program)
        self._sgd = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self._get_sgd_optimizer = get_sgd_optimizer
        self._optimizer: Any = None

    def activations(self, x: Tensor) -> Tensor:
        """Return the activations at the cut for batch ``x`` (the weights do not change)."""
        return self.run(x)

    def train(self, x: Tensor, grad_out: Tensor) -> Tensor:
        """Backpropagate the trunk's ``grad_out`` for batch ``x`` and take an SGD step."""
        out = self.run(x, grad_out)
        if self._optimizer is None:  # the parameters exist once the method has run
            self._optimizer = self._get_sgd_optimizer(self.parameters(), **self._sgd)
        self._optimizer.step(self.gradients())
        return out

    def parameters(self) -> dict[str, Tensor]:
        """Return the program's weights: views of its memory (writing them changes the program).

        The program must have run once (ExecuTorch 1.5 allocates them then).
        """
        return self._module.named_parameters()

    def gradients(self) -> dict[str, Tensor]:
        """Return the weights' gradients from the last :meth:`run` (zero for a zero gradient)."""
        return self._module.named_gradients()

    def state_dict(self) -> dict[str, Tensor]:
        """Return a copy of the device's weights, keyed as the split model's stages are."""
        return _unprefixed(self.parameters())

    def run(self, x: Tensor, grad_out: Tensor | None = None) -> Tensor:
        """Run the program once (no step); return the activations at the cut.

        With ``grad_out`` (default: zeros) the program also leaves the weights'
        gradients for it in :meth:`gradients`.
        """
        if tuple(x.shape) != self.step.input_shape:
            raise ValueError(f"the program takes batches of shape {self.step.input_shape}, "
                             f"got {tuple(x.shape)}")
        if grad_out is None:
            grad_out = torch.zeros(self.step.output_shape)
        _, out = self._module.forward_backward(METHOD, (x.contiguous(), grad_out.contiguous()))
        return out


def architecture(model: SplittableModel, cut: int, config: str = "") -> str:
    """Return what fixes the graph of the program of ``model``'s stages ``[0, cut)``.

    The model's class, the stages' modules (their repr holds every layer's settings), the
    names, shapes and dtypes of their parameters, the input and cut shapes, and ``config``:
    what built the model (e.g. the run's model and dataset settings), for settings a
    ``forward`` may read that no repr shows. Weights do not count: a round writes its own.
    """
    bottom, _ = split(model, cut)
    cls = type(model)
    params = [(name, tuple(p.shape), str(p.dtype)) for name, p in bottom.named_parameters()]
    return repr((f"{cls.__module__}.{cls.__qualname__}", repr(bottom), params,
                 tuple(model.input_shape), tuple(model.cut_shape(cut)), config))


@dataclass(frozen=True)
class ProgramKey:
    """What a cached program was exported for: two programs with one key have one graph."""

    architecture: str  # :func:`architecture` of the model at the cut
    cut: int
    input_shape: tuple[int, ...]  # the batch's shape (the program's shapes are static)


class ProgramCache:
    """Programs kept across rounds, each lent to one borrower at a time (thread-safe).

    An idle program is in the cache; a lent one only with its borrower, who gives it
    back when done (a program not given back, e.g. by a round that failed, is dropped).
    At most ``capacity`` idle programs are kept, the least recently given back dropped
    first. Borrowers use the programs' :meth:`~ExecuTorchClientStep.run`,
    :meth:`~ExecuTorchClientStep.parameters` and :meth:`~ExecuTorchClientStep.gradients`
    with an SGD of their own, so no optimiser state stays with a program.

    Parameters
    ----------
    capacity : int
        Idle programs kept.
    """

    def __init__(self, capacity: int = CACHE_CAPACITY) -> None:
        self.capacity = capacity
        #: Programs exported through :meth:`lend` so far.
        self.exports = 0
        self._idle: list[tuple[ProgramKey, ExecuTorchClientStep]] = []  # oldest first
        self._lock = threading.Lock()
        # One export at a time: torch.export is not documented as thread-safe.
        self._export_lock = threading.Lock()

    def __len__(self) -> int:
        """Return the number of idle programs."""
        with self._lock:
            return len(self._idle)

    def lend(self, key: ProgramKey, export: Callable[[], ExecuTorchClientStep], *,
             fits: Callable[[ExecuTorchClientStep], bool]) -> ExecuTorchClientStep:
        """Return an idle program for ``key`` that ``fits``, else ``export()``'s (counted).

        An idle program for ``key`` that does not fit is dropped.
        """
        program = self._take(key)
        if program is not None and fits(program):
            return program
        with self._export_lock:
            program = export()
            self.exports += 1
        return program

    def give_back(self, key: ProgramKey, program: ExecuTorchClientStep) -> None:
        """Keep ``program`` (exported for ``key``) for the next borrower."""
        with self._lock:
            self._idle.append((key, program))
            del self._idle[:max(len(self._idle) - self.capacity, 0)]

    def clear(self) -> None:
        """Drop the idle programs and reset :attr:`exports`."""
        with self._lock:
            self._idle.clear()
            self.exports = 0

    def _take(self, key: ProgramKey) -> ExecuTorchClientStep | None:
        """Remove and return the most recently given back idle program for ``key``."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] == key:
                    return self._idle.pop(i)[1]
        return None


#: The process's programs, shared by every :class:`ExecuTorchBottom` (and every thread).
PROGRAMS = ProgramCache()


class ExecuTorchBottom:
    """The device's stages as ExecuTorch programs, one per batch shape, with one set of weights.

    A program's shapes are static, so each batch shape gets its own program, borrowed
    from ``cache`` the first time a batch of that shape comes (a smaller last batch has
    its own) or exported from ``model`` if the cache has none. Every program borrowed
    gets all of its weights overwritten with ``model``'s, so nothing of an earlier round
    stays. The weights live in the first program's memory and one ExecuTorch SGD, made
    for this object (one round), steps them, so its momentum carries across shapes but
    not across rounds; another program gets them copied in before each run and hands
    its gradients to that SGD. :meth:`release` gives the programs back.

    Parameters
    ----------
    model : SplittableModel
        The network holding the round's weights; programs get them from it and it is
        not modified until :meth:`load_into`.
    cut : int
        Stages ``[0, cut)`` are the device's.
    lr, momentum, weight_decay : float
        SGD settings (ExecuTorch's SGD, as the device's optimiser).
    config : str
        What built ``model`` (part of the programs' key, see :func:`architecture`).
    cache : ProgramCache, optional
        Where programs are borrowed from (default: the process's :data:`PROGRAMS`).
    """

    def __init__(self, model: SplittableModel, cut: int, *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, config: str = "",
                 cache: ProgramCache | None = None) -> None:
        self._model, self._cut = model, cut
        self._bottom, _ = split(model, cut)
        self._architecture = architecture(model, cut, config)
        self._cache = PROGRAMS if cache is None else cache
        self._sgd = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self._programs: dict[ProgramKey, ExecuTorchClientStep] = {}
        # The program whose memory holds the weights (the first one borrowed).
        self._holder: ExecuTorchClientStep | None = None
        self._optimizer: Any = None

    @property
    def planned_bytes(self) -> int:
        """Bytes of the largest memory plan so far (what the runtime allocates to run one)."""
        return max((p.step.planned_bytes for p in self._programs.values()), default=0)

    def activations(self, x: Tensor) -> Tensor:
        """Return the activations at the cut for batch ``x`` (the weights do not change)."""
        return self._synced(x).run(x)

    def train(self, x: Tensor, grad_out: Tensor) -> Tensor:
        """Backpropagate the trunk's ``grad_out`` for batch ``x`` and take an SGD step."""
        program = self._synced(x)
        out = program.run(x, grad_out)  # the run recomputes every gradient
        self._optimizer.step(program.gradients())
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """Return a copy of the device's weights, keyed as the split model's stages are."""
        return {} if self._holder is None else self._holder.state_dict()

    @torch.no_grad()
    def load_into(self, bottom: nn.Module) -> None:
        """Copy the trained weights into ``bottom`` (the model's stages ``[0, cut)``)."""
        for name, value in self.state_dict().items():
            target = bottom.get_parameter(name)
            target.copy_(value.reshape(target.shape))

    def release(self) -> None:
        """Give the programs back to the cache; the weights are gone from here after."""
        programs, self._programs = self._programs, {}
        self._holder = self._optimizer = None  # another borrower may overwrite them now
        for key, program in programs.items():
            self._cache.give_back(key, program)

    def _synced(self, x: Tensor) -> ExecuTorchClientStep:
        """Return the program for ``x``'s shape, holding the current weights."""
        program = self._program(x)
        if program is not self._holder:
            assert self._holder is not None  # the first program borrowed is the holder
            _copy_weights(self._holder.parameters(), program)
        return program

    def _program(self, x: Tensor) -> ExecuTorchClientStep:
        key = ProgramKey(self._architecture, self._cut, tuple(x.shape))
        program = self._programs.get(key)
        if program is not None:
            return program
        program = self._cache.lend(key, lambda: self._export(key), fits=self._fits)
        if not self._fits(program):
            raise RuntimeError(f"the program exported at cut {self._cut} does not hold the "
                               "stages' parameters one for one")
        self._programs[key] = program
        if self._holder is None:
            from executorch.extension.training import get_sgd_optimizer

            _copy_weights({PREFIX + k: v for k, v in self._bottom.named_parameters()}, program)
            self._holder = program
            self._optimizer = get_sgd_optimizer(program.parameters(), **self._sgd)
        return program

    def _export(self, key: ProgramKey) -> ExecuTorchClientStep:
        """Export the program for ``key``'s batch shape and allocate its parameters."""
        exported = export_client_step(self._model, self._cut, batch_size=key.input_shape[0])
        program = ExecuTorchClientStep(exported, **self._sgd)
        program.run(torch.zeros(key.input_shape))  # ExecuTorch 1.5 allocates them on a run
        return program

    def _fits(self, program: ExecuTorchClientStep) -> bool:
        """Whether ``program``'s parameters are the stages', name for name and shape for shape.

        Then writing them all leaves nothing of the program's earlier weights.
        """
        mine = {PREFIX + name: p.shape for name, p in self._bottom.named_parameters()}
        return {name: p.shape for name, p in program.parameters().items()} == mine


@torch.no_grad()
def _copy_weights(source: dict[str, Tensor], program: ExecuTorchClientStep) -> None:
    """Overwrite every parameter of ``program`` with ``source``'s (keyed as the program's)."""
    for name, value in program.parameters().items():
        value.copy_(source[name])


def _unprefixed(named: dict[str, Tensor]) -> dict[str, Tensor]:
    """Copy the program's tensors, keyed without the export wrapper's ``bottom.``."""
    return {name.removeprefix(PREFIX): value.detach().clone() for name, value in named.items()}
