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
  each round from its held-out data through the current device side, in its own trunk
  and in every trunk worker: :meth:`seed`).
* **Returned gradients** (U-shaped) are heavy-tailed: once the model is confident, a
  misclassified example's row is ~100 times the median row, so no factor of the median
  fits them. Once seeded, their bound is ``seed_factor`` times the largest row the
  server's own examples gave this round, each row compared per example (a short last
  batch's rows are larger by the batch's shortfall). Other rows are also accepted up to
  that bound when it is the larger.
* **Clipped updates.** A trunk step's gradient norm is clipped to ``update_clip`` times
  the median of the recent steps' (after ``min_steps`` steps): a batch inside the row
  bounds still moves the trunk by at most a few ordinary steps.
* **Checked losses.** One device's batch whose mean loss is beyond the larger of the
  chance-level loss (``ln C``) and ``loss_factor`` times the median of its cut's recent
  batch losses is refused ``OUT_OF_RANGE`` before its update is applied (a strike): the
  trunk keeps its pre-step weights, momentum and batch-norm statistics (the snapshot
  :meth:`server.trunk.Trunk.step` restores). Rows inside every bound can still carry
  lies (labels flipped, activations scaled); once the trunk has learned, such a batch's
  loss is tens of times the recent median. So can an honest one's under strong label
  skew: the trunk, trained on other devices' classes since, has forgotten this one's.
  A batch beyond the bound is therefore compared with the server's own held-out rows
  of the same labels (seeded each round at every cut), run through the trunk as it is
  at that step: within ``label_factor`` times their loss it is taken. Flipped labels
  stay far beyond what their claimed classes' true rows give. The loss of a step over
  several devices' batches together (``batch_concurrent``) is not checked: refusing it
  would refuse the honest rows with the poisoned ones, and the trunk cannot tell one
  device's share of it.
* **Gradients a labelling explains.** An honest U-shaped device returns, for each
  example, ``(p - e_y) J / B``: its tail's softmax minus the one-hot of its label, through
  the tail's Jacobian at the features it received, over its batch size. The server holds
  the round's tail (the merged device tails), so for each row it finds the label whose
  gradient is nearest (:func:`label_consistency`). A batch whose distance from those
  gradients, relative to their norm, is beyond the larger of ``residual_floor`` and
  ``residual_factor`` times the median of recent batches' is refused ``OUT_OF_RANGE``: a
  sign-flipped (gradient ascent) or otherwise made-up gradient is at 1 or more, an honest
  one only as far as its tail moved since the round began (and compression or noise made
  it differ; the ServerApp seeds the statistics with its own rows sent as devices send
  them). The labels found give the batch's loss as the round's tail sees it, checked as
  the trunk's own loss is below: a device training on flipped labels is caught there.
* **Quarantine.** A device with ``strikes`` refused frames in a round is refused
  ``QUARANTINED`` for the rest of the round; the other devices carry on. A refused
  batch's loss is charged to the device whose admitted frame the step trains on
  (:meth:`TrunkGuard.sender_of`).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from server.consistency import Consistency, frozen_tail, label_consistency
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


