"""What the phone gateway costs its host per phone, and how many phones this host holds.

``python -m benchmarks gateway [--phones 1 8 32 ...] [--training 4]``

Every phone that joins costs the gateway's host one Flower SuperNode process (kept while the
gateway runs, so the phone stays the same node), and, while a round runs, that SuperNode's
ClientApp process (Flower starts one per message; it waits for the phone and holds the
model, the phone's data and the task). The phone's own browser costs the phone, not the host.

1. **Joined, between rounds.** A SuperLink (no TLS) and the gateway with N places; N phones
   join over the gateway's WebSocket (the hello a page sends, then the connection held, as
   an idle page holds it) and the gateway starts their SuperNodes. Once the SuperLink lists
   N nodes online: resident memory (PSS where the kernel gives it, else RSS) of the gateway
   and of every SuperNode with its children, the processes, and the CPU they use over
   ``--idle-s`` seconds. N grows until memory or start-up fails, or the list ends.
2. **In a round.** ``--training`` real phones (headless Chromium pages at a phone's size)
   train one round of the default job; the ClientApp processes alive during the round are
   sampled every 0.2 s: their largest resident memory is the in-round cost per phone.

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from websockets.sync.client import connect

from clients.gateway import stop_groups

ROOT = Path(__file__).resolve().parents[1]
FLWR = Path(sys.executable).with_name("flwr")


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(children.get(current, []))
    return found


def resident_bytes(pid: int) -> int:
    """Proportional set size (shared pages split between their users), else RSS."""
    try:
        rollup = (Path("/proc") / str(pid) / "smaps_rollup").read_text()
        return int(re.search(r"^Pss:\s+(\d+) kB", rollup, re.M)[1]) * 1024
    except (OSError, TypeError):
        try:
            return int((Path("/proc") / str(pid) / "statm").read_text().split()[1]) * 4096
        except OSError:
            return 0


def available_bytes() -> int:
    """Return the host's MemAvailable (what it can still give without swapping)."""
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)[1]) * 1024


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` so far."""
    total = 0
    for pid in pids:
        try:
            fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


class Federation:
    """A SuperLink and a gateway on 127.0.0.1, in a temporary folder."""

    def __init__(self, folder: Path, phones: int) -> None:
        self.folder = folder
        self.port = _free_port()
        home = folder / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        self.env = os.environ | {"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
                                 "PATH": os.pathsep.join([str(FLWR.parent),
                                                          os.environ.get("PATH", "")]),
                                 "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                                 "FLWR_DISABLE_UPDATE_CHECK": "1"}
        self.started: list[subprocess.Popen] = []
        self._start("superlink", [str(FLWR.with_name("flower-superlink")), "--insecure",
                                  "--host", "127.0.0.1", "--port", str(self.port),
                                  "--disable-runtime-dependency-installation"])
        self._wait(lambda: self.online() >= 0, "the SuperLink answers", 60)
        self.gateway = self._start("gateway", [
            sys.executable, "-m", "clients.gateway", "--superlink", f"127.0.0.1:{self.port}",
            "--insecure", "--phones", str(phones), "--port", str(_free_port()),
            "--qr", str(folder / "join.png"), "--logs", str(folder),
            "--cache-dir", str(folder / "caches")])
        self.url = self._join_url()

    def _start(self, name: str, command: list[str]) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        return proc

    def _join_url(self) -> str:
        for _ in range(600):
            found = re.search(r"phones join at (\S+)", (self.folder / "gateway.log").read_text())
            if found:
                return found[1]
            time.sleep(0.1)
        raise RuntimeError("the gateway printed no join URL")

    @staticmethod
    def _wait(condition: object, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {timeout_s:.0f} s for {what}")
            time.sleep(1)

    def wait_online(self, nodes: int) -> None:
        """Wait until the SuperLink lists ``nodes`` nodes online (RuntimeError after a while)."""
        self._wait(lambda: self.online() >= nodes, f"{nodes} nodes online", 60 + 2 * nodes)

    def online(self) -> int:
        """Return the nodes the SuperLink lists online (-1: it does not answer)."""
        listing = subprocess.run([str(FLWR), "supernode", "ls", "--format", "json"], cwd=ROOT,
                                 env=self.env, capture_output=True, text=True, timeout=120)
        if listing.returncode != 0:
            return -1
        nodes = json.loads(listing.stdout).get("nodes", [])
        return sum(n.get("status") == "online" for n in nodes)

    def supernodes(self) -> list[int]:
        """Return the gateway's SuperNodes and their ClientApps (its descendants)."""
        return [p for p in tree(self.gateway.pid) if p != self.gateway.pid]

    def stop(self) -> None:
        """Stop the gateway (and its SuperNodes), then the SuperLink."""
        stop_groups(self.started[::-1], timeout_s=30)


def idle_cost(phones: int, *, idle_s: float) -> dict[str, float]:
    """Join ``phones`` phones (held WebSockets) and measure the host's cost between rounds."""
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        before = available_bytes()
        federation = Federation(Path(tmp), phones)
        sockets = []
        try:
            base = federation.url.split("?")[0].replace("http", "ws")
            token = federation.url.split("token=")[1]
            for _ in range(phones):
                socket = connect(base + "phone", open_timeout=30)
                socket.send(json.dumps({"join": token, "backend": "none"}))
                assert "joined" in json.loads(socket.recv(timeout=30))
                sockets.append(socket)
            federation.wait_online(phones)
            pids = [federation.gateway.pid, *federation.supernodes()]
            spent = cpu_seconds(pids)
            time.sleep(idle_s)
            cpu = (cpu_seconds(pids) - spent) / idle_s
            host = before - available_bytes()
            gateway = resident_bytes(federation.gateway.pid)
            supernodes = sum(resident_bytes(p) for p in federation.supernodes())
            return {"phones": phones, "gateway_mib": gateway / 2**20,
                    "supernodes_mib": supernodes / 2**20,
                    "per_phone_mib": (gateway + supernodes) / phones / 2**20,
                    "host_mib": host / 2**20,
                    "processes": len(pids), "cpu_cores": cpu}
        finally:
            for socket in sockets:
                socket.close()
            federation.stop()


def round_cost(phones: int) -> dict[str, float]:
    """``phones`` Chromium pages train one round; the ClientApps' largest resident memory."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        federation = Federation(Path(tmp), phones)
        peaks: dict[int, int] = {}
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for pid in federation.supernodes():
                    try:
                        command = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                    except OSError:
                        continue
                    if b"flwr-clientapp" in command:
                        peaks[pid] = max(peaks.get(pid, 0), resident_bytes(pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=shutil.which("chromium"),
                                             args=["--no-sandbox"])
                pages = []
                for _ in range(phones):
                    page = browser.new_context(viewport={"width": 390, "height": 844}).new_page()
                    page.goto(federation.url)
                    page.click("#join")
                    pages.append(page)
                federation.wait_online(phones)
                sampler.start()
                overrides = (f"num_clients={phones} strategy.num_rounds=1 devices.web=true "
                             "dataplane.websocket_port=0 logger=none logger.plots=false")
                run = subprocess.run(
                    [str(FLWR), "run", ".", "--stream", "--run-config",
                     f'overrides="{overrides}" run-dir="{Path(tmp) / "run"}"'],
                    cwd=ROOT, env=federation.env, capture_output=True, text=True, timeout=900)
                if run.returncode != 0:
                    raise RuntimeError(run.stdout[-2000:])
                browser.close()
        finally:
            done.set()
            federation.stop()
        per_phone = sorted(peaks.values())
        return {"training_phones": phones, "clientapps_seen": len(per_phone),
                "clientapp_peak_mib": max(per_phone, default=0) / 2**20,
                "clientapp_median_mib": per_phone[len(per_phone) // 2] / 2**20
                if per_phone else 0.0}


def bench_gateway(phones: Sequence[int], *, training: int, idle_s: float) -> dict:
    """Run both parts; print a table and return the JSON's content."""
    print(f"{'phones':>7} {'gateway MiB':>12} {'SuperNodes MiB':>15} {'per phone MiB':>14} "
          f"{'host MiB':>9} {'processes':>10} {'CPU cores':>10}", flush=True)
    rows = []
    for count in phones:
        try:
            row = idle_cost(count, idle_s=idle_s)
        except (RuntimeError, OSError) as err:
            print(f"{count:>7} failed: {err}", flush=True)
            break
        rows.append(row)
        print(f"{row['phones']:>7} {row['gateway_mib']:>12.1f} {row['supernodes_mib']:>15.1f} "
              f"{row['per_phone_mib']:>14.1f} {row['host_mib']:>9.0f} {row['processes']:>10} "
              f"{row['cpu_cores']:>10.3f}",
              flush=True)
    result: dict = {"idle": rows}
    if training:
        result["round"] = round_cost(training)
        r = result["round"]
        print(f"in a round: {r['clientapps_seen']} ClientApp processes, peak "
              f"{r['clientapp_peak_mib']:.1f} MiB, median {r['clientapp_median_mib']:.1f} MiB "
              "each", flush=True)
    print(json.dumps(result))
    return result
