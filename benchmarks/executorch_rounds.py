"""A ClientApp round, the device's stages in ExecuTorch vs eager PyTorch (a benchmark).

``python -m benchmarks.executorch_rounds [overrides ...]``: SplitFed v1 on digits through
:func:`experiments.local.run_local` (the shipped ClientApp, one client at a time, the
in-process trunk), 2 clients, 3 rounds, cut 1, for ``cnn`` and ``lenet5`` under
``devices.runtime=eager`` and ``executorch``. Prints the median over the client-rounds of
rounds 2+ (round 1 also pays for importing ExecuTorch and exporting the programs, which
later rounds borrow from the process's cache, :data:`clients.executorch_program.PROGRAMS`)
of the handler's seconds (``handler-s``: the whole ClientApp round) and of its training
(``train-s``: the batches), then one JSON line: each model's ExecuTorch round over its
eager one.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from experiments.local import run_local
from protocols import compose_config

#: The job each runtime runs.
JOB = ("logger=none", "strategy=splitfed_v1", "model.cut=1", "num_clients=2",
       "strategy.num_rounds=3")


def round_seconds(model: str, runtime: str, overrides: Sequence[str]) -> dict[str, float]:
    """Return the median ``handler_s`` and ``train_s`` of rounds 2+ of one run."""
    with tempfile.TemporaryDirectory(prefix="executorch-rounds-") as run_dir:
        cfg = compose_config([*JOB, f"model={model}", f"devices.runtime={runtime}", *overrides])
        cfg.run_dir = run_dir
        run_local(cfg, concurrency=1)
        with open(Path(run_dir) / "clients.csv") as f:
            rows = [row for row in csv.DictReader(f) if row["round"] != "1"]
    return {key: statistics.median(float(row[key]) for row in rows)
            for key in ("handler_s", "train_s", "steps")}


def main(overrides: Sequence[str]) -> None:
    """Print each model's ClientApp round under both runtimes, then the ratios as JSON."""
    ratios: dict[str, float] = {}
    for model in ("cnn", "lenet5"):
        handler = {}
        for runtime in ("eager", "executorch"):
            seconds = round_seconds(model, runtime, overrides)
            handler[runtime] = seconds["handler_s"]
            print(f"{model} {runtime}: handler {seconds['handler_s']:.3f} s, train "
                  f"{seconds['train_s']:.3f} s, {seconds['steps']:.0f} steps", flush=True)
        ratio = handler["executorch"] / handler["eager"]
        ratios[f"{model}_executorch_over_eager"] = round(ratio, 2)
    print(json.dumps(ratios))


if __name__ == "__main__":
    main(sys.argv[1:])
