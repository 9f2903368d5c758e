"""``flwr run .`` runs the same ServerApp/ClientApp through a local SuperLink."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.serial


def pids_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions ``text`` (our own FLWR_HOME)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(proc.name))
    return pids


def finished_runs(flwr: Path, env: dict[str, str], *, timeout_s: float = 180.0) -> list[str]:
    """Wait until every run the local SuperLink knows has finished; return their statuses.

    ``flwr run --stream`` returns when the log stream ends, which is not always when the
    run does (seen: exit 0 while the ServerApp was still in round 1), so the SuperLink's
    own record of the run is what says it is over.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        listing = subprocess.run([str(flwr), "ls", "--format", "json"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)
        statuses = [run["status"] for run in json.loads(listing.stdout).get("runs", [])]
        if statuses and all(s.startswith("finished") for s in statuses):
            return statuses
        assert time.monotonic() < deadline, f"runs not finished after {timeout_s} s: {statuses}"
        time.sleep(1.0)


@pytest.fixture
def flwr_home(tmp_path):
    home = tmp_path / "flwr-home"
    home.mkdir()
    yield home
    # `flwr run` leaves its local SuperLink running; stop the one we started.
    for pid in pids_mentioning(str(home)):
        os.kill(pid, signal.SIGTERM)


def test_flwr_run_trains_with_the_same_apps_and_trunk_workers(tmp_path, flwr_home):
    """The ServerApp as the SuperLink starts it, with its trunk sharded over two worker
    processes (the ServerApp's children), which stop with it."""
    run_dir = tmp_path / "run"
    env = os.environ | {
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
    }
    flwr = Path(sys.executable).with_name("flwr")
    # Without --stream: `flwr run` submits the run and returns; the SuperLink's record says
    # when it is over (a log stream was seen to outlive its run by minutes under load).
    overrides = "strategy.num_rounds=2 logger=none dataplane.trunk_workers=2"
    proc = subprocess.run(
        [str(flwr), "run", ".",
         "--run-config", f'overrides="{overrides}" run-dir="{run_dir}"',
         "--federation-config", "num-supernodes=3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert finished_runs(flwr, env, timeout_s=300) == ["finished:completed"], proc.stdout[-3000:]
    rounds = json.loads((run_dir / "metrics.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["clients"] == 3 and r["failed_clients"] == 0 for r in rounds[1:])
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    assert json.loads((run_dir / "config.json").read_text())["strategy"]["num_rounds"] == 2
    # The ServerApp keeps its log in the run folder, as under experiments.run; it names the
    # trunk workers.
    log = (run_dir / "run.log").read_text()
    found = re.search(r"trunk workers serving at .* \(pids ([\d, ]+)\)", log)
    assert found, log[-3000:]
    pids = [int(p) for p in found.group(1).split(", ")]
    assert len(pids) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in pids)
