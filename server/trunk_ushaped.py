"""U-shaped split learning on the trunk: the middle stages, two exchanges per batch.

In the U-shaped configuration (Vepakomma et al. 2018, "Split learning for
health") the device keeps the first stages, the last stages *and* the loss, so
labels never leave it. Per batch:

1. ``forward`` (activations at the cut, nothing else) -> the trunk runs stages
   ``[cut, tail_cut)``, keeps the autograd graph for that session and answers
   ``features`` (its output at ``tail_cut``).
2. The device runs its tail and the loss, backpropagates to the features and
   sends ``backward`` (d loss / d features) -> the trunk backpropagates through
   the pending graph, steps its optimiser and answers ``gradient`` (the
   gradient at the cut).

``evaluate`` is forward-only (eval mode, no graph, no update). Each session has
at most one pending graph: a second ``forward`` replaces it (the abandoned
batch never stepped the trunk, and the reply's ``meta`` says so), a
``backward`` without one is refused. Refusals change no state. Pending graphs
are dropped when their session ends or its round's tokens are revoked.

Concurrency. The trunk's step is atomic under its lock, as in
:meth:`server.trunk.Trunk.train_step`, but here forward and step are two frames
apart, and another session may step the shared trunk in between. The pending
graph then holds weights that changed in place, so the step recomputes the
forward on the current weights from the kept activations (batch-norm
statistics restored, so they move once per batch) and applies the device's
gradient there: the usual bounded staleness of asynchronous split learning.
With one session at a time nothing changes in between and the kept graph is
used as is: exactly whole-model SGD.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from server.trunk import Trunk
from splitlearn.split import resolve_tail_cut
from splitlearn.wire import (
    Frame,
    FrameError,
    check_backward_frame,
    check_forward_frame,
    check_label_free,
    encode_frame,
)

#: What a U-shaped session may send.
USHAPED_REQUESTS = ("forward", "backward", "evaluate")


@dataclass
class _Pending:
    """One session's batch between its ``forward`` and its ``backward``."""

    trunk: Trunk
    cut: int
    tail_cut: int
    activations: Tensor  # leaf at the cut (requires grad)
    features: Tensor  # output at tail_cut, graph attached
    versions: tuple[int, ...]  # in-place versions of the stages' parameters after forward


def _stage_params(trunk: Trunk, cut: int, tail_cut: int) -> list[Tensor]:
    return [p for stage in trunk.model.stages[cut:tail_cut] for p in stage.parameters()]


def _versions(tensors: Iterable[Tensor]) -> tuple[int, ...]:
    # Autograd's own staleness test: an optimiser step bumps a parameter's _version.
    # (Batch-norm running statistics are not saved for backward, so another
    # session's forward alone does not make a pending graph stale.)
    return tuple(t._version for t in tensors)


def _run_stages(trunk: Trunk, cut: int, tail_cut: int, x: Tensor) -> Tensor:
    for stage in trunk.model.stages[cut:tail_cut]:
        x = stage(x)
    return x


