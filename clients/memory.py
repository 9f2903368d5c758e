"""Measure the memory a device holds while it trains one batch.

:class:`MemoryMeter` counts the tensors autograd keeps alive for backward (seen
through :func:`torch.autograd.graph.saved_tensors_hooks`) plus tensors the step
says it holds (the activations at the cut, kept until sent), and adds the
parameters, their gradients and the optimiser's state. Each saved tensor is
counted by its storage, once however many views of it are saved, and only while
that storage is alive: a weak-reference callback on the storage takes it off the
count when autograd (or anyone) lets go of it. So an activation that recomputation
(:mod:`clients.recompute`) frees after the forward and rebuilds during backward is
counted at the moment it really lives, and the meter's peak is the most that was
alive at once rather than a sum over the batch.

What it leaves out: parameters and buffers that layers save (they are counted
once as parameters; buffers not at all, like the estimate), and temporaries that
no layer saves (a tensor consumed at once by the next operation, the gradients
flowing backward). It is the measured counterpart of
:func:`splitlearn.calibration.client_train_memory_bytes`, not of the process's
resident memory.

:func:`memory_saving_ratio` uses it to compare training the whole model on the
device with training only the client's stages, recomputed.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from clients.cut_gradient import GradientRoot
from clients.recompute import run_stages
from splitlearn.models import SplittableModel
from splitlearn.models.lean import mask_cut_relu

_PackHook = Callable[[Tensor], Any]
_UnpackHook = Callable[[Any], Tensor]

# torch has no public getter for the active saved-tensor hooks; this is the one its
# own AOT autograd uses (argument: ignore tracing). None if a release drops it.
_top_saved_tensor_hooks: Callable[[bool], tuple[_PackHook, _UnpackHook] | None] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None
)


class MemoryMeter:
    """Peak bytes held while training one batch of ``trained``'s parameters.

    Use it as a context manager around one batch (forward, backward, optimiser
    step). Saved tensors are watched from entry to exit; the parameter, gradient
    and optimiser-state bytes are read at exit, when they are as large as they get
    (the steady state the next batches keep).

    Parameters
    ----------
    trained : nn.Module
        The modules the device trains; their parameters and buffers are not
        counted as activations when a layer saves them.
    optimizer : torch.optim.Optimizer | None, optional
        The optimiser whose per-parameter state (e.g. momentum) is counted.

    Attributes
    ----------
    live_bytes : int
        Bytes of watched storages alive now (0 outside the window).
    peak_saved_bytes : int
        Most watched bytes alive at once during the window.
    state_bytes : int
        Parameters, gradients and optimiser state at exit (0 before).
    """

    def __init__(
        self, trained: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        self.trained = trained
        self.optimizer = optimizer
        self.live_bytes = 0
        self.peak_saved_bytes = 0
        self.state_bytes = 0
        self._active = False
        self._excluded: set[int] = set()
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._hooks: AbstractContextManager[None] = nullcontext()

    @property
    def peak_bytes(self) -> int:
        """Peak watched bytes plus parameters, gradients and optimiser state."""
        return self.peak_saved_bytes + self.state_bytes

    def __enter__(self) -> MemoryMeter:
        self._excluded = _storage_ptrs([*self.trained.parameters(), *self.trained.buffers()])
        self._active = True
        self._hooks = _observed_saved_tensors(self.watch)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        self._active = False
        # Dropping the weak references drops their callbacks: a storage that
        # outlives the window (a batch the data set keeps) no longer reports.
        self._refs.clear()
        self._live.clear()
        self.live_bytes = 0
        self.state_bytes = parameter_state_bytes(self.trained, self.optimizer)

    def watch(self, tensor: Tensor) -> None:
        """Count ``tensor``'s storage for as long as it is alive (once per storage).

        Parameters
        ----------
        tensor : Tensor
            A tensor the device holds, e.g. the activations at the cut. Ignored
            outside the window and for the trained modules' own parameters.
        """
        storage = tensor.untyped_storage()
        key = id(storage)
        if not self._active or key in self._live or storage.data_ptr() in self._excluded:
            return
        size = storage.nbytes()
        self._live[key] = size
        self.live_bytes += size
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.live_bytes)
        # Storages keep their Python object while the memory lives, so the
        # callback runs exactly when the memory is freed.
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._release(key))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Watch nothing new meanwhile: e.g. while the trunk works, which may be in this thread."""
        active, self._active = self._active, False
        try:
            yield
        finally:
            self._active = active

    def observing(self) -> AbstractContextManager[None]:
        """Also watch tensors saved under whatever saved-tensor hooks are active now.

        PyTorch recomputes a stage's activations under its own hooks, which
        hide them from the meter's; entered inside that recomputation, this wraps
        the current hooks so the recomputed tensors are counted too.
        """
        if not self._active or _top_saved_tensor_hooks is None:
            # Without the getter the new pair would replace PyTorch's own
            # and break it; the recomputed tensors then go uncounted instead.
            return nullcontext()
        return _observed_saved_tensors(self.watch)

    def _release(self, key: int) -> None:
        self._refs.pop(key, None)
        self.live_bytes -= self._live.pop(key, 0)


