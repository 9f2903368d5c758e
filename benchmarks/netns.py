"""A real device behind a real slow link: network namespaces, ``tc``, and the virtual clock.

``python -m benchmarks netns`` (root) creates two fresh network namespaces, a
"server" side and a "device" side, joined by a veth pair (10.213.0.1/30 and
10.213.0.2/30), and shapes each direction with ``tc``'s token bucket filter (``tbf``)
to a device preset's links: the device end's egress is its uplink, the server end's
its downlink. The machine's own namespace is not touched. A SuperLink (and with it
the ServerApp and the trunk service) runs in the server namespace, one real
``flower-supernode`` in the device namespace (declared as the preset, so nothing is
emulated: its link is the shaped veth), and ``flwr run`` trains the default job.

Per client-round the virtual clock's prediction (:func:`splitlearn.planning.clock.
client_time`: the data-plane bytes over the preset's links, a round trip per
exchange, plus the compute measured here, the host being the device) plus the
trunk's busy time is compared with the measured wall time of the round's training.

``tc netem`` (delay) is often missing (no ``sch_netem`` module), so the preset's RTT is
added at the socket level instead: the data plane goes through
:mod:`benchmarks.delay_relay`, a process in the device namespace that listens on its
loopback and forwards to the trunk across the veth, each byte half the RTT late each
way (the ServerApp advertises the relay's address; see :func:`through_relay`). The
bandwidth stays the kernel's, on the veth. The control plane (SuperNode to SuperLink)
stays direct: Flower's messages are outside the compared training time. With
``--no-relay`` the latency is the veth's own, measured, and the prediction uses that.
Without root, ``ip netns``, veth or ``tbf`` the benchmark says which step failed and
exits non-zero.

The module also holds the data-plane processes the integration test runs in the
namespaces (``trunk`` and ``client`` subcommands; no Flower).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.delay_relay import start_relay

ROOT = Path(__file__).resolve().parents[1]
SERVER_IP, DEVICE_IP = "10.213.0.1", "10.213.0.2"
#: The preset whose links the veth gets: transfers dominate the default job's round.
PROFILE = "mid_range_phone"
#: The SuperLink's port in the server namespace (a fresh namespace: nothing else there).
SUPERLINK_PORT = 9095
#: The trunk's port in the server namespace, and the relay's on the device's loopback:
#: the ServerApp advertises ``advertise_host`` with its own port, so the two must match.
TRUNK_PORT = 9096
RELAY_HOST = "127.0.0.1"
#: Token bucket depth: a few packets, so an idle link saves up no more than that
#: (a deep bucket would let the first 32 KiB of every batch through unshaped).
TBF_BURST_BYTES = 4096
#: Queue the bucket may hold back: long enough that TCP's window never makes it drop.
TBF_LATENCY = "2s"


class NamespacesUnavailable(RuntimeError):
    """Network namespaces, veth or ``tbf`` cannot be used here; the message says which."""


def _run(argv: Sequence[str]) -> str:
    """Run a setup command; raise NamespacesUnavailable with its error if it fails."""
    if shutil.which(argv[0]) is None:
        raise NamespacesUnavailable(f"{argv[0]!r} is not installed")
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NamespacesUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def tbf(namespace: str, device: str, mbps: float) -> list[str]:
    """Return the ``tc`` command that shapes ``device``'s egress in ``namespace`` to ``mbps``."""
    return ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", f"{mbps * 1e6:.0f}bit", "burst", str(TBF_BURST_BYTES),
            "latency", TBF_LATENCY]


