"""The one client loop (clients/loop.py) over an in-process data-plane channel."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clients.app import ClientRound
from clients.device import DeviceDeadline
from clients.loop import evaluate_round, train_round
from clients.steps.base import ClientStep
from clients.steps.local_loss import LocalLossStep
from clients.steps.split import SplitStep
from clients.steps.ushaped import UShapedStep
from clients.steps.whole import WholeModelStep
from protocols import PROTOCOLS
from protocols.fedavg import FedAvgOptions
from protocols.local_loss import LocalLossOptions
from protocols.splitfed import SplitFedV2Options
from protocols.ushaped import UShapedOptions
from server.sessions.split import splitfed_v2_sessions
from splitlearn.config import OptimizerConfig, PrivacyConfig, RunSpec
from splitlearn.dataplane import GrpcTransport, InProcessTransport, TrunkChannel, TrunkEndpoint
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.messages import SMASHED_RECORD_KEY
from splitlearn.planning.clock import ClientMeasurement
from splitlearn.planning.devices import DeviceProfile
from splitlearn.privacy import ClientPrivacy, make_client_privacy
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff, train_whole


class RecordingTransport(InProcessTransport):
    """The in-process transport, keeping every frame sent and every reply received."""

    def __init__(self, endpoint: TrunkEndpoint, token: str) -> None:
        super().__init__(endpoint, token)
        self.sent: list[bytes] = []
        self.received: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)
        super().send(data)

    def receive(self, timeout_s: float) -> bytes:
        data = super().receive(timeout_s)
        self.received.append(data)
        return data

    def kinds(self) -> list[str]:
        return [pb.Request.FromString(d).WhichOneof("kind") for d in self.sent]


def recording_channel(server, cut: int = 1) -> tuple[TrunkChannel, RecordingTransport]:
    transport = RecordingTransport(server.endpoint, server.token(cut))
    return TrunkChannel(transport), transport


def plain(batches) -> ClientPrivacy:
    """privacy=none over fixed batches."""
    return ClientPrivacy(PrivacyConfig(), batches)


class BatchLog:
    """Stands in for the pacer: keeps each batch's measurement and the channel's wait so far."""

    def __init__(self, channel: TrunkChannel) -> None:
        self.channel = channel
        self.batches: list[tuple[ClientMeasurement, float, float]] = []

    def after_batch(self, work: ClientMeasurement, *, wall_s: float) -> None:
        self.batches.append((work, wall_s, self.channel.wait_s))


class SlowTrunk:
    """A session handler that holds every request until the test's gate opens (or times out)."""

    def __init__(self, inner, gate: threading.Event, hold_s: float) -> None:
        self.inner, self.gate, self.hold_s = inner, gate, hold_s
        self.blocked_s: list[float] = []

    def handle(self, session, request):
        started = time.perf_counter()
        self.gate.wait(self.hold_s)  # the gate stays shut: the trunk is slow
        self.blocked_s.append(time.perf_counter() - started)
        return self.inner.handle(session, request)

    def attach(self, session):
        self.inner.attach(session)

    def detach(self, session):
        self.inner.detach(session)

    def finish_round(self, finished):
        self.inner.finish_round(finished)


def test_compute_excludes_the_time_waiting_for_the_trunk(trunk_server_factory):
    gate = threading.Event()
    options = SplitFedV2Options(lr=0.1)
    server = trunk_server_factory(
        digits_like_model(), options=options,
        handler=lambda trunk, dataplane: SlowTrunk(splitfed_v2_sessions(trunk, options, dataplane),
                                                gate, hold_s=0.02),
    )
    model = digits_like_model()
    channel, _ = recording_channel(server)
    log = BatchLog(channel)
    step = SplitStep(model, RunSpec(strategy=options), cut=1)
    report = train_round(step, channel, plain(fixed_batches(4)), epochs=1,
                         pacer=log)  # type: ignore[arg-type]
    blocked = server.handler.blocked_s
    assert report.steps == len(log.batches) == len(blocked) == 4
    waited_before = 0.0
    for (work, busy, waited), held in zip(log.batches, blocked, strict=True):
        wait = waited - waited_before
        waited_before = waited
        assert wait >= held > 0  # the channel's wait covers the trunk's hold ...
        assert 0 < work.compute_s == busy  # ... the device's busy time, which is paced, does not
    # The loop's books: compute plus waiting fit in the round's time.
    assert sum(work.compute_s for work, _, _ in log.batches) == pytest.approx(report.compute_s)
    assert report.wait_s == channel.wait_s
    assert report.compute_s + channel.wait_s <= report.wall_s
    assert report.compute_s <= report.wall_s - sum(blocked)


