"""Bounds on what one device can do to a shared trunk with values inside every fixed bound.

The data plane refuses malformed, non-finite and absurdly large values
(``dataplane.max_abs_value``), but a device sending ordinary-looking activations of
1e6 passed those checks and, in three frames, pushed a shared trunk's weights to 1e15:
every other device's batches were refused ``STEP_NOT_FINITE`` from then on. A
:class:`TrunkGuard` bounds each device's influence where the trunk learns from it:

* **Rows calibrated from the cut's own distribution.** Each row (an example's tensor at
  a cut: activations, or a U-shaped device's returned gradient) must have an L2 norm
  within ``row_factor`` times the median norm of the recent rows seen at that cut. A
  frame with a row beyond it is refused ``OUT_OF_RANGE`` before the trunk runs it. The
  median is robust: a device sending a minority of the rows cannot move it far, however
  it picks its values (a quantile or a mean, which such a device can drag, would let
  the bound drift with it). Until ``min_rows`` rows were seen at a cut only the
  fixed bound applies, unless the run seeds the statistics (the ServerApp seeds them
  each round from its held-out data through the current device side: :meth:`seed`).
* **Clipped updates.** A trunk step's gradient norm is clipped to ``update_clip`` times
  the median of the recent steps' (after ``min_steps`` steps): a batch inside the row
  bounds still moves the trunk by at most a few ordinary steps.
* **Quarantine.** A device with ``strikes`` refused frames in a round is refused
  ``QUARANTINED`` for the rest of the round; the other devices carry on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from splitlearn.config import GuardConfig
from splitlearn.dataplane.codec import FrameError, Reason


class _Window:
    """Recent values and their median (refreshed every sixteenth of a window)."""

    def __init__(self, size: int, *, min_count: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.min_count = min_count
        self.refresh = max(1, size // 16)
        self.median: float | None = None  # None until min_count values were seen
        self._fresh = 0

    def add(self, values: list[float]) -> None:
        self.values.extend(values)
        self._fresh += len(values)
        if len(self.values) < self.min_count or (
                self.median is not None and self._fresh < self.refresh):
            return
        self.median = float(np.median(np.fromiter(self.values, dtype=np.float64)))
        self._fresh = 0

    def bound(self, factor: float) -> float | None:
        """``factor`` times the median, or None before ``min_count`` values."""
        return None if self.median is None else factor * self.median


class TrunkGuard:
    """A shared trunk's bounds on each device's influence (see the module docstring).

    Parameters
    ----------
    config : GuardConfig
        The bounds (``dataplane.guard``). A trunk without a guard has none
        (:func:`server.standalone.build_trunk_side` builds one when ``enabled``).
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, int], _Window] = {}
        self._steps = _Window(config.window_steps, min_count=config.min_steps)
        self._strikes: dict[tuple[str, int], int] = {}
        self._round = 0  # the latest round seen: older rounds' strikes are dropped
        #: Counts since :meth:`take_books`: refused frames, clipped steps, quarantined devices.
        self.refused = self.clipped = self.quarantined = 0

    def admit(self, client: str, server_round: int, what: str, cut: int, rows: Tensor) -> None:
        """Check a frame's rows at ``cut`` before the trunk learns from them.

        Parameters
        ----------
        client, server_round : str, int
            Who sent the frame, in which round (a quarantine lasts the round).
        what : str
            The tensor's kind (``activations``, ``gradient``): each kind at each cut has
            its own statistics.
        cut : int
            Where the rows stand in the network.
        rows : Tensor
            One row per example.

        Raises
        ------
        FrameError
            ``QUARANTINED`` for a device already quarantined this round, ``OUT_OF_RANGE``
            for a row beyond the bound (a strike).
        """
        norms = rows.detach().flatten(1).norm(dim=1)
        with self._lock:
            if server_round > self._round:  # quarantines last one round
                self._round = server_round
                self._strikes = {k: v for k, v in self._strikes.items() if k[1] >= server_round}
            if self._strikes.get((client, server_round), 0) >= self.config.strikes:
                raise FrameError(Reason.QUARANTINED, f"client {client} is quarantined for round "
                                 f"{server_round} after {self.config.strikes} refused frames")
            window = self._window(what, cut)
            largest = float(norms.max()) if len(norms) else 0.0
            bound = window.bound(self.config.row_factor)
            if bound is not None and largest > bound:
                self._strike(client, server_round)
                raise FrameError(Reason.OUT_OF_RANGE, (
                    f"{what} at cut {cut}: a row's norm {largest:.4g} is beyond the bound "
                    f"{bound:.4g} calibrated from recent rows (median {window.median:.4g})"))
            window.add(norms.tolist())

    def seed(self, what: str, cut: int, rows: Tensor) -> None:
        """Add rows of known provenance to a cut's statistics (see :func:`reference_rows`).

        Seeded rows need no warm-up: the bound applies from the next frame on.
        """
        norms = rows.detach().flatten(1).norm(dim=1).tolist()
        with self._lock:
            window = self._window(what, cut)
            window.min_count = min(window.min_count, len(norms))  # known rows need no warm-up
            window.add(norms)

    def bound(self, what: str, cut: int) -> float | None:
        """Return the current bound on a row's norm at ``cut`` (None: not calibrated yet)."""
        with self._lock:
            window = self._rows.get((what, cut))
            return None if window is None else window.bound(self.config.row_factor)

    def _window(self, what: str, cut: int) -> _Window:
        window = self._rows.get((what, cut))
        if window is None:
            window = self._rows[what, cut] = _Window(self.config.window_rows,
                                                     min_count=self.config.min_rows)
        return window

    def clip(self, grads: list[Tensor], norm: float) -> float:
        """Clip a step's gradients (total ``norm``) to the recent steps' bound; return the norm.

        Called with the trunk held, once per step whose gradients are finite.
        """
        if not self.config.update_clip:
            return norm
        with self._lock:
            median = self._steps.median
            if median is not None and norm > self.config.update_clip * median:
                bound = self.config.update_clip * median
                torch._foreach_mul_(grads, bound / norm)
                self.clipped += 1
                norm = bound
            # The clipped norm: a device that is clipped every step cannot raise the median.
            self._steps.add([norm])
            return norm

    def _strike(self, client: str, server_round: int) -> None:
        self.refused += 1
        key = (client, server_round)
        self._strikes[key] = self._strikes.get(key, 0) + 1
        if self._strikes[key] == self.config.strikes:
            self.quarantined += 1

    def take_books(self) -> dict[str, int]:
        """Return refused frames, clipped steps and devices quarantined; count again from 0."""
        with self._lock:
            books = {"guard_refused": self.refused, "guard_clipped": self.clipped,
                     "guard_quarantined": self.quarantined}
            self.refused = self.clipped = self.quarantined = 0
            return books


