"""The trunk's process: its sticky core, and an allocator that reuses what steps free.

Real threads pinned with the operating system's own affinity calls (the tests that move
threads need Linux and two cores, as CI has, and are skipped elsewhere). How many page
faults the allocator saves is a benchmark's (``python -m benchmarks allocator``), not a
test's: the kernel's counts move with whatever else the machine is doing.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable

import pytest
import torch

from benchmarks.cli import parse_arguments
from benchmarks.handoff import MODES, time_handoffs
from server import workers
from server.app import build_trunk, trunk_recipe
from server.cores import StickyCore, _sched_getcpu
from server.sessions.split import train_on_batch
from server.trunk import Trunk
from splitlearn.evaluation import intra_op_threads
from tests.conftest import digits_like_model, small_config
from tests.unit.test_trunk import activations

getcpu = _sched_getcpu()
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(getcpu is None or len(ALLOWED) < 2,
                                     reason="moves threads: Linux with two cores")


def in_thread(work: Callable[[], object]) -> object:
    """Run ``work`` in a fresh thread (its own affinity); return what it returned."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    thread.join()
    return result[0]


def ended_on(core: StickyCore, cpu: int) -> None:
    """Finish a unit of work on ``cpu`` (a thread pinned there calls leave)."""
    def work() -> None:
        os.sched_setaffinity(0, {cpu})
        core.leave()
    in_thread(work)


@needs_two_cores
def test_a_thread_elsewhere_is_moved_to_the_last_core_and_keeps_its_whole_set():
    first, other = ALLOWED[0], ALLOWED[1]
    core = StickyCore()
    ended_on(core, first)
    assert core.last == first

    def work() -> tuple[int, set[int]]:
        os.sched_setaffinity(0, {other})  # it runs on the other core now ...
        assert getcpu() == other
        os.sched_setaffinity(0, set(ALLOWED))  # ... and may run anywhere
        core.enter()
        return getcpu(), os.sched_getaffinity(0)

    # The scheduler may move a free thread at any tick; a move right after enter is rare.
    for _ in range(3):
        cpu, mask = in_thread(work)
        if cpu == first:
            break
    assert cpu == first and mask == set(ALLOWED)
    assert core.moves >= 1


@needs_two_cores
def test_a_thread_not_allowed_on_the_last_core_stays_where_it_may_run():
    first, other = ALLOWED[0], ALLOWED[1]
    core = StickyCore()
    ended_on(core, first)

    def work() -> tuple[int, set[int]]:
        os.sched_setaffinity(0, {other})
        core.enter()
        return getcpu(), os.sched_getaffinity(0)

    assert in_thread(work) == (other, {other})
    assert core.moves == 0


def test_disabled_or_before_any_work_it_leaves_threads_alone():
    off = StickyCore(enabled=False)
    off.leave()
    off.enter()
    assert not off.active and off.last is None and off.moves == 0
    fresh = StickyCore()
    if hasattr(os, "sched_getaffinity"):
        mask = os.sched_getaffinity(0)
        fresh.enter()  # nothing to follow yet
        assert os.sched_getaffinity(0) == mask
    assert fresh.moves == 0


def test_the_trunk_notes_where_each_step_ended_and_the_config_can_turn_it_off():
    model = digits_like_model("cnn")
    trunk = Trunk(copy.deepcopy(model), lr=0.1)
    train_on_batch(trunk, 2, *activations(model, seed=0))
    if trunk.core.active:
        assert trunk.core.last in ALLOWED
        assert trunk.fork().core.active
    off = Trunk(copy.deepcopy(model), lr=0.1, sticky_core=False)
    train_on_batch(off, 2, *activations(model, seed=0))
    assert off.core.last is None and not off.fork().core.active
    built, *_ = build_trunk(small_config("dataplane.trunk_sticky_core=false"))
    assert not built.core.active
    # By default: with one trunk process only (trunk workers measured no gain).
    assert trunk_recipe(small_config()).sticky_core
    assert not trunk_recipe(small_config("dataplane.trunk_workers=2")).sticky_core
    assert trunk_recipe(small_config("dataplane.trunk_workers=2",
                                     "dataplane.trunk_sticky_core=true")).sticky_core


def test_the_handoff_benchmark_times_every_mode():
    assert parse_arguments(["handoff", "model=lenet5"]).name == "handoff"
    rows = time_handoffs(["model=lenet5", "dataset=mnist"], steps=4, blocks=1)
    assert [row.mode for row in rows] == list(MODES)
    assert all(row.steps == 4 and row.step_ms > 0 and row.cpu_ms > 0 for row in rows)
    assert rows[0].core_moves == rows[1].core_moves == 0  # not sticky


def test_a_trunk_process_is_set_up_as_its_data_plane_settings_say(monkeypatch):
    """Threads and allocator, in the ServerApp's process and each worker's (on by default)."""
    calls = []
    monkeypatch.setattr(workers, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    with intra_op_threads(torch.get_num_threads()):  # this process's setting, restored
        workers.set_up_trunk_process(small_config("dataplane.trunk_threads=2").dataplane)
        assert calls == ["reuse"] and torch.get_num_threads() == 2
        workers.set_up_trunk_process(
            small_config("dataplane.trunk_reuses_memory=false").dataplane)
        assert calls == ["reuse"] and torch.get_num_threads() == 1
