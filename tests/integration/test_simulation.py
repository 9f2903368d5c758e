"""End to end: ``python -m experiments.run`` in Flower's Simulation Engine with gRPC.

Each test starts the real entry point in a subprocess (Ray, ServerApp lifespan,
trunk service on loopback, ClientApps in Ray actors) and reads the run folder.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

from tests.processes import run_or_report

ROOT = Path(__file__).resolve().parents[2]


def run_experiment(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    env = os.environ | {
        "FLWR_TELEMETRY_ENABLED": "0",
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_API_KEY": "",
    }
    proc = run_or_report([sys.executable, "-m", "experiments.run", f"hydra.run.dir={run_dir}",
                          *overrides], timeout_s=400, cwd=ROOT, env=env)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    assert "[round   2/" in stdout  # progress is shown per round
    (tmp_path / "console.txt").write_text(stdout + stderr)  # beside the run folder
    return run_dir


def run_in_process(tmp_path: Path, *overrides: str) -> Path:
    """Run the same config through the shipped apps in this process; return its run folder.

    The strategy, ClientApp, trunk and run folder are the deployed ones
    (:func:`experiments.local.run_local`, 2 clients at a time as Ray runs them here),
    without the engine's start-up: for tests of what a protocol does, not of the engine.
    """
    from experiments.local import run_local
    from protocols import compose_config

    run_dir = tmp_path / "run"
    cfg = compose_config(list(overrides))
    cfg.run_dir = str(run_dir)
    run_local(cfg, concurrency=2)
    return run_dir


def read_clients(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "clients.csv") as f:
        return list(csv.DictReader(f))


def test_clients_vanishing_mid_round_are_left_out_of_the_round(tmp_path):
    # An injected dropout is the device's own doing (in process as in the engine); processes
    # that really die are the deployment test's.
    run_dir = run_in_process(
        tmp_path, "strategy.num_rounds=2", "num_clients=3", "logger=none",
        "failures.dropout_rate=0.5", "failures.dropout_after_steps=2",
    )
    rounds = {r["round"]: r for r in json.loads((run_dir / "metrics.json").read_text())}
    rows = read_clients(run_dir)
    dropped = [row for row in rows if row["status"] == "dropout"]
    assert dropped, "seed 0 drops someone"
    assert all("vanished after 2 steps" in row["reason"] for row in dropped)
    checked = 0
    for server_round in (1, 2):
        ok = [row for row in rows if int(row["round"]) == server_round and row["status"] == "ok"]
        failed = [row for row in rows if int(row["round"]) == server_round
                  and row["status"] != "ok"]
        assert rounds[server_round]["failed_clients"] == len(failed)
        if ok:
            # Only finished clients count: their examples, nothing of the partial work.
            assert rounds[server_round]["examples"] == sum(float(r["num_examples"]) for r in ok)
            checked += 1
    assert checked, "some round must have had finished clients, or nothing was checked"
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"]

