"""The server trunk: one model, one optimiser, one lock, and one way to change them.

Every session handler trains through :meth:`Trunk.step`: it holds the lock from
forward to optimiser step, so concurrent clients never interleave a half-applied
update and a client that vanishes between steps leaves the trunk consistent. It
also does the books (steps, samples, busy seconds) and refuses to apply an update
whose gradients are not finite, so no input can leave the weights NaN.
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import get_total_norm, parameters_to_vector

from server.cores import StickyCore
from server.guard import TrunkGuard
from splitlearn.accelerators import autocast, resolve_device
from splitlearn.config import OptimizerConfig
from splitlearn.dataplane.codec import FrameError, Reason
from splitlearn.models import SplittableModel
from splitlearn.optim import make_optimizer, set_lr, trained_params
from splitlearn.stages import load_bottom_state

#: Separates a parameter's name from its optimiser state entry in :meth:`Trunk.optimizer_state`.
STATE_SEP = "|"


class Trunk:
    """Server-side stages of a splittable model.

    Parameters
    ----------
    model : SplittableModel
        The server's copy of the whole model; a session with cut ``k`` runs and
        trains ``model.stages[k:]`` (or up to a U-shaped tail cut). Stages below
        every cut in use get no gradient, so SGD leaves them as they are.
    lr, momentum, weight_decay : float
        The optimiser's base learning rate (the schedule scales it: :meth:`set_lr_factor`),
        and SGD's momentum and weight decay (:func:`splitlearn.optim.optimizer_kwargs`).
    optimizer : OptimizerConfig, optional
        Which optimiser (Hydra ``_target_``); None: plain SGD.
    device : torch.device | str
        Where the model, its optimiser state and its steps live (a ``server.device``
        value, resolved by :func:`splitlearn.accelerators.resolve_device`). Each batch
        moves there and its answer back to the host; every state this class returns
        (stages, optimiser state, checkpoint, snapshot) is on the host.
    precision : str
        ``fp32``, or ``bf16``: the forward under autocast to bfloat16 (its output, and
        so the loss and the gradient at the cut, back in float32).
    channels_last : bool, optional
        Give the stages 4-D activations channels-last (NHWC); None: as the model
        prefers (:attr:`SplittableModel.channels_last`). Only the activations change
        layout: the weights, their state and the gradient sent back keep PyTorch's
        standard one.
    sticky_core : bool
        Start every step on the core the last one ended on, whichever thread takes it
        (:class:`server.cores.StickyCore`; Linux).
    guard : TrunkGuard, optional
        Bounds each device's influence (:mod:`server.guard`): its sessions admit rows
        through it, and every step's update is clipped by it. None: no bounds beyond
        the data plane's fixed ones.
    """

    def __init__(
        self, model: SplittableModel, *, lr: float, momentum: float = 0.0,
        weight_decay: float = 0.0, optimizer: OptimizerConfig | None = None,
        device: torch.device | str = "cpu", precision: str = "fp32",
        channels_last: bool | None = None, sticky_core: bool = True,
        guard: TrunkGuard | None = None,
    ) -> None:
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.precision = precision
        autocast(self.device, precision)  # refuses an unknown precision now, not mid-step
        self._on_host = self.device.type == "cpu"
        self.model = model
        self.guard = guard
        self.hyper = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                      "optimizer": optimizer or OptimizerConfig()}
        #: The schedule's factor this round: the optimiser trains at ``lr`` times it.
        self.lr_factor = 1.0
        self.channels_last = model.channels_last if channels_last is None else channels_last
        # Shapes never change; probing them per frame would run the model under
        # concurrent training steps.
        self._cut_shapes = {cut: model.cut_shape(cut) for cut in model.valid_cuts}
        model.to(self.device)  # before the optimiser: its state is made where the weights are
        self.optimizer = make_optimizer(
            model.parameters(), self.hyper["optimizer"], lr=lr, momentum=momentum,
            weight_decay=weight_decay, key="strategy.trunk_optimizer")
        self._params = trained_params(self.optimizer)
        self._lock = threading.Lock()
        self.core = StickyCore(enabled=sticky_core)
        self._buffers = list(model.buffers())  # batch-norm statistics: a refused step restores them
        self.steps = 0
        self.samples = 0
        #: Samples each stage was trained on since :meth:`take_stage_samples` (per-client
        #: cuts: a stage's copy here is weighted by them when the round's copies merge).
        self.stage_samples = [0] * model.num_stages
        #: Seconds spent holding the trunk (the virtual clock adds them per round).
        self.busy_s = 0.0
        # The step in progress (lock held): its first stage and the rows it first ran,
        # which the guard's loss check charges to their sender.
        self._step_cut: int | None = None
        self._step_rows: Tensor | None = None
        self._step_forwards = 0  # forwards in the step: more than one is several frames

    @property
    def num_classes(self) -> int:
        """Classes of the model's output."""
        return self.model.num_classes

    def cut_shape(self, cut: int) -> tuple[int, ...]:
        """Per-sample shape of the activation at ``cut`` (ValueError if invalid)."""
        return self._cut_shapes[self.model.check_cut(cut)]

    def run(self, x: Tensor, start: int, end: int | None = None) -> Tensor:
        """Run stages ``[start, end)`` (to the output when ``end`` is None)."""
        if self._step_cut is not None:
            self._step_forwards += 1
            if self._step_rows is None:
                self._step_rows = x  # the batch as the session admitted it (a view of its frame)
        if not self._on_host:  # differentiable: the gradient at the cut comes back to the host
            x = x.to(self.device, non_blocking=True)
        if self.channels_last and x.dim() == 4:
            # A differentiable copy: a leaf's .grad keeps the leaf's layout (autograd's
            # layout contract), so the gradient at the cut goes back as it came.
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(self.device, self.precision):
            # islice: slicing the ModuleList would build a new ModuleList per step (~25 us).
            for stage in itertools.islice(self.model.stages, start, end):
                x = stage(x)
        if self.precision != "fp32" and x.is_floating_point():
            x = x.float()  # the loss, and what goes back on the wire, in float32
        return x if self._on_host else x.to("cpu")

    @contextmanager
    def _held(self, *, train: bool) -> Iterator[None]:
        with self._lock:
            self.core.enter()
            started = time.perf_counter()
            if self.model.training != train:  # walking every module costs ~70 us a step
                self.model.train(train)
            try:
                yield
            finally:
                self.busy_s += time.perf_counter() - started
                self.core.leave()

    @contextmanager
    def step(
        self, *, samples: int, from_stage: int, to_stage: int | None = None
    ) -> Iterator[Callable[..., None]]:
        """Hold the trunk for one update; the body runs its forward and calls the yielded backward.

        ``with trunk.step(samples=n, from_stage=cut) as backward: ...; backward(loss)``
        (``backward(loss, labels=labels)`` lets the guard compare the batch's loss with
        held-out rows of the same labels; or ``backward(output, gradient)``); stages
        ``[from_stage, to_stage)`` (to the last when ``to_stage`` is None; a U-shaped tail
        is the device's) are booked
        as trained on ``samples``. The update is applied only if the body
        returns and every gradient is finite; otherwise nothing changes (weights,
        optimiser state, and buffers the forward moved such as batch-norm statistics).
        With a guard, a loss given to ``backward`` is checked first
        (:meth:`TrunkGuard.check_loss`): a batch whose loss is far beyond the recent
        range is refused the same way, before any gradient is computed.

        Raises
        ------
        FrameError
            ``STEP_NOT_FINITE`` when a gradient is NaN or infinite; ``OUT_OF_RANGE``
            when the guard refuses the batch's loss.
        """
        with self._held(train=True):
            saved = self._save_buffers()
            self._step_cut, self._step_rows, self._step_forwards = from_stage, None, 0
            try:
                yield self._backward
                self._check_and_clip_gradients()
            except BaseException:
                self.optimizer.zero_grad(set_to_none=True)
                self._restore_buffers(saved)
                raise
            finally:
                self._step_cut = self._step_rows = None
            self.optimizer.step()
            self.steps += 1
            self.samples += samples
            for index in range(from_stage, to_stage or len(self.stage_samples)):
                self.stage_samples[index] += samples

    def _backward(self, output: Tensor, gradient: Tensor | None = None, *,
                  labels: Tensor | None = None) -> None:
        if gradient is None and self.guard is not None and self._step_cut is not None:
            # ``output`` is the batch's mean loss: refused before any gradient is computed.
            # A step over several frames' forwards (SGLR's group) is no one device's batch:
            # its loss is not charged to the first one's sender.
            rows = self._step_rows if self._step_forwards == 1 else None
            self.guard.check_loss(float(output.detach()), self._step_cut, classes=self.num_classes,
                                  rows=rows, labels=labels,
                                  reference=self._reference_loss)
        # Zeroed right before the backward: the gradients then reuse the memory the
        # last step's just freed (zeroing before the forward cost ~8% per step).
        self.optimizer.zero_grad(set_to_none=True)
        output.backward(gradient)

    def _reference_loss(self, rows: Tensor, labels: Tensor) -> float:
        """Return the mean loss of the step's stages, as they are, on held-out ``rows``.

        Called by the guard within a step (the trunk held), in the step's mode; the
        batch-norm statistics the forward moves are put back.
        """
        saved = self._save_buffers()
        try:
            with torch.no_grad():
                logits = self.run(rows, self._step_cut)  # type: ignore[arg-type]
                return float(nn.functional.cross_entropy(logits, labels))
        finally:
            self._restore_buffers(saved)

    @contextmanager
    def forward_only(self, *, train: bool) -> Iterator[None]:
        """Hold the trunk without updating it (evaluation; a U-shaped forward)."""
        with self._held(train=train):
            yield

    def _check_and_clip_gradients(self) -> None:
        # The optimiser's list: the model's own parameters() walks every module (~0.1 ms).
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        # One fused pass: a NaN or infinite entry (or an overflowing norm) is not finite.
        norm = float(get_total_norm(grads))
        if not math.isfinite(norm):
            raise FrameError(
                Reason.STEP_NOT_FINITE, "the step's gradients are not finite; not applied"
            )
        if self.guard is not None:
            self.guard.clip(grads, norm)

    def _save_buffers(self) -> Tensor | None:
        # One flat copy (counts become floats: exact below 2**24 batches).
        return parameters_to_vector(self._buffers) if self._buffers else None

    def _restore_buffers(self, saved: Tensor | None) -> None:
        if saved is None:
            return
        with torch.no_grad():
            values = saved.split([b.numel() for b in self._buffers])
            for buffer, value in zip(self._buffers, values, strict=True):
                buffer.copy_(value.view_as(buffer))

    def set_lr_factor(self, factor: float) -> None:
        """Train at the base learning rate times ``factor`` from now on (the round's schedule)."""
        with self._lock:
            self.lr_factor = factor
            set_lr(self.optimizer, self.hyper["lr"] * factor)

    def forget_optimizer_state(self, stages: Iterable[int]) -> None:
        """Drop the optimiser state (momentum, Adam's moments) of ``stages``' parameters.

        Those are stages that left the trunk for devices: one that comes back later starts
        afresh, as it would on a device, instead of applying momentum from before its
        weights were merged elsewhere.
        """
        with self._lock:
            for index in stages:
                for param in self.model.stages[index].parameters():
                    self.optimizer.state.pop(param, None)

    def optimizer_state(self) -> dict[str, Tensor]:
        """Return a copy of each parameter's optimiser state, keyed ``"<name>|<entry>"``.

        ``<name>`` is the parameter's key in :meth:`stage_state` (so the state merges per
        stage as the weights do); ``<entry>`` is the optimiser's (``momentum_buffer``;
        Adam's ``step``, ``exp_avg``, ``exp_avg_sq``). Parameters the optimiser has not
        stepped (or that keep no state, such as SGD without momentum) are left out.
        """
        with self._lock:
            return {f"{name}{STATE_SEP}{entry}": value.to("cpu", copy=True)
                    for name, param in self.model.stages.named_parameters()
                    if (state := self.optimizer.state.get(param))
                    for entry, value in state.items()
                    if isinstance(value, Tensor)}

    def load_optimizer_state(self, saved: Mapping[str, Tensor]) -> None:
        """Replace each parameter's optimiser state by ``saved``'s (those it lacks start afresh)."""
        by_param: dict[str, dict[str, Tensor]] = {}
        for key, value in saved.items():
            name, _, entry = key.rpartition(STATE_SEP)
            by_param.setdefault(name, {})[entry] = value
        with self._lock:
            for name, param in self.model.stages.named_parameters():
                if name in by_param:
                    # Per-parameter state where the parameter is; a scalar (Adam's step count)
                    # stays on the host, as torch's optimisers keep it.
                    self.optimizer.state[param] = {
                        entry: value.to(param.device, copy=True) if value.dim() else value.clone()
                        for entry, value in by_param[name].items()}
                else:
                    self.optimizer.state.pop(param, None)

    def take_books(self) -> dict[str, Any]:
        """Return steps, samples, busy seconds and samples per stage, and start counting again."""
        with self._lock:
            books = {"steps": self.steps, "samples": self.samples, "busy_s": self.busy_s,
                     "stage_samples": self.stage_samples}
            self.steps = self.samples = 0
            self.busy_s = 0.0
            self.stage_samples = [0] * len(self.stage_samples)
            return books

    def take_stage_samples(self) -> list[int]:
        """Return the samples per stage since the last call, and start counting again."""
        with self._lock:
            taken, self.stage_samples = self.stage_samples, [0] * len(self.stage_samples)
            return taken

    def stage_state(self) -> dict[str, Tensor]:
        """Return a copy of every stage's state, keyed ``"<stage index>.…"`` as clients do."""
        with self._lock:
            return {k: v.detach().to("cpu", copy=True)
                    for k, v in self.model.stages.state_dict().items()}

    def load_stages(self, state: Mapping[str, Tensor]) -> None:
        """Replace the stages ``state`` names (keys ``"<stage index>.…"``, whole stages only)."""
        with self._lock:
            load_bottom_state(self.model, state)

    def fork(self) -> Trunk:
        """Return an independent trunk on a copy of the model, with a fresh optimiser."""
        with self._lock:
            forked = Trunk(copy.deepcopy(self.model), **self.hyper, device=self.device,
                           precision=self.precision, channels_last=self.channels_last,
                           sticky_core=self.core.active, guard=self.guard)
        forked.set_lr_factor(self.lr_factor)
        return forked

    def host_model(self) -> SplittableModel:
        """Return the model on the host to read (calibration, shapes): itself on the CPU.

        Not a copy there, so not to be trained or changed; a snapshot on an accelerator.
        """
        return self.model if self._on_host else self.snapshot()

    def snapshot(self) -> SplittableModel:
        """Return an independent copy of the whole server model, on the host."""
        with self._lock:
            return copy.deepcopy(self.model).to("cpu")

    def state_dict(self) -> dict[str, Any]:
        """Return everything that carries over between rounds: weights, momentum, books."""
        with self._lock:
            return {"model": _on_host(self.model.state_dict()),
                    "optimizer": _on_host(self.optimizer.state_dict()),
                    "books": {"steps": self.steps, "samples": self.samples,
                              "busy_s": self.busy_s, "stage_samples": list(self.stage_samples)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run continues from it)."""
        with self._lock:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            books = state["books"]
            self.steps, self.samples = books["steps"], books["samples"]
            self.busy_s, self.stage_samples = books["busy_s"], list(books["stage_samples"])

    def add_books(self, *, steps: int, samples: int, busy_s: float) -> None:
        """Add the books of trunk copies merged into this one (SplitFed v1)."""
        with self._lock:
            self.steps += steps
            self.samples += samples
            self.busy_s += busy_s


def _on_host(state: Any) -> Any:
    """Return a copy of ``state`` (nested dicts and lists of tensors), every tensor on the host."""
    if isinstance(state, Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _on_host(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_host(v) for v in state)
    return copy.deepcopy(state)
