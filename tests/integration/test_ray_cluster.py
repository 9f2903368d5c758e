"""A run attached to a Ray cluster it did not start (``engine.ray_address``).

The test starts a Ray head as a separate process tree (``ray start --head`` on
127.0.0.1, its own temp folder), runs ``python -m experiments.run`` against it,
checks that the ClientApps ran in that cluster's workers, and stops what it
started by PID (``ray stop`` would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from experiments.central import free_port
from tests.integration.test_flwr_run import RAY_START_TIMEOUT
from tests.integration.test_simulation import read_clients, run_experiment
from tests.processes import pids_mentioning

RAY = Path(sys.executable).with_name("ray")


def stop_pids(pids: list[int], *, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is left: only the PIDs given."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)


@pytest.fixture
def ray_head():
    """A Ray head on 127.0.0.1 with 2 CPUs; yields its address and temp folder."""
    # ``ray start`` misses Ray's start-up window as a run does (RAY_START_TIMEOUT): once more.
    for attempt in (1, 2):
        # Ray's socket paths must stay short (AF_UNIX, 107 bytes): not under pytest's tmp_path.
        temp = Path(tempfile.mkdtemp(prefix="ray-head-", dir="/tmp"))
        port = free_port()
        started = start_ray_head(temp, port)
        if started.returncode == 0 or attempt == 2 or RAY_START_TIMEOUT not in started.stderr:
            break
        stop_ray_head(temp)
        warnings.warn(f"ray start: {RAY_START_TIMEOUT}; started again", stacklevel=1)
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"127.0.0.1:{port}", temp
    finally:
        stop_ray_head(temp)
    assert not pids_mentioning(str(temp)), "a process of the Ray head outlived the test"


def start_ray_head(temp: Path, port: int) -> subprocess.CompletedProcess:
    """``ray start --head`` with its files under ``temp``; the finished command."""
    return subprocess.run(
        [str(RAY), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=2", f"--temp-dir={temp}", "--include-dashboard=false",
         "--disable-usage-stats"],
        env=os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}, capture_output=True, text=True,
        timeout=120,
    )


def stop_ray_head(temp: Path) -> None:
    """Stop every process of the head whose files are under ``temp``; remove them."""
    stop_pids(pids_mentioning(str(temp)))
    shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.serial
def test_a_run_attached_to_a_ray_cluster_trains_in_its_workers(tmp_path, ray_head):
    address, temp = ray_head
    run_dir = run_experiment(
        tmp_path, f"engine.ray_address={address}", "strategy.num_rounds=2", "num_clients=3",
        "logger=none",
    )
    rounds = json.loads((run_dir / "metrics.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    assert rounds[2]["bytes_up"] > 0 and rounds[2]["failed_clients"] == 0
    assert {row["status"] for row in read_clients(run_dir)} == {"ok"}
    # The ClientApps ran in the head's workers (a Ray of the run's own would log elsewhere).
    logs = list((temp / "session_latest" / "logs").glob("worker-*.out"))
    assert any("ClientAppActor" in log.read_text(errors="replace") for log in logs)
