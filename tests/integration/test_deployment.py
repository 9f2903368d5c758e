"""Flower's Deployment Engine end to end, with TLS and node authentication; a TLS data plane.

The deployment tests start a SuperLink (TLS, SuperNode authentication on), register
the devices' public keys, start the devices as separate processes (``python -m
clients.connect``, where Ray, Hydra and W&B cannot be imported) and run ``flwr run .
<connection>``: the same apps as in simulation, with the trunk service on TLS too. One
device is killed mid-round, then the ServerApp, and the run resumes.
Every process a test started is stopped at its end. (What a device keeps in its
``context.state`` between rounds, such as error feedback's references, is checked
in process: :class:`experiments.local.LocalGrid` passes the Context through Flower's
serialisation, as a SuperNode hands it to each message's ClientApp process.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clients.app import TRUNK_ROOTS_KEY, build_client_app
from experiments.central import free_port
from experiments.certificates import Certificates, make_certificates, make_node_key
from experiments.local import LocalGrid
from server.app import run_training, start_runtime, stop_runtime
from tests.conftest import small_config
from tests.integration.test_flwr_run import finished_runs, listed_runs
from tests.integration.test_simulation import read_clients
from tests.processes import pids_mentioning, superlink_answers, wait_for

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

    (parquet, size), = device_data(tmp_path, shares=1)
    cfg = small_config("strategy.num_rounds=1", run_dir=str(tmp_path / "run"))
    rows = run_over_grpc(cfg, {1: {DATA_KEY: str(parquet), PROFILE_KEY: "wearable"},
                               2: {DATA_KEY: str(tmp_path / "missing.parquet")},
                               3: {PROFILE_KEY: "toaster"}})
    by_partition = {int(r["partition_id"]): r for r in rows}
    assert by_partition[0]["status"] == "ok"
    assert int(by_partition[0]["num_examples"]) == size  # its own file, one local epoch
    assert float(by_partition[0]["memory_budget"]) == preset_profiles()["wearable"]["memory_bytes"]
    # clients.csv names the preset each device declared (none: the server's default, host).
    assert [by_partition[p]["profile"] for p in range(3)] == ["wearable", "host", "toaster"]
    assert by_partition[1]["status"] == "failed"
    assert "missing.parquet: no parquet file" in by_partition[1]["reason"]
    assert by_partition[2]["status"] == "failed"
    assert "'toaster' is not a device preset" in by_partition[2]["reason"]


# --- the Deployment Engine ------------------------------------------------------------


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
        # Flower detaches some children (SuperExec and its apps); each names the test's folder.
        for pid in pids_mentioning(str(self.logs)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def flwr(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(FLWR), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


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
        wait_for(lambda: superlink_answers(port, ca=files.ca), "SuperLink health over TLS")
        yield files, env, port, processes
    finally:
        processes.stop_all()


def start_supernode(processes: Processes, env, *, port: int, ca: Path, key: Path,
                    partition: int, partitions: int, node_config: str = "") -> subprocess.Popen:
    return processes.start(f"supernode-{partition}", [
        str(FLWR.with_name("flower-supernode")), "--superlink", f"127.0.0.1:{port}",
        "--root-certificates", str(ca), "--auth-supernode-private-key", str(key),
        "--node-config", f"partition-id={partition} num-partitions={partitions} {node_config}",
        "--port", str(free_port()), "--max-retries", "3", "--max-wait-time", "30"], env)


def start_run(run_dir: Path, overrides: list[str], env) -> subprocess.Popen:
    """``flwr run . secure`` in the background (its output piped)."""
    return subprocess.Popen(
        [str(FLWR), "run", ".", "secure", "--stream", "--run-config",
         f'overrides="{" ".join(overrides)}" run-dir="{run_dir}"'], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def serverapp_pids(port: int) -> list[int]:
    """PIDs of the ServerApp processes our SuperLink (on ``port``) had started."""
    ours = set(pids_mentioning(f"127.0.0.1:{port}"))
    return sorted(ours & set(pids_mentioning("flwr-serverapp")))


def recorded_rounds(run_dir: Path) -> list[dict]:
    """The run's rounds so far (metrics.json is rewritten whole after every round)."""
    try:
        return json.loads((run_dir / "metrics.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def node_id_in_log(log: str) -> str:
    """The node id a SuperNode logged when it joined."""
    return log.split("SuperNode ID: ")[1].split()[0]


# --- devices ------------------------------------------------------------------------

#: What a device does not need: the test makes them impossible to import there.
SERVER_ONLY = ("ray", "hydra", "wandb")


def blocked_imports(folder: Path) -> Path:
    """A folder of packages that refuse to import, to put first on a device's PYTHONPATH."""
    for name in SERVER_ONLY:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not a client dependency')\n")
    return folder


def device_data(folder: Path, shares: int = 2) -> list[tuple[Path, int]]:
    """Each device's own parquet file (a share of the digits training split) and its size."""
    from splitlearn.data import load_digits_splits

    train, _ = load_digits_splits()
    files = []
    for i in range(shares):
        share = train.shard(num_shards=shares, index=i)
        share.to_parquet(folder / f"device{i}.parquet")
        files.append((folder / f"device{i}.parquet", share.num_rows))
    return files


def start_device(processes: Processes, env, *, index: int, count: int, port: int, ca: Path,
                 key: Path, profile: str, data: Path, cache: Path, ledger: Path | None = None
                 ) -> subprocess.Popen:
    """A device joining with ``python -m clients.connect`` (its own data and data cache;
    with a ``ledger``, also a privacy floor of activation noise and its ledger there)."""
    floor = ([] if ledger is None else
             ["--privacy-option", "activation_gaussian", "--privacy-ledger", str(ledger)])
    return processes.start(f"device-{index}", [
        sys.executable, "-m", "clients.connect", "--superlink", f"127.0.0.1:{port}",
        "--profile", profile, "--data", str(data), "--cache-dir", str(cache),
        "--root-certificates", str(ca), "--auth-key", str(key), "--partition-id", str(index),
        "--num-partitions", str(count), *floor, "--port", str(free_port()),
        "--max-wait-time", "60"], env)


def start_registered_devices(processes: Processes, env, tmp_path: Path, *, port: int, ca: Path,
                             profiles: list[str], data: list[tuple[Path, int]],
                             privacy_floor: bool) -> list[subprocess.Popen]:
    """Register a key per device with the SuperLink, start the devices, wait until online.

    On the devices Ray, Hydra and W&B cannot even be imported.
    """
    device_env = env | {"PYTHONPATH": os.pathsep.join(
        [str(blocked_imports(tmp_path / "blocked")), str(ROOT)])}
    probe = subprocess.run([sys.executable, "-c", "import ray"], env=device_env,
                           capture_output=True, text=True)
    assert "ray is not a client dependency" in probe.stderr  # the block works
    devices = []
    for i, profile in enumerate(profiles):
        private, public = make_node_key(tmp_path / "keys", f"device{i}")
        registered = flwr("supernode", "register", str(public), "--format", "json", env=env)
        assert registered.returncode == 0, registered.stdout + registered.stderr
        devices.append(start_device(
            processes, device_env, index=i, count=len(profiles), port=port, ca=ca, key=private,
            profile=profile, data=data[i][0], cache=tmp_path / "caches" / f"device{i}",
            ledger=tmp_path / "ledgers" / f"device{i}.json" if privacy_floor else None))
    wait_for(lambda: len(online_nodes(env)) == len(profiles),
             f"{len(profiles)} devices online")
    return devices


def messages_received(log: Path) -> int:
    """Messages a SuperNode has received whole, by its log (its key's query, then rounds)."""
    return log.read_text().count("Received successfully")


def checkpointed_round(run_dir: Path) -> int:
    """The round of the run folder's checkpoint (0 before the first)."""
    try:
        return torch.load(run_dir / "checkpoint.pt", weights_only=False).server_round
    except (FileNotFoundError, EOFError, RuntimeError):
        return 0


@pytest.mark.serial
def test_deployment_with_tls_node_auth_devices_that_vanish_and_a_serverapp_that_resumes(
        tmp_path, deployment):
    """SuperLink + 3 devices (clients.connect), 3 rounds, TLS everywhere, and two crashes.

    Round 2: one device dies before replying; the round completes with the other two.
    Round 3: the ServerApp is killed; the run resumes from its round-2 checkpoint.
    (A device restarted with the same key is refused until the SuperLink has marked its
    old session offline, a minute after its last heartbeat: too long for this test.)
    """
    from clients.device import preset_profiles
    from splitlearn.privacy import compute_epsilon

    files, env, port, processes = deployment
    data = device_data(tmp_path, shares=3)
    profiles = ["mid_range_phone", "raspberry_pi_4", "low_end_phone"]
    devices = start_registered_devices(processes, env, tmp_path, port=port, ca=files.ca,
                                       profiles=profiles, data=data, privacy_floor=True)
    # A node whose key was never registered is turned away by the SuperLink (checked once
    # round 1 is recorded: it takes the SuperNode ~15 s to give up, with the run going on).
    rogue, _ = make_node_key(tmp_path / "keys", "rogue")
    intruder = start_supernode(processes, env, port=port, ca=files.ca, key=rogue, partition=9,
                               partitions=3)

    run_dir = tmp_path / "run"
    # Noise this small protects nothing (it lets 3 rounds learn): what is tested is that
    # the spend survives the crashes. A vanished node is counted lost when the SuperLink
    # reports it missed its heartbeats (2 x 30 s), or at the round's timeout if that comes
    # first: 120 s, since round 1 starts a ClientApp process per message on every device
    # twice (its key, then its round), which took 34 s alone on a slow host and over 30 s
    # (then the timeout, losing two live devices) on a loaded CI host; this test runs beside
    # the other serial ones.
    sigma = 0.01
    overrides = ["strategy.num_rounds=3", "strategy.round_timeout_s=120", "logger=none",
                 "num_clients=3", "privacy=activation_gaussian",
                 f"privacy.noise_multiplier={sigma}", "privacy.clip_norm=20",
                 *tls_overrides(files)]
    first = start_run(run_dir, overrides, env)
    # As soon as round 1 is recorded, round 2 is sent: device 2 dies before replying.
    wait_for(lambda: len(recorded_rounds(run_dir)) >= 2, "round 1 recorded", timeout_s=300)
    os.killpg(devices[2].pid, signal.SIGKILL)
    dead_id = node_id_in_log(processes.log("device-2"))
    assert intruder.wait(timeout=90) != 0
    assert "Failed to activate SuperNode" in processes.log("supernode-9")
    [killed_run] = [int(r["run-id"]) for r in listed_runs(FLWR, env)]  # the only one yet
    wait_for(lambda: checkpointed_round(run_dir) == 2, "round 2 checkpointed", timeout_s=300)
    # The ServerApp dies during round 3, once the live devices hold its message: killed while
    # it is still sending them, a device keeps pulling the half-sent message until the
    # SuperLink marks the run failed (~50 s, Flower's), and only then takes the resumed run's.
    wait_for(lambda: all(messages_received(tmp_path / f"device-{i}.log") >= 4 for i in (0, 1)),
             "round 3 received", timeout_s=300)
    [serverapp] = serverapp_pids(port)
    os.kill(serverapp, signal.SIGKILL)
    first.kill()
    first.wait(timeout=30)
    before = torch.load(run_dir / "checkpoint.pt", weights_only=False)

    # A device may still be fetching the killed run's round-3 message when the resumed
    # round 3 arrives (seen twice on a loaded host: both devices then missed a 30 s round;
    # 55 s with it on an idle slow host), so the resumed run waits longer (the timeout is a
    # key a resume may change).
    second = start_run(run_dir, [*overrides, "resume=true", "strategy.round_timeout_s=180"],
                       env)
    output, _ = second.communicate(timeout=400)
    assert second.returncode == 0, output[-3000:]
    # The SuperLink marks the resumed run completed (and the killed one, once it has missed
    # its heartbeats, failed: Flower's bookkeeping, not waited for).
    statuses = finished_runs(FLWR, env, but=[killed_run])
    assert statuses.pop(killed_run) != "finished:completed"
    assert list(statuses.values()) == ["finished:completed"]
    rounds = recorded_rounds(run_dir)
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]  # none lost, none twice
    assert rounds[3]["test_accuracy"] > rounds[0]["test_accuracy"] + 0.2
    rows = read_clients(run_dir)
    by_round = {n: [r for r in rows if r["round"] == str(n)] for n in (1, 2, 3)}
    presets = preset_profiles()
    assert len(by_round[1]) == 3 and all(r["status"] == "ok" for r in by_round[1])
    for row in by_round[1]:
        i = int(row["partition_id"])
        # Each trained its own file under its declared memory budget ...
        assert int(row["num_examples"]) == 2 * data[i][1]  # 2 local epochs
        assert float(row["memory_budget"]) == presets[profiles[i]]["memory_bytes"]
        # ... sending smashed data up and getting gradients down over the TLS data plane.
        assert int(row["bytes_up"]) > int(row["weights_bytes_up"])
        assert int(row["bytes_down"]) > int(row["weights_bytes_down"])
    # Round 2 completed with the two others; the dead device is lost and not aggregated.
    second_round = {r["node_id"]: r for r in by_round[2]}
    assert second_round.pop(dead_id)["status"] == "lost"
    assert [r["status"] for r in second_round.values()] == ["ok", "ok"]
    assert rounds[2]["clients_lost"] == 1
    assert rounds[2]["examples"] == sum(int(r["num_examples"]) for r in second_round.values())
    # Round 3 ran once, after the resume, with the two live devices (the dead one, if
    # the SuperLink still listed it, is lost with the SuperLink's reason).
    third = {r["node_id"]: r for r in by_round[3]}
    if dead_id in third:
        assert third.pop(dead_id)["status"] == "lost"
    assert sorted(third) == sorted(second_round)
    assert [r["status"] for r in third.values()] == ["ok", "ok"]
    assert before.server_round == 2
    assert rounds[2]["virtual_time_s"] == before.reporter["clock_s"] < rounds[3]["virtual_time_s"]
    after = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert after.server_round == 3
    assert after.trunk["books"]["steps"] > before.trunk["books"]["steps"]
    # The devices' ledgers carried their spend over both crashes: three rounds' worth (two
    # releases each) at least, at most one round more (charged before it was lost).
    spent = [compute_epsilon(history=[(sigma / 2, 1.0, n)], delta=1e-5) for n in (6, 8)]
    assert spent[0] - 1e-9 <= rounds[3]["epsilon"] <= spent[1] + 1e-9
    assert json.loads((run_dir / "config.json").read_text())["dataplane"]["ssl_certfile"] == (
        str(files.certificate))
    # Each device read its file once and kept its data in its cache folder after.
    assert [len(list((tmp_path / "caches" / f"device{i}").glob("data-*.pt")))
            for i in range(3)] == [1, 1, 1]
