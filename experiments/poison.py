"""Devices that lie: poisoning attacks on the shared trunk, and what the defences leave of them.

A run of the real strategy, ClientApp and trunk in this process (:mod:`experiments.local`;
with ``dataplane.trunk_workers`` > 1 the trunk in its worker processes) in which chosen
devices lie. Each attack is a small class saying what a lying device changes and which
defence should stop it:

``extreme_activations`` (:class:`ExtremeActivations`), ``scaled_activations``
(:class:`ScaledActivations`), ``label_flip`` (:class:`LabelFlip`), ``scaled_weights``
(:class:`ScaledWeights`), ``sign_flipped_weights`` (:class:`SignFlippedWeights`),
``ushaped_scaled_gradient`` / ``ushaped_extreme_gradient`` (:class:`ScaledGradient`,
:class:`ExtremeGradient`: U-shaped) and ``slow_drift`` (:class:`SlowDrift`).

The lies live here, never in the shipped apps: a lying device is the shipped ClientApp
whose data-plane channel (:class:`WatchedChannel`) changes what leaves it, and whose
reply weights :class:`LyingFleet` changes after it answers. Honest devices get the same
channel without lies, which only counts the trunk's refusals (by reason), so a run tells
how many honest batches the defences refused. A lying device is *persistent*: a refused
batch does not end its round (it carries on with the next, until the trunk quarantines it),
where the shipped client gives up at its first refusal.

``python -m experiments.attack poison`` runs the whole table (:func:`run_suite`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from omegaconf import DictConfig
from torch import Tensor

from clients.app import ChannelFactory, build_client_app
from server.app import SplitRuntime
from server.trunk import Trunk
from splitlearn.config import GuardConfig, RunSpec
from splitlearn.dataplane import TrunkChannel, TrunkRejected
from splitlearn.dataplane.channel import Transport
from splitlearn.messages import record_to_state, state_to_record

# --- the attacks -------------------------------------------------------------------------


@dataclass(frozen=True)
class TrunkView:
    """What a lying device knows of the trunk: the fixed bound, and the guard's (adaptive).

    An adaptive attacker is assumed to know the guard's current bounds exactly (the
    strongest assumption: a real one would have to probe them with refused frames). With
    trunk workers (``dataplane.trunk_workers`` > 1) ``trunk`` is the ServerApp's: its guard
    is seeded as the workers' are but sees no device's rows, so its bounds come from the
    server's rows alone (a worker's, also from the rows its devices sent).
    """

    trunk: Trunk
    max_abs_value: float

    def cut_of(self, rows: Tensor) -> int:
        """Return the cut whose activations have ``rows``' shape (the first that fits)."""
        shape = tuple(rows.shape[1:])
        return next(c for c in self.trunk.model.valid_cuts if self.trunk.cut_shape(c) == shape)

    def bound(self, what: str, rows: Tensor) -> float | None:
        """Return the guard's bound on a row's norm where ``rows`` go (None: no guard yet)."""
        guard = self.trunk.guard
        return None if guard is None else guard.bound(what, self.cut_of(rows))


class Attack:
    """A device's lies; this base class tells none (an honest device).

    Each hook gets what the shipped device is about to send and returns what the lying
    device sends instead. ``device`` is the device's partition id (per-device state).
    """

    #: Table name (``--attacks``), the defence meant to stop it, and whether it needs a
    #: protocol whose devices return a gradient (a device tail: U-shaped); else the job's.
    name: ClassVar[str] = "none"
    stopped_by: ClassVar[str] = ""
    needs_device_tail: ClassVar[bool] = False

    def activations(self, acts: Tensor, view: TrunkView, *, device: int) -> Tensor:
        """Return the activations sent at the cut."""
        return acts

    def labels(self, labels: Tensor, num_classes: int) -> Tensor:
        """Return the labels sent with them (split and local-loss sessions)."""
        return labels

    def returned_gradient(self, grad: Tensor, view: TrunkView) -> Tensor:
        """Return the gradient a U-shaped device sends back at the tail cut."""
        return grad

    def weights(self, trained: dict[str, Tensor], received: dict[str, Tensor]
                ) -> dict[str, Tensor]:
        """Return the device-side weights of the reply (``received``: what the round sent)."""
        return trained


