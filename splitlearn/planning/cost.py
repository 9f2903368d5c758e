"""The planner's cost model: what a client's round costs at each cut (pure Python).

Everything here is arithmetic on numbers the zoo reports per stage
(:meth:`splitlearn.models.SplittableModel.stage_costs`) and on what clients
measured; nothing imports torch or Flower, so planners can be tested and
reasoned about alone.

A client ``i`` that trains ``s_i`` samples in ``b_i`` batches at cut ``c``
needs, in the virtual clock's terms (``splitlearn.planning.clock``)::

    T_i(c) = s_i * flops_client(c) / F_i            # compute (x 4/3 when recomputing)
           + s_i * smashed(c) / up_i                # activations up
           + s_i * smashed(c) / down_i              # their gradients down
           + b_i * e(c) * rtt_i                     # e round trips per batch (1; U-shaped 2)
           + params(c) / down_i + params(c) / up_i  # its stages' weights, there and back

and the trunk ``W_i(c) = b_i * t_batch(c) + s_i * flops_server(c) / F_trunk``: a fixed
cost per batch (decoding, checks, the step's own overhead, which is most of a step at a
deep cut) and its FLOPs, both measured (:func:`splitlearn.planning.monitor.fit_trunk`).
A shared trunk
serialises its steps, so a round lasts ``max_i T_i(c_i) + sum_i W_i(c_i)``
(the same model the virtual clock charges); a trunk per client in parallel
gives ``max_i (T_i(c_i) + W_i(c_i))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from splitlearn.communication import encoded_row_bytes
from splitlearn.planning.queue import DeviceRound, TrunkOf, round_seconds, shared

#: Backward costs about twice the forward: training = 3 forwards.
TRAIN_TO_FORWARD_FLOPS = 3


@dataclass(frozen=True)
class CutCost:
    """What cut ``cut`` costs per sample, from the model's stage costs.

    Parameters
    ----------
    cut : int
        Stages ``[0, cut)`` on the client.
    client_flops_per_sample : float
        Training FLOPs (forward + backward) of the client's stages.
    recompute_flops_per_sample : float
        Extra FLOPs when the client recomputes its activations (one more
        forward of its stages during backward).
    server_flops_per_sample : float
        Training FLOPs of the trunk's stages ``[cut, n)``.
    smashed_bytes_per_sample : int
        Bytes of the activation at the cut (float32); its gradient is as large.
    client_param_bytes : int
        Bytes of the client's weights (float32), downloaded and uploaded each round.
    memory_bytes : int
        Client training memory for one batch at the run's batch size.
    recompute_memory_bytes : int
        The same with per-stage activation recomputation.
    leak : float | None
        A measured attack score at this cut (e.g. inversion SSIM; higher
        reveals more), or None when not measured.
    exchanges_per_batch : int
        Round trips with the trunk per batch (U-shaped learning: 2; local loss,
        which only sends: 0).
    returns_gradient : bool
        Whether the gradient at the cut comes back down (not with local loss).
    gradient_bytes_per_sample : int | None
        Bytes of the gradient at the cut as it comes down, when its encoding
        differs from the activation's (:func:`with_compression`); None: as large.
    reference_bytes_per_example : int
        Memory the client holds per example of its data besides the batch's: uplink
        error feedback's float32 reference (:func:`with_compression`); 0 without.
    kept_samples : float
        Most samples of a round whose activations (and labels) the client keeps past
        their batch (:meth:`clients.steps.base.ClientStep.kept_samples_cap`; local loss:
        until the trunk's ack, or ``math.inf``, all of them, for the Flower reply).
    kept_bytes_per_sample : int
        What one kept sample takes: a float32 row at the cut and an int64 label.
    trunk_batch_s : float
        The trunk's fixed seconds per batch at this cut, besides its FLOPs (measured;
        0: FLOPs only).
    """

    cut: int
    client_flops_per_sample: float
    recompute_flops_per_sample: float
    server_flops_per_sample: float
    smashed_bytes_per_sample: int
    client_param_bytes: int
    memory_bytes: int
    recompute_memory_bytes: int
    leak: float | None = None
    exchanges_per_batch: int = 1
    returns_gradient: bool = True
    gradient_bytes_per_sample: int | None = None
    reference_bytes_per_example: int = 0
    kept_samples: float = 0
    kept_bytes_per_sample: int = 0
    trunk_batch_s: float = 0.0


def with_compression(cost: CutCost, *, uplink: str, downlink: str, topk_fraction: float = 0.1,
                     error_feedback: bool = False, feature_entries: int = 0) -> CutCost:
    """Return ``cost`` with the cut's tensors as the data plane encodes them.

    ``smashed_bytes_per_sample`` (float32 values) becomes the ``uplink``
    encoding's bytes and the gradient's the ``downlink`` one's
    (:func:`splitlearn.communication.encoded_row_bytes`; int8 at its dense size,
    an upper bound when activations have many zeros). With ``error_feedback`` and a
    lossy uplink the client also keeps a float32 row per example; a U-shaped client
    (``feature_entries``: values per example of the trunk's features) with a lossy
    downlink also a row of features.
    """
    entries = cost.smashed_bytes_per_sample // 4
    return replace(
        cost,
        smashed_bytes_per_sample=encoded_row_bytes(entries, uplink, topk_fraction=topk_fraction),
        gradient_bytes_per_sample=encoded_row_bytes(entries, downlink,
                                                    topk_fraction=topk_fraction),
        reference_bytes_per_example=4 * error_feedback * (
            entries * (uplink != "none") + feature_entries * (downlink != "none")),
    )


def with_kept_samples(cost: CutCost, samples: float) -> CutCost:
    """Return ``cost`` with ``samples`` kept past their batch (:attr:`CutCost.kept_samples`).

    Before :func:`with_compression`: a kept sample is its float32 row and int64 label.
    """
    return replace(cost, kept_samples=samples,
                   kept_bytes_per_sample=cost.smashed_bytes_per_sample + 8)


@dataclass(frozen=True)
class ClientState:
    """What the planner knows of one client (smoothed measurements or a prior).

    Parameters
    ----------
    client : str
        The client's id (a Flower node id as text).
    flops_per_s : float
        Training FLOP/s.
    uplink_bytes_per_s, downlink_bytes_per_s : float
        Link bandwidths.
    rtt_s : float
        Round-trip latency, paid once per batch.
    memory_bytes : float
        Memory budget for training.
    samples : int
        Samples the client trains per round (epochs included).
    batches : int
        Batches per round (data-plane exchanges).
    utility : float
        Statistical utility of its data (SmartSplit's selection), >= 0.
    current_cut : int | None
        The cut it held last round, if any (moving costs bytes).
    examples : int
        Examples in its local data (what per-example memory scales with); 0: unknown.
    measured : bool
        Whether its speed was measured (False: the figures are a prior's guess).
    flops_per_s_at : tuple[tuple[int, float], ...]
        ``(cut, FLOP/s)`` where its speed at that cut was measured: a cut's layers run at
        their own efficiency (small early convolutions, per-batch overhead), so a rate
        measured at one cut is not the rate at another. ``flops_per_s`` elsewhere.
    """

    client: str
    flops_per_s: float
    uplink_bytes_per_s: float
    downlink_bytes_per_s: float
    rtt_s: float
    memory_bytes: float
    samples: int
    batches: int
    utility: float = 1.0
    current_cut: int | None = None
    examples: int = 0
    measured: bool = True
    flops_per_s_at: tuple[tuple[int, float], ...] = ()

    def rate_at(self, cut: int) -> float:
        """Return its training FLOP/s at ``cut``: measured there, else ``flops_per_s``."""
        return next((rate for c, rate in self.flops_per_s_at if c == cut), self.flops_per_s)


@dataclass(frozen=True)
class Assignment:
    """One client's part in a round: its cut, whether it recomputes, how much it trains.

    ``steps`` caps the batches it trains this round (partial work: a slow device
    trains what fits the round's deadline); None is its whole round. With
    ``deadline_s`` (partial work kept by the device) the device instead trains until
    its next batch would end after that many seconds of its round, at least
    ``least_work`` of its round and at most all of it; ``steps`` is then what the
    plan predicts it trains.

    ``client_s`` and ``trunk_s`` are the cost model's prediction of the client's own
    seconds (``T``) and the trunk's for it (``W``), which the round's metrics compare
    with the clock's.
    """

    client: str
    cut: int
    recompute: bool = False
    steps: int | None = None
    deadline_s: float | None = None
    least_work: float = 1.0
    client_s: float = 0.0
    trunk_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A round's plan: who trains at which cut, and the predicted makespan.

    Parameters
    ----------
    assignments : tuple[Assignment, ...]
        The clients that take part.
    makespan_s : float
        Predicted round length under the cost model.
    excluded : dict[str, str]
        Clients left out, with the reason (no cut fits its memory, not selected).
    round_s : float | None
        The round predicted by playing it out at the trunk
        (:func:`predicted_round_s`), which the clock charges the same way; None: not
        predicted. ``makespan_s`` is the planners' objective, an upper bound of it.
    """

    assignments: tuple[Assignment, ...]
    makespan_s: float
    excluded: dict[str, str] = field(default_factory=dict)
    round_s: float | None = None

    def cut_of(self, client: str) -> int | None:
        """Return ``client``'s cut, or None when it does not take part."""
        return next((a.cut for a in self.assignments if a.client == client), None)

    @property
    def slowest_client_s(self) -> float:
        """The predicted seconds of the slowest taking-part client's own round."""
        return max((a.client_s for a in self.assignments), default=0.0)

    @property
    def trunk_s(self) -> float:
        """The predicted seconds of trunk work for all taking-part clients together."""
        return sum(a.trunk_s for a in self.assignments)


def client_seconds(client: ClientState, cost: CutCost, *, recompute: bool = False) -> float:
    """Predicted seconds of the client's own compute and transfers at ``cost.cut``."""
    flops = cost.client_flops_per_sample + (cost.recompute_flops_per_sample if recompute else 0.0)
    activations = client.samples * cost.smashed_bytes_per_sample
    gradient = cost.gradient_bytes_per_sample
    gradients = (client.samples * (cost.smashed_bytes_per_sample if gradient is None else gradient)
                 if cost.returns_gradient else 0)
    weights = cost.client_param_bytes
    return (
        client.samples * flops / client.rate_at(cost.cut)
        + (activations + weights) / client.uplink_bytes_per_s
        + (gradients + weights) / client.downlink_bytes_per_s
        + client.batches * cost.exchanges_per_batch * client.rtt_s
    )


def device_round(client: ClientState, cost: CutCost, *, trunk_flops_per_s: float,
                 recompute: bool = False, steps: int | None = None,
                 trunk: int | str = 0) -> DeviceRound:
    """Return the client's round at ``cost.cut`` as its trunk's queue sees it (predicted).

    The parts of :func:`client_seconds` by when they happen: its weights down before its
    first batch and up after its last; per batch, a third of its compute (the forward),
    the activations up and half its round trips before the trunk's step, the rest after
    it. ``steps`` batches (None: all of its round).
    """
    per_batch = client.samples / max(client.batches, 1)
    forward = cost.client_flops_per_sample / TRAIN_TO_FORWARD_FLOPS
    flops = cost.client_flops_per_sample + (cost.recompute_flops_per_sample if recompute else 0.0)
    gradient = cost.gradient_bytes_per_sample
    gradient_bytes = ((cost.smashed_bytes_per_sample if gradient is None else gradient)
                      if cost.returns_gradient else 0)
    rtt = cost.exchanges_per_batch * client.rtt_s / 2
    rate = client.rate_at(cost.cut)
    return DeviceRound(
        client.batches if steps is None else steps,
        before_s=cost.client_param_bytes / client.downlink_bytes_per_s,
        up_s=per_batch * (forward / rate
                          + cost.smashed_bytes_per_sample / client.uplink_bytes_per_s) + rtt,
        trunk_s=cost.trunk_batch_s + per_batch * cost.server_flops_per_sample / trunk_flops_per_s,
        down_s=per_batch * ((flops - forward) / rate
                            + gradient_bytes / client.downlink_bytes_per_s) + rtt,
        after_s=cost.client_param_bytes / client.uplink_bytes_per_s,
        trunk=trunk, waits=cost.exchanges_per_batch > 0)


def predicted_rounds(plan: Plan, clients: Mapping[str, ClientState],
                     costs: Mapping[int, CutCost], *, trunk_flops_per_s: float,
                     trunk_of: TrunkOf = shared) -> dict[str, DeviceRound]:
    """Return each taking-part client's predicted round, in node order (its trunk's order).

    A device with a deadline trains the batches the plan predicts (``steps``).
    """
    taking = sorted(plan.assignments, key=lambda a: _node_order(a.client))
    return {a.client: device_round(
                clients[a.client], costs[a.cut], trunk_flops_per_s=trunk_flops_per_s,
                recompute=a.recompute, steps=a.steps, trunk=trunk_of(i, a.client))
            for i, a in enumerate(taking)}


def predicted_round_s(plan: Plan, clients: Mapping[str, ClientState],
                      costs: Mapping[int, CutCost], *, trunk_flops_per_s: float,
                      trunk_of: TrunkOf = shared) -> float:
    """Return ``plan``'s round played out at the trunk (:func:`predicted_rounds`)."""
    return round_seconds(list(predicted_rounds(
        plan, clients, costs, trunk_flops_per_s=trunk_flops_per_s, trunk_of=trunk_of).values()))


def _node_order(client: str) -> tuple[int, str]:
    """Sort key of a client id: numerically where it is a node id."""
    return (int(client), "") if client.isdigit() else (0, client)


def trunk_seconds(client: ClientState, cost: CutCost, *, trunk_flops_per_s: float) -> float:
    """Predicted seconds the trunk works for ``client`` at ``cost.cut``."""
    return (client.batches * cost.trunk_batch_s
            + client.samples * cost.server_flops_per_sample / trunk_flops_per_s)


@dataclass(frozen=True)
class RoundWork:
    """A client's round at one cut as a line in the batches it trains (partial work).

    Its weights cross once whatever it trains (``fixed_s``); each batch adds the
    same compute, activations, gradients and round trips (``per_batch_s``) and the
    same trunk work (``trunk_per_batch_s``). At ``batches`` steps the times are
    :func:`client_seconds` and :func:`trunk_seconds`.
    """

    batches: int
    fixed_s: float
    per_batch_s: float
    trunk_per_batch_s: float

    @classmethod
    def of(cls, client: ClientState, cost: CutCost, *, trunk_flops_per_s: float,
           recompute: bool = False) -> RoundWork:
        """Return ``client``'s round at ``cost.cut`` as a line."""
        whole = client_seconds(client, cost, recompute=recompute)
        fixed = client_seconds(replace(client, samples=0, batches=0), cost, recompute=recompute)
        trunk = trunk_seconds(client, cost, trunk_flops_per_s=trunk_flops_per_s)
        batches = max(client.batches, 1)
        return cls(client.batches, fixed, (whole - fixed) / batches, trunk / batches)

    def client_s(self, steps: int) -> float:
        """Client seconds when it trains ``steps`` batches."""
        return self.fixed_s + steps * self.per_batch_s

    def trunk_s(self, steps: int) -> float:
        """Trunk seconds for ``steps`` of its batches."""
        return steps * self.trunk_per_batch_s

    def steps_within(self, deadline_s: float) -> int:
        """Return the most batches that end by ``deadline_s`` (0: not even its weights)."""
        if self.client_s(self.batches) <= deadline_s:
            return self.batches
        if self.per_batch_s <= 0 or deadline_s < self.fixed_s:
            return 0
        steps = min(self.batches, math.floor((deadline_s - self.fixed_s) / self.per_batch_s))
        # The division rounds: settle on the definition, client_s(steps) <= deadline_s.
        while steps < self.batches and self.client_s(steps + 1) <= deadline_s:
            steps += 1
        while steps > 0 and self.client_s(steps) > deadline_s:
            steps -= 1
        return steps


def needed_memory(client: ClientState, cost: CutCost, *, recompute: bool = False) -> int:
    """Return the client's training memory at the cut: a batch's, and the rows it keeps."""
    batch = cost.recompute_memory_bytes if recompute else cost.memory_bytes
    kept = int(min(cost.kept_samples, client.samples)) * cost.kept_bytes_per_sample
    return batch + cost.reference_bytes_per_example * client.examples + kept


def fits(client: ClientState, cost: CutCost, *, recompute: bool = False) -> bool:
    """Whether the cut's training memory fits the client's budget."""
    return needed_memory(client, cost, recompute=recompute) <= client.memory_bytes


def makespan(
    times: Iterable[tuple[float, float]], *, shared_trunk: bool = True
) -> float:
    """Round length from ``(client seconds, trunk seconds)`` per taking-part client."""
    pairs = list(times)
    if not pairs:
        return 0.0
    if shared_trunk:
        return max(t for t, _ in pairs) + sum(w for _, w in pairs)
    return max(t + w for t, w in pairs)


def move_bytes(costs: Sequence[CutCost], old_cut: int | None, new_cut: int) -> int:
    """Bytes of the stages that change sides when a client's cut moves.

    The client's stages are exchanged every round anyway; moving adds the
    stages it newly holds (downloaded) or gives up (uploaded to the trunk).
    """
    if old_cut is None or old_cut == new_cut:
        return 0
    by_cut = {c.cut: c.client_param_bytes for c in costs}
    return abs(by_cut[new_cut] - by_cut[old_cut])
