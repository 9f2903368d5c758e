"""Flower's Deployment Engine end to end, with TLS and node authentication; a TLS data plane.

The deployment test starts a SuperLink (TLS, SuperNode authentication on), registers
three SuperNodes' public keys, starts the SuperNodes as separate processes and runs
``flwr run . <connection>``: the same apps as in simulation, with the trunk service
also on TLS. Every process it started is stopped by its process group at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clients.app import TRUNK_ROOTS_KEY, build_client_app
from experiments.local import LocalGrid
from server.app import run_training, start_runtime, stop_runtime
from tests.conftest import small_config
from tests.integration.test_flwr_run import finished_runs
from tests.integration.test_simulation import read_clients
from tests.tls import Certificates, make_certificates, make_node_key

ROOT = Path(__file__).resolve().parents[2]
FLWR = Path(sys.executable).with_name("flwr")


def tls_overrides(files: Certificates) -> list[str]:
    """The trunk service on TLS with the test's certificates."""
    return [f"dataplane.ssl_certfile={files.certificate}", f"dataplane.ssl_keyfile={files.key}",
            f"dataplane.ssl_ca_certfile={files.ca}"]


def run_over_grpc(cfg, node_configs: dict[int, dict[str, str]]) -> list[dict[str, str]]:
    """Train ``cfg`` with the shipped ClientApp dialling the trunk over gRPC; client rows."""
    runtime = start_runtime(cfg)
    try:
        grid = LocalGrid(build_client_app(), num_nodes=cfg.num_clients, concurrency=1)
        for node, extra in node_configs.items():
            grid.contexts[node].node_config.update(extra)
        run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    return read_clients(Path(cfg.run_dir))


def test_tls_trunk_trains_nodes_that_verify_it_and_refuses_the_rest(tmp_path):
    ours = make_certificates(tmp_path / "ours")
    stranger = make_certificates(tmp_path / "stranger", name="stranger")
    cfg = small_config("strategy.num_rounds=1", *tls_overrides(ours), run_dir=str(tmp_path / "a"))
    # Node 1 trusts only another CA; node 2 its own copy of ours; node 3 what the task sends.
    rows = run_over_grpc(cfg, {1: {TRUNK_ROOTS_KEY: str(stranger.ca)},
                               2: {TRUNK_ROOTS_KEY: str(ours.ca)}})
    by_partition = {int(r["partition_id"]): r for r in rows}
    assert by_partition[0]["status"] == "refused"
    assert "UNAVAILABLE" in by_partition[0]["reason"]
    for partition in (1, 2):
        assert by_partition[partition]["status"] == "ok"
        assert int(by_partition[partition]["bytes_up"]) > 0
    # A node that requires TLS refuses a plaintext trunk before it sends anything.
    plain = small_config("strategy.num_rounds=1", run_dir=str(tmp_path / "b"))
    rows = run_over_grpc(plain, {1: {TRUNK_ROOTS_KEY: str(ours.ca)}})
    refused = [r for r in rows if r["status"] == "refused"]
    assert [r["partition_id"] for r in refused] == ["0"]
    assert "does not serve TLS" in refused[0]["reason"]


def test_node_config_declares_the_device_and_its_data_or_the_node_declines(tmp_path):
    from clients.app import DATA_KEY
    from clients.device import PROFILE_KEY, preset_profiles

    (parquet, size), = device_data(tmp_path, halves=1)
    cfg = small_config("strategy.num_rounds=1", run_dir=str(tmp_path / "run"))
    rows = run_over_grpc(cfg, {1: {DATA_KEY: str(parquet), PROFILE_KEY: "wearable"},
                               2: {DATA_KEY: str(tmp_path / "missing.parquet")},
                               3: {PROFILE_KEY: "toaster"}})
    by_partition = {int(r["partition_id"]): r for r in rows}
    assert by_partition[0]["status"] == "ok"
    assert int(by_partition[0]["num_examples"]) == size  # its own file, one local epoch
    assert float(by_partition[0]["memory_budget"]) == preset_profiles()["wearable"]["memory_bytes"]
    assert by_partition[1]["status"] == "failed"
    assert "missing.parquet: no parquet file" in by_partition[1]["reason"]
    assert by_partition[2]["status"] == "failed"
    assert "'toaster' is not a device preset" in by_partition[2]["reason"]


# --- the Deployment Engine ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Processes this test started, each in its own group (their children go with them)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


