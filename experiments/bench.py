"""Benchmarks (numbers, not tests): ``python -m experiments.bench NAME [overrides ...]``.

``overhead``
    Samples/s of SplitFed through the real stack (Flower Simulation Engine,
    ClientApps in Ray actors, gRPC data plane) divided by samples/s of the same
    split math in one process with the in-process transport. Defaults: the
    ResNet-style network on digits resized to 32x32, 4 clients, 5 rounds.
    Round 1 pays for engine start-up, so throughput is steady state (rounds 2+)
    and start-up is reported apart. The last line printed is the ratio.

Extra arguments are Hydra overrides, e.g. ``strategy.num_rounds=5``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from splitlearn.config import compose_config  # noqa: E402

OVERHEAD_DEFAULTS = (
    "model=resnet",
    "dataset.image_size=32",
    "num_clients=4",
    "strategy.num_rounds=5",
    "strategy.local_epochs=1",
    "logger=none",
)


def steady_samples_per_s(rounds: Sequence[dict]) -> float:
    """Training samples per second over rounds 2+ (round 1 includes start-up)."""
    steady = [r for r in rounds if r.get("round", 0) >= 2 and "round_train_s" in r]
    if not steady:
        raise ValueError("need at least 2 training rounds to measure steady state")
    return sum(r["examples"] for r in steady) / sum(r["round_train_s"] for r in steady)


def run_flower(cfg: DictConfig) -> list[dict]:
    """Run through the Simulation Engine and gRPC; return per-round metrics."""
    from experiments.run import launch_simulation

    with tempfile.TemporaryDirectory(prefix="bench-") as run_dir:
        cfg.run_dir = run_dir
        launch_simulation(cfg)
        return json.loads((Path(run_dir) / "metrics.json").read_text())


def run_limit(cfg: DictConfig) -> list[dict]:
    """Run the same rounds in this process, one client thread per core."""
    from experiments.inprocess import run_in_process

    # As in the Simulation Engine: one client per core, each with the
    # configured intra-op threads (1 by default, the fastest on the dev VM).
    torch.set_num_threads(cfg.engine.torch_threads)
    return run_in_process(cfg, concurrency=os.cpu_count() or 1)


def bench_overhead(overrides: Sequence[str]) -> float:
    """Print both throughputs and return their ratio (Flower / in-process)."""
    cfg = compose_config([*OVERHEAD_DEFAULTS, *overrides])
    started = time.perf_counter()
    flower = run_flower(cfg.copy())
    flower_total = time.perf_counter() - started
    limit = run_limit(cfg.copy())
    flower_sps, limit_sps = steady_samples_per_s(flower), steady_samples_per_s(limit)
    first = next(r for r in flower if r["round"] == 1)
    print(f"model={cfg.model.name} cut={cfg.model.cut} image_size={cfg.dataset.image_size} "
          f"clients={cfg.num_clients} rounds={cfg.strategy.num_rounds}")
    print(f"flower+grpc : {flower_sps:8.1f} samples/s steady; round 1 (with start-up) "
          f"{first['round_train_s']:.1f}s; whole run {flower_total:.1f}s")
    print(f"in-process  : {limit_sps:8.1f} samples/s steady")
    ratio = flower_sps / limit_sps
    print(f"overhead ratio (flower+grpc / in-process): {ratio:.3f}")
    print(f"{ratio:.3f}")
    return ratio


BENCHMARKS = {"overhead": bench_overhead}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the benchmark name and its Hydra overrides; run it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = parser.parse_args(argv)
    BENCHMARKS[args.name](args.overrides)


if __name__ == "__main__":
    main()