def test_partial_work_stops_after_the_steps_asked_for_across_epochs(trunk_server_factory):
    options = SplitFedV2Options(lr=0.1)
    server = trunk_server_factory(digits_like_model(), options=options)
    channel, _ = recording_channel(server)
    step = SplitStep(digits_like_model(), RunSpec(strategy=options), cut=1)
    seen: list[int] = []
    report = train_round(step, channel, plain(fixed_batches(3)), epochs=2, on_step=seen.append,
                         max_steps=4)  # the whole first epoch and one batch of the second
    assert seen == [1, 2, 3, 4] and report.steps == 4
    assert report.examples == 4 * len(fixed_batches(1)[0][1])
    assert report.exchanges == 4 and channel.bytes_up > 0


def test_a_device_keeps_the_rounds_deadline_by_its_own_clock(trunk_server_factory):
    """One device second per batch, one for the weights down and a half to send them back:
    by a deadline of 5 s it trains 3 of its 6 batches (a fourth, uploaded, would end at
    5.5 s), by 5.5 s 4; at least 4 it trains 4; a deadline past its round leaves it whole."""
    options = SplitFedV2Options(lr=0.1)
    server = trunk_server_factory(digits_like_model(), options=options)

    def trained(deadline_s: float, least: int) -> tuple[int, DeviceDeadline]:
        channel, _ = recording_channel(server)
        step = SplitStep(digits_like_model(), RunSpec(strategy=options), cut=1)
        deadline = DeviceDeadline(deadline_s=deadline_s, least_steps=least,
                                  batch_s=lambda work, wall_s: 1.0, spent_s=1.0, reserve_s=0.5)
        report = train_round(step, channel, plain(fixed_batches(3)), epochs=2, deadline=deadline)
        assert report.steps == report.exchanges
        return report.steps, deadline

    steps, deadline = trained(5.0, 1)
    assert steps == 3 and deadline.spent_s == 4.0
    assert trained(5.5, 1)[0] == 4 and trained(5.0, 4)[0] == 4
    assert trained(100.0, 1)[0] == 6


def test_a_deadline_counts_batches_on_the_devices_clock():
    """The emulated device's batch is its virtual time (compute rescaled, links, RTT); its
    weights cross its links before and after; a real device counts wall seconds."""
    phone = DeviceProfile("phone", flops_per_s=1e9, memory_bytes=1 << 30, uplink_mbps=8.0,
                          downlink_mbps=16.0, rtt_s=0.05)
    deadline = DeviceDeadline.emulated(phone, host_flops_per_s=1e10, deadline_s=10.0,
                                       least_steps=1, weights_bytes=1_000_000)
    assert deadline.spent_s == pytest.approx(1_000_000 / phone.downlink_bytes_per_s)
    assert deadline.reserve_s == pytest.approx(1_000_000 / phone.uplink_bytes_per_s)
    work = ClientMeasurement(0.1, 100_000, 100_000, 1)
    before = deadline.spent_s
    deadline.after_batch(work, wall_s=99.0)  # the host's wall time is not the device's
    expected = (0.1 * 10 + 100_000 / phone.uplink_bytes_per_s
                + 100_000 / phone.downlink_bytes_per_s + 0.05)
    assert deadline.spent_s - before == pytest.approx(expected)
    real = DeviceDeadline.measured(deadline_s=10.0, least_steps=1)
    real.after_batch(work, wall_s=2.5)
    assert real.spent_s == 2.5
    assert not real.reached(0)  # nothing before its least work
    assert not real.reached(1)  # 2.5 s, and one more at that pace ends at 5 s
    real.after_batch(work, wall_s=5.0)
    assert real.reached(2)  # 7.5 s, and one more at the mean 3.75 s ends past 10 s


