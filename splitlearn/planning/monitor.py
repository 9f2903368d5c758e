"""Smoothing what clients measured into the planner's :class:`ClientState` (pure Python).

Each round a client reports what it did: FLOPs and the seconds they took,
bytes and the seconds they took each way, exchanges and the latency they
added, its memory budget, its workload, and optionally its loss and label
coverage. :class:`ClientMonitor` turns these into rates and keeps an
exponentially weighted moving average of each::

    estimate <- alpha * measured + (1 - alpha) * estimate    (the first sets it)

A rate measured more than ``jump`` times above or below its estimate replaces it: the
device changed (a throttled phone, Wi-Fi lost for cellular), and averaging would plan
the next rounds with a device that no longer exists.

* ``flops_per_s = flops / compute_s``, per cut: a device's rate at the first cut it
  trained at is its speed, and at each other cut it trained at it keeps the ratio
  measured there (a cut's layers run at their own efficiency: on this host the
  planner benchmark's ResNet trains at 22 GFLOP/s below cut 1 and 97-105 below cuts
  2-4). A measurement at a known cut more than ``jump`` times off what the ratio
  predicts is the device changing: its speed moves, and every cut's rate with it;
  otherwise the rate at its first cut, or the ratio at another, is smoothed.
  ``uplink = bytes_up / upload_s``;
  ``downlink = bytes_down / download_s``; ``rtt_s = latency_s / exchanges``.
  A rate whose duration (or amount) is zero or missing is not updated: a
  round without uploads says nothing about the uplink.
* The memory budget, samples, batches, label coverage and cut are taken as
  last reported, not averaged: a budget is a limit (averaging could plan
  above it) and the workload is configuration.
* ``utility = label_coverage x (samples / mean samples) x (loss / mean loss)``
  over the clients that reported them: Oort's statistical utility (a client
  with more data, and with higher recent loss on it, has more to teach), times
  the share of the classes it holds. A factor that is unknown counts as 1, so
  a client that reported nothing has utility 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from splitlearn.planning.cost import ClientState


@dataclass
class _Estimates:
    """What is known of one client (None: never measured)."""

    flops_per_s: float | None = None  # at the first cut it trained at (its speed)
    #: Each cut it trained at: its rate there over its speed (1 at the first).
    cut_ratio: dict[int, float] = field(default_factory=dict)
    uplink_bytes_per_s: float | None = None
    downlink_bytes_per_s: float | None = None
    rtt_s: float | None = None
    loss: float | None = None
    memory_bytes: float | None = None
    samples: int | None = None
    batches: int | None = None
    label_coverage: float | None = None
    cut: int | None = None
    examples: int | None = None

    def __setstate__(self, state: dict) -> None:
        # A checkpoint written before rates were kept per cut has none: it resumes without.
        self.__dict__.update({"cut_ratio": {}} | state)


class ClientMonitor:
    """Exponentially weighted estimates of each client's speed, links and utility.

    Parameters
    ----------
    alpha : float
        Weight of the newest measurement, in (0, 1]; 1 keeps only the latest.
    jump : float
        A rate this many times above or below its estimate replaces it (> 1).
    """

    def __init__(self, alpha: float = 0.5, jump: float = 2.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        if not jump > 1:
            raise ValueError(f"jump must be > 1, got {jump}")
        self.alpha = alpha
        self.jump = jump
        self._known: dict[str, _Estimates] = {}

    def observe(
        self,
        client: str,
        *,
        flops: float,
        compute_s: float | None,
        bytes_up: float,
        upload_s: float | None,
        bytes_down: float,
        download_s: float | None,
        exchanges: int,
        latency_s: float | None,
        memory_bytes: float | None,
        samples: int,
        batches: int,
        loss: float | None = None,
        label_coverage: float | None = None,
        cut: int | None = None,
        examples: int | None = None,
    ) -> None:
        """Fold one round's measurements of ``client`` into its estimates.

        Parameters
        ----------
        client : str
            The client's id.
        flops : float
            Training FLOPs executed.
        compute_s : float | None
            The seconds they took (zero or None: not measured).
        bytes_up : float
            Bytes sent.
        upload_s : float | None
            The seconds they took (zero or None: not measured).
        bytes_down : float
            Bytes received.
        download_s : float | None
            The seconds they took (zero or None: not measured).
        exchanges : int
            Round trips with the trunk.
        latency_s : float | None
            Seconds of latency those round trips added (all of them together).
        memory_bytes : float | None
            The client's memory budget (bytes), if reported.
        samples, batches : int
            Samples trained and batches exchanged this round.
        loss : float | None
            Recent training loss, if reported.
        label_coverage : float | None
            Share of the classes present in its data, in [0, 1], if reported.
        cut : int | None
            The cut it trained at, if any.
        """
        known = self._known.setdefault(client, _Estimates())
        self._observe_speed(known, _rate(flops, compute_s), cut)
        known.uplink_bytes_per_s = self._rate(known.uplink_bytes_per_s, _rate(bytes_up, upload_s))
        known.downlink_bytes_per_s = self._rate(
            known.downlink_bytes_per_s, _rate(bytes_down, download_s)
        )
        known.rtt_s = self._rate(known.rtt_s, _per_exchange(latency_s, exchanges))
        known.loss = self._smooth(known.loss, loss)
        if memory_bytes is not None and memory_bytes > 0:
            known.memory_bytes = memory_bytes
        if samples > 0 and batches > 0:
            known.samples, known.batches = samples, batches
        if label_coverage is not None:
            known.label_coverage = label_coverage
        if cut is not None:
            known.cut = cut
        if examples:
            known.examples = examples

    def _observe_speed(self, known: _Estimates, measured: float | None, cut: int | None) -> None:
        """Fold a measured FLOP/s at ``cut`` into the device's speed and its ratio there."""
        if measured is None or measured <= 0:
            return
        if known.flops_per_s is None:  # its first measurement: its speed, ratio 1 there
            known.flops_per_s = measured
            if cut is not None:
                known.cut_ratio[cut] = 1.0
            return
        first = next(iter(known.cut_ratio), None)
        ratio = 1.0 if cut is None else known.cut_ratio.get(cut)
        if ratio is None:  # a cut it had not trained at: its ratio there, from its speed now
            known.cut_ratio[cut] = measured / known.flops_per_s  # type: ignore[index]
        elif not 1 / self.jump <= measured / (known.flops_per_s * ratio) <= self.jump:
            known.flops_per_s = measured / ratio  # the device changed: every cut with it
        elif cut is None or cut == first:
            known.flops_per_s = self._smooth(known.flops_per_s, measured / ratio)
        else:
            known.cut_ratio[cut] = self._smooth(ratio, measured / known.flops_per_s)  # type: ignore[assignment]

    def observe_memory(self, client: str, memory_bytes: float, *, examples: int = 0) -> None:
        """Record the memory budget (bytes) a client reported, e.g. when it declined a cut.

        ``examples``, when it reported them, is how many examples its data holds.
        """
        if memory_bytes > 0:
            self._known.setdefault(client, _Estimates()).memory_bytes = memory_bytes
        if examples > 0:
            self._known.setdefault(client, _Estimates()).examples = examples

    def state(self, client: str, prior: ClientState) -> ClientState:
        """Return ``prior`` with every field this monitor measured for ``client`` replaced.

        ``prior`` supplies what was never measured (e.g. the device profile's
        figures); its id is replaced by ``client``, so one prior may serve as
        a template.
        """
        known = self._known.get(client, _Estimates())
        measured = {
            "flops_per_s": known.flops_per_s,
            "uplink_bytes_per_s": known.uplink_bytes_per_s,
            "downlink_bytes_per_s": known.downlink_bytes_per_s,
            "rtt_s": known.rtt_s,
            "memory_bytes": known.memory_bytes,
            "samples": known.samples,
            "batches": known.batches,
            "current_cut": known.cut,
            "examples": known.examples,
        }
        updates = {name: value for name, value in measured.items() if value is not None}
        if known.flops_per_s is not None:
            updates["flops_per_s_at"] = tuple(
                (cut, known.flops_per_s * ratio) for cut, ratio in sorted(known.cut_ratio.items()))
        return replace(prior, client=client, utility=self.utility(client), **updates,
                       measured=prior.measured or known.flops_per_s is not None)

    def utility(self, client: str) -> float:
        """``label_coverage x samples / mean x loss / mean`` (unknown factors count as 1)."""
        known = self._known.get(client, _Estimates())
        coverage = 1.0 if known.label_coverage is None else known.label_coverage
        samples = self._relative(known.samples, [k.samples for k in self._known.values()])
        loss = self._relative(known.loss, [k.loss for k in self._known.values()])
        return coverage * samples * loss

    @staticmethod
    def _relative(value: float | None, reported: list[float | None]) -> float:
        """Divide ``value`` by the mean of the values reported (1.0 when unknown)."""
        known = [v for v in reported if v is not None]
        mean = sum(known) / len(known) if known else 0.0
        if value is None or mean <= 0:
            return 1.0
        return value / mean

    def _rate(self, estimate: float | None, measured: float | None) -> float | None:
        """One EWMA step of a rate, or the measurement itself where it jumped."""
        if measured is not None and estimate and measured > 0 and not (
                1 / self.jump <= measured / estimate <= self.jump):
            return measured
        return self._smooth(estimate, measured)

    def _smooth(self, estimate: float | None, measured: float | None) -> float | None:
        """One EWMA step; a missing measurement leaves the estimate as it was."""
        if measured is None:
            return estimate
        if estimate is None:
            return measured
        return self.alpha * measured + (1 - self.alpha) * estimate