@dataclass
class ExtremeActivations(Attack):
    """Every entry of every row at ``dataplane.max_abs_value``: inside the fixed bound.

    The measured failure the guard exists for: unguarded, three such frames push the
    trunk's weights to ~1e15 and every honest batch after them is refused
    ``STEP_NOT_FINITE``. Stopped by the guard's calibrated row bound (``OUT_OF_RANGE``,
    then ``QUARANTINED``).
    """

    name: ClassVar[str] = "extreme_activations"
    stopped_by: ClassVar[str] = "row bound (guard)"

    def activations(self, acts: Tensor, view: TrunkView, *, device: int) -> Tensor:
        """Return rows of ``max_abs_value`` everywhere."""
        return torch.full_like(acts, view.max_abs_value)


@dataclass
class ScaledActivations(Attack):
    """Activations times ``factor``: every row stays inside the guard's calibrated bound.

    Honest rows of the small CNN at cut 1 reach 1.5x the median norm and the bound is
    20x, so 10x passes. Meant to be limited by the clipped update and the loss check
    (a batch whose loss is far beyond its cut's recent range is refused).
    """

    factor: float = 10.0
    name: ClassVar[str] = "scaled_activations"
    stopped_by: ClassVar[str] = "update clip, loss check"

    def activations(self, acts: Tensor, view: TrunkView, *, device: int) -> Tensor:
        """Return ``factor`` x the activations."""
        return acts * self.factor


@dataclass
class LabelFlip(Attack):
    """Labels ``y -> C - 1 - y`` on the device's data (for digits: ``9 - y``).

    The rows are honest, so no row bound sees it. Meant to be stopped by the loss check
    once the trunk has learned (a flipped batch's loss is then far above the recent
    range); from one device in ten it may also be within noise.
    """

    name: ClassVar[str] = "label_flip"
    stopped_by: ClassVar[str] = "loss check"

    def labels(self, labels: Tensor, num_classes: int) -> Tensor:
        """Return the flipped labels."""
        return num_classes - 1 - labels


@dataclass
class ScaledWeights(Attack):
    """The device's reply weights times ``factor`` (every floating-point array).

    The trunk never sees them: FedAvg of the device side takes them in. Needs a robust
    aggregation of the device weights (``aggregation``); the trunk's guard does not stop it.
    """

    factor: float = 10.0
    name: ClassVar[str] = "scaled_weights"
    stopped_by: ClassVar[str] = "robust aggregation (not the trunk guard)"

    def weights(self, trained: dict[str, Tensor], received: dict[str, Tensor]
                ) -> dict[str, Tensor]:
        """Return ``factor`` x every floating-point array."""
        return {k: v * self.factor if v.is_floating_point() else v for k, v in trained.items()}


@dataclass
class SignFlippedWeights(ScaledWeights):
    """The device's reply weights negated (times ``factor``, 1: the plain sign flip).

    One negated copy in ten moves FedAvg's average to 0.8 x the honest one (two: 0.6 x).
    Needs a robust aggregation, as :class:`ScaledWeights` does.
    """

    factor: float = -1.0
    name: ClassVar[str] = "sign_flipped_weights"


@dataclass
class ScaledGradient(Attack):
    """U-shaped: the gradient returned at the tail cut times ``factor`` (negative: ascent).

    The trunk learns from it as from activations: ``-4`` pushes the trunk up the loss
    at up to four times an honest step. Adaptive: the factor shrinks where needed so
    that the largest row stays at ``margin`` x the guard's current bound on returned
    gradients (per example: the guard compares a short batch's rows as a full one's).
    Meant to be limited by the bound and the update clip only: the trunk sees neither a
    U-shaped device's labels nor its loss.
    """

    factor: float = -4.0
    margin: float = 0.95
    name: ClassVar[str] = "ushaped_scaled_gradient"
    needs_device_tail: ClassVar[bool] = True
    stopped_by: ClassVar[str] = "row bound, update clip (not stopped: see the table)"
    _usual: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def returned_gradient(self, grad: Tensor, view: TrunkView) -> Tensor:
        """Return ``factor`` x the honest gradient, capped just inside the guard's bound."""
        scale = abs(self.factor)
        bound = view.bound("gradient", grad)
        usual = self._usual.setdefault(id(view), len(grad))
        self._usual[id(view)] = usual = max(usual, len(grad))  # its full batch
        largest = float(grad.flatten(1).norm(dim=1).max()) * len(grad) / usual
        if bound is not None and largest > 0:
            scale = min(scale, self.margin * bound / largest)
        return grad * math.copysign(scale, self.factor)