def flwr(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(FLWR), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(condition, what: str, *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s} s"
        time.sleep(0.5)


def superlink_up(port: int, ca: Path) -> bool:
    try:  # verified against the test's CA: the SuperLink serves TLS
        return httpx.get(f"https://127.0.0.1:{port}/health", verify=str(ca), timeout=2).is_success
    except httpx.HTTPError:
        return False


def online_nodes(env: dict[str, str]) -> list[int]:
    listing = flwr("supernode", "ls", "--format", "json", env=env)
    if listing.returncode != 0:
        return []
    nodes = json.loads(listing.stdout).get("nodes", [])
    return [n["node-id"] for n in nodes if n.get("status") == "online"]


@pytest.fixture
def deployment(tmp_path):
    """A SuperLink with TLS and SuperNode authentication, and a CLI connection to it."""
    files = make_certificates(tmp_path / "certificates")
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "secure"\n\n[superlink.secure]\n'
        f'address = "127.0.0.1:{port}"\nroot-certificates = "{files.ca}"\n')
    env = os.environ | {"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
                        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                        "FLWR_DISABLE_UPDATE_CHECK": "1"}
    processes = Processes(tmp_path)
    try:
        processes.start("superlink", [
            str(FLWR.with_name("flower-superlink")), "--ssl-ca-certfile", str(files.ca),
            "--ssl-certfile", str(files.certificate), "--ssl-keyfile", str(files.key),
            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(port),
            "--disable-runtime-dependency-installation"], env)
        wait_for(lambda: superlink_up(port, files.ca), "SuperLink health over TLS")
        yield files, env, port, processes
    finally:
        processes.stop_all()


def start_supernode(processes: Processes, env, *, port: int, ca: Path, key: Path,
                    partition: int, partitions: int) -> subprocess.Popen:
    return processes.start(f"supernode-{partition}", [
        str(FLWR.with_name("flower-supernode")), "--superlink", f"127.0.0.1:{port}",
        "--root-certificates", str(ca), "--auth-supernode-private-key", str(key),
        "--node-config", f"partition-id={partition} num-partitions={partitions}",
        "--port", str(free_port()), "--max-retries", "3", "--max-wait-time", "30"], env)