def parameter_state_bytes(
    trained: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Bytes of trainable parameters, their gradients and the optimiser's state.

    Parameters
    ----------
    trained : nn.Module
        The trained modules.
    optimizer : torch.optim.Optimizer | None, optional
        Its per-parameter state tensors (momentum, Adam moments) are added.

    Returns
    -------
    int
        Bytes as held now (a gradient that does not exist yet counts 0).
    """
    params = [p for p in trained.parameters() if p.requires_grad]
    total = sum(_nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0) for p in params)
    state = getattr(optimizer, "state", {})
    for p in params:
        total += sum(_nbytes(v) for v in state.get(p, {}).values() if isinstance(v, Tensor))
    return total


def memory_saving_ratio(
    model: SplittableModel, cut: int, *, batch_size: int, seed: int = 0
) -> dict[str, float]:
    """Measured memory of training the whole model vs the recomputed client side.

    Each figure is the peak of one SGD step with momentum on a random batch,
    measured with :class:`MemoryMeter` after a warm-up step (which creates the
    gradients and momentum the steady state holds): the whole model plainly,
    with cross-entropy; the client's stages ``[0, cut)`` as a split step trains
    them with recomputation (every stage recomputed, a
    :class:`~splitlearn.models.lean.MaskReLU` at the cut, the output dropped
    once sent), and for reference plainly, back-propagating a random gradient
    at the cut (the trunk's reply). ``model`` is not modified.

    Parameters
    ----------
    model : SplittableModel
        The network.
    cut : int
        A valid cut.
    batch_size : int
        Samples per batch.
    seed : int, optional
        Seed of the random batch and cut gradient.

    Returns
    -------
    dict[str, float]
        ``cut``; peak bytes ``whole_bytes``, ``client_bytes`` (recomputed) and
        ``client_plain_bytes``; ``ratio`` (``whole_bytes / client_bytes``) and
        ``plain_ratio`` (``whole_bytes / client_plain_bytes``).
    """
    cut = model.check_cut(cut)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, *model.input_shape, generator=generator)
    labels = torch.randint(0, model.num_classes, (batch_size,), generator=generator)
    grad = torch.randn(batch_size, *model.cut_shape(cut), generator=generator)

    def whole_loss(logits: Tensor) -> tuple[Tensor, None]:
        return nn.functional.cross_entropy(logits, labels), None

    def cut_gradient(activations: Tensor) -> tuple[Tensor, Tensor]:
        return activations, grad

    whole = _measure_steps(copy.deepcopy(model).stages, whole_loss, inputs, recompute=False)
    lean = copy.deepcopy(model)
    mask_cut_relu(lean, cut)  # as the split step does when it recomputes
    client = _measure_steps(lean.stages[:cut], cut_gradient, inputs, recompute=True,
                            frees_output=True)
    plain = _measure_steps(copy.deepcopy(model).stages[:cut], cut_gradient, inputs,
                           recompute=False)
    return {"cut": float(cut), "whole_bytes": float(whole), "client_bytes": float(client),
            "client_plain_bytes": float(plain), "ratio": whole / client,
            "plain_ratio": whole / plain}


#: From the stages' output: the tensor to back-propagate from and its gradient (None: a loss).
_Backward = Callable[[Tensor], tuple[Tensor, Tensor | None]]


def _measure_steps(
    stages: nn.ModuleList, backward: _Backward, inputs: Tensor, *, recompute: bool,
    frees_output: bool = False,
) -> int:
    """Peak bytes of the second of two SGD steps (the first creates grads and momentum).

    ``frees_output``: as a split step, drop the output (sent by then) before the
    backward, and recompute the last stage too.
    """
    stages.train()
    optimizer = torch.optim.SGD(stages.parameters(), lr=0.01, momentum=0.9)
    peak = 0
    for _ in range(2):
        meter = MemoryMeter(stages, optimizer)
        with meter:
            out = run_stages(stages, inputs, recompute=recompute,
                             recompute_output=frees_output, recompute_context=meter.observing)
            meter.watch(out)
            optimizer.zero_grad(set_to_none=True)
            start, grad = backward(out)
            if grad is None:  # a loss
                del out
                start.backward()
            else:
                root = GradientRoot(start)
                del out, start  # what a split step has sent, it no longer holds
                root.backward(grad)
            optimizer.step()
        peak = meter.peak_bytes
    return peak


@contextmanager
def _observed_saved_tensors(watch: Callable[[Tensor], None]) -> Iterator[None]:
    """Saved-tensor hooks that call ``watch`` on each saved tensor, then defer.

    Only the innermost pair of saved-tensor hooks applies, so when a pair is
    already active (PyTorch's recomputation) the new pair calls it rather
    than replacing it; otherwise it saves a detached alias (the documented way
    to avoid a reference cycle through the saved output's ``grad_fn``).
    """
    current = _current_saved_tensor_hooks()
    if current is None:
        pack: _PackHook = torch.Tensor.detach
        unpack: _UnpackHook = _identity
    else:
        pack, unpack = current

    def watching_pack(tensor: Tensor) -> Any:
        watch(tensor)
        return pack(tensor)

    with torch.autograd.graph.saved_tensors_hooks(watching_pack, unpack):
        yield


def _current_saved_tensor_hooks() -> tuple[_PackHook, _UnpackHook] | None:
    """Return the active pair of saved-tensor hooks, or None (also when torch cannot say)."""
    return None if _top_saved_tensor_hooks is None else _top_saved_tensor_hooks(True)


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage_ptrs(tensors: Sequence[Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}
