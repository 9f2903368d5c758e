"""Device profiles, their assignment, the virtual clock and client-side emulation."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import pytest
import torch

from clients.device import (
    EmulatedSession,
    MemoryBudgetExceeded,
    check_memory,
    device_profile,
    plan_round,
)
from server.app import make_task_template
from splitlearn.config import compose_config, to_container
from splitlearn.planning.clock import (
    ClientMeasurement,
    VirtualClock,
    client_time,
    round_time,
)
from splitlearn.planning.devices import (
    MBIT,
    DeviceProfile,
    assign_profiles,
    build_fleet,
    mix_counts,
)
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
        assert len(fleet) == 20 and {p.name for p in fleet} == set(devices["mix"])


def test_undefined_profile_and_bad_values_are_named():
    with pytest.raises(ValueError, match=r"undefined profiles \['tablet'\]"):
        build_fleet(num_clients=2, mix={"tablet": 1.0}, profiles={}, seed=0)
    with pytest.raises(ValueError, match="availability"):
        replace(PHONE, availability=1.5)
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


def test_round_time_is_slowest_client_plus_trunk_and_clock_accumulates():
    assert round_time([1.0, 3.5, 2.0], trunk_s=0.25) == 3.75
    assert round_time([], trunk_s=0.25) == 0.25
    assert round_time([1.0, 3.5, 2.0], trunk_s=0.25, sequential=True) == 6.75
    clock = VirtualClock()
    clock.advance(2.0)
    assert clock.advance(1.5) == 3.5
    with pytest.raises(ValueError):
        clock.advance(-1)


def task_for(overrides):
    cfg = compose_config(overrides)
    return make_task_template(cfg, "127.0.0.1:1", host_flops_per_s=1e10)


def test_client_derives_the_same_profile_as_the_server():
    cfg = compose_config(["devices=mixed", "num_clients=10"])
    devices = to_container(cfg.devices)
    fleet = build_fleet(num_clients=10, mix=devices["mix"], profiles=devices["profiles"], seed=0)
    task = task_for(["devices=mixed", "num_clients=10"])
    for pid in range(10):
        assert device_profile(task, partition_id=pid, num_partitions=10) == fleet[pid]


def test_availability_and_dropout_rates_match_profiles():
    task = task_for(["devices=phones"])
    plans = [
        plan_round(replace(task, server_round=r), partition_id=p, num_partitions=100)
        for r in range(1, 21) for p in range(100)
    ]
    for name in ("low_end_phone", "flagship_phone"):
        mine = [pl for pl in plans if pl.profile.name == name]
        expected = mine[0].profile
        unavailable = sum(not pl.available for pl in mine) / len(mine)
        dropping = sum(pl.fail_after_steps >= 0 for pl in mine) / len(mine)
        assert unavailable == pytest.approx(1 - expected.availability, abs=0.05)
        assert dropping == pytest.approx(expected.dropout, abs=0.05)
    # Deterministic: the same draw again.
    assert plan_round(task, partition_id=3, num_partitions=100) == plan_round(
        task, partition_id=3, num_partitions=100)


def test_extra_dropout_rate_applies_without_devices():
    task = replace(task_for([]), dropout_rate=1.0, dropout_after_steps=3)
    plan = plan_round(task, partition_id=0, num_partitions=10)
    assert plan.profile is None and plan.available and plan.fail_after_steps == 3


def test_memory_budget_is_checked_with_numbers():
    task = task_for(["model.cut=3"])
    needed = check_memory(task, None)
    assert needed > 0
    with pytest.raises(MemoryBudgetExceeded, match=r"\[memory\] cut 3 at batch 32 needs"):
        check_memory(task, replace(PHONE, memory_bytes=needed - 1))
    assert check_memory(task, replace(PHONE, memory_bytes=needed)) == needed


def test_emulated_session_waits_as_long_as_the_link_would(trunk_server_factory):
    from splitlearn.split import split

    server = trunk_server_factory(digits_like_model())
    slow = replace(PHONE, uplink_mbps=1.0, downlink_mbps=1.0, rtt_s=0.02)
    inner = server.endpoint.local_session(server.token(1))
    session = EmulatedSession(inner, slow, host_flops_per_s=slow.flops_per_s)
    x, y = fixed_batches(1, batch=8)[0]
    acts = split(digits_like_model(), 1)[0](x).detach()
    started = time.perf_counter()
    session.exchange(acts, y)
    elapsed = time.perf_counter() - started
    link = inner.bytes_up / slow.uplink_bytes_per_s + inner.bytes_down / slow.downlink_bytes_per_s
    assert link > 0.1  # ~16 KiB each way at 1 Mbit/s
    assert elapsed >= link + slow.rtt_s
    assert torch.is_tensor(session.exchange(acts, y).grad)