def test_on_step_sees_every_step_and_its_exception_aborts_the_round(trunk_server_factory):
    options = SplitFedV2Options(lr=0.1)
    server = trunk_server_factory(digits_like_model(), options=options)
    seen: list[int] = []
    channel, _ = recording_channel(server)
    step = SplitStep(digits_like_model(), RunSpec(strategy=options), cut=1)
    report = train_round(step, channel, plain(fixed_batches(3)), epochs=2, on_step=seen.append)
    assert seen == [1, 2, 3, 4, 5, 6] and report.steps == 6

    class Vanished(RuntimeError):
        pass

    def vanish_at_two(n: int) -> None:
        seen.append(n)
        if n == 2:
            raise Vanished(n)

    seen.clear()
    server = trunk_server_factory(digits_like_model(), options=options)
    channel, transport = recording_channel(server)
    step = SplitStep(digits_like_model(), RunSpec(strategy=options), cut=1)
    with pytest.raises(Vanished):
        train_round(step, channel, plain(fixed_batches(5)), epochs=1, on_step=vanish_at_two)
    assert seen == [1, 2]
    assert len(transport.sent) == 2 and server.trunk.steps == 2  # nothing after the abort


CASES = {
    "splitfed_v2": ("splitfed_v2", SplitStep, SplitFedV2Options(lr=0.1)),
    "ushaped": ("ushaped", UShapedStep, UShapedOptions(lr=0.1)),
    "local_loss": ("local_loss", LocalLossStep, LocalLossOptions(lr=0.1)),
    "local_loss_bulk": ("local_loss", LocalLossStep, LocalLossOptions(lr=0.1, bulk=True)),
    "fedavg": (None, WholeModelStep, FedAvgOptions(lr=0.1)),
}
#: Round trips for N batches, from each protocol's definition.
EXPECTED_EXCHANGES = {
    "splitfed_v2": lambda n: n,  # forward -> gradient
    "ushaped": lambda n: 2 * n,  # forward -> features, backward -> gradient
    "local_loss": lambda n: 1,  # one-way frames; the last ack costs one round trip
    "local_loss_bulk": lambda n: 0,  # rides the Flower reply
    "fedavg": lambda n: 1,  # weights down and up
}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("case", list(CASES))
def test_exchanges_and_bytes_follow_the_protocol(trunk_server_factory, case):
    protocol, step_class, options = CASES[case]
    model = digits_like_model()
    step: ClientStep = step_class(model, RunSpec(strategy=options), cut=1)
    channel = transport = None
    if step.needs_channel:
        server = trunk_server_factory(digits_like_model(), protocol=protocol, options=options)
        channel, transport = recording_channel(server)
    report = train_round(step, channel, plain(fixed_batches(3)), epochs=2)
    assert report.steps == 6 and report.examples == 96
    assert report.exchanges == EXPECTED_EXCHANGES[case](6)
    assert report.exchanges == report.steps * step.exchanges_per_batch + step.extra_exchanges()
    if transport is not None:
        assert channel is not None
        assert report.bytes_up == channel.bytes_up == sum(len(d) for d in transport.sent)
        assert report.bytes_down == channel.bytes_down == sum(len(d) for d in transport.received)
        assert len(transport.received) == len(transport.sent)  # every request answered
        kinds = {"splitfed_v2": ["forward"] * 6, "ushaped": ["forward", "backward"] * 6,
                 "local_loss": ["smashed"] * 6}[case]
        assert transport.kinds() == kinds
    elif case == "local_loss_bulk":  # activations and labels kept for the reply
        kept = step.reply_arrays()[SMASHED_RECORD_KEY]
        assert kept["batch-sizes"].tolist() == [16] * 6
        assert report.bytes_up == tensor_bytes([kept["activations"], kept["labels"]])
        assert report.bytes_down == 0
    else:  # no data plane: the weights, in the Flower messages, are the ClientApp's to count
        assert report.bytes_up == report.bytes_down == 0


