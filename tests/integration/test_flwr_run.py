"""``flwr run .`` runs the same ServerApp/ClientApp through a local SuperLink."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Collection
from pathlib import Path

import pytest

from experiments.central import free_port
from strategies.privacy import update_epsilon
from tests.integration.test_simulation import read_clients
from tests.processes import pids_mentioning, superlink_answers, wait_for

ROOT = Path(__file__).resolve().parents[2]
FLWR = Path(sys.executable).with_name("flwr")
pytestmark = pytest.mark.serial


def finished_runs(flwr: Path, env: dict[str, str], *, timeout_s: float = 180.0,
                  poll_s: float = 5.0, but: Collection[int] = ()) -> dict[int, str]:
    """Wait until every run the local SuperLink knows has finished; return their statuses.

    ``flwr run --stream`` returns when the log stream ends, which is not always when the
    run does (seen: exit 0 while the ServerApp was still in round 1), so the SuperLink's
    own record of the run is what says it is over. Each ``flwr ls`` costs ~1.4 s of CPU,
    so polling every second would take half a core from the run it waits for. Runs in
    ``but`` are not waited for (a run whose ServerApp was killed is marked failed only
    when its heartbeats have been missed, 40 s later).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = {int(run["run-id"]): run["status"] for run in listed_runs(flwr, env)}
        if statuses and all(s.startswith("finished") for r, s in statuses.items()
                            if r not in but):
            return statuses
        assert time.monotonic() < deadline, f"runs not finished after {timeout_s} s: {statuses}"
        time.sleep(poll_s)