#: Kinds whose rows are a mean over their frame (a device's gradient of its batch's mean
#: loss): a row of a frame of n examples is compared as n / (the most rows of recent frames)
#: of its norm, so a short last batch's rows (2x for 16 of 32) are not taken for outliers,
#: and a device that sends one example at a time gets no more per example than one sending 32.
MEAN_KINDS = frozenset({"gradient"})
#: Admitted frames remembered (weakly, while alive) to charge a step's loss to its sender.
SENDERS_KEPT = 1024


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
        self._losses: dict[int, _Window] = {}  # per cut: recent single-device batch losses
        self._residuals: dict[int, _Window] = {}  # per tail cut: returned gradients' residuals
        self._seeded: dict[tuple[str, int], float] = {}  # the largest row of the last seeding
        self._frames: dict[str, deque[int]] = {}  # rows per recent frame, of the MEAN_KINDS
        # Storage address -> (the admitted rows, who sent them, in which round): a step
        # trains on a view of the rows its session admitted, so the address names the sender.
        self._senders: dict[int, tuple[weakref.ref[Tensor], str, int]] = {}
        self._strikes: dict[tuple[str, int], int] = {}
        # The server's held-out rows at each cut and their labels (the last seeding's).
        self._reference_rows: dict[int, Tensor] = {}
        self._reference_labels: Tensor | None = None
        self._round = 0  # the latest round seen: older rounds' strikes are dropped
        #: Counts since :meth:`take_books`: refused frames (of them, for their loss), clipped
        #: steps, quarantined devices.
        self.refused = self.loss_refused = self.clipped = self.quarantined = 0

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
            if what in MEAN_KINDS:  # as if the frame had the usual rows (see MEAN_KINDS)
                norms = norms * (len(rows) / self._usual_rows(what, len(rows)))
            if server_round > self._round:  # quarantines last one round
                self._round = server_round
                self._strikes = {k: v for k, v in self._strikes.items() if k[1] >= server_round}
            if self._strikes.get((client, server_round), 0) >= self.config.strikes:
                raise FrameError(Reason.QUARANTINED, f"client {client} is quarantined for round "
                                 f"{server_round} after {self.config.strikes} refused frames")
            window = self._window(what, cut)
            largest = float(norms.max()) if len(norms) else 0.0
            bound = self._bound(what, cut)
            if bound is not None and largest > bound:
                self._strike(client, server_round)
                raise FrameError(Reason.OUT_OF_RANGE, (
                    f"{what} at cut {cut}: a row's norm {largest:.4g} is beyond the bound "
                    f"{bound:.4g} calibrated from recent rows (median {window.median:.4g}) "
                    f"and the server's own (largest {self._seeded.get((what, cut), 0.0):.4g})"))
            window.add(norms.tolist())
            self._remember(rows, client, server_round)

    def _usual_rows(self, what: str, rows: int) -> int:
        """Return the most rows of the recent frames of ``what`` (this one included).

        The most, not the median: a device flooding short frames could drag a median
        down and get honest full frames refused; a long frame only lets every row by more.
        """
        recent = self._frames.get(what)
        if recent is None:
            recent = self._frames[what] = deque(maxlen=self.config.window_steps)
        recent.append(rows)
        return max(recent)

    def _remember(self, rows: Tensor, client: str, server_round: int) -> None:
        if len(self._senders) >= SENDERS_KEPT:  # forget the frames no session holds any more
            self._senders = {k: v for k, v in self._senders.items() if v[0]() is not None}
        self._senders[_address(rows)] = (weakref.ref(rows), client, server_round)

    def sender_of(self, rows: Tensor | None) -> tuple[str, int] | None:
        """Return (client, round) of the admitted frame ``rows`` are, or None.

        None for rows no admitted frame holds, such as the concatenated batches of
        several devices (``batch_concurrent``). The admitted frame must still be alive,
        so its memory cannot have been reused for other rows.
        """
        if rows is None:
            return None
        with self._lock:
            kept = self._senders.get(_address(rows))
        if kept is None:
            return None
        admitted, client, server_round = kept
        frame = admitted()
        if frame is None or frame.shape != rows.shape:
            return None
        return client, server_round

    def check_loss(self, loss: float, cut: int, *, classes: int, rows: Tensor | None,
                   labels: Tensor | None = None,
                   reference: Callable[[Tensor, Tensor], float] | None = None) -> None:
        """Refuse a batch whose mean loss is far beyond its cut's recent range (a strike).

        Called by the trunk before the batch's update is computed. Only a batch that is
        one device's admitted frame (``rows``) is checked and enters the statistics. A
        batch beyond the bound whose ``labels`` are given is taken when its loss is within
        ``label_factor`` times ``reference(rows, labels)``: the trunk's mean loss, as it is
        now, on the server's held-out rows at ``cut`` with the same labels.

        Raises
        ------
        FrameError
            ``OUT_OF_RANGE`` beyond ``max(ln classes, loss_factor x median)`` and beyond
            ``label_factor`` times the same labels' reference loss.
        """
        sender = self.sender_of(rows)
        if sender is not None:
            self._check_loss_of(sender, loss, cut, classes=classes, labels=labels,
                                reference=reference)

    def _check_loss_of(self, sender: tuple[str, int], loss: float, cut: int, *,
                       classes: int, floor: float = 1.0, labels: Tensor | None = None,
                       reference: Callable[[Tensor, Tensor], float] | None = None) -> None:
        """Check ``sender``'s batch loss at ``cut`` (see :meth:`check_loss`).

        The bound is at least ``floor`` times the chance level ``ln classes``.
        """
        if not self.config.loss_factor or not math.isfinite(loss):
            return  # a non-finite loss leaves non-finite gradients: STEP_NOT_FINITE
        with self._lock:
            window = self._loss_window(cut)
            median = window.median
            bound = None if median is None else max(floor * math.log(classes),
                                                    self.config.loss_factor * median)
            if bound is None or loss <= bound:
                window.add([loss])
                return
            same = self._same_labels(cut, labels) if reference is not None else None
        # Outside the lock: the reference runs the trunk's stages.
        known = None if same is None else reference(*same)  # type: ignore[misc]
        with self._lock:
            if known is not None and loss <= self.config.label_factor * known:
                window.add([loss])
                return
            self.loss_refused += 1
            self._strike(*sender)
        beside = "" if known is None else f", {known:.4g} on held-out rows of its labels"
        raise FrameError(Reason.OUT_OF_RANGE, (
            f"the batch's loss {loss:.4g} at cut {cut} is beyond the bound {bound:.4g} from "
            f"recent batches (median {median:.4g}{beside}); not applied"))

    def _same_labels(self, cut: int, labels: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """Return held-out rows at ``cut`` with ``labels``' labels, one per row (None: too few).

        Each label takes the held-out rows of that label in turn; a batch whose labels
        are not half covered by held-out rows (a class the server holds no example of)
        gets none.
        """
        rows, held = self._reference_rows.get(cut), self._reference_labels
        if not self.config.label_factor or labels is None or rows is None or held is None:
            return None
        wanted = labels.detach().to("cpu", torch.long).flatten()
        picks: list[int] = []
        for label, count in zip(*torch.unique(wanted, return_counts=True), strict=True):
            pool = torch.nonzero(held == label).flatten()
            if len(pool):
                picks += pool.repeat(int(count) // len(pool) + 1)[:int(count)].tolist()
        if 2 * len(picks) < len(wanted):
            return None
        index = torch.tensor(picks)
        return rows[index], held[index]

    def check_returned(self, client: str, server_round: int, cut: int, *, tail: nn.Module,
                       features: Tensor, grad: Tensor) -> Consistency | None:
        """Refuse a returned gradient no labelling of the batch explains (a strike).

        ``tail`` is the device's tail as the server knows it (in eval mode: see
        :mod:`server.consistency`), ``features`` what the trunk sent for the batch and
        ``grad`` what came back. Called before the trunk backpropagates ``grad``. The
        labels found also give the batch's loss, which is checked as :meth:`check_loss`
        checks the trunk's own, against a bound of at least ``tail_loss_floor`` times the
        chance level (a device's own tail gives honest losses a wider spread), when they
        explain the gradient within ``residual_floor``: under gradient noise or lossy
        compression they are guesses, and their loss is not the device's. Returns what
        :func:`label_consistency` found (None: not checked).

        Raises
        ------
        FrameError
            ``OUT_OF_RANGE`` when the relative residual is beyond
            ``max(residual_floor, residual_factor x the recent median)``, or the loss is
            beyond its bound.
        """
        if not self.config.residual_floor:
            return None
        found = label_consistency(tail, features, grad)
        if found is None:
            return None
        with self._lock:
            window = self._residual_window(cut)
            bound = max(self.config.residual_floor, window.bound(self.config.residual_factor)
                        or 0.0)
            if found.residual > bound:
                self._strike(client, server_round)
                raise FrameError(Reason.OUT_OF_RANGE, (
                    f"the gradient returned at cut {cut} is {found.residual:.3g} (relative) "
                    f"from the nearest any labelling of the batch gives through this round's "
                    f"tail; the bound is {bound:.3g} (recent median {window.median or 0:.3g})"))
            window.add([found.residual])
        if found.residual <= self.config.residual_floor:  # labels that explain the gradient
            self._check_loss_of((client, server_round), float(found.losses.mean()), cut,
                                classes=found.classes, floor=self.config.tail_loss_floor)
        return found

    def _residual_window(self, cut: int) -> _Window:
        window = self._residuals.get(cut)
        if window is None:
            window = self._residuals[cut] = _Window(self.config.window_steps,
                                                    min_count=self.config.min_steps)
        return window

    def _loss_window(self, cut: int) -> _Window:
        window = self._losses.get(cut)
        if window is None:
            window = self._losses[cut] = _Window(self.config.window_steps,
                                                 min_count=self.config.min_steps)
        return window

    def _seed_losses(self, cut: int, losses: list[float]) -> None:
        """Restart a cut's loss statistics from ``losses`` if they are beyond its bound."""
        if not losses:
            return
        median = float(np.median(losses))
        with self._lock:
            window = self._loss_window(cut)
            if window.median is not None and median <= self.config.loss_factor * window.median:
                return  # the usual case: the recent batches describe this round's model too
            fresh = self._losses[cut] = _Window(self.config.window_steps, min_count=len(losses))
            fresh.add(losses)

    def seed(self, what: str, cut: int, rows: Tensor) -> None:
        """Add rows of known provenance to a cut's statistics (see :func:`reference_rows`).

        Seeded rows need no warm-up: the bound applies from the next frame on. Seeded
        ``loss`` values (held-out batches' mean losses through this round's model) restart
        the cut's loss statistics when their median is beyond the current bound: the
        device side moved so far (an average of poisoned copies, say) that the recent
        batches' median would refuse every device, honest ones included, from then on.
        """
        if what == "loss":
            self._seed_losses(cut, rows.detach().flatten().tolist())
            return
        if what == "labels":  # the held-out rows' labels, for the same-label reference
            with self._lock:
                self._reference_labels = rows.detach().to("cpu", torch.long).flatten()
            return
        if what == "activations":  # ... and their rows at this cut
            with self._lock:
                self._reference_rows[cut] = rows.detach()
        if what == "residual":  # the server's own batches, returned as devices return them
            with self._lock:
                window = self._residuals[cut] = _Window(self.config.window_steps,
                                                        min_count=1)
                window.add(rows.detach().flatten().tolist())
            return
        norms = rows.detach().flatten(1).norm(dim=1)
        with self._lock:
            window = self._window(what, cut)
            window.min_count = min(window.min_count, len(norms))  # known rows need no warm-up
            window.add(norms.tolist())
            if len(norms):  # this round's reference replaces the last one's
                self._seeded[what, cut] = float(norms.max())

    def seed_all(self, rows: Mapping[tuple[str, int], Tensor]) -> None:
        """Seed every ``(what, cut)`` of :func:`reference_rows`'s rows (see :meth:`seed`)."""
        for (what, cut), values in rows.items():
            self.seed(what, cut, values)

    def bound(self, what: str, cut: int) -> float | None:
        """Return the current bound on a row's norm at ``cut`` (None: not calibrated yet)."""
        with self._lock:
            return self._bound(what, cut)

    def _bound(self, what: str, cut: int) -> float | None:
        """``row_factor`` x the recent median, or ``seed_factor`` x the largest seeded row.

        A mean kind's seeded bound replaces the median's: its honest rows are heavy-tailed
        (the median of returned gradients falls 100-fold as the model grows confident,
        while a misclassified row's stays), so no factor of the median fits them all.
        """
        seeded = self._seeded.get((what, cut))
        if seeded is not None and what in MEAN_KINDS:
            return self.config.seed_factor * seeded
        window = self._rows.get((what, cut))
        bounds = [] if window is None or window.median is None else [
            window.bound(self.config.row_factor)]
        if seeded is not None:
            bounds.append(self.config.seed_factor * seeded)
        return max(bounds, default=None)

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
        """Return the counts of refusals, loss refusals, clips and quarantines; reset them."""
        with self._lock:
            books = {"guard_refused": self.refused, "guard_loss_refused": self.loss_refused,
                     "guard_clipped": self.clipped, "guard_quarantined": self.quarantined}
            self.refused = self.loss_refused = self.clipped = self.quarantined = 0
            return books


def _address(rows: Tensor) -> int:
    """Where ``rows`` start in memory (shared by every view of them at the same offset)."""
    return rows.untyped_storage().data_ptr() + rows.storage_offset() * rows.element_size()


def _same(tensor: Tensor) -> Tensor:
    return tensor


def reference_tail(model: nn.Module, inputs: Tensor, labels: Tensor, *, tail_cut: int,
                   batch_size: int, received: Callable[[Tensor], Tensor] = _same,
                   returned: Callable[[Tensor], Tensor] = _same,
                   ) -> dict[tuple[str, int], Tensor]:
    """Return what honest U-shaped devices return at ``tail_cut``, by kind.

    Per batch of ``batch_size`` of the server's examples: the gradient of the batch's
    mean loss with respect to the trunk's output (``gradient``), as a device computes it
    from the features it receives (``received``: what the downlink's compression leaves
    of them) and sends it (``returned``: noised, then what the uplink's compression leaves);
    the batch's mean loss (``loss``); and how far :func:`label_consistency` finds the
    returned gradient from the nearest labelling's (``residual``): the honest spread the
    consistency check allows for.
    """
    stages = list(model.stages)  # type: ignore[attr-defined]
    tail = frozen_tail(stages[tail_cut:])
    grads, losses, residuals = [], [], []
    for start in range(0, len(inputs), batch_size):
        with torch.no_grad():
            features = nn.Sequential(*stages[:tail_cut])(inputs[start:start + batch_size])
        got = received(features).detach().requires_grad_(True)
        loss = nn.functional.cross_entropy(tail(got), labels[start:start + batch_size])
        grad = returned(torch.autograd.grad(loss, got)[0])
        found = label_consistency(tail, features, grad)
        grads.append(grad)
        losses.append(loss.detach())
        residuals.append(found.residual if found is not None else 0.0)
    return {("gradient", tail_cut): torch.cat(grads), ("loss", tail_cut): torch.stack(losses),
            ("residual", tail_cut): torch.tensor(residuals)}


def reference_rows(model: nn.Module, inputs: Tensor, labels: Tensor, *, cuts: Sequence[int],
                   tail_cut: int | None, batch_size: int,
                   received: Callable[[Tensor], Tensor] = _same,
                   returned: Callable[[Tensor], Tensor] = _same,
                   ) -> dict[tuple[str, int], Tensor]:
    """Return what honest devices would send at each cut, from data of known provenance.

    ``model`` is the network as the devices hold it this round (their averaged side
    joined with the trunk, any release at the cut included); ``inputs``/``labels`` are
    the server's own held-out examples. Activations at every cut in ``cuts``; with a
    device tail (``tail_cut``), also what :func:`reference_tail` gives (``received`` and
    ``returned`` as there); without one, each batch's mean loss (``("loss", cut)``, the
    same for every cut).
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
        rows |= reference_tail(model, inputs, labels, tail_cut=tail_cut, batch_size=batch_size,
                               received=received, returned=returned)
    else:  # the trunk holds the loss: the batches' mean losses, the loss check's floor
        with torch.no_grad():
            for stage in stages[max(cuts):]:
                x = stage(x)
            losses = nn.functional.cross_entropy(x, labels, reduction="none")
        means = torch.stack([chunk.mean() for chunk in losses.split(batch_size)])
        rows |= {("loss", cut): means for cut in cuts}
    rows["labels", 0] = labels.detach()  # the same-label reference of the loss check
    return rows