def test_split_round_equals_whole_model_sgd_and_reports_its_losses(trunk_server_factory):
    options = SplitFedV2Options(lr=0.1, momentum=0.0)
    model = digits_like_model()
    reference = copy.deepcopy(model)
    server = trunk_server_factory(model, options=options, lr=0.1)
    batches = fixed_batches(3)
    channel, _ = recording_channel(server)
    report = train_round(SplitStep(model, RunSpec(strategy=options), cut=1), channel,
                         plain(batches), epochs=1)
    # Reference losses and hits: each batch scored just before its own update.
    losses, hits = [], 0
    replay = copy.deepcopy(reference)
    for x, y in batches:
        with torch.no_grad():
            logits = replay(x)
        losses.append(float(nn.functional.cross_entropy(logits, y)))
        hits += int((logits.argmax(1) == y).sum())
        train_whole(replay, [(x, y)], lr=0.1)
    train_whole(reference, batches, lr=0.1)
    joined = copy.deepcopy(server.trunk.model)
    joined.stages[0].load_state_dict(model.stages[0].state_dict())
    assert max_param_diff(joined, reference) < 1e-5
    assert report.loss == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert report.accuracy == pytest.approx(hits / 48)


OPTIMIZERS = {
    "sgd": OptimizerConfig(),
    "sgd-nesterov": OptimizerConfig(options={"nesterov": True}),  # torch's SGD, not LightSGD
    "adam": OptimizerConfig(_target_="torch.optim.Adam"),
    "adamw": OptimizerConfig(_target_="torch.optim.AdamW", options={"betas": [0.8, 0.95]}),
}


@pytest.mark.parametrize("cut", digits_like_model().valid_cuts)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_split_round_equals_the_whole_model_trained_by_the_same_optimizer(
        trunk_server_factory, name, cut):
    # Devices and trunk each step their own parameters with the configured optimiser,
    # through the real data plane; every optimiser here is per parameter, so together
    # they are the whole model's optimiser.
    optimizer = OPTIMIZERS[name]
    options = SplitFedV2Options(lr=0.01, momentum=0.5, weight_decay=0.01, optimizer=optimizer)
    model = digits_like_model()
    reference = copy.deepcopy(model)
    # The reference's layout: channels-last convolutions round differently, and Adam's
    # normalised step would magnify that where a gradient is near zero.
    server = trunk_server_factory(model, options=options, lr=0.01, momentum=0.5,
                                  weight_decay=0.01, optimizer=optimizer, channels_last=False)
    batches = fixed_batches(4)
    channel = TrunkChannel(GrpcTransport(server.service.address, server.token(cut),
                                         max_frame_bytes=1 << 20))
    try:
        train_round(SplitStep(model, RunSpec(strategy=options), cut=cut), channel,
                    plain(batches), epochs=1)
    finally:
        channel.close()
    kwargs = {"lr": 0.01, "weight_decay": 0.01} | (
        {"momentum": 0.5} if optimizer._target_ == "torch.optim.SGD" else {})
    whole = {"sgd": torch.optim.SGD, "sgd-nesterov": torch.optim.SGD, "adam": torch.optim.Adam,
             "adamw": torch.optim.AdamW}[name](reference.parameters(),
                                               **kwargs | dict(optimizer.options))
    reference.train()
    for x, y in batches:
        whole.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        whole.step()
    joined = copy.deepcopy(server.trunk.model)
    for index in range(cut):
        joined.stages[index].load_state_dict(model.stages[index].state_dict())
    untrained = digits_like_model()
    assert max_param_diff(joined, untrained) > 1e-3  # it trained
    assert max_param_diff(joined, reference) < 1e-6