@dataclass
class ShapedLink:
    """Two fresh namespaces joined by a veth pair, each direction shaped by ``tbf``.

    A context manager: on exit (and if setting up fails half-way) every process
    still in the namespaces is killed, by PID, and the namespaces are deleted,
    which deletes the veth pair with them.

    Parameters
    ----------
    uplink_mbps, downlink_mbps : float
        Device to server, and server to device, in Mbit/s.
    tag : str
        Prefix of the namespaces' and interfaces' names (this process's id by default).
    """

    uplink_mbps: float
    downlink_mbps: float
    tag: str = field(default_factory=lambda: f"sl{os.getpid()}")

    @property
    def server(self) -> str:
        """The server namespace's name."""
        return f"{self.tag}-srv"

    @property
    def device(self) -> str:
        """The device namespace's name."""
        return f"{self.tag}-dev"

    def __enter__(self) -> ShapedLink:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root (euid is not 0)")
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        srv, dev = f"{self.tag}-s", f"{self.tag}-d"  # interface names: 15 characters at most
        _run(["ip", "netns", "add", self.server])
        _run(["ip", "netns", "add", self.device])
        _run(["ip", "link", "add", srv, "netns", self.server, "type", "veth",
              "peer", "name", dev, "netns", self.device])
        for ns, nic, ip in ((self.server, srv, SERVER_IP), (self.device, dev, DEVICE_IP)):
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", nic])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # SuperLink <-> ServerApp
            _run(["ip", "-n", ns, "link", "set", nic, "up"])
        _run(tbf(self.device, dev, self.uplink_mbps))
        _run(tbf(self.server, srv, self.downlink_mbps))

    def exec(self, namespace: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``namespace`` (``ip netns exec`` execs it: same PID)."""
        return ["ip", "netns", "exec", namespace, *argv]

    def close(self) -> None:
        """Kill what still runs in the namespaces (only ours can), then delete them."""
        for ns in (self.server, self.device):
            if not Path("/run/netns", ns).exists():
                continue
            for _ in range(3):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.5)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def unavailable_reason() -> str | None:
    """Why shaped namespaces cannot be made here (None: they can); leaves nothing behind."""
    try:
        with ShapedLink(10.0, 10.0, tag=f"probe{os.getpid()}"):
            return None
    except NamespacesUnavailable as err:
        return str(err)


def connect_rtt_s(link: ShapedLink, port: int, *, tries: int = 20) -> float:
    """Median TCP connect time from the device namespace to ``SERVER_IP:port``: one RTT."""
    probe = ("import socket, statistics, sys, time\n"
             "samples = []\n"
             f"for _ in range({tries}):\n"
             "    t = time.perf_counter()\n"
             f"    socket.create_connection(('{SERVER_IP}', {port}), timeout=5).close()\n"
             "    samples.append(time.perf_counter() - t)\n"
             "print(statistics.median(samples))\n")
    out = subprocess.run(link.exec(link.device, [sys.executable, "-c", probe]),
                         capture_output=True, text=True, timeout=60, check=True)
    return float(out.stdout.strip())


def through_relay(link: ShapedLink, rtt_s: float) -> tuple[subprocess.Popen, list[str]]:
    """Start the delay relay in the device namespace; return it and the overrides using it.

    It listens on the device's loopback (``RELAY_HOST:TRUNK_PORT``) and forwards to the
    trunk (``SERVER_IP:TRUNK_PORT``) across the shaped veth, ``rtt_s / 2`` late each way.
    On the device's side, so the server namespace is as in a plain deployment (the trunk
    only advertises another address) and what crosses the veth is already delayed: the
    device's first hop adds the latency, the link its bandwidth. It dies with the
    namespace (:meth:`ShapedLink.close`) if the caller does not kill it first.
    """
    relay, _ = start_relay(f"{RELAY_HOST}:{TRUNK_PORT}", f"{SERVER_IP}:{TRUNK_PORT}",
                           delay_s=rtt_s / 2, prefix=link.exec(link.device, []))
    return relay, [f"dataplane.port={TRUNK_PORT}", f"dataplane.advertise_host={RELAY_HOST}"]


def _wait_for(path: Path, timeout_s: float = 120.0) -> Path:
    """Return ``path`` once it exists (the trunk writes it whole, by a rename)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.1)
    return path


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def preset(name: str):  # noqa: ANN201 - a DeviceProfile (imported late: no torch at import)
    """Return the shipped device preset ``name``."""
    from clients.device import declared_profile

    return declared_profile(name)