@pytest.mark.slow
def test_deployment_engine_with_tls_and_node_auth_trains_through_the_data_plane(
        tmp_path, deployment):
    files, env, port, processes = deployment
    keys = [make_node_key(tmp_path / "keys", f"node{i}") for i in range(3)]
    for _, public in keys:
        registered = flwr("supernode", "register", str(public), "--format", "json", env=env)
        assert registered.returncode == 0, registered.stdout + registered.stderr
    # A node whose key was never registered is turned away by the SuperLink.
    rogue, _ = make_node_key(tmp_path / "keys", "rogue")
    intruder = start_supernode(processes, env, port=port, ca=files.ca, key=rogue, partition=9,
                               partitions=3)
    nodes = [start_supernode(processes, env, port=port, ca=files.ca, key=private, partition=i,
                             partitions=3) for i, (private, _) in enumerate(keys)]
    wait_for(lambda: len(online_nodes(env)) == 3, "3 SuperNodes online")
    assert intruder.wait(timeout=90) != 0
    assert "Failed to activate SuperNode" in processes.log("supernode-9")

    run_dir = tmp_path / "run"
    # A vanished node is waited for until the round's timeout, then counted lost.
    overrides = " ".join(["strategy.num_rounds=2", "strategy.round_timeout_s=30",
                          "logger=none", "num_clients=3", *tls_overrides(files)])
    run = subprocess.Popen(
        [str(FLWR), "run", ".", "secure", "--stream", "--run-config",
         f'overrides="{overrides}" run-dir="{run_dir}"'], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # As soon as round 1 is recorded, round 2 is sent: its third node dies before replying.
    wait_for(lambda: len(recorded_rounds(run_dir)) >= 2, "round 1 recorded", timeout_s=300)
    os.killpg(nodes[2].pid, signal.SIGKILL)
    output, _ = run.communicate(timeout=400)
    assert run.returncode == 0, output[-3000:]
    assert finished_runs(FLWR, env) == ["finished:completed"], processes.log("superlink")
    rounds = recorded_rounds(run_dir)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[1]["clients"] == 3 and rounds[1]["failed_clients"] == 0
    assert rounds[2]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    rows = read_clients(run_dir)
    first = [r for r in rows if r["round"] == "1"]
    assert len(first) == 3 and all(r["status"] == "ok" for r in first)
    # Smashed data went up and gradients came down over the (TLS) data plane.
    assert all(int(r["bytes_up"]) > int(r["weights_bytes_up"]) for r in first)
    assert all(int(r["bytes_down"]) > int(r["weights_bytes_down"]) for r in first)
    # Round 2 completed with the two others; the dead node is lost and not aggregated.
    dead = node_id_in_log(processes.log("supernode-2"))
    second = {r["node_id"]: r for r in rows if r["round"] == "2"}
    assert second.pop(dead)["status"] == "lost"
    assert [r["status"] for r in second.values()] == ["ok", "ok"]
    assert rounds[2]["clients_lost"] == 1
    assert rounds[2]["examples"] == sum(int(r["num_examples"]) for r in second.values())
    config = json.loads((run_dir / "config.json").read_text())
    assert config["dataplane"]["ssl_certfile"] == str(files.certificate)


def recorded_rounds(run_dir: Path) -> list[dict]:
    """The run's rounds so far (metrics.json is rewritten whole after every round)."""
    try:
        return json.loads((run_dir / "metrics.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def node_id_in_log(log: str) -> str:
    """The node id a SuperNode logged when it joined."""
    return log.split("SuperNode ID: ")[1].split()[0]


# --- a device joining with clients.connect --------------------------------------------

#: What a device does not need: the test makes them impossible to import there.
SERVER_ONLY = ("ray", "hydra", "wandb")


def blocked_imports(folder: Path) -> Path:
    """A folder of packages that refuse to import, to put first on a device's PYTHONPATH."""
    for name in SERVER_ONLY:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not a client dependency')\n")
    return folder


def device_data(folder: Path, halves: int = 2) -> list[tuple[Path, int]]:
    """Each device's own parquet file (a share of the digits training split) and its size."""
    from splitlearn.data import load_digits_splits

    train, _ = load_digits_splits()
    files = []
    for i in range(halves):
        share = train.shard(num_shards=halves, index=i)
        share.to_parquet(folder / f"device{i}.parquet")
        files.append((folder / f"device{i}.parquet", share.num_rows))
    return files


@pytest.mark.slow
def test_devices_join_with_clients_connect_and_train_on_their_own_data(tmp_path, deployment):
    from clients.device import preset_profiles

    files, env, port, processes = deployment
    device_env = env | {"PYTHONPATH": os.pathsep.join(
        [str(blocked_imports(tmp_path / "blocked")), str(ROOT)])}
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=device_env,
                           capture_output=True, text=True)
    assert "ray is not a client dependency" in probe.stderr  # the block works
    data = device_data(tmp_path)
    profiles = ["mid_range_phone", "raspberry_pi_4"]
    for i, ((parquet, _), profile) in enumerate(zip(data, profiles, strict=True)):
        private, public = make_node_key(tmp_path / "keys", f"device{i}")
        assert flwr("supernode", "register", str(public), env=env).returncode == 0
        processes.start(f"device-{i}", [
            sys.executable, "-m", "clients.connect", "--superlink", f"127.0.0.1:{port}",
            "--profile", profile, "--data", str(parquet), "--root-certificates", str(files.ca),
            "--auth-key", str(private), "--partition-id", str(i), "--num-partitions", "2",
            "--port", str(free_port()), "--max-wait-time", "60"], device_env)
    wait_for(lambda: len(online_nodes(env)) == 2, "2 devices online")

    run_dir = tmp_path / "run"
    # Two devices leave the first round near chance (this CNN's plateau); three rounds do not.
    overrides = " ".join(["strategy.num_rounds=3", "logger=none", "num_clients=2",
                          *tls_overrides(files)])
    proc = flwr("run", ".", "secure", "--stream", "--run-config",
                f'overrides="{overrides}" run-dir="{run_dir}"', env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert finished_runs(FLWR, env) == ["finished:completed"], processes.log("device-0")
    rounds = json.loads((run_dir / "metrics.json").read_text())
    assert rounds[3]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.3
    rows = read_clients(run_dir)
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows), processes.log("device-0")
    presets = preset_profiles()
    for row in rows:
        i = int(row["partition_id"])
        # Each trained its own file (2 local epochs) under its declared memory budget.
        assert int(row["num_examples"]) == 2 * data[i][1]
        assert float(row["memory_budget"]) == presets[profiles[i]]["memory_bytes"]
