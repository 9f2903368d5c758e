"""End to end: ``python -m experiments.run`` in Flower's Simulation Engine with gRPC.

Each test starts the real entry point in a subprocess (Ray, ServerApp lifespan,
trunk service on loopback, ClientApps in Ray actors) and reads the run folder.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rounds import PARTS, clients_in_parallel, round_budget

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
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "[round   2/" in proc.stdout  # progress is shown per round
    (tmp_path / "console.txt").write_text(proc.stdout + proc.stderr)  # beside the run folder
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


@pytest.mark.serial
def test_a_users_own_module_trains_two_rounds_and_leaves_a_complete_run_folder(tmp_path):
    """Through the entry point and the Simulation Engine: ``model._target_`` names any
    nn.Module (importable in Ray's workers, no edit to the project), and the run folder
    holds everything a person reads, its state dict back in the user's keys."""
    import torch

    from tests.user_nets import TinyNet

    run_dir = run_experiment(
        tmp_path, "model._target_=tests.user_nets.TinyNet", "+model.options.hidden=24",
        "model.cut=2", "strategy.num_rounds=2", "num_clients=3", "logger=wandb",
        "logger.mode=offline",
    )
    net = TinyNet(hidden=24)
    net.load_state_dict(torch.load(run_dir / "model.pt"))  # strictly the user's keys
    config = json.loads((run_dir / "config.json").read_text())
    assert config["num_clients"] == 3 and config["strategy"]["num_rounds"] == 2
    rounds = json.loads((run_dir / "metrics.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1, 2]
    # The run's elapsed time (progress lines, ETA) grows, whatever the clients report.
    assert 0 < rounds[0]["wall_s"] < rounds[1]["wall_s"] < rounds[2]["wall_s"]
    # Learning happened: the joined model beats its random initialisation.
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    for r in rounds[1:]:
        # Every digits training sample, once per local epoch.
        assert r["examples"] == 1437 * config["strategy"]["local_epochs"]
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["failed_clients"] == 0
    rows = read_clients(run_dir)
    assert len(rows) == 6 and {row["status"] for row in rows} == {"ok"}
    # Where each client's handler spent its time: set-up, then training, within the handler.
    for row in rows:
        setup, train, handler = (float(row[k]) for k in ("setup_s", "train_s", "handler_s"))
        assert 0 < setup and 0 < train and setup + train <= handler
    budget = round_budget(rounds, rows, parallel=clients_in_parallel(["num_clients=3"]))
    assert sum(budget[key] for key, _ in PARTS) == pytest.approx(budget["round_s"])
    assert 0 < budget["evaluate_s"] < budget["round_s"]
    assert (run_dir / "metrics.csv").read_text().startswith("round,")
    for png in ("metrics.png", "clients.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    offline = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0
    # What the user saw: devices that ended their streams cleanly (no "ended abruptly",
    # the trunk's word for a device that vanished), and no start-up chatter of Ray's
    # or of alembic's (Flower's link state imports it).
    console = (tmp_path / "console.txt").read_text()
    for noise in ("ended abruptly", "alembic", "Tip: In future versions of Ray"):
        assert noise not in console, noise


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

