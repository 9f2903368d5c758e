"""The trunk's step when it hops between threads: ``python -m benchmarks handoff``.

In a run, the shared trunk steps in the data-plane thread of whichever client's batch it
trains, so with two clients streaming its steps alternate between two threads. This
suite times the step of the config's model at its cut (the default job's SmallCNN unless
overridden; :func:`server.sessions.split.train_on_batch`, one intra-op thread) three ways,
in interleaved blocks after a warm-up:

- ``one thread``: every step from the same thread (the trunk benchmark's way);
- ``two threads``: steps alternating between two threads, ``dataplane.trunk_sticky_core``
  off: each starts on whichever core its thread wakes on;
- ``two threads, sticky core``: the same with it on (:class:`server.cores.StickyCore`).

Each step trains one of eight fixed batches. Median milliseconds per step, the thread's
CPU milliseconds (``time.thread_time``) and the sticky trunk's moves go to ``handoff.json``
in the run folder with a bar plot (``handoff.png``); the last line printed is JSON.
"""

from __future__ import annotations

import copy
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.trunk import Batch, cut_batches
from protocols import compose_config
from server.sessions.split import train_on_batch
from server.trunk import Trunk
from splitlearn.config import to_object
from splitlearn.models.factory import build_model_from_config

MODES = ("one thread", "two threads", "two threads, sticky core")


@dataclass(frozen=True)
class HandoffTime:
    """One way of taking the trunk's steps: median wall and CPU milliseconds a step."""

    mode: str
    step_ms: float
    cpu_ms: float
    steps: int
    core_moves: int


def timed_step(trunk: Trunk, cut: int, batch: Batch) -> tuple[float, float]:
    """Train one batch; return its wall and this thread's CPU seconds."""
    wall, cpu = time.perf_counter(), time.thread_time()
    train_on_batch(trunk, cut, batch[0].clone(), batch[1])  # a fresh tensor, as decoded
    return time.perf_counter() - wall, time.thread_time() - cpu


def steps_in_one_thread(step: Callable[[int], tuple[float, float]], count: int
                        ) -> list[tuple[float, float]]:
    """Take ``count`` steps from the calling thread."""
    return [step(i) for i in range(count)]


def steps_in_two_threads(step: Callable[[int], tuple[float, float]], count: int
                         ) -> list[tuple[float, float]]:
    """Take ``count`` steps alternating between two threads (as two clients' requests)."""
    times: list[tuple[float, float]] = []
    turns = [threading.Semaphore(1), threading.Semaphore(0)]

    def serve(side: int) -> None:
        for i in range(side, count, 2):
            turns[side].acquire()
            times.append(step(i))
            turns[1 - side].release()

    threads = [threading.Thread(target=serve, args=(side,)) for side in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return times


def time_handoffs(overrides: Sequence[str], *, steps: int = 40, blocks: int = 5
                  ) -> list[HandoffTime]:
    """Median step of each mode, ``steps`` per block, ``blocks`` interleaved blocks."""
    cfg = compose_config(list(overrides))
    model = build_model_from_config(to_object(cfg.model), to_object(cfg.dataset), seed=cfg.seed)
    cut, options = cfg.model.cut, cfg.strategy
    batches = cut_batches(model, cut, options.batch_size)
    trunks = {mode: Trunk(copy.deepcopy(model), lr=options.lr, momentum=options.momentum,
                          sticky_core=mode.endswith("sticky core")) for mode in MODES}
    takes = {mode: steps_in_one_thread if mode == "one thread" else steps_in_two_threads
             for mode in MODES}
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for block in range(blocks + 1):  # block 0 warms up (oneDNN picks its kernels)
        for mode, trunk in trunks.items():
            taken = takes[mode](lambda i, t=trunk: timed_step(t, cut, batches[i % 8]), steps)
            if block:
                times[mode].extend(taken)
    return [HandoffTime(mode=mode, step_ms=statistics.median(w for w, _ in times[mode]) * 1e3,
                        cpu_ms=statistics.median(c for _, c in times[mode]) * 1e3,
                        steps=len(times[mode]), core_moves=trunks[mode].core.moves)
            for mode in MODES]


def bench_handoff(overrides: Sequence[str], *, steps: int = 40, blocks: int = 5,
                  out_dir: Path | None = None) -> list[HandoffTime]:
    """Time the modes; write ``handoff.json`` and ``handoff.png``; print a JSON line."""
    torch.set_num_threads(1)
    out_dir = out_dir or Path("outputs/bench") / time.strftime("handoff-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = time_handoffs(overrides, steps=steps, blocks=blocks)
    for row in rows:
        print(f"{row.mode}: {row.step_ms:.2f} ms a step ({row.cpu_ms:.2f} ms of the thread's "
              f"CPU), {row.core_moves} moves to the last step's core", flush=True)
    (out_dir / "handoff.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    plot_handoffs(rows, out_dir / "handoff.png")
    by_mode = {r.mode: r.step_ms for r in rows}
    print(f"results in {out_dir}")
    print(json.dumps({"step_ms": {m: round(v, 3) for m, v in by_mode.items()},
                      "sticky_speedup": round(by_mode["two threads"]
                                              / by_mode["two threads, sticky core"], 3)}))
    return rows


def plot_handoffs(rows: Sequence[HandoffTime], path: Path) -> None:
    """Bars: milliseconds a step per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    bars = ax.bar(range(len(rows)), [r.step_ms for r in rows], color="tab:blue")
    ax.bar_label(bars, fmt="%.2f ms", fontsize=8)
    ax.set_xticks(range(len(rows)), [r.mode for r in rows], fontsize=8)
    ax.set_ylabel("ms per trunk step (median)")
    ax.set_title("The trunk's step, from one thread or alternating between two")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