@pytest.mark.parametrize("protocol", ["splitfed_v2", "ushaped"])
def test_evaluate_round_scores_the_pipeline_without_an_update(trunk_server_factory, protocol):
    step_class, options = {"splitfed_v2": (SplitStep, SplitFedV2Options()),
                           "ushaped": (UShapedStep, UShapedOptions())}[protocol]
    model = digits_like_model()
    server = trunk_server_factory(model, protocol=protocol, options=options)
    before = copy.deepcopy(server.trunk.model.state_dict())
    x = torch.cat([b[0] for b in fixed_batches(3)])
    y = torch.cat([b[1] for b in fixed_batches(3)])
    channel, transport = recording_channel(server)
    step = step_class(model, RunSpec(strategy=options), cut=1)
    loss, accuracy, examples = evaluate_round(step, channel,
                                              DataLoader(TensorDataset(x, y), batch_size=20))
    with torch.no_grad():
        logits = digits_like_model().eval()(x)
    assert examples == 48
    assert loss == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert accuracy == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert transport.kinds() == ["evaluate"] * 3
    assert server.trunk.steps == 0
    for key, value in server.trunk.model.state_dict().items():
        assert torch.equal(value, before[key])


# --- DP-SGD's empty batches --------------------------------------------------------------------


def dpsgd_privacy(n: int, batch_size: int, seed: int):
    data = TensorDataset(torch.rand(n, 1, 8, 8), torch.randint(0, 10, (n,)))
    settings = PrivacyConfig(name="dpsgd_client", clip_norm=0.5, noise_multiplier=2.0)
    return make_client_privacy(settings, DataLoader(data, batch_size=batch_size),
                               generator=torch.Generator().manual_seed(seed))


def test_an_empty_dp_batch_takes_a_noise_only_step(trunk_server_factory):
    options = SplitFedV2Options(lr=0.5, momentum=0.0)
    server = trunk_server_factory(digits_like_model(), options=options)
    model = digits_like_model()
    step = SplitStep(model, RunSpec(strategy=options), cut=1)
    privacy = dpsgd_privacy(16, 4, seed=3)  # q = 1/4, expected batch 4
    empty = (torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.int64))
    privacy.batches = lambda: [empty]  # this epoch's Poisson sample came out empty
    channel, transport = recording_channel(server)
    before = [p.detach().clone() for p in step.bottom.parameters()]
    seen: list[int] = []
    report = train_round(step, channel, privacy, epochs=1, on_step=seen.append)
    privacy.close()
    assert report.steps == 1 and report.examples == 0 and seen == [1]
    assert transport.sent == [] and report.bytes_up == 0 and server.trunk.steps == 0
    assert report.exchanges == 0  # nothing went to the trunk
    # The step is the generator's noise alone: sigma * C per coordinate, over E, times lr.
    noise = torch.Generator().manual_seed(3)
    for p, p0 in zip(step.bottom.parameters(), before, strict=True):
        expected = torch.normal(0.0, 2.0 * 0.5, size=p.shape, generator=noise) / 4.0
        torch.testing.assert_close(p0 - p.detach(), 0.5 * expected)


def test_poisson_rounds_send_only_the_non_empty_batches(trunk_server_factory):
    options = SplitFedV2Options(lr=0.1)
    server = trunk_server_factory(digits_like_model(), options=options)
    step = SplitStep(digits_like_model(), RunSpec(strategy=options), cut=1)
    privacy = dpsgd_privacy(6, 1, seed=1)  # q = 1/6: a third of the batches are empty
    sizes: list[int] = []
    sample = privacy.batches

    def batches():
        for x, y in sample():
            sizes.append(len(y))
            yield x, y

    privacy.batches = batches
    channel, transport = recording_channel(server)
    seen: list[int] = []
    report = train_round(step, channel, privacy, epochs=3, on_step=seen.append)
    privacy.close()
    assert len(sizes) == 18 and 0 in sizes and any(sizes)
    assert report.steps == 18 and report.examples == sum(sizes)
    assert seen == list(range(1, 19))  # noise-only steps are steps (the dropout hook counts them)
    sent = sum(1 for s in sizes if s)
    assert len(transport.sent) == sent == server.trunk.steps
    assert report.exchanges == sent  # an empty batch makes no round trip