class UShapedTrunk:
    """Pending graphs of U-shaped sessions, keyed by session token (thread-safe).

    Parameters
    ----------
    max_batch : int
        Largest accepted batch.
    """

    def __init__(self, *, max_batch: int) -> None:
        self.max_batch = max_batch
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        #: Forwards whose backward never came before the next forward.
        self.replaced = 0
        #: Steps that recomputed their forward because the trunk changed in between.
        self.recomputed = 0

    @property
    def pending_sessions(self) -> int:
        """Sessions holding a graph right now."""
        with self._lock:
            return len(self._pending)

    def drop(self, sessions: Iterable[str]) -> None:
        """Forget the pending graphs of ``sessions`` (ended or revoked)."""
        with self._lock:
            for session in sessions:
                self._pending.pop(session, None)

    def handle(
        self, frame: Frame, *, session: str, cut: int, tail_cut: int, trunk: object
    ) -> bytes:
        """Answer one U-shaped request frame.

        Parameters
        ----------
        frame : Frame
            A decoded request frame.
        session : str
            The session's token (one pending graph per token).
        cut, tail_cut : int
            From the session's grant: the trunk runs stages ``[cut, tail_cut)``.
        trunk : object
            The :class:`~server.trunk.Trunk` this session trains.

        Returns
        -------
        bytes
            A ``features`` or ``gradient`` frame.

        Raises
        ------
        FrameError
            Naming why the frame is refused; nothing was changed.
        """
        if not isinstance(trunk, Trunk):
            raise FrameError(
                f"U-shaped sessions need a shared or per-client trunk, not {type(trunk).__name__}"
            )
        try:
            resolve_tail_cut(trunk.model, cut, tail_cut)
        except ValueError as err:
            raise FrameError(f"session grant: {err}") from None
        if frame.kind == "backward":
            return encode_frame("gradient", {"grad": self._backward(frame, session)})
        if frame.kind not in ("forward", "evaluate"):
            raise FrameError(
                f"U-shaped sessions may send {', '.join(map(repr, USHAPED_REQUESTS))}, "
                f"not {frame.kind!r}"
            )
        check_label_free(frame, allowed=("activations",))
        acts, _ = check_forward_frame(
            frame, cut_shape=trunk.cut_shape(cut), num_classes=trunk.model.num_classes,
            max_batch=self.max_batch, need_labels=False,
        )
        if frame.kind == "evaluate":
            return encode_frame("features", {"features": self.evaluate(trunk, cut, tail_cut, acts)})
        features, replaced = self.forward(session, trunk, cut, tail_cut, acts)
        meta = {"replaced_pending": True} if replaced else {}
        return encode_frame("features", {"features": features}, meta)

    def forward(
        self, session: str, trunk: Trunk, cut: int, tail_cut: int, activations: Tensor
    ) -> tuple[Tensor, bool]:
        """Run stages ``[cut, tail_cut)`` in training mode and keep the graph.

        Returns
        -------
        tuple[Tensor, bool]
            The features (detached) and whether a pending forward was replaced.
        """
        acts = activations.detach().requires_grad_(True)
        params = _stage_params(trunk, cut, tail_cut)
        with trunk._lock:
            started = time.perf_counter()
            trunk.model.train()
            features = _run_stages(trunk, cut, tail_cut, acts)
            versions = _versions(params)
            trunk.busy_s += time.perf_counter() - started
        pending = _Pending(trunk, cut, tail_cut, acts, features, versions)
        with self._lock:
            replaced = self._pending.pop(session, None) is not None
            self._pending[session] = pending
            self.replaced += replaced
        return features.detach(), replaced

    def _backward(self, frame: Frame, session: str) -> Tensor:
        with self._lock:
            pending = self._pending.get(session)
        if pending is None:
            raise FrameError(
                "backward without a pending forward: send the batch's 'forward' first"
            )
        grad = check_backward_frame(frame, features_shape=pending.features.shape)
        with self._lock:
            if self._pending.get(session) is not pending:
                raise FrameError("the pending forward was replaced while this backward arrived")
            del self._pending[session]
        return self.step(pending, grad)

    def step(self, pending: _Pending, grad: Tensor) -> Tensor:
        """Backpropagate ``grad`` through the pending forward, step, return the cut gradient."""
        trunk, cut, tail_cut = pending.trunk, pending.cut, pending.tail_cut
        params = _stage_params(trunk, cut, tail_cut)
        with trunk._lock:
            started = time.perf_counter()
            acts, features = pending.activations, pending.features
            stale = _versions(params) != pending.versions
            restore: list[tuple[Tensor, Tensor]] = []
            if stale:
                self.recomputed += 1
                buffers = [b for s in trunk.model.stages[cut:tail_cut] for b in s.buffers()]
                restore = [(b, b.detach().clone()) for b in buffers]
                trunk.model.train()
                acts = acts.detach().requires_grad_(True)
                features = _run_stages(trunk, cut, tail_cut, acts)
            trunk.optimizer.zero_grad(set_to_none=True)
            features.backward(grad.to(features.dtype))
            with torch.no_grad():
                for buffer, saved in restore:  # this batch's statistics count once
                    buffer.copy_(saved)
            trunk.optimizer.step()
            trunk.steps += 1
            trunk.samples += len(acts)
            trunk.busy_s += time.perf_counter() - started
        assert acts.grad is not None
        return acts.grad

    @torch.no_grad()
    def evaluate(self, trunk: Trunk, cut: int, tail_cut: int, activations: Tensor) -> Tensor:
        """Features at ``tail_cut`` in eval mode, without a graph or an update."""
        with trunk._lock:
            trunk.model.eval()
            return _run_stages(trunk, cut, tail_cut, activations)