def reference_rows(model: nn.Module, inputs: Tensor, labels: Tensor, *, cuts: Sequence[int],
                   tail_cut: int | None, batch_size: int) -> dict[tuple[str, int], Tensor]:
    """Return what honest devices would send at each cut, from data of known provenance.

    ``model`` is the network as the devices hold it this round (their averaged side
    joined with the trunk, any release at the cut included); ``inputs``/``labels`` are
    the server's own held-out examples. Activations at every cut in ``cuts``; with a
    device tail (``tail_cut``), also the gradient a device returns there: that of its
    batch's mean loss (``batch_size`` rows a batch) with respect to the trunk's output.
    """
    stages = list(model.stages)  # type: ignore[attr-defined]
    rows: dict[tuple[str, int], Tensor] = {}
    with torch.no_grad():
        x = inputs
        for index, stage in enumerate(stages[:max(cuts)]):
            x = stage(x)
            if index + 1 in cuts:
                rows["activations", index + 1] = x
    if tail_cut is not None:
        grads = []
        for start in range(0, len(inputs), batch_size):
            with torch.no_grad():
                features = nn.Sequential(*stages[:tail_cut])(inputs[start:start + batch_size])
            features.requires_grad_(True)
            loss = nn.functional.cross_entropy(nn.Sequential(*stages[tail_cut:])(features),
                                               labels[start:start + batch_size])
            grads.append(torch.autograd.grad(loss, features)[0])
        rows["gradient", tail_cut] = torch.cat(grads)
    return rows
