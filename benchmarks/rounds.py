"""The default job's seconds per round and where they go: ``python -m benchmarks rounds``.

Runs ``python -m experiments.run`` as a user does (Simulation Engine, Ray, the
gRPC data plane, W&B offline, a checkpoint per round), ``--repeats`` times,
each followed by the same run without tracking (``logger=none
checkpoint=false``), and splits the steady rounds (2+) into a time budget from
what the run records:

* ``round_train_s``: the server's wall time from sending the round to having
  every reply; ``evaluate_s``: the central evaluation; ``wall_s``: the run's
  clock after each round's evaluation;
* per client (``clients.csv``): ``handler_s`` (the ClientApp handler),
  ``setup_s`` (step, data and privacy engine before training), ``train_s``
  (the training loop), ``compute_s`` (its own forward, backward and step).

ClientApps run ``parallel`` at a time (Ray's CPUs over
``engine.num_cpus_per_client``), so client seconds count as ``1/parallel`` of
a round. The parts add up to the mean round; what the run without tracking
saves is W&B's and the checkpoint's share of "between rounds". The last line is
JSON with ``seconds_per_round`` (median of rounds 2+, the median over repeats).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from protocols import compose_config

#: The budget's parts, in the order a round spends them.
PARTS = (
    ("flower_dispatch_s", "Flower + Ray: messages to and from the ClientApps"),
    ("client_setup_s", "client set-up: step, data, privacy engine"),
    ("client_compute_s", "client compute: forward, backward, step"),
    ("trunk_wait_s", "data plane + shared trunk (clients waiting)"),
    ("client_wrapup_s", "client: channel, weights to record, metrics"),
    ("evaluate_s", "central evaluation"),
    ("between_rounds_s", "between rounds: aggregation, logging, checkpoint"),
)


def round_walls(history: Sequence[dict]) -> dict[int, float]:
    """Seconds each round took on the run's clock (from one evaluation to the next)."""
    ordered = sorted(history, key=lambda r: r["round"])
    return {b["round"]: b["wall_s"] - a["wall_s"] for a, b in itertools.pairwise(ordered)}


def round_budget(history: Sequence[dict], clients: Sequence[dict], *, parallel: int,
                 first_round: int = 2) -> dict[str, float]:
    """Mean seconds per round of each part of :data:`PARTS`, over rounds ``first_round``+.

    Parameters
    ----------
    history : Sequence[dict]
        The run's per-round rows (``metrics.json``): ``round``, ``wall_s``,
        ``round_train_s``, ``evaluate_s``, ``trunk_s``.
    clients : Sequence[dict]
        Per-client rows (``clients.csv``) with ``round``, ``status``,
        ``handler_s``, ``setup_s``, ``train_s``, ``compute_s``.
    parallel : int
        ClientApps that run at once.

    Returns
    -------
    dict[str, float]
        The parts (they add up to ``round_s``), ``round_s`` itself and
        ``trunk_busy_s`` (the trunk's own step time, within ``trunk_wait_s``
        and the dispatch).

    Raises
    ------
    ValueError
        If no round from ``first_round`` on has every figure, or ``parallel`` < 1.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    walls = round_walls(history)
    rows = {r["round"]: r for r in history}
    per_client: dict[int, list[dict]] = defaultdict(list)
    for row in clients:
        if row.get("status") == "ok":
            per_client[int(row["round"])].append(row)
    rounds = [r for r in sorted(walls) if r >= first_round and per_client.get(r)
              and "round_train_s" in rows[r]]
    if not rounds:
        raise ValueError(f"no round >= {first_round} with timings to budget")
    parts: dict[str, list[float]] = defaultdict(list)
    for r in rounds:
        for key, value in _one_round(rows[r], walls[r], per_client[r], parallel).items():
            parts[key].append(value)
    return {key: statistics.fmean(values) for key, values in parts.items()}


def _one_round(row: dict, wall: float, clients: Sequence[dict], parallel: int
               ) -> dict[str, float]:
    def total(key: str) -> float:
        return sum(float(c[key]) for c in clients) / parallel

    handler, setup = total("handler_s"), total("setup_s")
    train, compute = total("train_s"), total("compute_s")
    return {
        "flower_dispatch_s": row["round_train_s"] - handler,
        "client_setup_s": setup,
        "client_compute_s": compute,
        "trunk_wait_s": train - compute,
        "client_wrapup_s": handler - setup - train,
        "evaluate_s": row["evaluate_s"],
        "between_rounds_s": wall - row["round_train_s"] - row["evaluate_s"],
        "round_s": wall,
        "trunk_busy_s": row.get("trunk_s", math.nan),
    }


def clients_in_parallel(overrides: Sequence[str]) -> int:
    """ClientApps the Simulation Engine runs at once for this config on this machine."""
    cfg = compose_config(list(overrides))
    per_client = float(cfg.engine.num_cpus_per_client)
    return max(1, min(int(cfg.num_clients), int((os.cpu_count() or 1) // per_client)))


def run_job(overrides: Sequence[str]) -> tuple[list[dict], list[dict], float]:
    """Run ``experiments.run`` in a subprocess; return its rows, client rows and wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as run_dir:
        env = os.environ | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        cmd = [sys.executable, "-m", "experiments.run", f"hydra.run.dir={run_dir}", *overrides]
        started = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, cwd=run_dir, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        history = json.loads((Path(run_dir) / "metrics.json").read_text())
        with open(Path(run_dir) / "clients.csv") as f:
            clients = list(csv.DictReader(f))
    return history, clients, seconds