def test_bottom_views_share_the_model():
    # The step trains views of the model's stages: what the reply sends is what was trained.
    model = digits_like_model()
    step = SplitStep(model, RunSpec(strategy=SplitFedV2Options()), cut=2)
    bottom, _ = split(model, 2)
    assert [id(p) for p in step.trained().parameters()] == [id(p) for p in bottom.parameters()]


def test_label_coverage_counts_the_models_classes_not_the_largest_label_present():
    from torch.utils.data import TensorDataset

    from clients.app import label_coverage

    two_classes = TensorDataset(torch.zeros(4, 1), torch.tensor([0, 1, 1, 0]))
    assert label_coverage(two_classes, 10) == pytest.approx(0.2)
    assert label_coverage(TensorDataset(torch.zeros(0, 1), torch.zeros(0, dtype=torch.long)),
                          10) == 0.0


@pytest.mark.parametrize("privacy,secret", [
    (PrivacyConfig(), False),
    (PrivacyConfig(name="dpsgd_client", noise_multiplier=1.0), False),  # Poisson-sampled anyway
    (PrivacyConfig(name="activation_gaussian", noise_multiplier=1.0), True),
])
def test_the_batch_order_is_the_nodes_secret_under_activation_noise(privacy, secret):
    """A server that could recompute the order would know which rows of two noised releases
    belong to one example, and could average their noise away."""
    spec = RunSpec(privacy=privacy)

    def order() -> list[float]:
        rnd = ClientRound(PROTOCOLS["splitfed_v2"], spec, server_round=3, cut=1,
                          recompute=False, token="", trunk_address="", partition_id=1,
                          num_partitions=4)
        return [float(v) for x, _ in rnd.loader() for v in x.flatten(1).sum(1)]

    first, second = order(), order()
    assert sorted(first) == sorted(second)  # the same examples ...
    assert (first != second) == secret  # ... in a repeatable order unless it is secret


@pytest.mark.parametrize("sent,share", [(0.1, 0.1), ("0.25", 0.25), (float("nan"), 1.0),
                                        (float("inf"), 1.0), (-3.0, 0.0), (7.0, 1.0),
                                        ("lots", 1.0), (None, 1.0)])
def test_a_rounds_least_share_is_read_as_a_share_or_the_whole_round(sent, share):
    from clients.app import share_of_round

    assert share_of_round(sent) == share  # a NaN used to fail the round in math.ceil


@pytest.mark.parametrize("sent,deadline", [(5.0, 5.0), ("2.5", 2.5), (0.0, None), (-1.0, None),
                                           (float("nan"), None), (float("inf"), None),
                                           ("soon", None), (None, None)])
def test_a_rounds_deadline_is_a_positive_number_of_seconds_or_none(sent, deadline):
    from clients.app import _positive_or_none

    assert _positive_or_none(sent) == deadline