def listed_runs(flwr: Path, env: dict[str, str]) -> list[dict]:
    """The runs the SuperLink knows, as ``flwr ls --format json`` lists them."""
    listing = subprocess.run([str(flwr), "ls", "--format", "json"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    return json.loads(listing.stdout).get("runs", [])


def run_log(flwr: Path, env: dict[str, str], run_id: int) -> str:
    """What the run logged, as the SuperLink keeps it (``flwr log RUN_ID --show``)."""
    shown = subprocess.run([str(flwr), "log", str(run_id), "--show"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    return shown.stdout + shown.stderr


def what_the_run_said(flwr: Path, env: dict[str, str], run_id: int, run_dir: Path) -> str:
    """A failed run's record and log at the SuperLink, the tail of its own log and of the
    SuperLink's."""
    record = [r for r in listed_runs(flwr, env) if int(r["run-id"]) == run_id]
    own = run_dir / "run.log"
    return (f"{json.dumps(record, indent=1)}\n--- flwr log {run_id} ---\n"
            f"{run_log(flwr, env, run_id)[-6000:]}\n--- {own} ---\n"
            f"{own.read_text()[-3000:] if own.exists() else '(none)'}\n"
            f"{superlink_tail(Path(env['FLWR_HOME']) / 'local-superlink')}")


@pytest.fixture
def local_superlink(tmp_path):
    """The SuperLink ``flwr run .`` starts for itself (``address = ":local:"``), started first.

    ``flwr run`` gives the SuperLink it starts 15 s to answer, which a loaded 2-core CI host
    missed. Started here with the same flags and files, on the port ``flwr run`` is told to
    use, it is healthy when ``flwr run`` looks, and ``flwr run`` uses it as its own. A free
    port keeps it apart from a local SuperLink the developer may run on Flower's default one.
    Yields the environment for ``flwr`` commands. Stopping the SuperLink stops the rest:
    its SuperExec (a session of its own) watches the SuperLink's PID, and the simulation
    and its Ray processes are the SuperExec's.
    """
    flwr_home = tmp_path / "flwr-home"
    port = free_port()
    env = os.environ | {
        "FLWR_HOME": str(flwr_home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
    }
    files = flwr_home / "local-superlink"  # the folder `flwr run` gives its own SuperLink
    files.mkdir(parents=True)
    with open(files / "superlink.out", "w") as out:
        superlink = subprocess.Popen(
            [str(FLWR.with_name("flower-superlink")), "--insecure", "--simulation",
             "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(port),
             "--database", str(files / "state.db"), "--log-file", str(files / "superlink.log")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def ready() -> bool:
        code = superlink.poll()
        assert code is None, f"flower-superlink exited ({code}):\n{superlink_tail(files)}"
        return superlink_answers(port)

    try:
        wait_for(ready, "local SuperLink", timeout_s=120)
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(superlink.pid, signal.SIGTERM)
        superlink.wait(timeout=30)
        stop_stragglers(f"--runtime-api-address 127.0.0.1:{port} ")


def stop_stragglers(mark: str, *, grace_s: float = 30.0) -> None:
    """Fail if a process naming ``mark`` outlives its SuperLink by ``grace_s``; kill it."""
    try:
        wait_for(lambda: not pids_mentioning(mark), f"processes naming {mark!r} to stop",
                 timeout_s=grace_s)
    finally:
        for pid in pids_mentioning(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def superlink_tail(files: Path) -> str:
    """The end of what the local SuperLink printed and logged."""
    return "\n".join(f"--- {f} ---\n{f.read_text()[-3000:]}"
                     for f in (files / "superlink.out", files / "superlink.log") if f.exists())


#: Ray's raylet has a hard-coded 30 s to register, which a loaded 2-core machine can miss.
#: ``experiments.run`` starts Ray itself with retries; under ``flwr run`` Flower's
#: simulation process starts it, once, so a run that died of this is submitted again.
RAY_START_TIMEOUT = "The current node timed out during startup"


def test_flwr_run_trains_with_the_same_apps_and_trunk_workers(tmp_path, local_superlink):
    """The ServerApp as the SuperLink starts it, with its trunk sharded over two worker
    processes (the ServerApp's children), which stop with it; the cut's tensors travel as
    top-k with error feedback, whose memory each worker keeps for its clients; the device
    side is averaged through SecAgg+ and DP-FedAvg."""
    env, flwr = local_superlink, FLWR
    for attempt in (1, 2):
        run_dir = tmp_path / f"run-{attempt}"
        run_id = submit_run(flwr, env, run_dir)
        status = finished_runs(flwr, env, timeout_s=300)[run_id]
        if (status == "finished:completed" or attempt == 2
                or RAY_START_TIMEOUT not in run_log(flwr, env, run_id)):
            break
        warnings.warn(f"run {run_id}: Ray did not start ({RAY_START_TIMEOUT}); submitted again",
                      stacklevel=1)
    assert status == "finished:completed", what_the_run_said(flwr, env, run_id, run_dir)
    rounds = json.loads((run_dir / "metrics.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["clients"] == 3 and r["failed_clients"] == 0 for r in rounds[1:])
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    assert json.loads((run_dir / "config.json").read_text())["strategy"]["num_rounds"] == 2
    assert [r["update_epsilon"] for r in rounds[1:]] == [
        update_epsilon(noise_multiplier=0.01, releases=r, delta=1e-5) for r in (1, 2)]
    rows = read_clients(run_dir)
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok"}
    assert {r["update_weight"] for r in rows} == {"1.0"}  # DP-FedAvg: devices count alike
    # 8 KiB of activations per example at cut 1; top-k keeps a tenth at 4 bytes a value
    # (plus the example's id and label): under 1 KiB, had any batch gone twice or dense.
    for r in rounds[1:]:
        assert r["bytes_up"] - r["weights_bytes_up"] < 1024 * r["examples"]
    # The ServerApp keeps its log in the run folder, as under experiments.run; it names the
    # trunk workers.
    log = (run_dir / "run.log").read_text()
    found = re.search(r"trunk workers serving at .* \(pids ([\d, ]+)\)", log)
    assert found, log[-3000:]
    pids = [int(p) for p in found.group(1).split(", ")]
    assert len(pids) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in pids)


#: SecAgg+ and DP-FedAvg: the workflow's four stages per round go through the engine too.
#: The noise is too small to protect anything; what is checked is its accounting.
SECURE = ("aggregation.secure=true", "aggregation.update_clip_norm=5",
          "aggregation.update_noise_multiplier=0.01", "aggregation.max_weight=1",
          "aggregation.clipping_range=5")


def submit_run(flwr: Path, env: dict[str, str], run_dir: Path) -> int:
    """Submit 2 rounds of the default job (top-k with error feedback at the cut, SecAgg+
    with DP-FedAvg) on 3 simulated nodes; return the run's id.

    Without ``--stream``: ``flwr run`` submits the run and returns; the SuperLink's record
    says when it is over (a log stream was seen to outlive its run by minutes under load).
    """
    overrides = ("strategy.num_rounds=2 logger=none dataplane.trunk_workers=2 "
                 "compression=topk_feedback " + " ".join(SECURE))
    proc = subprocess.run(
        [str(flwr), "run", ".",
         "--run-config", f'overrides="{overrides}" run-dir="{run_dir}"',
         "--federation-config", "num-supernodes=3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    started = re.search(r"Successfully started run (\d+)", proc.stdout)
    assert started, proc.stdout[-3000:]
    return int(started.group(1))