def steady_median(history: Sequence[dict], first_round: int = 2) -> float:
    """Median seconds per round over rounds ``first_round``+."""
    return statistics.median(s for r, s in round_walls(history).items() if r >= first_round)


def not_learning(accuracies: Sequence[float], floor: float) -> str | None:
    """Say why runs ending at test ``accuracies`` are not a figure (None: they are)."""
    worst = min(accuracies, default=float("nan"))
    if worst >= floor:
        return None
    return f"final test accuracy {worst:.4f} is below the floor {floor}"


def bench_rounds(overrides: Sequence[str], *, repeats: int = 3,
                 out_dir: Path | None = None, floor: float = 0.5) -> dict:
    """Print the budget of the default job (with ``overrides``); return the summary.

    A job whose final test accuracy is below ``floor`` in any run gets no seconds per
    round (``None``, and ``not_learning`` says why): rounds of training that does not
    learn are not a figure.
    """
    parallel = clients_in_parallel(overrides)
    untracked = [*overrides, "logger=none", "checkpoint=false"]
    out_dir = out_dir or Path("outputs/bench") / time.strftime("rounds-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    budgets, medians, bare, whole, accuracies = [], [], [], [], []
    for i in range(repeats):
        history, clients, seconds = run_job(overrides)
        budgets.append(round_budget(history, clients, parallel=parallel))
        medians.append(steady_median(history))
        whole.append(seconds)
        accuracies.append(history[-1]["test_accuracy"])
        bare_history, _, _ = run_job(untracked)
        bare.append(steady_median(bare_history))
        print(f"run {i + 1}/{repeats}: {medians[-1]:.3f} s per round (median of rounds 2+), "
              f"{bare[-1]:.3f} s without W&B and checkpoints; whole command {seconds:.1f} s, "
              f"final accuracy {history[-1]['test_accuracy']:.4f}", flush=True)
    budget = {key: statistics.median(b[key] for b in budgets) for key in budgets[0]}
    print(f"time budget per steady round ({parallel} ClientApps at a time), median of "
          f"{repeats} runs:")
    for key, label in PARTS:
        print(f"  {label:<52} {budget[key]:6.3f} s ({budget[key] / budget['round_s']:5.1%})")
    print(f"  {'mean round':<52} {budget['round_s']:6.3f} s; the trunk's own steps "
          f"{budget['trunk_busy_s']:.3f} s of it")
    summary = {"seconds_per_round": statistics.median(medians),
               "seconds_per_round_untracked": statistics.median(bare),
               "whole_command_s": statistics.median(whole), "parallel": parallel,
               "budget": budget, "runs": medians, "final_accuracy": accuracies,
               "floor": floor}
    why = not_learning(accuracies, floor)
    if why is not None:
        summary |= {"seconds_per_round": None, "seconds_per_round_untracked": None,
                    "not_learning": why}
        print(f"not reported: {why}", flush=True)
    (out_dir / "rounds.json").write_text(json.dumps(summary, indent=2))
    plot_budget(budget, out_dir / "rounds.png")
    print(f"results in {out_dir}")
    print(json.dumps({k: summary[k] for k in ("seconds_per_round", "seconds_per_round_untracked",
                                              "whole_command_s")}))
    return summary


def plot_budget(budget: dict[str, float], path: Path) -> None:
    """One horizontal stacked bar: the steady round and its parts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.6))
    left = 0.0
    for key, label in PARTS:
        width = max(budget[key], 0.0)
        ax.barh(0, width, left=left, label=f"{label} ({budget[key]:.3f} s)")
        left += width
    ax.set_yticks([])
    ax.set_xlabel("seconds per steady round")
    ax.set_title(f"The default job: {budget['round_s']:.2f} s per round")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