def predict_s(*, compute_s: float, bytes_up: int, bytes_down: int, exchanges: int,
              trunk_s: float, profile, rtt_s: float) -> float:  # noqa: ANN001
    """Return the clock's time for a client round on this link: client time plus trunk's.

    The host is the device here, so its compute is taken as measured (the profile's
    FLOP/s set to the host's); the RTT is the one the link has (the relay's, or the
    veth's own without it).
    """
    from splitlearn.planning.clock import ClientMeasurement, client_time

    device = replace(profile, rtt_s=rtt_s)
    work = ClientMeasurement(compute_s, bytes_up, bytes_down, exchanges)
    return client_time(work, device, host_flops_per_s=device.flops_per_s).total_s + trunk_s


# --- the data-plane processes of the integration test ---------------------------------


def serve_trunk(overrides: Sequence[str], *, token_file: Path) -> None:
    """Serve the trunk on ``dataplane.host``; write its address and a token; on EOF, report.

    Prints one JSON line when stdin closes: the trunk's steps, samples and busy seconds.
    """
    from protocols import compose_config
    from server.app import build_trunk
    from splitlearn.dataplane import TrunkService

    cfg = compose_config(list(overrides))
    trunk, _, tokens, endpoint = build_trunk(cfg)
    service = TrunkService(endpoint, host=cfg.dataplane.host, port=cfg.dataplane.port,
                           advertise_host=cfg.dataplane.advertise_host)
    address = service.start()
    token = tokens.issue(client="netns", protocol=cfg.strategy.name, cut=1, server_round=1,
                         ttl_s=3600)
    partial = token_file.with_suffix(".part")  # the reader never sees half a file
    partial.write_text(json.dumps({"address": address, "token": token}))
    partial.rename(token_file)
    sys.stdin.read()
    service.stop(1.0)
    print(json.dumps({"steps": trunk.steps, "samples": trunk.samples, "busy_s": trunk.busy_s}),
          flush=True)


def train_client(overrides: Sequence[str], *, token_file: Path, partition: int,
                 partitions: int) -> None:
    """One client round over gRPC with the shipped loop (cut 1); print its report as JSON."""
    import torch

    from clients.loop import epoch_loader, train_round
    from protocols import compose_config, protocol_named
    from splitlearn.config import run_spec
    from splitlearn.data import client_dataset
    from splitlearn.dataplane import GrpcTransport, TrunkChannel
    from splitlearn.models.factory import build_model_from_config
    from splitlearn.privacy.registry import make_client_privacy

    cfg = compose_config(list(overrides))
    spec = run_spec(cfg, host_flops_per_s=0.0)
    torch.set_num_threads(spec.torch_threads)
    model = build_model_from_config(spec.model, spec.dataset)
    step = protocol_named(cfg.strategy.name).client(model, spec, cut=1, recompute=False)
    data = client_dataset(spec.dataset, spec.partitioner, seed=spec.seed,
                          partition_id=partition, num_partitions=partitions)
    loader = epoch_loader(data, spec, server_round=1, partition_id=partition)
    access = json.loads(_wait_for(token_file).read_text())  # started beside the trunk
    channel = TrunkChannel(GrpcTransport(access["address"], access["token"]))
    try:
        report = train_round(step, channel, make_client_privacy(spec.privacy, loader),
                             epochs=spec.strategy.local_epochs)
    finally:
        channel.close()
    print(json.dumps(vars(report)), flush=True)


