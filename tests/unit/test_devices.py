"""Device profiles, their assignment, the virtual clock and client-side emulation."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest

import clients.device
from clients.device import (
    DevicePlan,
    MemoryBudgetExceeded,
    Pacer,
    device_profile,
    plan_round,
    virtual_time,
)
from clients.loop import train_round
from clients.steps.split import SplitStep
from clients.steps.ushaped import UShapedStep
from protocols import compose_config
from protocols.splitfed import SplitFedV2Options
from protocols.ushaped import UShapedOptions
from splitlearn.config import PrivacyConfig, RunSpec, run_spec, to_container
from splitlearn.models.factory import build_model_from_config
from splitlearn.planning.clock import (
    ClientMeasurement,
    VirtualClock,
    client_time,
)
from splitlearn.planning.devices import (
    MBIT,
    DeviceProfile,
    assign_profiles,
    build_fleet,
    mix_counts,
)
from splitlearn.privacy import ClientPrivacy
from tests.conftest import digits_like_model, fixed_batches

PHONE = DeviceProfile(
    name="phone", flops_per_s=2e9, memory_bytes=2**20, uplink_mbps=8.0, downlink_mbps=40.0,
    rtt_s=0.05, availability=0.5, dropout=0.2,
)


def test_mix_counts_follow_weights_and_add_up():
    assert mix_counts(10, {"a": 0.5, "b": 0.3, "c": 0.2}) == {"a": 5, "b": 3, "c": 2}
    counts = mix_counts(7, {"a": 1, "b": 1, "c": 1})
    assert sum(counts.values()) == 7 and sorted(counts.values()) == [2, 2, 3]
    assert mix_counts(1000, {"a": 0.123, "b": 0.877}) == {"a": 123, "b": 877}


@pytest.mark.parametrize("mix", [{}, {"a": 0.0}, {"a": -1.0, "b": 2.0}])
def test_bad_mixes_are_refused(mix):
    with pytest.raises(ValueError, match="device mix"):
        mix_counts(5, mix)


def test_assignment_is_deterministic_per_seed():
    mix = {"a": 0.3, "b": 0.3, "c": 0.4}
    first = assign_profiles(50, mix, seed=7)
    assert first == assign_profiles(50, mix, seed=7)
    assert first != assign_profiles(50, mix, seed=8)
    assert Counter(first) == Counter(mix_counts(50, mix))


def test_every_shipped_fleet_builds_from_its_presets():
    for option in ("phones", "mixed", "edge_boards"):
        cfg = compose_config([f"devices={option}"])
        devices = to_container(cfg.devices)
        fleet = build_fleet(num_clients=20, mix=devices["mix"], profiles=devices["profiles"],
                            seed=0)
        assert fleet is not None and len(fleet) == 20
        assert {p.name for p in fleet} == set(devices["mix"])
        assert Counter(p.name for p in fleet) == Counter(mix_counts(20, devices["mix"]))
        for profile in fleet:  # each client got its preset's numbers
            assert profile == DeviceProfile.from_mapping(profile.name,
                                                         devices["profiles"][profile.name])
    assert build_fleet(num_clients=5, mix={}, profiles={}, seed=0) is None


def test_undefined_profile_and_bad_values_are_named():
    with pytest.raises(ValueError, match=r"undefined profiles \['tablet'\]"):
        build_fleet(num_clients=2, mix={"tablet": 1.0}, profiles={}, seed=0)
    with pytest.raises(ValueError, match="availability"):
        replace(PHONE, availability=1.5)
    with pytest.raises(ValueError, match="flops_per_s"):
        replace(PHONE, flops_per_s=0.0)
    with pytest.raises(ValueError, match="unknown keys"):
        DeviceProfile.from_mapping("x", {"flops": 1})


def test_client_time_is_compute_rescaled_plus_link():
    work = ClientMeasurement(compute_s=0.5, bytes_up=1_000_000, bytes_down=4_000_000,
                             exchanges=10)
    t = client_time(work, PHONE, host_flops_per_s=8e9)
    assert t.compute_s == pytest.approx(0.5 * 8e9 / 2e9)  # 4x slower than the host
    assert t.upload_s == pytest.approx(1_000_000 / (8.0 * MBIT))  # 1 s at 8 Mbit/s
    assert t.download_s == pytest.approx(4_000_000 / (40.0 * MBIT))  # 0.8 s
    assert t.latency_s == pytest.approx(10 * 0.05)
    assert t.total_s == pytest.approx(2.0 + 1.0 + 0.8 + 0.5)
    with pytest.raises(ValueError, match="host_flops_per_s"):
        client_time(work, PHONE, host_flops_per_s=0.0)
    # Without a profile (or a host speed) the device is this host, links are free.
    for profile, host in ((None, 8e9), (PHONE, 0.0)):
        here = virtual_time(work, profile=profile, host_flops_per_s=host)
        assert (here.compute_s, here.upload_s, here.download_s, here.latency_s) == (
            0.5, 0.0, 0.0, 0.0)
    assert virtual_time(work, profile=PHONE, host_flops_per_s=8e9) == t


def test_the_clock_accumulates_rounds_and_never_goes_back():
    clock = VirtualClock()
    clock.advance(2.0)
    assert clock.advance(1.5) == 3.5
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert clock.now_s == 3.5


def spec_for(overrides: list[str]) -> RunSpec:
    return run_spec(compose_config(overrides), host_flops_per_s=1e10)


def test_client_derives_the_same_profile_as_the_server():
    cfg = compose_config(["devices=mixed", "num_clients=10"])
    devices = to_container(cfg.devices)
    fleet = build_fleet(num_clients=10, mix=devices["mix"], profiles=devices["profiles"], seed=0)
    spec = run_spec(cfg, host_flops_per_s=1e10)
    assert fleet is not None
    for pid in range(10):
        assert device_profile(spec, partition_id=pid, num_partitions=10) == fleet[pid]
    assert device_profile(spec_for([]), partition_id=0, num_partitions=10) is None


def test_availability_and_dropout_rates_match_profiles():
    spec = spec_for(["devices=phones"])
    plans = [
        plan_round(spec, server_round=r, partition_id=p, num_partitions=100)
        for r in range(1, 21) for p in range(100)
    ]
    for name in ("low_end_phone", "flagship_phone"):
        mine = [pl for pl in plans if pl.profile.name == name]
        expected = mine[0].profile
        unavailable = sum(not pl.available for pl in mine) / len(mine)
        dropping = sum(pl.fail_after_steps >= 0 for pl in mine) / len(mine)
        assert unavailable == pytest.approx(1 - expected.availability, abs=0.05)
        assert dropping == pytest.approx(expected.dropout, abs=0.05)
        assert {pl.fail_after_steps for pl in mine} == {-1, spec.failures.dropout_after_steps}
    # Deterministic: the same draw again; another round draws anew.
    again = [plan_round(spec, server_round=r, partition_id=p, num_partitions=100)
             for r in range(1, 21) for p in range(100)]
    assert again == plans
    assert [pl.available for pl in plans[:100]] != [pl.available for pl in plans[100:200]]


def test_extra_dropout_rate_applies_without_devices():
    spec = spec_for(["failures.dropout_rate=1.0", "failures.dropout_after_steps=3"])
    plan = plan_round(spec, server_round=1, partition_id=0, num_partitions=10)
    assert plan.profile is None and plan.available and plan.fail_after_steps == 3
    calm = plan_round(spec_for([]), server_round=1, partition_id=0, num_partitions=10)
    assert calm == DevicePlan(None, True, -1)
    # Some, not all: the extra rate on its own, then combined with the profiles' rates.
    some = spec_for(["failures.dropout_rate=0.3"])
    plans = [plan_round(some, server_round=r, partition_id=p, num_partitions=50)
             for r in range(1, 21) for p in range(50)]
    assert all(pl.available for pl in plans)
    assert sum(pl.fail_after_steps >= 0 for pl in plans) / len(plans) == pytest.approx(
        0.3, abs=0.05)
    both = spec_for(["devices=phones", "failures.dropout_rate=0.5"])
    plans = [plan_round(both, server_round=r, partition_id=p, num_partitions=100)
             for r in range(1, 21) for p in range(100)]
    low = [pl for pl in plans if pl.profile.name == "low_end_phone"]
    expected = 1 - (1 - low[0].profile.dropout) * (1 - 0.5)
    assert sum(pl.fail_after_steps >= 0 for pl in low) / len(low) == pytest.approx(
        expected, abs=0.05)


def test_memory_budget_is_checked_with_numbers():
    spec = spec_for(["model.cut=3"])
    model = build_model_from_config(spec.model, spec.dataset)
    step = SplitStep(model, spec, cut=3)
    batch = spec.strategy.batch_size
    needed = step.memory_bytes(batch)
    # Parameters, their gradients and momentum (float32) plus saved activations per sample.
    params = sum(p.numel() for stage in model.stages[:3] for p in stage.parameters())
    per_sample = step.memory_bytes(2 * batch) - needed
    assert per_sample > 0 and per_sample % batch == 0
    assert needed == 12 * params + per_sample
    # The U-shaped device also holds the tail: more memory at the same cut.
    ushaped = UShapedStep(build_model_from_config(spec.model, spec.dataset),
                          RunSpec(model=spec.model, strategy=UShapedOptions()), cut=3)
    assert ushaped.memory_bytes(batch) > needed
    what = f"split at cut 3, batch {batch}"
    tight = DevicePlan(replace(PHONE, memory_bytes=needed - 1), True, -1)
    with pytest.raises(MemoryBudgetExceeded, match=(
        rf"{what} needs {needed / 2**20:.1f} MiB; phone has {(needed - 1) / 2**20:.1f} MiB"
    )):
        tight.check_memory(needed, what=what)
    DevicePlan(replace(PHONE, memory_bytes=needed), True, -1).check_memory(needed, what=what)
    DevicePlan(None, True, -1).check_memory(2**60, what=what)  # no profile: no limit
    assert MemoryBudgetExceeded.kind == "memory"
    with pytest.raises(MemoryBudgetExceeded) as declined:  # the planner learns the data's size
        tight.check_memory(needed, what=what, examples=144)
    assert declined.value.examples == 144 and declined.value.budget_bytes == needed - 1


# --- emulation: the pacer sleeps off what the device would have needed more --------------------


def device_seconds(work: ClientMeasurement, profile: DeviceProfile, host_flops: float) -> float:
    """Reference: compute rescaled, bytes over each link, a round trip per exchange."""
    return (work.compute_s * host_flops / profile.flops_per_s
            + work.bytes_up / (profile.uplink_mbps * 1e6 / 8)
            + work.bytes_down / (profile.downlink_mbps * 1e6 / 8)
            + work.exchanges * profile.rtt_s)


@pytest.fixture
def slept(monkeypatch):
    """Durations the pacer asks to sleep (nothing really sleeps)."""
    durations: list[float] = []
    monkeypatch.setattr(clients.device, "time", SimpleNamespace(sleep=durations.append))
    return durations


def test_pacer_sleeps_the_device_time_minus_the_wall_time(slept):
    pacer = Pacer(PHONE, host_flops_per_s=8e9)
    work = ClientMeasurement(compute_s=0.01, bytes_up=20_000, bytes_down=50_000, exchanges=2)
    pacer.after_batch(work, wall_s=0.004)
    device = 0.01 * 4 + 20_000 / 1e6 + 50_000 / 5e6 + 2 * 0.05
    assert device == pytest.approx(device_seconds(work, PHONE, 8e9))
    assert slept == [pytest.approx(device - 0.004)]
    # A batch that already took longer than the device would is not slowed down.
    pacer.after_batch(work, wall_s=device + 1.0)
    assert slept[1] == 0.0


class RecordingPacer(Pacer):
    """The real pacer, keeping what each batch reported."""

    def __init__(self, profile: DeviceProfile, *, host_flops_per_s: float) -> None:
        super().__init__(profile, host_flops_per_s=host_flops_per_s)
        self.batches: list[tuple[ClientMeasurement, float]] = []

    def after_batch(self, work: ClientMeasurement, *, wall_s: float) -> None:
        self.batches.append((work, wall_s))
        super().after_batch(work, wall_s=wall_s)


@pytest.mark.parametrize(("protocol", "step_class", "options"), [
    ("splitfed_v2", SplitStep, SplitFedV2Options(lr=0.1)),
    ("ushaped", UShapedStep, UShapedOptions(lr=0.1)),
])
def test_pacer_in_the_loop_paces_every_batch_by_its_own_traffic(
    trunk_server_factory, slept, protocol, step_class, options
):
    model = digits_like_model()
    server = trunk_server_factory(model, protocol=protocol, options=options)
    channel = server.local_channel(server.token(1))
    step = step_class(model, RunSpec(strategy=options), cut=1)
    slow = replace(PHONE, uplink_mbps=1.0, downlink_mbps=2.0, rtt_s=0.02)
    pacer = RecordingPacer(slow, host_flops_per_s=4e9)
    batches = fixed_batches(3, batch=8)
    report = train_round(step, channel, ClientPrivacy(PrivacyConfig(), batches), epochs=1,
                         pacer=pacer)
    assert report.steps == 3 and len(pacer.batches) == len(slept) == 3
    for (work, wall), sleep in zip(pacer.batches, slept, strict=True):
        assert work.exchanges == step.exchanges_per_batch
        assert work.bytes_up > 0 and work.bytes_down > 0
        assert 0 <= work.compute_s <= wall
        assert sleep == pytest.approx(max(device_seconds(work, slow, 4e9) - wall, 0.0))
    # The batches' measurements add up to the round's.
    assert sum(w.bytes_up for w, _ in pacer.batches) == report.bytes_up == channel.bytes_up
    assert sum(w.bytes_down for w, _ in pacer.batches) == report.bytes_down == channel.bytes_down
    assert sum(w.compute_s for w, _ in pacer.batches) == pytest.approx(report.compute_s)