def test_a_warm_process_builds_a_simulated_devices_data_once(monkeypatch):
    """The Simulation Engine's workers serve device after device: a partition is built once."""
    import clients.app as client_app
    from splitlearn.data.cache import ProcessData

    built = []
    original = client_app.client_dataset

    def counting(*args, **kwargs):  # noqa: ANN202 - the loader's own signature
        built.append(kwargs["partition_id"])
        return original(*args, **kwargs)

    monkeypatch.setattr(client_app, "client_dataset", counting)
    monkeypatch.setattr(client_app, "PROCESS_DATA", ProcessData(max_bytes=2**20))

    def data(partition_id: int, server_round: int) -> TensorDataset:
        return ClientRound(PROTOCOLS["splitfed_v2"], RunSpec(), server_round=server_round,
                           cut=1, recompute=False, token="", trunk_address="",
                           partition_id=partition_id, num_partitions=4).dataset()

    rounds = [data(p, r) for r in (1, 2) for p in (1, 2)]
    assert built == [1, 2]
    for first, later in ((rounds[0], rounds[2]), (rounds[1], rounds[3])):
        assert all(torch.equal(a, b) for a, b in zip(first.tensors, later.tensors, strict=True))
    assert not torch.equal(rounds[0].tensors[0][:5], rounds[1].tensors[0][:5])


def device_side_flops(model, cut: int, batches) -> float:  # noqa: ANN001
    """Reference: FLOPs of stages [0, cut) trained alone on the batches (no trunk, no loss).

    Each batch's forward, and its backward from a gradient at the cut, as the device runs
    them; what the trunk computes for it is the trunk's.
    """
    from torch.utils.flop_counter import FlopCounterMode

    bottom = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        for x, _ in batches:
            out = x
            for stage in bottom.stages[:cut]:
                out = stage(out)
            out.backward(torch.ones_like(out))
    return counter.get_total_flops()


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_counted_round_charges_the_devices_own_flops_not_the_trunks(trunk_server_factory,
                                                                       cut: int):
    options = SplitFedV2Options(lr=0.1)
    server = trunk_server_factory(digits_like_model(), options=options)
    model = digits_like_model()
    batches = fixed_batches(4)  # equal batches: the first one's count per example is exact
    channel, _ = recording_channel(server, cut=cut)
    log = BatchLog(channel)
    step = SplitStep(model, RunSpec(strategy=options), cut=cut)
    report = train_round(step, channel, plain(batches), epochs=1, count_flops=True,
                         pacer=log)  # type: ignore[arg-type]
    expected = device_side_flops(digits_like_model(), cut, batches)
    # The trunk ran on this thread (in-process) and is not counted; the SGD step's
    # element-wise updates count no FLOPs either.
    assert report.flops == pytest.approx(expected, rel=1e-9)
    assert [work.flops for work, _, _ in log.batches] == pytest.approx([expected / 4] * 4)
    assert report.measurement.flops == report.flops
    # Uncounted, the clock falls back on the host's seconds.
    plain_report = train_round(SplitStep(digits_like_model(), RunSpec(strategy=options), cut=cut),
                               recording_channel(server, cut=cut)[0], plain(batches), epochs=1)
    assert plain_report.flops is None and plain_report.measurement.flops is None


def test_the_clock_charges_counted_flops_at_the_devices_speed_whatever_the_host_took():
    from splitlearn.planning.clock import client_time

    device = DeviceProfile("test", flops_per_s=2e9, memory_bytes=1 << 30, uplink_mbps=8.0,
                           downlink_mbps=16.0, rtt_s=0.05)
    slow_host = ClientMeasurement(compute_s=9.0, bytes_up=10**6, bytes_down=2 * 10**6,
                                  exchanges=3, flops=4e9)
    quick_host = ClientMeasurement(compute_s=0.01, bytes_up=10**6, bytes_down=2 * 10**6,
                                   exchanges=3, flops=4e9)
    for work in (slow_host, quick_host):
        time = client_time(work, device, host_flops_per_s=5e10)
        assert time.compute_s == pytest.approx(2.0)  # 4 GFLOP at 2 GFLOP/s
        assert time.upload_s == pytest.approx(1.0) and time.download_s == pytest.approx(1.0)
        assert time.latency_s == pytest.approx(0.15)
    # Without a count, the host's seconds at its FLOP/s, at the device's.
    uncounted = client_time(replace(slow_host, flops=None), device, host_flops_per_s=5e10)
    assert uncounted.compute_s == pytest.approx(9.0 * 5e10 / 2e9)
