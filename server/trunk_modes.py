"""How sessions map onto trunks: shared, one copy per client, or batched.

* :class:`SharedTrunk` (SplitFed v2, sequential SL): every session steps the one
  trunk, batch by batch, in arrival order.
* :class:`TrunkPerClient` (SplitFed v1): each client trains its own copy of the
  trunk during a round; at the end the copies of clients that *finished* are
  averaged (weighted by samples) into the global trunk, the rest discarded.
  Copies exist only while their client trains, so memory follows the number of
  clients per round, not the number registered.
* :class:`BatchingTrunk` (SplitFed v2 option): concurrent clients' batches are
  concatenated into one trunk step. The barrier is over the streams actually
  open (the Simulation Engine runs only as many clients at once as it has
  resources), with a timeout, so a slow or vanished client never blocks others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from server.trunk import Trunk, TrunkStep


class SharedTrunk:
    """Every session uses the same trunk."""

    def __init__(self, trunk: Trunk) -> None:
        self.trunk = trunk

    def trunk_for(self, client: str) -> Trunk:
        """Return the shared trunk."""
        return self.trunk

    def finish_round(self, finished: Iterable[str]) -> None:
        """Nothing to merge: updates were applied as batches arrived."""


class TrunkPerClient:
    """One trunk copy per client and round, merged over the clients that finished."""

    def __init__(self, trunk: Trunk) -> None:
        self.trunk = trunk
        self._copies: dict[str, Trunk] = {}
        self._lock = threading.Lock()

    def trunk_for(self, client: str) -> Trunk:
        """Return ``client``'s copy, forking the global trunk on first use."""
        with self._lock:
            if client not in self._copies:
                self._copies[client] = self.trunk.fork()
            return self._copies[client]

    def finish_round(self, finished: Iterable[str]) -> None:
        """Average the finished clients' copies into the global trunk; drop all copies."""
        with self._lock:
            copies, self._copies = self._copies, {}
        kept = [copies[c] for c in finished if c in copies and copies[c].samples > 0]
        if not kept:
            return
        total = sum(t.samples for t in kept)
        states = [t.model.state_dict() for t in kept]
        weights = [t.samples / total for t in kept]
        merged = {
            key: sum(s[key].double() * w for s, w in zip(states, weights, strict=True))
            .to(states[0][key].dtype)
            for key in states[0]
        }
        with self.trunk._lock:
            self.trunk.model.load_state_dict(merged)
            self.trunk.steps += sum(t.steps for t in kept)
            self.trunk.samples += total
            self.trunk.busy_s += sum(t.busy_s for t in kept)


@dataclass
class _Slot:
    cut: int
    activations: torch.Tensor
    labels: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    result: TrunkStep | None = None


class BatchingTrunk:
    """Concatenate the batches of concurrently connected clients into one step.

    Parameters
    ----------
    trunk : Trunk
        The shared trunk.
    open_streams : Callable[[], int]
        How many clients are connected right now (the barrier's size).
    timeout_s : float
        Longest a batch waits for the others before stepping with what is there.
    """

    def __init__(self, trunk: Trunk, *, open_streams: Callable[[], int], timeout_s: float) -> None:
        self.trunk = trunk
        self.model = trunk.model
        self.cut_shape = trunk.cut_shape
        self.open_streams = open_streams
        self.timeout_s = timeout_s
        self._pending: list[_Slot] = []
        self._cond = threading.Condition()
        self.steps = 0  # combined steps taken

    def trunk_for(self, client: str) -> BatchingTrunk:
        """All sessions go through the barrier."""
        return self

    def finish_round(self, finished: Iterable[str]) -> None:
        """Nothing to merge."""

    def evaluate_batch(
        self, cut: int, activations: torch.Tensor, labels: torch.Tensor
    ) -> TrunkStep:
        """Evaluate without a barrier (no update to share)."""
        return self.trunk.evaluate_batch(cut, activations, labels)

    def train_step(self, cut: int, activations: torch.Tensor, labels: torch.Tensor) -> TrunkStep:
        """Wait for the other connected clients (or the timeout), then step together."""
        slot = _Slot(cut, activations, labels)
        with self._cond:
            self._pending.append(slot)
            if len(self._pending) >= max(self.open_streams(), 1):
                self._flush()
            elif not self._cond.wait_for(slot.done.is_set, timeout=self.timeout_s):
                self._flush()  # the others are late: go with who is here
        assert slot.result is not None
        return slot.result

    def _flush(self) -> None:
        """Run one trunk step per cut over the pending batches (lock held)."""
        pending, self._pending = self._pending, []
        for cut in sorted({s.cut for s in pending}):
            group = [s for s in pending if s.cut == cut]
            sizes = [len(s.labels) for s in group]
            step = self.trunk.train_step(
                cut, torch.cat([s.activations for s in group]), torch.cat([s.labels for s in group])
            )
            self.steps += 1
            total = sum(sizes)
            assert step.grad is not None
            assert step.losses is not None and step.hits is not None
            parts = zip(
                group, step.grad.split(sizes), step.losses.split(sizes), step.hits.split(sizes),
                strict=True,
            )
            for slot, grad, losses, hits in parts:
                # The union's mean loss weights each sample by 1/total; rescale so each
                # client receives the gradient of its own batch's mean loss.
                slot.result = TrunkStep(
                    grad * (total / len(losses)), float(losses.mean()), int(hits.sum())
                )
                slot.done.set()
        self._cond.notify_all()