def _rate(amount: float, seconds: float | None) -> float | None:
    """``amount / seconds``, or None when either is zero or missing (nothing to learn)."""
    if seconds is None or seconds <= 0 or amount <= 0:
        return None
    return amount / seconds


def _per_exchange(latency_s: float | None, exchanges: int) -> float | None:
    """Latency per round trip, or None when there were none or no latency was measured."""
    if latency_s is None or latency_s <= 0 or exchanges <= 0:
        return None
    return latency_s / exchanges


def fit_trunk(observations: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Fit the trunk's time, ``seconds = batches x t_batch + flops / F``, to what it took.

    Parameters
    ----------
    observations : Sequence[tuple[float, float, float]]
        ``(batches, flops, seconds)``: one calibration step at a cut, or a round's work
        (its batches and trunk FLOPs) and the trunk's busy seconds in it.

    Returns
    -------
    tuple[float, float]
        ``(t_batch, F)``: seconds per batch and FLOP/s (``math.inf`` where FLOPs
        explain none of it). Least squares on relative errors, so that a one-step
        calibration weighs as much as a round; both parts are kept >= 0 (where the
        joint fit makes one negative, the better fit of the other alone).

    Raises
    ------
    ValueError
        No observation of positive seconds.
    """
    rows = [(b / s, f / s) for b, f, s in observations if s > 0 and (b > 0 or f > 0)]
    if not rows:
        raise ValueError("fit_trunk: no observation of positive seconds")
    uu = sum(u * u for u, _ in rows)
    vv = sum(v * v for _, v in rows)
    uv = sum(u * v for u, v in rows)
    su, sv = sum(u for u, _ in rows), sum(v for _, v in rows)
    candidates = [(su / uu if uu > 0 else 0.0, 0.0), (0.0, sv / vv if vv > 0 else 0.0)]
    det = uu * vv - uv * uv
    if det > 1e-12 * uu * vv:
        batch, per_flop = (su * vv - sv * uv) / det, (sv * uu - su * uv) / det
        if batch >= 0 and per_flop >= 0:
            candidates.append((batch, per_flop))

    def residual(fit: tuple[float, float]) -> float:
        return sum((u * fit[0] + v * fit[1] - 1) ** 2 for u, v in rows)

    batch, per_flop = min(candidates, key=residual)
    return batch, (1 / per_flop if per_flop > 0 else math.inf)