def dataplane_round(link: ShapedLink, overrides: Sequence[str], *, folder: Path,
                    partition: int = 0, partitions: int = 10,
                    rtt_s: float = 0.0) -> tuple[dict, dict]:
    """Run the trunk in the server namespace, a client round in the device one; both reports.

    With ``rtt_s`` > 0 the client reaches the trunk through the delay relay.
    """
    token_file = folder / "trunk.json"
    module = [sys.executable, "-m", "benchmarks.netns"]
    relay, routing = through_relay(link, rtt_s) if rtt_s > 0 else (None, [])
    trunk = subprocess.Popen(
        link.exec(link.server, [*module, "--token-file", str(token_file), "trunk",
                                f"dataplane.host={SERVER_IP}", *routing, *overrides]),
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # The client starts at once and waits for the trunk's address after its imports (each
    # process takes seconds to import torch and Flower: side by side, not one after the other).
    client = subprocess.Popen(
        link.exec(link.device, [*module, "--token-file", str(token_file), "--partition",
                                str(partition), "--partitions", str(partitions), "client",
                                *overrides]),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not token_file.exists():
            if trunk.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trunk did not start (exit {trunk.poll()})")
            time.sleep(0.2)
        out, err = client.communicate(timeout=300)
        if client.returncode != 0:
            raise RuntimeError(f"the client failed: {err[-3000:]}")
        books, _ = trunk.communicate(input="", timeout=60)
    finally:
        _stop(client)
        _stop(trunk)
        _stop(relay)
    return json.loads(out.splitlines()[-1]), json.loads(books.splitlines()[-1])


# --- the benchmark: a real SuperNode -------------------------------------------------


def _flwr_env(folder: Path, port: int) -> dict[str, str]:
    """Environment of the Flower processes: their home, Ray's and W&B's folders in ``folder``."""
    home = folder / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "netns"\n\n[superlink.netns]\n'
        f'address = "{SERVER_IP}:{port}"\ninsecure = true\n')
    for sub in ("ray", "wandb"):
        (folder / sub).mkdir(exist_ok=True)
    return os.environ | {
        "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_TMPDIR": str(folder / "ray"), "WANDB_DIR": str(folder / "wandb"),
        "WANDB_MODE": "disabled"}


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _online(link: ShapedLink, env: dict[str, str]) -> int:
    """SuperNodes the SuperLink lists as online (0 while it is not up)."""
    done = subprocess.run(link.exec(link.server, [_bin("flwr"), "supernode", "ls", "--format",
                                                  "json"]),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return 0
    try:
        nodes = json.loads(done.stdout).get("nodes", [])
    except json.JSONDecodeError:
        return 0
    return sum(n.get("status") == "online" for n in nodes)


def deployment_run(link: ShapedLink, overrides: Sequence[str], *, folder: Path,
                   profile: str, rtt_s: float = 0.0, timeout_s: float = 900) -> Path:
    """SuperLink and ``flwr run`` in the server namespace, a SuperNode in the device one.

    With ``rtt_s`` > 0 the data plane goes through the delay relay (the control plane
    does not). Returns the run folder (``clients.csv``, ``metrics.json``). Logs go to
    ``folder``.
    """
    env = _flwr_env(folder, SUPERLINK_PORT)
    logs = []

    def start(name: str, ns: str, argv: list[str]) -> subprocess.Popen:
        log = open(folder / f"{name}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        return subprocess.Popen(link.exec(ns, argv), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    try:
        _, routing = through_relay(link, rtt_s) if rtt_s > 0 else (None, [])
        overrides = [*overrides, *routing]
        start("superlink", link.server, [
            _bin("flower-superlink"), "--insecure", "--host", SERVER_IP,
            "--port", str(SUPERLINK_PORT), "--disable-runtime-dependency-installation"])
        node = start("supernode", link.device, [
            _bin("flower-supernode"), "--insecure", "--superlink",
            f"{SERVER_IP}:{SUPERLINK_PORT}", "--node-config",
            f'partition-id=0 num-partitions=1 device-profile="{profile}"',
            "--max-retries", "10", "--max-wait-time", "60"])
        deadline = time.monotonic() + 120
        while _online(link, env) < 1:
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the SuperNode did not come online: "
                                   + (folder / "supernode.log").read_text()[-2000:])
            time.sleep(1)
        run_dir = folder / "run"
        run = start("flwr-run", link.server, [
            _bin("flwr"), "run", ".", "netns", "--stream", "--run-config",
            f'overrides="{" ".join(overrides)}" run-dir="{run_dir}"'])
        if run.wait(timeout=timeout_s) != 0 or not (run_dir / "metrics.json").exists():
            raise RuntimeError("flwr run failed: " + (folder / "flwr-run.log").read_text()[-3000:])
        return run_dir
    finally:
        link.close()  # kills every process in the namespaces (ours, by PID), deletes them
        for log in logs:
            log.close()


@dataclass(frozen=True)
class ClientRound:
    """One client-round: the clock's prediction against the measured wall time."""

    round: int
    steps: int
    bytes_up: int
    bytes_down: int
    compute_s: float
    trunk_s: float
    predicted_s: float
    wall_s: float

    @property
    def error(self) -> float:
        """Wall against clock, relative to the clock."""
        return (self.wall_s - self.predicted_s) / self.predicted_s


def client_rounds(run_dir: Path, *, profile, rtt_s: float) -> list[ClientRound]:  # noqa: ANN001
    """Read the run's client rows and the trunk's time per round; predict each round.

    Only the data plane is compared: the round's training (``train_s``) against its
    bytes without the weights (those travel in Flower's messages, outside ``train_s``).
    SplitFed exchanges once per batch.
    """
    trunk_s = {r["round"]: r["trunk_s"] for r in json.loads((run_dir / "metrics.json")
                                                           .read_text())}
    with open(run_dir / "clients.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    out = []
    for row in rows:
        rnd = int(row["round"])
        up = int(row["bytes_up"]) - int(row["weights_bytes_up"])
        down = int(row["bytes_down"]) - int(row["weights_bytes_down"])
        steps, compute = int(row["steps"]), float(row["compute_s"])
        predicted = predict_s(compute_s=compute, bytes_up=up, bytes_down=down, exchanges=steps,
                              trunk_s=trunk_s[rnd], profile=profile, rtt_s=rtt_s)
        out.append(ClientRound(rnd, steps, up, down, compute, trunk_s[rnd], predicted,
                               float(row["train_s"])))
    return out


def plot(rounds: Sequence[ClientRound], path: Path, *, title: str) -> None:
    """Predicted and measured seconds per client-round, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(rounds))
    ax.bar([x - 0.2 for x in xs], [r.predicted_s for r in rounds], 0.4, label="virtual clock")
    ax.bar([x + 0.2 for x in xs], [r.wall_s for r in rounds], 0.4, label="wall time")
    for x, r in zip(xs, rounds, strict=True):
        ax.annotate(f"{r.error:+.1%}", (x, max(r.predicted_s, r.wall_s)), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"round {r.round}" for r in rounds])
    ax.set_ylabel("seconds of training")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


NETNS_DEFAULTS = ("num_clients=1", "strategy.min_train_nodes=1", "strategy.num_rounds=3",
                  "logger=none", f"dataplane.host={SERVER_IP}")


def bench_netns(overrides: Sequence[str], *, profile_name: str = PROFILE,
                out_dir: Path | None = None, relay: bool = True) -> float:
    """Shape a veth to ``profile_name``'s links, train across it, compare with the clock.

    ``relay``: add the preset's RTT with the delay relay (else the veth's own RTT is
    the link's, and the prediction's). Returns the worst absolute error over the
    client-rounds. Raises NamespacesUnavailable (with the failing step) where the
    machine does not allow it.
    """
    profile = preset(profile_name)
    out_dir = out_dir or Path("outputs/bench") / time.strftime("netns-%Y-%m-%d-%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-netns-") as tmp, \
            ShapedLink(profile.uplink_mbps, profile.downlink_mbps) as link:
        probe = subprocess.Popen(  # something to connect to, for the RTT
            link.exec(link.server, [sys.executable, "-c", "import socket, time; s = socket."
                                    f"create_server(('{SERVER_IP}', 9) ); time.sleep(600)"]))
        time.sleep(1.0)
        veth_rtt = connect_rtt_s(link, 9)
        probe.kill()
        probe.wait()
        rtt = profile.rtt_s if relay else veth_rtt
        applied = (f"socket relay, {rtt * 1e3 / 2:g} ms each way" if relay
                   else "none (the veth's own, measured)")
        print(f"{profile_name}: up {profile.uplink_mbps:g} Mbit/s, down "
              f"{profile.downlink_mbps:g} Mbit/s by tbf; veth RTT {veth_rtt * 1e3:.3f} ms; "
              f"RTT {rtt * 1e3:.3f} ms: {applied}", flush=True)
        run_dir = deployment_run(link, [*NETNS_DEFAULTS, *overrides], folder=Path(tmp),
                                 profile=profile_name, rtt_s=rtt if relay else 0.0)
        rounds = client_rounds(run_dir, profile=profile, rtt_s=rtt)
        metrics = json.loads((run_dir / "metrics.json").read_text())
    return report(rounds, metrics, out_dir=out_dir, profile=profile,
                  latency={"rtt_ms": rtt * 1e3, "rtt_applied": applied,
                           "veth_rtt_ms": round(veth_rtt * 1e3, 4)})


def report(rounds: Sequence[ClientRound], metrics: list[dict], *, out_dir: Path,
           profile, latency: dict) -> float:  # noqa: ANN001
    """Print the table and the JSON line; write CSV, JSON and the plot; the worst error."""
    for r in rounds:
        print(f"round {r.round}: {r.steps} batches, {r.bytes_up / 2**20:.2f} MiB up, "
              f"{r.bytes_down / 2**20:.2f} MiB down, compute {r.compute_s:.2f} s, trunk "
              f"{r.trunk_s:.2f} s; clock {r.predicted_s:.2f} s, wall {r.wall_s:.2f} s "
              f"({r.error:+.1%})", flush=True)
    with open(out_dir / "netns.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "steps", "bytes_up", "bytes_down", "compute_s", "trunk_s",
                         "predicted_s", "wall_s", "error"])
        for r in rounds:
            writer.writerow([r.round, r.steps, r.bytes_up, r.bytes_down, r.compute_s,
                             r.trunk_s, r.predicted_s, r.wall_s, r.error])
    errors = [r.error for r in rounds]
    summary = {"profile": profile.name, "uplink_mbit": profile.uplink_mbps,
               "downlink_mbit": profile.downlink_mbps, **latency,
               "predicted_s": [round(r.predicted_s, 3) for r in rounds],
               "wall_s": [round(r.wall_s, 3) for r in rounds],
               "clock_error": [round(e, 4) for e in errors],
               "median_abs_error": statistics.median(abs(e) for e in errors),
               "max_abs_error": max(abs(e) for e in errors),
               "test_accuracy": metrics[-1].get("test_accuracy")}
    (out_dir / "netns.json").write_text(json.dumps(summary, indent=2))
    plot(rounds, out_dir / "netns.png", title=f"{profile.name} links by tbf "
         f"({profile.uplink_mbps:g} up / {profile.downlink_mbps:g} down Mbit/s), RTT "
         f"{latency['rtt_ms']:g} ms ({latency['rtt_applied']}), one SuperNode")
    print(f"results in {out_dir}")
    print(json.dumps(summary))
    return summary["max_abs_error"]


def main(argv: Sequence[str] | None = None) -> None:
    """``bench`` (the default), or the ``trunk`` / ``client`` processes of the test."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="bench", choices=("bench", "trunk",
                                                                        "client"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides")
    parser.add_argument("--profile", default=PROFILE, help="bench: the device preset")
    parser.add_argument("--token-file", type=Path, help="trunk, client: address and token")
    parser.add_argument("--partition", type=int, default=0, help="client: partition id")
    parser.add_argument("--partitions", type=int, default=10, help="client: partitions")
    parser.add_argument("--no-relay", action="store_true",
                        help="bench: add no latency (the veth's own RTT is the link's)")
    args = parser.parse_args(argv)
    if args.command == "trunk":
        serve_trunk(args.overrides, token_file=args.token_file)
    elif args.command == "client":
        train_client(args.overrides, token_file=args.token_file, partition=args.partition,
                     partitions=args.partitions)
    else:
        run_bench(args.overrides, profile_name=args.profile, relay=not args.no_relay)


def run_bench(overrides: Sequence[str], *, profile_name: str = PROFILE,
              relay: bool = True) -> None:
    """Run the benchmark; exit non-zero with the reason where namespaces are unavailable."""
    try:
        bench_netns(overrides, profile_name=profile_name, relay=relay)
    except NamespacesUnavailable as err:
        sys.exit(f"netns benchmark: network namespaces with a shaped veth are not available "
                 f"here: {err}")


if __name__ == "__main__":
    main()