@dataclass
class ExtremeGradient(Attack):
    """U-shaped: every entry of the returned gradient at ``max_abs_value`` (its sign kept).

    Stopped by the guard's row bound on returned gradients, as extreme activations are.
    """

    name: ClassVar[str] = "ushaped_extreme_gradient"
    needs_device_tail: ClassVar[bool] = True
    stopped_by: ClassVar[str] = "row bound (guard)"

    def returned_gradient(self, grad: Tensor, view: TrunkView) -> Tensor:
        """Return ``max_abs_value`` with the gradient's signs."""
        return torch.where(grad < 0, -view.max_abs_value, view.max_abs_value).to(grad.dtype)


@dataclass
class SlowDrift(Attack):
    """Activations scaled by ``growth ** t`` at the device's ``t``-th batch, just inside bounds.

    An adaptive attacker: before each batch it reads the guard's current bound and caps
    the factor so that its largest row stays at ``margin`` x that bound, and every entry
    at ``margin`` x the fixed bound (``max_abs_value``). Without a guard it reaches the
    fixed bound in ~200 batches (20 rounds of the default job). Meant to be limited by
    the median-based bound (a minority of rows cannot drag the median up), the update
    clip and the loss check.
    """

    growth: float = 1.07
    margin: float = 0.95
    name: ClassVar[str] = "slow_drift"
    stopped_by: ClassVar[str] = "median row bound, update clip, loss check"
    _batches: Counter[int] = field(default_factory=Counter, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def factor(self, acts: Tensor, view: TrunkView, *, device: int) -> float:
        """Return this batch's factor: the drift so far, capped just inside both bounds."""
        with self._lock:
            self._batches[device] += 1
            steps = self._batches[device]
        factor = self.growth ** steps
        largest = float(acts.abs().max())
        if largest > 0:
            factor = min(factor, self.margin * view.max_abs_value / largest)
        bound = view.bound("activations", acts)
        norm = float(acts.flatten(1).norm(dim=1).max())
        if bound is not None and norm > 0:
            factor = min(factor, self.margin * bound / norm)
        return max(factor, 1.0)

    def activations(self, acts: Tensor, view: TrunkView, *, device: int) -> Tensor:
        """Return the activations times this batch's factor."""
        return acts * self.factor(acts, view, device=device)


#: Every attack of the table, by name.
ATTACKS: dict[str, type[Attack]] = {a.name: a for a in (
    ExtremeActivations, ScaledActivations, LabelFlip, ScaledWeights, SignFlippedWeights,
    ScaledGradient, ExtremeGradient, SlowDrift)}


# --- lying devices over the shipped ClientApp ---------------------------------------------


class Refusals:
    """The trunk's refusals as the devices saw them: per (honest|attacker, reason)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()

    def add(self, role: str, reason: str) -> None:
        """Count one refused frame."""
        with self._lock:
            self.counts[role, reason] += 1

    def of(self, role: str) -> dict[str, int]:
        """Return ``role``'s refusals by reason."""
        with self._lock:
            return {r: n for (who, r), n in sorted(self.counts.items()) if who == role}


class WatchedChannel(TrunkChannel):
    """A device's channel that counts the trunk's refusals and, for a liar, lies.

    Parameters
    ----------
    transport, **kwargs
        As for :class:`~splitlearn.dataplane.TrunkChannel`.
    attack : Attack | None
        The device's lies (None: an honest device, whose refusals end its round as the
        shipped client's do).
    view : TrunkView
        What the device knows of the trunk.
    device : int
        Its partition id.
    refusals : Refusals
        Where refusals are counted.
    """

    def __init__(self, transport: Transport, *, attack: Attack | None, view: TrunkView,
                 device: int, refusals: Refusals, **kwargs: Any) -> None:
        super().__init__(transport, **kwargs)
        self.attack, self.view, self.device, self.refusals = attack, view, device, refusals
        self._shapes: dict[str, tuple[int, ...]] = {}  # last shapes sent (a liar's stand-ins)

    @property
    def role(self) -> str:
        """``attacker`` or ``honest``."""
        return "honest" if self.attack is None else "attacker"

    def _refused(self, err: TrunkRejected) -> None:
        """Count a refusal; a liar carries on unless quarantined (or the session ended)."""
        self.refusals.add(self.role, err.reason or "SESSION_ENDED")
        if self.attack is None or err.reason in (None, "QUARANTINED"):
            raise err

    def forward(self, activations: Tensor, labels: Tensor, *,
                example_ids: Tensor | None = None) -> tuple[Tensor, float, int]:
        """Send (lied-about) activations and labels; a liar's refused batch gets zeros back."""
        sent, sent_labels = activations, labels
        if self.attack is not None:
            sent = self.attack.activations(activations, self.view, device=self.device)
            sent_labels = self.attack.labels(labels, self.view.trunk.num_classes)
        try:
            return super().forward(sent, sent_labels, example_ids=example_ids)
        except TrunkRejected as err:
            self._refused(err)
            return torch.zeros_like(activations), 0.0, 0

    def forward_features(self, activations: Tensor, *,
                         example_ids: Tensor | None = None) -> Tensor:
        """U-shaped forward (honest: the U-shaped lie is in the returned gradient)."""
        self._shapes["acts"] = tuple(activations.shape)
        try:
            features = super().forward_features(activations, example_ids=example_ids)
        except TrunkRejected as err:
            if "features" not in self._shapes:
                raise
            self._refused(err)
            return torch.zeros(self._shapes["features"])
        self._shapes["features"] = tuple(features.shape)
        return features

    def backward(self, grad: Tensor) -> Tensor:
        """Return (a lie about) d loss / d features; a liar's refused one gets zeros back."""
        sent = grad if self.attack is None else self.attack.returned_gradient(grad, self.view)
        try:
            return super().backward(sent)
        except TrunkRejected as err:
            self._refused(err)
            return torch.zeros(self._shapes["acts"])

    def send_smashed(self, activations: Tensor, labels: Tensor, *,
                     example_ids: Tensor | None = None) -> None:
        """Local loss: send (lied-about) smashed data one way."""
        if self.attack is not None:
            activations = self.attack.activations(activations, self.view, device=self.device)
            labels = self.attack.labels(labels, self.view.trunk.num_classes)
        try:
            super().send_smashed(activations, labels, example_ids=example_ids)
        except TrunkRejected as err:  # an earlier frame's ack, collected to make room
            self._refused(err)

    def flush(self) -> None:
        """Wait for every one-way frame's ack; a liar's refused frames are counted and passed."""
        while True:
            try:
                super().flush()
                return
            except TrunkRejected as err:
                self._refused(err)


#: The partition of the device a thread is serving (read when its channel opens).
_serving = threading.local()


def watched_channels(channels: ChannelFactory, *, attack: Attack | None, view: TrunkView,
                     refusals: Refusals) -> ChannelFactory:
    """Open each session as the run does (``channels``), through a :class:`WatchedChannel`.

    The run's own channel brings the transport: in process to the trunk, or over gRPC to
    the trunk worker the session was dealt to (``dataplane.trunk_workers`` > 1).
    """

    def open_channel(address: str, token: str, spec: RunSpec, *,
                     proof: bytes | None = None) -> TrunkChannel:
        opened = channels(address, token, spec, proof=proof)
        return WatchedChannel(
            opened.transport, attack=attack, view=view,
            device=getattr(_serving, "partition", -1), refusals=refusals,
            reply_timeout_s=opened.reply_timeout_s, max_frame_bytes=opened.max_frame_bytes,
            compression=spec.compression)

    return open_channel


class LyingFleet:
    """What the grid calls: the shipped ClientApp, lying on the ``liars``' partitions.

    Parameters
    ----------
    honest, lying : ClientApp
        The shipped ClientApp over honest and lying channels.
    attack : Attack
        Also applied to a lying device's reply weights.
    liars : Sequence[int]
        The lying devices' partition ids.
    """

    def __init__(self, honest: ClientApp, lying: ClientApp, *, attack: Attack,
                 liars: Sequence[int]) -> None:
        self.honest, self.lying, self.attack, self.liars = honest, lying, attack, set(liars)

    def __call__(self, message: Message, context: Context) -> Message:
        """Handle ``message`` as the node's device (honest or lying) would."""
        partition = int(context.node_config["partition-id"])
        _serving.partition = partition
        if partition not in self.liars:
            return self.honest(message, context)
        reply = self.lying(message, context)
        if (message.metadata.message_type.startswith("train") and not reply.has_error()
                and "arrays" in reply.content.array_records):
            received = record_to_state(message.content["arrays"])
            trained = record_to_state(reply.content["arrays"])
            reply.content["arrays"] = state_to_record(self.attack.weights(trained, received))
        return reply


def lying_fleet(attack: Attack, liars: Sequence[int], refusals: Refusals
                ) -> Callable[[ChannelFactory, SplitRuntime], LyingFleet]:
    """Return :func:`experiments.local.run_local`'s ``client_app``: a fleet with liars."""

    def build(channels: ChannelFactory, runtime: SplitRuntime) -> LyingFleet:
        view = TrunkView(runtime.trunk, runtime.cfg.dataplane.max_abs_value)

        def app(lies: Attack | None) -> ClientApp:
            return build_client_app(watched_channels(channels, attack=lies, view=view,
                                                     refusals=refusals))

        return LyingFleet(app(None), app(attack), attack=attack, liars=liars)

    return build


# --- one run, and the table --------------------------------------------------------------

#: Overrides before the user's: the default job (digits, the small CNN at cut 1, SplitFed
#: v2, 10 devices), offline.
POISON_DEFAULTS = ("logger=none",)
#: What "defences off" overrides: the trunk's guard (row bounds, clip, loss and gradient
#: checks, quarantine), the bound on each device's update, claims counted as claimed.
DEFENCES_OFF = ("dataplane.guard.enabled=false", "aggregation.max_update_ratio=0",
                "aggregation.max_examples_ratio=0")


@dataclass
class RunRow:
    """One row of the table."""

    attack: str
    strategy: str
    attackers: int
    defences: str  # "on" or "off"
    accuracy: float
    delta: float = math.nan  # accuracy minus the no-attack run's (same protocol and defences)
    quarantined: int = 0  # device-rounds quarantined (the run's guard_quarantined)
    honest_refused: dict[str, int] = field(default_factory=dict)
    attacker_refused: dict[str, int] = field(default_factory=dict)
    clipped: int = 0  # trunk steps whose update the guard clipped
    shortened: int = 0  # device-rounds whose update was shortened (aggregation.max_update_ratio)
    seconds: float = 0.0
    history: list[float] = field(default_factory=list)  # test accuracy per round
    walls: list[float] = field(default_factory=list)  # the run's clock at each evaluation

    def summary(self) -> str:
        """One line of progress."""
        return (f"{self.attack:>26} x{self.attackers} defences {self.defences:<3} "
                f"acc {self.accuracy:.3f} ({self.delta:+.3f}) quarantined {self.quarantined} "
                f"honest refused {self.honest_refused or 0} attacker refused "
                f"{sum(self.attacker_refused.values())} ({self.seconds:.0f} s)")


def liars_of(attackers: int, num_clients: int) -> list[int]:
    """Return the lying partitions: the last ones (the in-process grid serves them last).

    So the round's evaluation follows their batches with the fewest honest steps between
    (the worst case for the trunk).
    """
    return list(range(num_clients - attackers, num_clients))


def run_poisoned(cfg: DictConfig, attack: Attack, *, attackers: int, defences: str,
                 concurrency: int = 2) -> RunRow:
    """Train ``cfg`` with ``attackers`` devices lying as ``attack`` says; return its row."""
    from experiments.local import run_local

    refusals = Refusals()
    torch.set_num_threads(cfg.engine.torch_threads)
    started = time.perf_counter()
    result = run_local(cfg, concurrency=concurrency,
                       client_app=lying_fleet(attack, liars_of(attackers, cfg.num_clients),
                                              refusals))
    history = result.history
    return RunRow(
        attack=attack.name if attackers else "none", strategy=str(cfg.strategy.name),
        attackers=attackers, defences=defences, accuracy=float(history[-1]["test_accuracy"]),
        quarantined=int(sum(r.get("guard_quarantined", 0) for r in history)),
        honest_refused=refusals.of("honest"), attacker_refused=refusals.of("attacker"),
        clipped=int(sum(r.get("guard_clipped", 0) for r in history)),
        shortened=int(sum(r.get("updates_shortened", 0) for r in history)),
        seconds=time.perf_counter() - started,
        history=[float(r["test_accuracy"]) for r in history],
        walls=[float(r["wall_s"]) for r in history])


def protocol_for(attack: Attack) -> str | None:
    """Return the protocol ``attack`` needs (None: the job's own).

    An attack on a returned gradient needs the registry's first protocol with a device tail.
    """
    from protocols import PROTOCOLS

    if not attack.needs_device_tail:
        return None
    return next(p.name for p in PROTOCOLS.values() if p.capabilities.device_tail is not None)


def suite_config(strategy: str | None, defences: str, overrides: Sequence[str],
                 defence_overrides: Sequence[str]) -> DictConfig:
    """Compose one run's config: the default job, the protocol, the user's, the defences'.

    ``strategy`` None keeps the job's protocol (the default's, or the user's override).
    """
    from protocols import compose_config

    switched = defence_overrides if defences == "on" else DEFENCES_OFF
    protocol = [f"strategy={strategy}"] if strategy is not None else []
    return compose_config([*POISON_DEFAULTS, *protocol, *overrides, *switched])


def run_suite(*, attacks: Sequence[str], attackers: Sequence[int], overrides: Sequence[str],
              defence_overrides: Sequence[str] = (), concurrency: int = 2,
              out: Path | None = None, log: Callable[[str], None] = print) -> list[RunRow]:
    """Run the no-attack references and every attack from each count of liars, on and off.

    Returns the rows in table order (references first); with ``out``, also writes
    ``poison.csv``, ``poison.json``, ``poison.md`` and ``poison.png`` there.
    """
    started = time.perf_counter()
    rows: list[RunRow] = []
    references: dict[tuple[str | None, str], RunRow] = {}
    plan = [(name, n, d) for name in attacks for n in attackers for d in ("on", "off")]
    for strategy in dict.fromkeys(protocol_for(ATTACKS[a]()) for a in attacks):
        for defences in ("on", "off"):
            cfg = suite_config(strategy, defences, overrides, defence_overrides)
            row = run_poisoned(cfg, Attack(), attackers=0, defences=defences,
                               concurrency=concurrency)
            row.delta = 0.0
            references[strategy, defences] = row
            rows.append(row)
            log(row.summary())
    for name, count, defences in plan:
        attack = ATTACKS[name]()
        cfg = suite_config(protocol_for(attack), defences, overrides, defence_overrides)
        row = run_poisoned(cfg, attack, attackers=count, defences=defences,
                           concurrency=concurrency)
        row.delta = row.accuracy - references[protocol_for(attack), defences].accuracy
        rows.append(row)
        log(row.summary())
    if out is not None:
        cfg = suite_config(None, "on", overrides, defence_overrides)
        write_results(rows, out, footer=describe(cfg, defence_overrides, started,
                                                 concurrency=concurrency))
    return rows


def describe(cfg: DictConfig, defence_overrides: Sequence[str], started: float, *,
             concurrency: int) -> str:
    """Return the table's footnote: the job, the defences, the time taken."""
    extra = f" plus `{' '.join(defence_overrides)}`" if defence_overrides else ""
    return (f"{cfg.dataset.name}, {cfg.model.name} cut {cfg.model.cut}, {cfg.num_clients} "
            f"devices ({concurrency} at a time), {cfg.strategy.num_rounds} rounds x "
            f"{cfg.strategy.local_epochs} local epoch(s), seed {cfg.seed}; the liars are the "
            f"last partitions. Defences on: the "
            f"defaults{extra}; off: `{' '.join(DEFENCES_OFF)}`. "
            f"{time.perf_counter() - started:.0f} s in all.")


# --- the defences' cost on honest runs -----------------------------------------------------

#: What :func:`measure_cost` compares: the defaults, without the loss check, without the guard.
COST_SETTINGS = {"defaults": (), "no loss check": ("dataplane.guard.loss_factor=0",),
                 "guard off": DEFENCES_OFF}


def seconds_per_round(walls: Sequence[float]) -> float:
    """Median seconds of rounds 2+, from the run's clock at each evaluation (round 0 on)."""
    rounds = [b - a for a, b in itertools.pairwise(walls)]
    steady = rounds[1:] or rounds  # round 1 includes the start-up
    return sorted(steady)[len(steady) // 2]


def measure_cost(overrides: Sequence[str], *, repeats: int, concurrency: int = 2,
                 log: Callable[[str], None] = print) -> str:
    """Honest runs with each of :data:`COST_SETTINGS`, interleaved ``repeats`` times.

    Returns a markdown table: per setting, the median seconds per round over the runs
    (each run's median of rounds 2+), every run's, and the final accuracies. Interleaved
    because a shared host drifts over minutes; compare the rows of one table only.
    """
    seconds: dict[str, list[float]] = {name: [] for name in COST_SETTINGS}
    accuracy: dict[str, list[float]] = {name: [] for name in COST_SETTINGS}
    for repeat in range(repeats):
        for name, switched in COST_SETTINGS.items():
            cfg = suite_config(None, "on", overrides, switched)
            row = run_poisoned(cfg, Attack(), attackers=0, defences=name,
                               concurrency=concurrency)
            seconds[name].append(seconds_per_round(row.walls))
            accuracy[name].append(row.accuracy)
            log(f"repeat {repeat + 1}: {name}: {seconds[name][-1]:.2f} s/round, "
                f"accuracy {row.accuracy:.3f}")
    lines = ["| setting | s/round (median) | each run | final accuracy |",
             "| --- | ---: | --- | --- |"]
    for name in COST_SETTINGS:
        runs = sorted(seconds[name])
        lines.append(f"| {name} | {runs[len(runs) // 2]:.2f} | "
                     f"{', '.join(f'{v:.2f}' for v in seconds[name])} | "
                     f"{', '.join(f'{v:.3f}' for v in accuracy[name])} |")
    return "\n".join(lines) + "\n"


def step_seconds(guard: GuardConfig | None, *, steps: int, seed: int = 0) -> float:
    """Median seconds of a trunk step at cut 1 of the small CNN (batch 32), as a session takes it.

    Each step admits its rows through the guard and trains the shared trunk on them, as a
    split session does; ``guard=None``: a trunk without a guard.
    """
    from server.guard import TrunkGuard
    from server.sessions.split import admit, train_on_batch
    from splitlearn.models import build_model

    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10, seed=seed)
    trunk = Trunk(model, lr=0.05, momentum=0.5, sticky_core=False,
                  guard=None if guard is None else TrunkGuard(guard))
    generator = torch.Generator().manual_seed(seed)
    bottom = model.stages[0]
    times = []
    for _ in range(steps):
        with torch.no_grad():
            acts = bottom(torch.rand(32, 1, 8, 8, generator=generator))
        labels = torch.randint(0, 10, (32,), generator=generator)
        started = time.perf_counter()
        admit(trunk, "device", 1, "activations", 1, acts)
        train_on_batch(trunk, 1, acts, labels)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def measure_step_cost(*, repeats: int, steps: int = 300) -> str:
    """Trunk steps without a guard, with it but no loss check, and with the defaults.

    Interleaved ``repeats`` times in one process; returns a markdown table of the median
    microseconds per step and the overhead against no guard.
    """
    settings = {"guard off": None, "no loss check": GuardConfig(loss_factor=0),
                "defaults": GuardConfig()}
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trunk's process runs (dataplane.trunk_threads)
    try:
        for _ in range(repeats):
            for name, guard in settings.items():
                seconds[name].append(step_seconds(guard, steps=steps))
    finally:
        torch.set_num_threads(threads)
    medians = {name: sorted(v)[len(v) // 2] for name, v in seconds.items()}
    lines = ["| trunk | us/step (median of medians) | vs guard off |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {1e6 * m:.0f} | {m / medians['guard off'] - 1:+.1%} |"
              for name, m in medians.items()]
    return "\n".join(lines) + "\n"


# --- results ------------------------------------------------------------------------------

COLUMNS = ("attack", "strategy", "attackers", "defences", "accuracy", "delta", "quarantined",
           "shortened", "honest_refused", "attacker_refused", "clipped", "seconds")


def _reasons(counts: Mapping[str, int]) -> str:
    return " ".join(f"{r}:{n}" for r, n in counts.items()) or "0"


def format_table(rows: Sequence[RunRow]) -> str:
    """Markdown table of the suite."""
    lines = ["| attack | protocol | attackers | defences | final accuracy | vs no attack | "
             "devices quarantined | updates shortened | honest batches refused | "
             "attacker batches refused |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    lines += [f"| {r.attack} | {r.strategy} | {r.attackers} | {r.defences} | "
              f"{r.accuracy:.3f} | {100 * r.delta:+.1f} pts | {r.quarantined} | {r.shortened} | "
              f"{_reasons(r.honest_refused)} | {_reasons(r.attacker_refused)} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(rows: Sequence[RunRow], out: Path, *, footer: str = "") -> None:
    """Write ``poison.csv``, ``poison.json``, ``poison.md`` and ``poison.png`` into ``out``."""
    import csv

    out.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(r) for r in rows]
    (out / "poison.json").write_text(json.dumps(records, indent=1) + "\n")
    with open(out / "poison.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for record in records:
            writer.writerow([_reasons(record[c]) if isinstance(record[c], dict)
                             else record[c] for c in COLUMNS])
    (out / "poison.md").write_text(format_table(rows) + (f"\n{footer}\n" if footer else ""))
    plot(rows, out / "poison.png")


def plot(rows: Sequence[RunRow], path: Path) -> None:
    """Bar chart: each attack's final accuracy, defences on and off, per count of liars."""
    from matplotlib.figure import Figure

    attacked = [r for r in rows if r.attackers]
    labels = list(dict.fromkeys(f"{r.attack} x{r.attackers}" for r in attacked))
    figure = Figure(figsize=(max(6.0, 0.7 * len(labels) + 4), 4.5), layout="constrained")
    axes = figure.add_subplot()
    width = 0.4
    for offset, defences in ((-width / 2, "on"), (width / 2, "off")):
        values = {f"{r.attack} x{r.attackers}": r.accuracy for r in attacked
                  if r.defences == defences}
        axes.bar([i + offset for i in range(len(labels))],
                 [values.get(label, math.nan) for label in labels], width,
                 label=f"defences {defences}")
    styles = iter(["--", ":", "-.", (0, (1, 4))])
    for reference in (r for r in rows if not r.attackers):
        axes.axhline(reference.accuracy, linestyle=next(styles, "--"), color="black",
                     linewidth=0.8,
                     label=f"no attack, {reference.strategy}, defences {reference.defences}")
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    axes.set_ylabel("final test accuracy")
    axes.set_ylim(0, 1)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.savefig(path, dpi=120)


def replot(out: Path) -> None:
    """Draw ``poison.png`` again from the ``poison.json`` in ``out``."""
    rows = [RunRow(**record) for record in json.loads((out / "poison.json").read_text())]
    plot(rows, out / "poison.png")
